"""`jcsaug prepare`: every task's raw layout -> resampled volumes + datalist; resume; bad raw data named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

import jcsaug.tasks.prepare as prepare_module
from fake_raw import MNMS_CASES, TASK_NAMES, make_fake_raw, raw_case_files
from jcsaug.data import intensity_normalisation
from jcsaug.tasks import PrepareError, RawCase, get_task, load_split, paper_setting, prepare_task
from jcsaug.tasks.splits import half_subset, scaled_sizes
from preloaded import run_module


@pytest.mark.parametrize("task", TASK_NAMES)
def test_prepared_dataset_matches_the_task(prepared, task):
    spec = get_task(task)
    _, data = prepared[task]
    datalist = json.loads((data / "dataset.json").read_text())
    assert datalist["name"] == task and datalist["labels"] == {str(k): v for k, v in spec.labels.items()}
    for split in ("training", "validation", "test"):
        assert datalist[split], split
    seen: set[str] = set()
    for split in datalist["num_cases"]:
        if split.startswith("training_"):
            continue
        ids = {e["case"] for e in datalist[split]}
        assert not ids & seen, f"case in two splits: {ids & seen}"
        seen |= ids
    for entry in datalist["training"]:
        image, label = nib.load(str(data / entry["image"])), nib.load(str(data / entry["label"]))
        assert image.shape == label.shape and len(image.shape) == 3
        np.testing.assert_allclose(image.affine, label.affine)
        zooms = image.header.get_zooms()
        for axis, target in enumerate(spec.spacing):
            if target > 0:
                assert zooms[axis] == pytest.approx(target, rel=1e-3), (axis, zooms)
        values = set(np.unique(np.asarray(label.dataobj)).tolist())
        assert values <= set(spec.labels) and len(values) > 1
    scheme = datalist["normalisation"]["scheme"]
    assert scheme == ("ct" if spec.modality == "CT" else "zscore")


def test_kits_slice_axis_ends_last_and_ct_is_normalised(prepared):
    """KiTS arrays are stored (z, y, x) with a permuting affine; after RAS reorientation the 3.2 mm axis is last."""
    _, data = prepared["kits19_tumor"]
    files = load_split(data, "training", "kits19_tumor")
    image = nib.load(files[0]["image"])
    assert image.header.get_zooms() == pytest.approx((1.6, 1.6, 3.2), rel=1e-3)
    assert nib.aff2axcodes(image.affine) == ("R", "A", "S")
    norm = json.loads((data / "dataset.json").read_text())["normalisation"]
    lo, hi = norm["clip"]
    transform = intensity_normalisation(data)
    x = transform({"image": np.asarray(image.dataobj, dtype=np.float32)[None]})["image"]
    assert float(x.min()) == pytest.approx((lo - norm["mean"]) / norm["std"], abs=1e-4)
    assert float(x.max()) == pytest.approx((hi - norm["mean"]) / norm["std"], abs=1e-4)


def test_cross_domain_and_reduced_data_splits(prepared):
    prostate = json.loads((prepared["prostate_crosssite"][1] / "dataset.json").read_text())
    assert {e["domain"] for e in prostate["training"] + prostate["test_source"]} == {"BMC"}
    assert {e["domain"] for e in prostate["validation"] + prostate["test"]} == {"I2CVB"}
    assert len(prostate["validation"]) == 1 and prostate["validation"][0]["case"] == "I2CVB_Case00"
    mnms = json.loads((prepared["cardiac_crosssite"][1] / "dataset.json").read_text())
    assert {e["domain"] for e in mnms["validation"] + mnms["test"]} == {"5"}
    assert "5" not in {e["domain"] for e in mnms["training"]}
    by_subject = {}
    for split in ("training", "validation", "test", "test_seen"):
        for e in mnms[split]:
            by_subject.setdefault(e["case"].rsplit("_", 1)[0], set()).add(split)
    assert all(len(s) == 1 for s in by_subject.values()), "ED and ES of a subject in different splits"
    atlas = json.loads((prepared["atlas_stroke"][1] / "dataset.json").read_text())
    half = {e["case"] for e in atlas["training_50"]}
    assert half < {e["case"] for e in atlas["training"]}
    with pytest.raises(ValueError, match="training_50"):
        load_split(prepared["btcv_abdomen"][1], "training", "btcv_abdomen", train_fraction=0.5)


def test_split_sizes_follow_the_paper_and_scale_down(caplog):
    with caplog.at_level("WARNING"):
        assert scaled_sizes(220, [145, 31, 44]) == [145, 31, 44]
        assert scaled_sizes(655, [145, 31, 44]) == [145, 31, 44]
    assert not caplog.records  # the paper's split: nothing to warn of
    with caplog.at_level("WARNING"):
        small = scaled_sizes(8, [145, 31, 44])
    assert sum(small) == 8 and min(small) >= 1 and small[0] > small[1]
    # fewer cases than the paper's (e.g. MS-CMRSeg with --skip-unlabelled): said, with both splits
    with caplog.at_level("WARNING"):
        assert scaled_sizes(35, [30, 10], "C0 cases") == [26, 9]
    assert "35 C0 cases found, fewer than the paper's 40: split sizes scaled to 26 / 9 (paper: 30 / 10)" in caplog.text
    with pytest.raises(PrepareError, match="at least 3"):
        scaled_sizes(2, [145, 31, 44])
    assert len(half_subset([f"c{i}" for i in range(145)], 73, 145, seed=0)) == 73
    assert len(half_subset([f"c{i}" for i in range(140)], 70, 140, seed=0)) == 70


def test_rerun_skips_finished_cases_and_an_interrupted_run_resumes(tmp_path, monkeypatch):
    raw = make_fake_raw("btcv_abdomen", tmp_path / "raw")
    calls: list[str] = []
    original = prepare_module.prepare_case

    def interrupted(spec, case, out_dir, seed=0):
        if len(calls) == 4:
            raise KeyboardInterrupt
        calls.append(case.case_id)
        return original(spec, case, out_dir, seed)

    monkeypatch.setattr(prepare_module, "prepare_case", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare_task("btcv_abdomen", raw, tmp_path / "data", progress=False)
    assert not (tmp_path / "data" / "dataset.json").exists()
    done = list(calls)
    calls.clear()
    monkeypatch.setattr(
        prepare_module, "prepare_case", lambda *a, **k: (calls.append(a[1].case_id), original(*a, **k))[1]
    )
    first = prepare_task("btcv_abdomen", raw, tmp_path / "data", progress=False)
    assert not set(calls) & set(done) and len(calls) == 10 - len(done)
    calls.clear()
    assert prepare_task("btcv_abdomen", raw, tmp_path / "data", progress=False) == first
    assert calls == []
    with pytest.raises(PrepareError, match="other settings"):
        prepare_task("btcv_abdomen", raw, tmp_path / "data", seed=1, progress=False)


def _needle(task: str, key: str) -> str:
    return key[3:] if task == "btcv_abdomen" else key  # BTCV files are img0001 / label0001


def _rewrite(path: Path, array: np.ndarray | None = None, affine: np.ndarray | None = None) -> None:
    nii = nib.load(str(path))
    data = np.asarray(nii.dataobj) if array is None else array
    nib.save(nib.Nifti1Image(data, nii.affine if affine is None else affine), str(path))


def _first_labelled(task: str, raw: Path) -> tuple[str, Path, Path]:
    files = raw_case_files(task, raw)
    skip = {"RUNMC"} if task == "prostate_crosssite" else set()
    key = next(k for k in sorted(files) if not any(k.startswith(s) for s in skip) and "LGE" not in k)
    return key, *files[key]


def _prepare_error(task: str, raw: Path, out: Path) -> str:
    with pytest.raises(PrepareError) as err:
        prepare_task(task, raw, out, progress=False)
    return str(err.value)


@pytest.mark.parametrize("task", TASK_NAMES)
def test_missing_label_is_named(tmp_path, task):
    raw = make_fake_raw(task, tmp_path / "raw")
    key, _, label = _first_labelled(task, raw)
    label.unlink()
    message = _prepare_error(task, raw, tmp_path / "data")
    assert "label file missing" in message and _needle(task, key) in message


@pytest.mark.parametrize("task", TASK_NAMES)
def test_shape_mismatch_is_named(tmp_path, task):
    raw = make_fake_raw(task, tmp_path / "raw")
    key, _, label = _first_labelled(task, raw)
    data = np.asarray(nib.load(str(label)).dataobj)
    _rewrite(label, data[:-2])
    message = _prepare_error(task, raw, tmp_path / "data")
    assert "shape" in message and _needle(task, key) in message


@pytest.mark.parametrize("task", [t for t in TASK_NAMES if t != "prostate_crosssite"])
def test_affine_mismatch_is_named(tmp_path, task):
    raw = make_fake_raw(task, tmp_path / "raw")
    key, _, label = _first_labelled(task, raw)
    affine = nib.load(str(label)).affine.copy()
    affine[:3, 3] += 5.0
    _rewrite(label, affine=affine)
    message = _prepare_error(task, raw, tmp_path / "data")
    assert "affines differ" in message and _needle(task, key) in message


def test_prostate_label_geometry_is_copied_from_the_image(prepared):
    """The fake I2CVB_Case01 label has 0.8001 mm zooms (the known quirk): prepared, not refused."""
    _, data = prepared["prostate_crosssite"]
    assert (data / "labels" / "I2CVB_Case01.nii.gz").is_file()


@pytest.mark.parametrize("change", ["spacing", "flipped", "shifted"])
def test_prostate_label_spacing_is_repaired_and_another_grid_refused(tmp_path, change):
    """Only the spacing quirk is repaired (DATASETS.md: the label's spacing is overwritten with the image's; here
    1 % off, past the affine check's tolerance): a label whose axes or origin differ from the image's is a
    different grid, refused with both affines named."""
    raw = make_fake_raw("prostate_crosssite", tmp_path / "raw")
    key, _, label = _first_labelled("prostate_crosssite", raw)
    affine = nib.load(str(label)).affine.copy()
    if change == "spacing":
        affine[0, 0] *= 1.01
    elif change == "flipped":
        affine[0, 0], affine[0, 3] = -affine[0, 0], affine[0, 3] + 0.8 * 29
    else:
        affine[:3, 3] += 2.0
    _rewrite(label, affine=affine)
    if change == "spacing":
        prepare_task("prostate_crosssite", raw, tmp_path / "data", progress=False)
        image, label = (nib.load(str(tmp_path / "data" / d / f"{key}.nii.gz")) for d in ("images", "labels"))
        np.testing.assert_allclose(label.affine, image.affine)
        return
    message = _prepare_error("prostate_crosssite", raw, tmp_path / "data")
    assert "affines differ beyond the voxel spacing" in message and key in message


@pytest.mark.parametrize("task", [t for t in TASK_NAMES if not get_task(t).binarise_labels])  # prostate: below
def test_label_values_outside_the_classes_are_named(tmp_path, task):
    raw = make_fake_raw(task, tmp_path / "raw")
    key, _, label = _first_labelled(task, raw)
    data = np.asarray(nib.load(str(label)).dataobj).copy()
    data.flat[0] = 77
    _rewrite(label, data)
    message = _prepare_error(task, raw, tmp_path / "data")
    assert "[77]" in message and _needle(task, key) in message


@pytest.mark.parametrize("task", TASK_NAMES)
def test_no_foreground_in_a_training_case_is_named(tmp_path, task, prepared):
    training_case = json.loads((prepared[task][1] / "dataset.json").read_text())["training"][0][
        "case"
    ]  # e.g. A0S9V9_ED
    raw = make_fake_raw(task, tmp_path / "raw")
    files = raw_case_files(task, raw)
    key = next(k for k in files if k in training_case or _needle(task, k) in training_case
               or training_case.startswith(k) or training_case == k.replace("patient", "patient0"))  # fmt: skip
    label = files[key][1]
    _rewrite(label, np.zeros_like(np.asarray(nib.load(str(label)).dataobj)))
    message = _prepare_error(task, raw, tmp_path / "data")
    assert "no foreground" in message and "'training'" in message and f"case {training_case}:" in message


def test_unknown_task_and_missing_raw_folder(tmp_path):
    with pytest.raises(PrepareError, match="unknown task"):
        prepare_task("nope", tmp_path, tmp_path / "out")
    with pytest.raises(PrepareError, match="does not exist"):
        prepare_task("kits19_tumor", tmp_path / "missing", tmp_path / "out")
    with pytest.raises(PrepareError, match="no cases found"):
        prepare_task("kits19_tumor", tmp_path, tmp_path / "out")


def test_paper_setting_table_and_fallback(caplog):
    table = {"deepmedic": {"0.5": ["dice", 1e-3], "1.0": ["dice", 2e-3]}, "unet3d": {"1.0": ["ce", 5e-4]}}
    assert paper_setting(table, "deepmedic", 0.5) == ("dice", 1e-3)
    assert paper_setting(table, "unet3d", 1.0) == ("ce", 5e-4)
    with caplog.at_level("WARNING"):
        assert paper_setting(table, "transformer", 0.5) == ("dice", 1e-3)
    assert "no L_val/beta for transformer" in caplog.text


def test_cli_prepare_reports_errors_without_a_traceback(tmp_path):
    raw = make_fake_raw("kits19_tumor", tmp_path / "raw")
    ok = run_module("jcsaug.cli", ["prepare", "kits19_tumor", raw, "--out", tmp_path / "data", "--quiet"])
    assert ok.returncode == 0, ok.stderr
    assert Path(ok.stdout.strip()) == tmp_path / "data" / "dataset.json"
    shutil.rmtree(raw / "case_00001")
    (raw / "case_00001").mkdir()
    bad = run_module("jcsaug.cli", ["prepare", "kits19_tumor", raw, "--out", tmp_path / "other"])
    assert bad.returncode == 1 and "case_00001" in bad.stderr and "Traceback" not in bad.stderr


def test_worker_processes_give_the_same_dataset(tmp_path, prepared):
    raw, serial = prepared["btcv_abdomen"]
    path = prepare_task("btcv_abdomen", raw, tmp_path / "parallel", num_workers=2, progress=False)
    parallel, reference = json.loads(path.read_text()), json.loads((serial / "dataset.json").read_text())
    for key in ("training", "validation", "test", "normalisation", "num_cases"):
        assert parallel[key] == reference[key], key
    for entry in parallel["training"]:
        a = np.asarray(nib.load(str(tmp_path / "parallel" / entry["image"])).dataobj)
        np.testing.assert_array_equal(a, np.asarray(nib.load(str(serial / entry["image"])).dataobj))


def test_a_raw_file_changed_in_place_is_prepared_again(tmp_path):
    """Issue 12 item 12: records match on size + mtime of the raw files, not on their paths only."""
    raw = make_fake_raw("btcv_abdomen", tmp_path / "raw")
    prepare_task("btcv_abdomen", raw, tmp_path / "data", progress=False)
    key, image, _ = _first_labelled("btcv_abdomen", raw)
    prepared = next((tmp_path / "data" / "images").glob(f"*{_needle('btcv_abdomen', key)}*"))
    before = np.asarray(nib.load(str(prepared)).dataobj).copy()
    data = np.asarray(nib.load(str(image)).dataobj)
    _rewrite(image, (data + 100).astype(data.dtype))  # same path, same shape, new content
    prepare_task("btcv_abdomen", raw, tmp_path / "data", progress=False)
    assert not np.array_equal(before, np.asarray(nib.load(str(prepared)).dataobj))
    record = json.loads(
        (tmp_path / "data" / ".prepare" / "cases" / prepared.name.replace(".nii.gz", ".json")).read_text()
    )
    assert record["sources"]["image"] == {"path": str(image), "size": image.stat().st_size,
                                          "mtime_ns": image.stat().st_mtime_ns}  # fmt: skip


@pytest.mark.parametrize("workers", [0, 2])
def test_every_failing_case_is_reported_and_the_others_are_prepared(tmp_path, workers):
    """Issue 12 item 12: with or without workers, all failing cases are named at the end, not only the first."""
    raw = make_fake_raw("btcv_abdomen", tmp_path / "raw")
    files = raw_case_files("btcv_abdomen", raw)
    broken = sorted(files)[:3]
    for key in broken:
        files[key][1].write_bytes(b"not a nifti")
    message = _prepare_error("btcv_abdomen", raw, tmp_path / "data") if workers == 0 else None
    if workers:
        with pytest.raises(PrepareError) as err:
            prepare_task("btcv_abdomen", raw, tmp_path / "data", num_workers=workers, progress=False)
        message = str(err.value)
    assert message.startswith(f"3 of {len(files)} cases failed")
    for key in broken:
        assert f"cannot read label {files[key][1]}" in message
    assert len(list((tmp_path / "data" / ".prepare" / "cases").glob("*.json"))) == len(files) - 3


def _one_case(tmp_path: Path, image: np.ndarray, label: np.ndarray) -> RawCase:
    """A raw case on the prostate grid (0.8 x 0.8 x 1.5 mm, RAS): resampling it changes no voxel."""
    affine = np.diag([0.8, 0.8, 1.5, 1.0])
    paths = tmp_path / "raw_image.nii.gz", tmp_path / "raw_label.nii.gz"
    nib.save(nib.Nifti1Image(image, affine, dtype=image.dtype), str(paths[0]))  # int64 needs an explicit dtype
    nib.save(nib.Nifti1Image(label, affine), str(paths[1]))
    return RawCase("case", *paths)


@pytest.mark.parametrize(
    ("dtype", "lo", "hi", "stored"),
    [
        (np.int16, -1024, 3000, np.int16),  # CT in HU
        (np.uint16, 1000, 45039, np.uint16),  # MR stored as uint16 beyond 32767: was clipped to 32767
        (np.uint8, 0, 255, np.int16),
        (np.int32, -5, 70000, np.int32),
        (np.int64, 0, 40000, np.int32),  # int64 is stored as int32 where the values fit
        (np.int64, 0, 3_000_000_000, np.float32),
    ],
)
def test_integer_images_keep_their_values(tmp_path, dtype, lo, hi, stored):
    """Defect 1: an integer image is written as int16 only where its values fit; no value is clipped."""
    rng = np.random.default_rng(0)
    image = rng.integers(lo, hi, (12, 10, 8), endpoint=True).astype(dtype)
    image.flat[:2] = lo, hi
    label = np.zeros(image.shape, np.uint8)
    label[4:8, 4:7, 3:5] = 1
    record = prepare_module.prepare_case(get_task("prostate_crosssite"), _one_case(tmp_path, image, label), tmp_path)
    out = np.asarray(nib.load(str(tmp_path / record["image"])).dataobj)
    assert out.dtype == stored
    assert out.min() == lo and out.max() == hi
    if stored != np.float32:  # exact, voxel for voxel (same grid)
        np.testing.assert_array_equal(out.astype(np.int64), image.astype(np.int64))


def test_prostate_masks_are_binarised_as_the_reference_does(tmp_path):
    """DATASETS.md: prostate is > 0 and some masks carry values above 1 (the reference code binarises > 0): every
    positive value becomes class 1; a negative value is refused, naming the case and file."""
    image = np.ones((12, 10, 8), np.float32)
    label = np.zeros(image.shape, np.int16)
    label[4:8, 4:7, 3:5] = 1
    label[2, 2, 2], label[3, 3, 3], label[9, 9, 7] = 2, 3, 255
    record = prepare_module.prepare_case(get_task("prostate_crosssite"), _one_case(tmp_path, image, label), tmp_path)
    out = np.asarray(nib.load(str(tmp_path / record["label"])).dataobj)
    np.testing.assert_array_equal(out, (label > 0).astype(out.dtype))
    label[0, 0, 0] = -1
    (tmp_path / "negative").mkdir()
    case = _one_case(tmp_path / "negative", image, label)
    with pytest.raises(PrepareError, match=r"label values \[-1\] .* not classes of prostate_crosssite"):
        prepare_module.prepare_case(get_task("prostate_crosssite"), case, tmp_path / "out")


def test_prostate_sites_are_found_under_their_older_folder_names(tmp_path):
    """DATASETS.md names I2CVB also HCRUDB and BMC ISBI_1.5: those folders are read, with the same case ids."""
    from jcsaug.tasks.layouts import find_prostate

    raw = make_fake_raw("prostate_crosssite", tmp_path / "raw")
    expected = [(c.case_id, c.image.name, c.domain) for c in find_prostate(raw)]
    (raw / "BMC").rename(raw / "ISBI_1.5")
    (raw / "I2CVB").rename(raw / "HCRUDB")
    found = find_prostate(raw)
    assert [(c.case_id, c.image.name, c.domain) for c in found] == expected
    assert {c.image.parent.name for c in found} == {"ISBI_1.5", "HCRUDB"}
    shutil.rmtree(raw / "HCRUDB")
    with pytest.raises(PrepareError, match="I2CVB or HCRUDB"):
        find_prostate(raw)


def test_nan_label_voxels_are_named(tmp_path):
    """Defect 2: NaN in a float label is refused with the count, not shown as the int64 cast of NaN."""
    image = np.ones((12, 10, 8), np.float32)
    label = np.zeros(image.shape, np.float32)
    label[4:8, 4:7, 3:5] = 1
    label[0, 0, :3] = np.nan
    label[1, 0, 0] = np.inf
    case = _one_case(tmp_path, image, label)
    with pytest.raises(PrepareError) as err:
        prepare_module.prepare_case(get_task("prostate_crosssite"), case, tmp_path / "out")
    message = str(err.value)
    assert "4 NaN/Inf voxels" in message and str(case.label) in message and "case case" in message
    assert "-9223372036854775808" not in message


def test_max_cases_must_be_positive_and_keeps_that_many_subjects(tmp_path):
    """Defect 3: ``max_cases=-1`` kept all subjects but one, silently; now anything but a positive count is refused."""
    raw = make_fake_raw("btcv_abdomen", tmp_path / "raw")
    for bad in (-1, 0, 2.5):
        with pytest.raises(PrepareError, match="max_cases must be a positive number"):
            prepare_task("btcv_abdomen", raw, tmp_path / "data", max_cases=bad, progress=False)
    assert not (tmp_path / "data").exists()  # refused before anything is written
    cases = get_task("btcv_abdomen").find_cases(raw, False)
    assert len(prepare_module._subset(cases, 3, seed=0)) == 3 and prepare_module._subset(cases, None, 0) == cases


def _prepared_arrays(data: Path, case: str) -> tuple[np.ndarray, np.ndarray]:
    """(image, label) arrays of a prepared case; StopIteration if no split holds it."""
    datalist = json.loads((data / "dataset.json").read_text())
    splits = ("training", "validation", "test", "test_source", "test_seen")
    entry = next(e for split in splits for e in datalist.get(split, []) if e["case"] == case)
    return tuple(np.asarray(nib.load(str(data / entry[key])).dataobj) for key in ("image", "label"))


def test_mscmrseg_labels_become_lv_myocardium_rv(prepared):
    """DATASETS.md: MS-CMRSeg stores 500 / 200 / 600 = LV / myocardium / RV, remapped to M&Ms' 1 / 2 / 3 (the fake
    data is at the task's spacing and RAS, so the prepared label is the raw one voxel for voxel, remapped)."""
    raw, data = prepared["cardiac_crosssequence"]
    assert get_task("cardiac_crosssequence").labels == {0: "background", 1: "LV blood pool", 2: "LV myocardium",
                                                        3: "RV blood pool"}  # fmt: skip
    for raw_case, case in (("patient1_C0", "patient01_C0"), ("patient3_LGE", "patient03_LGE")):
        raw_label = np.asarray(nib.load(str(raw_case_files("cardiac_crosssequence", raw)[raw_case][1])).dataobj)
        _, label = _prepared_arrays(data, case)
        expected = np.select([raw_label == 500, raw_label == 200, raw_label == 600], [1, 2, 3], 0)
        assert len(np.unique(expected)) == 4  # every class present, with different voxel counts (a swap shows)
        np.testing.assert_array_equal(label, expected)


def test_mnms_volumes_are_the_csv_ed_and_es_frames_of_image_and_label(prepared):
    """DATASETS.md: M&Ms `_sa` / `_sa_gt` are 4D (x, y, z, t); `<code>_ED` / `<code>_ES` are the frames the CSV's
    0-based ED / ES columns name, the image's and the label's the same frame (the fake ES heart is smaller, and its
    other frames' labels are empty, so an off-by-one, a swap or a mismatch fails)."""
    raw, data = prepared["cardiac_crosssite"]
    frames = {code: {"ED": ed, "ES": es} for _, code, *_, ed, es in MNMS_CASES}
    files = raw_case_files("cardiac_crosssite", raw)
    checked = 0
    for code, (image_path, label_path) in files.items():
        raw_image, raw_label = (np.asarray(nib.load(str(p)).dataobj) for p in (image_path, label_path))
        for phase, frame in frames[code].items():
            try:
                image, label = _prepared_arrays(data, f"{code}_{phase}")
            except StopIteration:  # a Validation case of a seen centre: in no split (the paper's rule)
                continue
            np.testing.assert_array_equal(label, raw_label[..., frame])
            np.testing.assert_allclose(image, raw_image[..., frame], rtol=1e-6)
            checked += 1
    assert checked >= 16


def test_prostate_source_site_trains_on_its_first_cases(prepared):
    """DATASETS.md: BMC Case00-19 train, the following cases are the source-domain test (`test_source`); scaled down
    on the fake data, the order holds."""
    datalist = json.loads((prepared["prostate_crosssite"][1] / "dataset.json").read_text())
    train = [int(e["case"].removeprefix("BMC_Case")) for e in datalist["training"]]
    test_source = [int(e["case"].removeprefix("BMC_Case")) for e in datalist["test_source"]]
    assert train and test_source and max(train) < min(test_source)
    assert sorted(train + test_source) == list(range(len(train) + len(test_source)))


def test_atlas_r1_one_scan_per_subject_lesion_files_united_and_thresholded(tmp_path):
    """ATLAS R1.x (the release the paper used): one case per subject (its first scan), its `LesionSmooth` files
    united and binarised at > 0.5 (the masks' 0.3 rim is background), the site folder as the domain."""
    from fake_raw import ATLAS_R1_SUBJECTS, make_fake_atlas_r1
    from jcsaug.tasks.layouts import find_atlas

    raw = make_fake_atlas_r1(tmp_path)
    cases = {c.case_id: c for c in find_atlas(raw)}
    assert sorted(cases) == sorted(s[1] for s in ATLAS_R1_SUBJECTS)
    assert cases["031810"].image.parent.name == "t01"
    assert {c.domain for c in cases.values()} == {"Site1", "Site2"}
    assert [p.name for p in cases["031806"].extra_labels] == ["031806_LesionSmooth_1_stx.nii.gz"]
    assert cases["031806"].label.name == "031806_LesionSmooth_stx.nii.gz"
    assert all(not c.extra_labels for k, c in cases.items() if k != "031806")

    prepare_task("atlas_stroke", raw, tmp_path / "data", progress=False)
    datalist = json.loads((tmp_path / "data" / "dataset.json").read_text())
    assert sum(datalist["num_cases"][s] for s in ("training", "validation", "test")) == len(ATLAS_R1_SUBJECTS)
    case = cases["031806"]
    masks = [np.asarray(nib.load(str(p)).dataobj) for p in (case.label, *case.extra_labels)]
    assert all(np.allclose(np.unique(m), [0.0, 0.3, 1.0]) for m in masks)  # the rim: 0.3
    _, label = _prepared_arrays(tmp_path / "data", "031806")
    np.testing.assert_array_equal(label, (np.maximum(*masks) > 0.5).astype(label.dtype))
    record = json.loads((tmp_path / "data" / prepare_module.STATE_DIR / "cases" / "031806.json").read_text())
    assert record["source_extra_labels"] == [str(case.extra_labels[0])]


def test_atlas_r1_lesion_files_must_share_a_grid_and_a_changed_one_is_prepared_again(tmp_path):
    from fake_raw import make_fake_atlas_r1
    from jcsaug.tasks.layouts import find_atlas

    raw = make_fake_atlas_r1(tmp_path)
    case = next(c for c in find_atlas(raw) if c.extra_labels)
    spec = get_task("atlas_stroke")
    prepare_module.prepare_case(spec, case, tmp_path / "out")
    assert prepare_module._done(tmp_path / "out", case) is not None
    extra = case.extra_labels[0]
    _rewrite(extra, np.zeros((28, 30, 25), np.float32))
    assert prepare_module._done(tmp_path / "out", case) is None  # its stamp changed: prepared again
    with pytest.raises(PrepareError, match=rf"case {case.case_id}: label .*{extra.name} \(shape \(28, 30, 25\)\) "
                                           r"does not match"):  # fmt: skip
        prepare_module.prepare_case(spec, case, tmp_path / "out")
    _rewrite(extra, np.full((28, 30, 26), np.nan, np.float32))
    with pytest.raises(PrepareError, match=r"NaN/Inf voxels"):
        prepare_module.prepare_case(spec, case, tmp_path / "out")


def test_atlas_without_either_release_names_both_layouts(tmp_path):
    from jcsaug.tasks.layouts import find_atlas

    with pytest.raises(
        PrepareError, match=r"T1w\.nii\.gz \(ATLAS v2\.0\) or .*LesionSmooth_stx\.nii\.gz \(ATLAS R1\.x\)"
    ):
        find_atlas(tmp_path)


def test_mnms_unlabeled_folder_without_labels_or_with_empty_ones_is_left_out(tmp_path, caplog):
    """DATASETS.md: M&Ms `Training/Unlabeled` may or may not hold labels. A subject there without a `_sa_gt` file
    is skipped (no --skip-unlabelled needed), one whose ED/ES labels are empty is left out with a warning, one
    with labels trains (its folder is `Training`)."""
    import shutil as _shutil

    from fake_raw import MNMS_CSV

    raw = make_fake_raw("cardiac_crosssite", tmp_path / "raw")
    source = raw / "Training" / "Labeled" / "A0S9V9"
    rows = []
    for code, gt in (("U1N0GT", None), ("U2EMPT", "empty"), ("U3LABL", "copy")):
        folder = raw / "Training" / "Unlabeled" / code
        folder.mkdir(parents=True)
        _shutil.copy(source / "A0S9V9_sa.nii.gz", folder / f"{code}_sa.nii.gz")
        if gt == "copy":
            _shutil.copy(source / "A0S9V9_sa_gt.nii.gz", folder / f"{code}_sa_gt.nii.gz")
        elif gt == "empty":
            nii = nib.load(str(source / "A0S9V9_sa_gt.nii.gz"))
            nib.save(nib.Nifti1Image(np.zeros(nii.shape, np.uint8), nii.affine), str(folder / f"{code}_sa_gt.nii.gz"))
        rows.append(f"{90 + len(rows)},{code},GE,C,3,0,3,50,NOR,M,170,70")
    with open(raw / MNMS_CSV, "a") as f:
        f.write("\n".join(rows) + "\n")

    with caplog.at_level("WARNING"):
        prepare_task("cardiac_crosssite", raw, tmp_path / "data", progress=False)
    datalist = json.loads((tmp_path / "data" / "dataset.json").read_text())
    cases = {e["case"]: split for split in datalist["num_cases"] for e in datalist[split]}
    assert not any(c.startswith(("U1N0GT", "U2EMPT")) for c in cases)
    assert cases["U3LABL_ED"] == cases["U3LABL_ES"] == "training"
    assert "U2EMPT_ED, U2EMPT_ES" in caplog.text and "left out" in caplog.text


def test_mscmrseg_resamples_in_plane_only_and_keeps_the_slices_as_acquired(tmp_path):
    """MS-CMRSeg's spacing is 1.25 x 1.25 in plane with the slice axis as acquired (SPEC: 0 = kept): a case
    acquired at 0.9 mm in plane and 12 mm slices comes out 1.25 x 1.25 x 12 with its 6 slices."""
    raw = make_fake_raw("cardiac_crosssequence", tmp_path / "raw")
    image, label = raw_case_files("cardiac_crosssequence", raw)["patient1_C0"]
    affine = np.diag([0.9, 0.9, 12.0, 1.0])
    _rewrite(image, affine=affine)
    _rewrite(label, affine=affine)
    prepare_task("cardiac_crosssequence", raw, tmp_path / "data", progress=False)
    for folder in ("images", "labels"):
        nii = nib.load(str(tmp_path / "data" / folder / "patient01_C0.nii.gz"))
        assert nii.header.get_zooms() == pytest.approx((1.25, 1.25, 12.0), rel=1e-4)
        assert nii.shape[2] == 6 and nii.shape[0] == round(32 * 0.9 / 1.25)


def test_mscmrseg_t2_volumes_are_not_cases(tmp_path):
    """MS-CMRSeg ships T2 beside bSSFP (C0) and LGE (DATASETS.md); the paper uses C0 -> LGE, so a T2 volume and its
    label are left out of the cases, the splits and the prepared files."""
    from jcsaug.tasks.layouts import find_mscmrseg

    raw = make_fake_raw("cardiac_crosssequence", tmp_path / "raw")
    image, label = raw_case_files("cardiac_crosssequence", raw)["patient1_C0"]
    (raw / "t2").mkdir()
    (raw / "t2gt").mkdir()
    shutil.copy(image, raw / "t2" / "patient1_T2.nii.gz")
    shutil.copy(label, raw / "t2gt" / "patient1_T2_manual.nii.gz")
    cases = find_mscmrseg(raw)
    assert {c.domain for c in cases} == {"C0", "LGE"} and not any("T2" in c.case_id for c in cases)
    prepare_task("cardiac_crosssequence", raw, tmp_path / "data", progress=False)
    datalist = json.loads((tmp_path / "data" / "dataset.json").read_text())
    prepared = [e["case"] for split in datalist["num_cases"] for e in datalist[split]]
    assert prepared and not any("T2" in c for c in prepared)
    assert not list((tmp_path / "data" / "images").glob("*T2*"))


def test_mr_images_are_z_scored_case_by_case_at_load(prepared):
    """MR tasks (SPEC: case-wise z-score): at load time each image's voxels get mean 0 and sd 1 (CT: above)."""
    _, data = prepared["atlas_stroke"]
    assert json.loads((data / "dataset.json").read_text())["normalisation"] == {"scheme": "zscore"}
    transform = intensity_normalisation(data)
    for entry in load_split(data, "training", "atlas_stroke")[:2]:
        raw = np.asarray(nib.load(entry["image"]).dataobj, dtype=np.float32)
        x = np.asarray(transform({"image": raw[None]})["image"])
        assert abs(raw.mean()) > 1 and float(x.mean()) == pytest.approx(0.0, abs=1e-4)
        assert float(x.std()) == pytest.approx(1.0, rel=1e-3)


def test_a_btcv_case_without_an_organ_is_prepared(tmp_path):
    """DATASETS.md: BTCV's 13 organs are not in every case (e.g. a removed gallbladder): such a case is prepared,
    its record counting no voxel of that class."""
    raw = make_fake_raw("btcv_abdomen", tmp_path / "raw")
    key, _, label = _first_labelled("btcv_abdomen", raw)
    values = np.asarray(nib.load(str(label)).dataobj)
    _rewrite(label, np.where(values == 4, 0, values).astype(values.dtype))  # 4: gallbladder
    prepare_task("btcv_abdomen", raw, tmp_path / "data", progress=False)
    case = f"btcv_{_needle('btcv_abdomen', key)}"  # raw img0001 -> case btcv_0001
    record = json.loads((tmp_path / "data" / prepare_module.STATE_DIR / "cases" / f"{case}.json").read_text())
    counts = record["class_voxels"]
    assert counts[4] == 0 and all(counts[c] > 0 for c in range(1, 14) if c != 4)
