"""The synthetic dataset of the default bundle: files, datalist, determinism, lesion sizes, domain shift."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from monai.data import load_decathlon_datalist
from monai.transforms import LoadImaged
from scipy import ndimage

from helpers import COMBINED_SHIFT, COMBINED_SHIFT_RECORDED
from jcsaug.data import make_synthetic_dataset, synthetic_datalist
from jcsaug.data.synthetic import (
    SPLITS,
    TARGET_SHIFTS,
    describe_shift,
    resolve_target_shift,
    shift_undoing_ops,
    synthesize_case,
)

SHAPE = (32, 32, 32)
COUNTS = {"num_train": 4, "num_val": 2, "num_test": 3}


def _load(root: Path, rel: str) -> np.ndarray:
    return np.asanyarray(nib.load(str(root / rel)).dataobj)


def _all_cases(json_path: Path) -> dict[str, list[tuple[np.ndarray, np.ndarray]]]:
    root = json_path.parent
    meta = json.loads(json_path.read_text())
    return {s: [(_load(root, e["image"]), _load(root, e["label"])) for e in meta[s]] for s in SPLITS}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_synthetic_dataset(tmp_path_factory.mktemp("syn"), shape=SHAPE, seed=3, progress=False, **COUNTS)


def test_files_and_datalist_load_with_monai(dataset: Path) -> None:
    root = dataset.parent
    meta = json.loads(dataset.read_text())
    assert meta["labels"] == {"0": "background", "1": "lesion"}
    assert meta["seed"] == 3 and meta["shape"] == list(SHAPE)
    assert meta["domain"] == {"training": "source", "validation": "target", "test": "target"}
    assert [len(meta[s]) for s in SPLITS] == [4, 2, 3]
    names = [Path(e["image"]).name for s in SPLITS for e in meta[s]]
    assert len(set(names)) == len(names) == 9
    loader = LoadImaged(["image", "label"], ensure_channel_first=True, image_only=True)
    for split, (img_dir, lbl_dir, _) in SPLITS.items():
        items = load_decathlon_datalist(str(dataset), True, split, str(root))
        assert len(items) == len(meta[split])
        for item in items:
            assert Path(item["image"]).parent.name == img_dir and Path(item["label"]).parent.name == lbl_dir
            d = loader(item)
            assert tuple(d["image"].shape) == (1, *SHAPE) and tuple(d["label"].shape) == (1, *SHAPE)
            np.testing.assert_allclose(np.asarray(d["image"].affine), np.eye(4))
    img = nib.load(str(root / meta["training"][0]["image"]))
    lbl = nib.load(str(root / meta["training"][0]["label"]))
    assert img.get_data_dtype() == np.float32 and lbl.get_data_dtype() == np.uint8
    assert nib.aff2axcodes(img.affine) == ("R", "A", "S")


def test_labels_binary_foreground_and_intensity_scale(dataset: Path) -> None:
    for cases in _all_cases(dataset).values():
        for image, label in cases:
            assert set(np.unique(label).tolist()) == {0, 1}
            assert 0.01 <= label.mean() <= 0.03
            assert abs(float(image.mean())) < 1e-3 and abs(float(image.std()) - 1.0) < 1e-3
            assert 2 <= ndimage.label(label)[1] <= 6


def test_default_shape_foreground_fraction(tmp_path: Path) -> None:
    path = make_synthetic_dataset(tmp_path, num_train=1, num_val=1, num_test=1, progress=False)
    for cases in _all_cases(path).values():
        for image, label in cases:
            assert image.shape == (48, 48, 48)
            assert 0.01 <= label.mean() <= 0.03


def test_deterministic_by_seed(dataset: Path, tmp_path: Path) -> None:
    again = make_synthetic_dataset(tmp_path / "a", shape=SHAPE, seed=3, progress=False, **COUNTS)
    other = make_synthetic_dataset(tmp_path / "b", shape=SHAPE, seed=4, progress=False, **COUNTS)
    first, second, third = _all_cases(dataset), _all_cases(again), _all_cases(other)
    for split in SPLITS:
        for (i1, l1), (i2, l2), (i3, l3) in zip(first[split], second[split], third[split]):
            assert i1.tobytes() == i2.tobytes() and l1.tobytes() == l2.tobytes()
            assert not np.array_equal(i1, i3) and not np.array_equal(l1, l3)
    # the gzip files carry no timestamp: same seed, same bytes
    meta = json.loads(dataset.read_text())
    rel = meta["test"][0]["image"]
    assert (dataset.parent / rel).read_bytes() == (again.parent / rel).read_bytes()


def test_case_does_not_depend_on_other_counts(dataset: Path, tmp_path: Path) -> None:
    small = make_synthetic_dataset(tmp_path, num_train=2, num_val=1, num_test=1, shape=SHAPE, seed=3, progress=False)
    big, little = _all_cases(dataset), _all_cases(small)
    assert np.array_equal(big["training"][1][0], little["training"][1][0])
    assert np.array_equal(big["validation"][0][1], little["validation"][0][1])


def _orientation(label: np.ndarray) -> float:
    """Mean over lesions of log(variance along axis 0 / variance along axis 2)."""
    comps, n = ndimage.label(label)
    ratios = []
    for k in range(1, n + 1):
        var = np.argwhere(comps == k).var(axis=0)
        ratios.append(np.log(var[0] / var[2]))
    return float(np.mean(ratios))


def _skewness(image: np.ndarray) -> float:
    x = image.astype(np.float64)
    return float(((x - x.mean()) ** 3).mean() / x.std() ** 3)


def test_target_domain_differs_from_source(tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    source = [synthesize_case(rng, SHAPE, "source") for _ in range(6)]
    target = [synthesize_case(rng, SHAPE, "target") for _ in range(6)]
    # lesions are elongated along array axis 0 in the source domain, along axis 2 in the target domain
    assert all(_orientation(lbl) > 0.5 for _, lbl in source)
    assert all(_orientation(lbl) < -0.5 for _, lbl in target)
    # mirrored placement along axis 0
    centre = (SHAPE[0] - 1) / 2
    assert np.mean([np.argwhere(lbl)[:, 0].mean() for _, lbl in source]) < centre
    assert np.mean([np.argwhere(lbl)[:, 0].mean() for _, lbl in target]) > centre
    # gamma > 1 on the rescaled image skews the intensity distribution to the right
    assert np.mean([_skewness(img) for img, _ in target]) > np.mean([_skewness(img) for img, _ in source]) + 0.2


def test_the_blur_shift_is_the_tra_blur_of_the_plain_case_and_changes_nothing_else() -> None:
    """``blur``: the same case as the source domain, its z-scored image then smoothed by a Gaussian whose sigma is
    drawn last (so the other domains' cases are unchanged by the key)."""
    blur = TARGET_SHIFTS["blur"]
    rng, plain_rng = np.random.default_rng(5), np.random.default_rng(5)
    image, label = synthesize_case(rng, SHAPE, blur)
    plain, plain_label = synthesize_case(plain_rng, SHAPE, {**blur, "blur": None})
    sigma = plain_rng.uniform(*blur["blur"])
    assert 0.8 <= sigma < 1.0
    np.testing.assert_array_equal(label, plain_label)
    np.testing.assert_allclose(image, ndimage.gaussian_filter(plain, sigma), atol=1e-6)
    assert np.abs(np.diff(image, axis=1)).mean() < 0.7 * np.abs(np.diff(plain, axis=1)).mean()  # smoother
    without_key = {k: v for k, v in TARGET_SHIFTS["default"].items() if k != "blur"}  # a domain of before the key
    a = synthesize_case(np.random.default_rng(9), SHAPE, without_key)
    np.testing.assert_array_equal(a[0], synthesize_case(np.random.default_rng(9), SHAPE, "target")[0])


def test_the_gamma_shift_is_the_default_gamma_of_the_plain_case_and_nothing_else() -> None:
    """``gamma``: the source case (same lesions, same place), its image robustly rescaled to [0, 1], raised to the
    gamma drawn next and z-scored: the default shift's intensity change without its rotation and mirror."""
    shift = TARGET_SHIFTS["gamma"]
    rng, plain_rng = np.random.default_rng(5), np.random.default_rng(5)
    image, label = synthesize_case(rng, SHAPE, shift)
    plain, plain_label = synthesize_case(plain_rng, SHAPE, "source")
    power = plain_rng.uniform(*shift["gamma"])
    assert 1.4 <= power < 1.6
    np.testing.assert_array_equal(label, plain_label)
    lo, hi = np.percentile(plain, [0.5, 99.5])  # the rescaling does not see the plain case's z-scoring
    expected = np.clip((plain - lo) / (hi - lo), 0.0, 1.0) ** power
    np.testing.assert_allclose(image, (expected - expected.mean()) / expected.std(), atol=1e-4)
    assert _skewness(image) > _skewness(plain) + 0.2


def _zscore(x: np.ndarray) -> np.ndarray:
    return (x - x.mean()) / (x.std() + 1e-8)


@pytest.mark.parametrize("scale", [(1.3, 1.4), (0.7, 0.75)])
def test_the_scale_shift_magnifies_the_plain_case_about_its_centre(scale: tuple[float, float]) -> None:
    """``scale``: the source case (same draws) magnified by the factor drawn next, image (linear) and label (nearest)
    alike, about the volume's centre; then z-scored. A factor below 1 shrinks it, the border filled by reflection."""
    rng, plain_rng = np.random.default_rng(7), np.random.default_rng(7)
    image, label = synthesize_case(rng, SHAPE, {"scale": scale})
    plain, plain_label = synthesize_case(plain_rng, SHAPE, "source")
    factor = plain_rng.uniform(*scale)
    assert scale[0] <= factor < scale[1]
    centre = (np.asarray(SHAPE) - 1) / 2.0
    coords = centre[:, None, None, None] + (np.indices(SHAPE) - centre[:, None, None, None]) / factor
    expected = ndimage.map_coordinates(plain, coords, order=1, mode="reflect")
    np.testing.assert_allclose(image, _zscore(expected), atol=1e-4)
    np.testing.assert_array_equal(label, ndimage.map_coordinates(plain_label, coords, order=0, mode="reflect"))
    if factor > 1:  # what grew fills more of the volume (some of it leaves at the border)
        assert label.sum() > 1.5 * plain_label.sum()


def test_the_noise_shift_adds_gaussian_noise_to_the_plain_z_scored_case() -> None:
    """``noise``: the source case, then Gaussian noise of the standard deviation drawn next, added last."""
    rng, plain_rng = np.random.default_rng(3), np.random.default_rng(3)
    image, label = synthesize_case(rng, SHAPE, {"noise": [0.1, 0.15]})
    plain, plain_label = synthesize_case(plain_rng, SHAPE, "source")
    std = plain_rng.uniform(0.1, 0.15)
    np.testing.assert_array_equal(label, plain_label)
    np.testing.assert_allclose(image, plain + plain_rng.normal(0.0, std, size=SHAPE), atol=1e-5)
    assert 0.1 <= float(np.std(image - plain)) < 0.16


def test_the_low_resolution_shift_is_the_tra_low_resolution_of_the_plain_case() -> None:
    """``low_resolution``: the source case, then zoomed down by the factor drawn next and back up (the TRA's own op,
    the last series, so its bin reproduces the shift); the label is untouched. Undone by the TRA bin of that zoom,
    by no TEA op."""
    import torch

    from jcsaug.ops.intensity import low_resolution

    rng, plain_rng = np.random.default_rng(4), np.random.default_rng(4)
    image, label = synthesize_case(rng, SHAPE, {"low_resolution": [0.6, 0.8]})
    plain, plain_label = synthesize_case(plain_rng, SHAPE, "source")
    zoom = plain_rng.uniform(0.6, 0.8)
    np.testing.assert_array_equal(label, plain_label)
    expected = low_resolution(torch.from_numpy(plain)[None, None], [zoom])[0, 0].numpy()
    np.testing.assert_allclose(image, expected, atol=1e-6)
    small = int(round(SHAPE[0] * zoom))  # nearest upsampling repeats slices: fewer distinct ones along each axis
    assert len(np.unique(image[:, 5, 5])) <= small < SHAPE[0]
    assert shift_undoing_ops({"low_resolution": [0.6, 0.8]}) == {
        "tra": [{"series": "low_resolution", "op": "low_resolution[0.6,0.8)"}], "tea": []}  # fmt: skip
    assert shift_undoing_ops({"low_resolution": [0.82, 0.9]})["tra"][0]["op"] == "low_resolution[0.8,1)"
    assert (
        describe_shift({"low_resolution": [0.6, 0.8]}) == "resolution reduced by a zoom of 0.6-0.8 (down and up again)"
    )
    # a domain without the key (one recorded before it) draws the same cases
    no_key = {k: v for k, v in TARGET_SHIFTS["default"].items() if k != "low_resolution"}
    a = synthesize_case(np.random.default_rng(9), SHAPE, no_key)
    np.testing.assert_array_equal(a[0], synthesize_case(np.random.default_rng(9), SHAPE, "target")[0])


def test_the_ops_that_undo_a_zoom_and_noise_are_named_from_the_catalogues() -> None:
    """A magnified target: the TRA zoom whose bin holds the factor's magnitude (its direction drawn: partial) and the
    TEA zoom the other way; a shrunk one: the TEA zoom up; noise: the TRA noise of that sd, no TEA op (none
    denoises)."""
    assert shift_undoing_ops({"scale": [1.3, 1.4]}) == {
        "tra": [{"series": "scale", "op": "scale±[0.3,0.4)", "partial": True, "sign": "-"}],
        "tea": [["scale_down_0.35"]]}  # fmt: skip
    shrunk = shift_undoing_ops({"scale": [0.7, 0.78]})
    assert shrunk["tea"] == [["scale_up_0.35"]] and shrunk["tra"][0]["sign"] == "+"  # 1 / 0.74 - 1 = 0.35
    assert shift_undoing_ops({"noise": [0.1, 0.15]}) == {"tra": [{"series": "noise", "op": "noise_std[0.1,0.15)"}],
                                                          "tea": []}  # fmt: skip
    assert describe_shift({"scale": [1.3, 1.4], "noise": [0.1, 0.15]}) == (
        "scene magnified by 1.3-1.4, Gaussian noise sd 0.1-0.15"
    )


def test_existing_dataset_is_not_rewritten(tmp_path: Path) -> None:
    path = make_synthetic_dataset(tmp_path, num_train=1, num_val=1, num_test=1, shape=SHAPE, progress=False)
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    old = {p: _load(tmp_path, str(p.relative_to(tmp_path))) for p in files if "nii" in p.name}
    past = 1_000_000_000
    for p in files:
        os.utime(p, ns=(past, past))
    assert make_synthetic_dataset(tmp_path, num_train=1, num_val=1, num_test=1, shape=SHAPE, progress=False) == path
    assert all(p.stat().st_mtime_ns == past for p in files)
    with pytest.warns(UserWarning, match="overwrite=True"):
        make_synthetic_dataset(tmp_path, num_train=2, num_val=1, num_test=1, shape=SHAPE, progress=False)
    assert all(p.stat().st_mtime_ns == past for p in files)
    # overwrite regenerates and drops stale cases of the split folders
    stale = tmp_path / "imagesTr" / "case_099.nii.gz"
    stale.write_bytes(b"stale")
    make_synthetic_dataset(tmp_path, num_train=1, num_val=1, num_test=1, shape=SHAPE, overwrite=True, progress=False)
    assert all(p.stat().st_mtime_ns != past for p in files)
    assert sorted(p for p in tmp_path.rglob("*") if p.is_file()) == files
    assert all(np.array_equal(_load(tmp_path, str(p.relative_to(tmp_path))), old[p]) for p in files if "nii" in p.name)


def test_interrupted_generation_is_redone(tmp_path: Path) -> None:
    path = make_synthetic_dataset(tmp_path, num_train=1, num_val=1, num_test=1, shape=SHAPE, progress=False)
    label_file = tmp_path / json.loads(path.read_text())["training"][0]["label"]
    path.unlink()  # as if generation had stopped before writing the datalist
    label_file.unlink()
    assert make_synthetic_dataset(tmp_path, num_train=1, num_val=1, num_test=1, shape=SHAPE, progress=False) == path
    assert path.is_file() and label_file.is_file()
    assert not list(tmp_path.rglob("*.tmp"))


@pytest.mark.parametrize(
    ("kwargs", "shown"),
    [
        ({"num_train": 0}, "0"),
        ({"num_val": -2}, "-2"),
        ({"num_test": 1.5}, "1.5"),
        ({"shape": (32, 32)}, "(32, 32)"),
        ({"shape": (32, 32, 32, 32)}, "(32, 32, 32, 32)"),
        ({"shape": (32, 8, 32)}, "(32, 8, 32)"),
        ({"seed": -1}, "-1"),
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict, shown: str) -> None:
    with pytest.raises(ValueError, match=shown.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        make_synthetic_dataset(tmp_path, progress=False, **kwargs)
    assert not (tmp_path / "dataset.json").exists()


def test_out_dir_is_a_file(tmp_path: Path) -> None:
    target = tmp_path / "not_a_dir"
    target.write_text("x")
    with pytest.raises(NotADirectoryError, match="not_a_dir"):
        make_synthetic_dataset(target, progress=False)


def test_unknown_domain() -> None:
    with pytest.raises(ValueError, match="'other'"):
        synthesize_case(np.random.default_rng(0), SHAPE, "other")


@pytest.mark.parametrize("content", [b"", b"{not json", b"\xff\xfe\x00", b"[1, 2]"])
def test_unreadable_datalist_is_an_error_and_nothing_is_regenerated(tmp_path: Path, content: bytes) -> None:
    """Issue 12 item 1: `: > D/dataset.json` must not regenerate the dataset over the files in D."""
    make_synthetic_dataset(tmp_path, num_train=1, num_val=1, num_test=1, shape=SHAPE, progress=False)
    (tmp_path / "dataset.json").write_bytes(content)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match=rf"cannot read the datalist {tmp_path / 'dataset.json'} \("):
        make_synthetic_dataset(tmp_path, num_train=1, num_val=1, num_test=1, shape=SHAPE, progress=False)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    # the folder is jcsaug's (marker): an explicit overwrite regenerates it
    path = make_synthetic_dataset(tmp_path, num_train=1, num_val=1, num_test=1, shape=SHAPE, overwrite=True,
                                  progress=False)  # fmt: skip
    assert json.loads(path.read_text())["num_training"] == 1


def test_only_empty_or_jcsaug_folders_are_written(tmp_path: Path) -> None:
    user = tmp_path / "user"
    (user / "imagesTr").mkdir(parents=True)
    mine = user / "imagesTr" / "case_000.nii.gz"
    mine.write_bytes(b"a user's own volume")
    for overwrite in (False, True):
        with pytest.raises(ValueError, match=rf"{user} is not empty and was not made by make_synthetic_dataset"):
            make_synthetic_dataset(user, num_train=1, num_val=1, num_test=1, shape=SHAPE, overwrite=overwrite,
                                   progress=False)  # fmt: skip
    assert mine.read_bytes() == b"a user's own volume" and sorted(user.rglob("*")) == [user / "imagesTr", mine]
    (user / "dataset.json").write_text("")  # unreadable, no marker: even overwrite=True refuses
    with pytest.raises(ValueError, match="cannot read the datalist"):
        make_synthetic_dataset(user, num_train=1, num_val=1, num_test=1, shape=SHAPE, overwrite=True, progress=False)
    assert mine.read_bytes() == b"a user's own volume"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert make_synthetic_dataset(empty, num_train=1, num_val=1, num_test=1, shape=SHAPE, progress=False).is_file()


# ------------------------------------------------------- a target shift given as a mapping (helpers.COMBINED_SHIFT)


def _long_axes(label: np.ndarray) -> list[int]:
    """The array axis of largest extent of each lesion."""
    comps, n = ndimage.label(label)
    return [int(np.argmax(np.argwhere(comps == k).var(axis=0))) for k in range(1, n + 1)]


def test_a_mapping_shift_makes_the_target_cases_it_asks_for_and_records_them(tmp_path: Path) -> None:
    path = make_synthetic_dataset(tmp_path, num_train=2, num_val=2, num_test=2, shape=SHAPE, seed=1,
                                  progress=False, target_shift=COMBINED_SHIFT)  # fmt: skip
    meta = json.loads(path.read_text())
    assert meta["target_shift"] == COMBINED_SHIFT_RECORDED and meta["domain_shift"]["name"] == "custom"
    assert meta["domain_shift"]["undone_by"] == {  # a quarter turn about the third axis, the mirror, the blur
        "tra": [{"series": "rotate_longitudinal", "op": "rot90"}, {"series": "mirror_sagittal", "op": "flip"},
                {"series": "blur_sharpen", "op": "blur[0.8,1)"}],
        "tea": [["rotate_longitudinal_acw_90", "rotate_longitudinal_cw_90"], ["mirror_sagittal"], ["sharpen_0.9"]],
    }  # fmt: skip
    assert meta["domain_shift"]["blur"]["target"] == [0.8, 1.0] and "mirrored" in meta["description"]
    cases = _all_cases(path)
    target = cases["validation"] + cases["test"]
    source_axes = [a for _, lbl in cases["training"] for a in _long_axes(lbl)]
    target_axes = [a for _, lbl in target for a in _long_axes(lbl)]
    assert max(set(source_axes), key=source_axes.count) == 0 and max(set(target_axes), key=target_axes.count) == 1
    centre = (SHAPE[0] - 1) / 2
    assert np.mean([np.argwhere(lbl)[:, 0].mean() for _, lbl in cases["training"]]) < centre
    assert np.mean([np.argwhere(lbl)[:, 0].mean() for _, lbl in target]) > centre  # mirrored placement
    roughness = [np.abs(np.diff(img, axis=1)).mean() for img, _ in cases["training"] + target]
    assert max(roughness[2:]) < 0.7 * min(roughness[:2])  # blurred
    rng = np.random.default_rng(np.random.SeedSequence(1, spawn_key=(1, 0)))  # validation case 0
    expected = synthesize_case(rng, SHAPE, {**COMBINED_SHIFT_RECORDED, "blur": (0.8, 1.0)})
    np.testing.assert_array_equal(cases["validation"][0][0], expected[0])


@pytest.mark.parametrize(
    ("shift", "shown"),
    [
        (
            {"long_axis": 1, "sigma": 2},
            r"\['sigma'\]; the keys are \['long_axis', 'mirror_axis0', 'gamma', 'blur', 'scale', 'noise', "
            r"'low_resolution'\]",
        ),
        ({"long_axis": 3}, "'long_axis' .* got 3"),
        ({"long_axis": True}, "'long_axis' .* got True"),
        ({"long_axis": 1.0}, r"'long_axis' .* got 1\.0"),
        ({"mirror_axis0": 1}, "'mirror_axis0' .* got 1"),
        ({"gamma": [0, 1.5]}, r"'gamma' .* got \[0, 1\.5\]"),
        ({"gamma": [1.6, 1.4]}, r"'gamma' .* got \[1\.6, 1\.4\]"),
        ({"gamma": [1.4, float("inf")]}, r"'gamma' .* got \[1\.4, inf\]"),
        ({"gamma": 1.5}, r"'gamma' .* got 1\.5"),
        ({"gamma": [1.0, 1.2, 1.4]}, r"'gamma' .* got \[1\.0, 1\.2, 1\.4\]"),
        ({"blur": [-0.1, 1.0]}, r"'blur' .* 0 <= lo < hi; got \[-0\.1, 1\.0\]"),
        ({"blur": [0.5, float("nan")]}, r"'blur' .* got \[0\.5, nan\]"),
        ({"blur": "0.8,1"}, "'blur' .* got '0.8,1'"),
        ({"scale": [0, 1.2]}, r"'scale' .* 0 < lo < hi; got \[0, 1\.2\]"),
        ({"noise": [0.2, 0.1]}, r"'noise' .* 0 <= lo < hi; got \[0\.2, 0\.1\]"),
        ({"low_resolution": [0.5, 1.2]}, r"'low_resolution' .* 0 < lo < hi <= 1; got \[0\.5, 1\.2\]"),
        ({"low_resolution": [0, 0.5]}, r"'low_resolution' .* got \[0, 0\.5\]"),
        (3, "a mapping, got 3"),
    ],
)
def test_bad_target_shift_mappings_are_refused_naming_key_and_value(tmp_path: Path, shift: object, shown: str) -> None:
    with pytest.raises(ValueError, match=shown):
        make_synthetic_dataset(tmp_path, num_train=1, num_val=1, num_test=1, shape=SHAPE, progress=False,
                               target_shift=shift)  # fmt: skip
    assert not any(tmp_path.iterdir())


def test_mappings_are_normalised_and_a_mapping_equal_to_a_named_shift_is_that_shift() -> None:
    assert resolve_target_shift({"blur": [0.8, 1]}) == ("blur", TARGET_SHIFTS["blur"])  # JSON lists, integers
    assert resolve_target_shift("rotate-longitudinal") == ("rotate-longitudinal", TARGET_SHIFTS["rotate-longitudinal"])
    name, target = resolve_target_shift(COMBINED_SHIFT)
    assert (name, target) == ("custom", {**COMBINED_SHIFT_RECORDED, "blur": (0.8, 1.0)})
    # the source domain itself is a valid control: no shift, no undoing op
    ranges = ("gamma", "blur", "scale", "noise", "low_resolution")
    assert resolve_target_shift({})[1] == {"long_axis": 0, "mirror_axis0": False, **dict.fromkeys(ranges)}
    assert describe_shift({}) == "no shift" and shift_undoing_ops({}) == {"tra": [], "tea": []}
    assert describe_shift(COMBINED_SHIFT).startswith("lesion long axis rotated from array axis 0 to 1, placement")


def test_a_named_shift_and_the_equal_mapping_share_a_folder_another_mapping_is_flagged(tmp_path: Path) -> None:
    kwargs = {"num_train": 1, "num_val": 1, "num_test": 1, "shape": SHAPE, "progress": False}
    named = make_synthetic_dataset(tmp_path / "named", target_shift="blur", **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert make_synthetic_dataset(tmp_path / "named", target_shift={"blur": (0.8, 1.0)}, **kwargs) == named
        as_mapping = make_synthetic_dataset(tmp_path / "mapping", target_shift={"blur": [0.8, 1]}, **kwargs)
    assert as_mapping.read_text() == named.read_text()  # recorded by its name, as if asked by name
    custom = synthetic_datalist(tmp_path / "custom", target_shift=COMBINED_SHIFT, **kwargs)
    before = custom.stat().st_mtime_ns
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same mapping written otherwise, or any shift: the folder as it is
        same = {"blur": (0.8, 1.0), "gamma": None, "mirror_axis0": True, "long_axis": 1}
        assert make_synthetic_dataset(tmp_path / "custom", target_shift=same, **kwargs) == custom
        assert make_synthetic_dataset(tmp_path / "custom", target_shift=None, **kwargs) == custom
    other = {**COMBINED_SHIFT, "blur": [0.6, 0.8]}
    with pytest.warns(UserWarning, match=r"'target_shift': \{'long_axis': 1, 'mirror_axis0': True, 'gamma': None, "
                      r"'blur': \[0\.6, 0\.8\], 'scale': None, 'noise': None, 'low_resolution': None\}"):  # fmt: skip
        make_synthetic_dataset(tmp_path / "custom", target_shift=other, **kwargs)
    for asked in ("default", "blur"):
        with pytest.warns(UserWarning, match=f"'target_shift': '{asked}'"):
            make_synthetic_dataset(tmp_path / "custom", target_shift=asked, **kwargs)
    with pytest.warns(UserWarning, match=r"'target_shift': \{'long_axis': 1"):  # a named folder asked for a mapping
        make_synthetic_dataset(tmp_path / "named", target_shift=COMBINED_SHIFT, **kwargs)
    assert custom.stat().st_mtime_ns == before
