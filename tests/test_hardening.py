"""Property-based hardening (hypothesis): TRA cascade and class groups over random shapes, dtypes, label
sets and value ranges; NaN/Inf images, corrupted NIfTI files and foreign policy files give clear errors."""

from __future__ import annotations

import gzip
import json
import re
import tempfile
import warnings
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from monai.data import MetaTensor
from monai.transforms import Compose, Lambda

from jcsaug.data import CheckFinited, CheckImageLabeld, SafeLoadImaged
from jcsaug.data.checks import label_value_problems
from jcsaug.ops.tra import TRA_SERIES, apply_tra, sample_tra_params
from jcsaug.policy import ClassGroupd, TRACascaded, make_tra_policy
from jcsaug.policy.io import load_policies, save_policies

pytestmark = pytest.mark.usefixtures("single_thread")

FAST = settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

shapes = st.tuples(*[st.integers(4, 20)] * 3)
image_dtypes = st.sampled_from([np.float32, np.float64, np.int16])
label_dtypes = st.sampled_from([np.uint8, np.int64])
value_ranges = st.sampled_from(["constant", "unit", "huge", "negative", "mixed"])
label_sets = st.sets(st.integers(0, 200), min_size=1, max_size=5)
seeds = st.integers(0, 2**31 - 1)


def _image(rng: np.random.RandomState, shape, dtype, kind: str) -> np.ndarray:
    if kind == "constant":
        x = np.full(shape, rng.uniform(-1e3, 1e3))
    elif kind == "unit":
        x = rng.rand(*shape)
    elif kind == "huge":
        x = rng.uniform(-1e6, 1e6, size=shape)
    elif kind == "negative":
        x = -rng.uniform(1, 1e3, size=shape)
    else:
        x = rng.randn(*shape) * 1e3 + rng.choice([0.0, 1e5])
    if np.issubdtype(dtype, np.integer):
        x = np.clip(np.round(x), np.iinfo(dtype).min, np.iinfo(dtype).max)
    return x.astype(dtype)[None]


def _label(rng: np.random.RandomState, shape, dtype, values) -> np.ndarray:
    return rng.choice(sorted(values), size=shape).astype(dtype)[None]


def _check_outputs(img_in, lab_in, img_out, lab_out):
    assert img_out.dtype == torch.float32
    assert torch.isfinite(img_out).all(), "TRA produced non-finite intensities"
    assert img_out.shape[0] == 1 and sorted(img_out.shape[1:]) == sorted(img_in.shape[1:])
    assert lab_out.shape == img_out.shape
    assert lab_out.dtype == torch.as_tensor(lab_in).dtype
    # nearest-neighbour labels: only input values (and the 0 padding of the resampling)
    assert set(torch.unique(lab_out).tolist()) <= set(np.unique(lab_in).tolist()) | {0}


@FAST
@given(shapes, image_dtypes, label_dtypes, value_ranges, label_sets, seeds)
def test_tra_cascade_pipeline_properties(shape, img_dtype, lab_dtype, kind, values, seed):
    rng = np.random.RandomState(seed % 2**32)
    img, lab = _image(rng, shape, img_dtype, kind), _label(rng, shape, lab_dtype, values)
    policy = make_tra_policy("uniform", num_groups=2)
    pipeline = Compose([ClassGroupd("label"), TRACascaded("image", policy, label_keys="label")])
    pipeline.set_random_state(seed)
    out = pipeline({"image": torch.as_tensor(img), "label": torch.as_tensor(lab)})
    _check_outputs(img, lab, out["image"], out["label"])
    centre = int(lab[(0, *[s // 2 for s in shape])])
    assert out["class_group"] == int(centre != 0)
    ops = out["tra_ops"]
    assert ops.shape == (15,) and ops.dtype == torch.long
    assert all(0 <= int(o) < s.size for o, s in zip(ops, TRA_SERIES))


@FAST
@given(
    shapes,
    image_dtypes,
    value_ranges,
    label_sets,
    st.lists(st.integers(0, 10), min_size=15, max_size=15),
    seeds,
)
def test_every_tra_op_combination_stays_finite(shape, img_dtype, kind, values, raw_choices, seed):
    """Explicit op choices (every op of every series reachable), not only what a policy happens to draw."""
    rng = np.random.RandomState(seed % 2**32)
    img, lab = _image(rng, shape, img_dtype, kind), _label(rng, shape, np.int64, values)
    choices = [c % s.size for c, s in zip(raw_choices, TRA_SERIES)]
    params = sample_tra_params(choices, rng)
    images, labels = apply_tra({"image": torch.as_tensor(img)}, {"label": torch.as_tensor(lab)}, params)
    _check_outputs(img, lab, images["image"], labels["label"])


@pytest.mark.parametrize("kind", ["constant", "huge", "negative"])
@pytest.mark.parametrize("series", range(len(TRA_SERIES)))
def test_each_op_at_its_strongest_on_extreme_images(series, kind):
    """Regression grid: every single op, top bin, on constant / ±1e6 / negative images, int16 input."""
    rng = np.random.RandomState(series)
    img = _image(rng, (9, 6, 13), np.int16 if kind == "negative" else np.float32, kind)
    lab = _label(rng, (9, 6, 13), np.uint8, {0, 1, 2})
    for sign_seed in range(2):
        choices = [0] * len(TRA_SERIES)
        choices[series] = TRA_SERIES[series].size - 1
        params = sample_tra_params(choices, np.random.RandomState(sign_seed))
        images, labels = apply_tra({"image": torch.as_tensor(img)}, {"label": torch.as_tensor(lab)}, params)
        _check_outputs(img, lab, images["image"], labels["label"])


# ------------------------------------------------------------------------------------------ class groups


@FAST
@given(
    st.dictionaries(st.integers(0, 6), st.integers(0, 3), max_size=6),
    st.integers(-2, 8),
    shapes,
    label_dtypes,
)
def test_class_group_mapping_or_clear_error(mapping, centre, shape, lab_dtype):
    if lab_dtype is np.uint8 and centre < 0:
        centre = -centre
    lab = np.zeros((1, *shape), dtype=lab_dtype)
    lab[(0, *[s // 2 for s in shape])] = centre
    t = ClassGroupd("label", mapping=mapping or None)
    if not mapping:  # default: background 0 -> 0, any other value -> 1, negative refused
        if centre < 0:
            with pytest.raises(ValueError, match=rf"key 'label': label value {centre} is negative"):
                t({"label": torch.as_tensor(lab)})
        else:
            assert t({"label": torch.as_tensor(lab)})["class_group"] == int(centre != 0)
    elif centre in mapping:
        assert t({"label": lab})["class_group"] == mapping[centre]
    else:
        with pytest.raises(ValueError, match=rf"label value {centre} at the patch centre is not in the class-group"):
            t({"label": torch.as_tensor(lab)})


@FAST
@given(st.integers(2, 5), shapes, seeds)
def test_class_group_of_one_hot_labels(channels, shape, seed):
    rng = np.random.RandomState(seed % 2**32)
    cls = rng.randint(channels, size=shape)
    onehot = np.eye(channels, dtype=np.uint8)[cls].transpose(3, 0, 1, 2)
    out = ClassGroupd("label", mapping={c: c for c in range(channels)})({"label": onehot})
    assert out["class_group"] == cls[tuple(s // 2 for s in shape)]


@FAST
@given(st.dictionaries(st.integers(0, 5), st.integers(-3, 8), min_size=1, max_size=5), st.integers(1, 4))
def test_class_group_mapping_out_of_range_is_refused(mapping, num_groups):
    bad = sorted(v for v in mapping.values() if not 0 <= v < num_groups)
    if bad:
        with pytest.raises(
            ValueError, match=re.escape(f"class groups {bad} in mapping out of range [0, {num_groups})")
        ):
            ClassGroupd("label", mapping=mapping, num_groups=num_groups)
    else:
        ClassGroupd("label", mapping=mapping, num_groups=num_groups)


# -------------------------------------------------------------------------------------------- NaN / Inf


nonfinite = st.sampled_from([float("nan"), float("inf"), float("-inf")])


@FAST
@given(shapes, st.sampled_from([np.float32, np.float64]), st.lists(nonfinite, min_size=1, max_size=6), seeds)
def test_nonfinite_image_is_refused_naming_the_case(shape, dtype, bad_values, seed):
    rng = np.random.RandomState(seed % 2**32)
    x = rng.randn(1, *shape).astype(dtype)
    flat = rng.choice(x.size, size=len(bad_values), replace=False)
    x.reshape(-1)[flat] = bad_values
    n_nan = sum(np.isnan(v) for v in bad_values)
    n_inf = len(bad_values) - n_nan
    name = f"/data/case_{seed}.nii.gz"
    with pytest.raises(ValueError, match=rf"'image' of case {name}: {n_nan} NaN and {n_inf} Inf voxels"):
        CheckFinited("image")({"image": MetaTensor(x, meta={"filename_or_obj": name})})
    with pytest.raises(ValueError, match=rf"'image' of case case_{seed}: {n_nan} NaN"):
        CheckFinited("image", case_key="case")({"image": torch.as_tensor(x), "case": f"case_{seed}"})

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cleaned = CheckFinited("image", clean=True)({"image": MetaTensor(x, meta={"filename_or_obj": name})})
    assert [str(w.message) for w in caught] == [
        f"'image' of case {name}: {n_nan} NaN and {n_inf} Inf voxels (of {x.size}) set to 0"
    ]
    out = cleaned["image"]
    assert isinstance(out, MetaTensor) and out.meta["filename_or_obj"] == name and out.dtype == torch.as_tensor(x).dtype
    assert torch.isfinite(out).all()
    assert (out.reshape(-1)[torch.as_tensor(flat)] == 0).all()
    keep = np.isfinite(x)
    assert np.array_equal(out.numpy()[keep], x[keep])


def test_check_finite_passes_clean_data_and_integers_and_warns_once_per_case():
    x = np.ones((1, 4, 4, 4), np.float32)
    d = {"image": x, "label": np.zeros((1, 4, 4, 4), np.uint8)}
    assert CheckFinited(["image", "label"])(d)["image"] is x
    x_bad = x.copy()
    x_bad[0, 0, 0, 0] = np.nan
    t = CheckFinited("image", clean=True)
    with pytest.warns(UserWarning, match="'image' of case <unknown case>: 1 NaN and 0 Inf voxels"):
        out = t({"image": x_bad})
    assert isinstance(out["image"], np.ndarray) and out["image"][0, 0, 0, 0] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t({"image": x_bad})  # the same case again: no second warning


def test_nonfinite_image_never_reaches_tra():
    """The documented guard: CheckFinited before the cascade stops a NaN case before it can poison policies."""
    x = np.zeros((1, 6, 6, 6), np.float32)
    x[0, 1, 2, 3] = np.inf
    pipeline = Compose(
        [
            CheckFinited("image"),
            ClassGroupd("label"),
            TRACascaded("image", make_tra_policy("uniform", num_groups=2), label_keys="label"),
        ]
    )
    with pytest.raises(RuntimeError) as err:  # MONAI's Compose wraps it in a RuntimeError
        pipeline({"image": MetaTensor(x, meta={"filename_or_obj": "sick.nii.gz"}), "label": np.zeros_like(x)})
    assert "'image' of case sick.nii.gz: 0 NaN and 1 Inf voxels" in str(err.value.__cause__ or err.value)


# ---------------------------------------------------------------------------------------- corrupted files


@pytest.fixture(scope="module")
def nifti_dir():
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        img = np.random.RandomState(0).rand(12, 10, 8).astype(np.float32)
        nib.save(nib.Nifti1Image(img, np.eye(4)), d / "good.nii.gz")
        nib.save(nib.Nifti1Image(img, np.eye(4)), d / "good.nii")
        yield d


def _load(path: Path):
    return SafeLoadImaged("image", image_only=True)({"image": str(path)})


def test_good_nifti_loads(nifti_dir):
    assert tuple(_load(nifti_dir / "good.nii.gz")["image"].shape) == (12, 10, 8)


@settings(max_examples=15, deadline=None, database=None)
@given(st.floats(0.0, 0.999))
def test_truncated_nifti_gz_names_the_file(nifti_dir, fraction):
    data = (nifti_dir / "good.nii.gz").read_bytes()
    path = nifti_dir / "truncated.nii.gz"
    path.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(ValueError, match=rf"^cannot read {path}: \w+"):
        _load(path)


@settings(max_examples=15, deadline=None, database=None)
@given(st.floats(0.0, 0.99))
def test_truncated_nifti_names_the_file(nifti_dir, fraction):
    data = (nifti_dir / "good.nii").read_bytes()
    path = nifti_dir / "truncated.nii"
    path.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(ValueError, match=rf"^cannot read {path}: \w+"):
        _load(path)


@settings(max_examples=15, deadline=None, database=None)
@given(st.binary(min_size=0, max_size=600), st.booleans())
def test_garbage_bytes_name_the_file(nifti_dir, payload, gzipped):
    path = nifti_dir / "garbage.nii.gz"
    path.write_bytes(gzip.compress(payload) if gzipped else payload)
    with pytest.raises(ValueError, match=rf"^cannot read {path}: \w+"):
        _load(path)


def test_missing_file_names_the_file(nifti_dir):
    with pytest.raises(ValueError, match=rf"^cannot read {nifti_dir / 'nope.nii.gz'}: FileNotFoundError"):
        _load(nifti_dir / "nope.nii.gz")


# ------------------------------------------------------------------------------------ foreign policy files


@settings(max_examples=15, deadline=None, database=None)
@given(st.data())
def test_policy_file_for_another_catalogue_is_refused(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("policies") / "policies.json"
    save_policies(path, tra=make_tra_policy("nnunet", num_groups=2))
    doc = json.loads(path.read_text())
    g = data.draw(st.integers(0, 1))
    s = data.draw(st.integers(0, 14))
    entry = doc["tra"]["groups"][g]["series"][s]
    how = data.draw(st.sampled_from(["rename_op", "drop_op", "rename_series", "drop_series"]))
    if how == "rename_op":
        entry["ops"][data.draw(st.integers(0, len(entry["ops"]) - 1))]["name"] = "foreign_op"
        expected = rf"{path}: TRA group {g}, series '{entry['series']}': op names .* do not match the catalogue"
    elif how == "drop_op":
        entry["ops"].pop()
        expected = rf"{path}: TRA group {g}, series '{entry['series']}': op names .* do not match the catalogue"
    elif how == "rename_series":
        entry["series"] = "foreign_series"
        expected = rf"{path}: TRA series {s} is 'foreign_series', expected"
    else:
        doc["tra"]["groups"][g]["series"].pop(s)
        expected = rf"{path}: TRA policy has 14 series, the catalogue has 15"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=expected):
        load_policies(path)


@pytest.mark.parametrize("missing", [1, 4, 8, 9])
def test_nifti_gz_missing_only_its_gzip_trailer_is_refused(nifti_dir, missing):
    """nibabel alone loads such a file (the voxels are complete): the CRC/length trailer is checked too."""
    data = (nifti_dir / "good.nii.gz").read_bytes()
    path = nifti_dir / "no_trailer.nii.gz"
    path.write_bytes(data[:-missing])
    with pytest.raises(ValueError, match=rf"^cannot read {path}: EOFError"):
        _load(path)


# ------------------------------------------------------------------------------- image/label pairs (issue 12 5, 6)


def _pair(tmp: Path, name: str, image: np.ndarray, label: np.ndarray, label_affine=None) -> dict:
    nib.save(nib.Nifti1Image(image, np.eye(4)), tmp / f"{name}_img.nii.gz")
    nib.save(nib.Nifti1Image(label, np.eye(4) if label_affine is None else label_affine), tmp / f"{name}_lbl.nii.gz")
    return {"image": str(tmp / f"{name}_img.nii.gz"), "label": str(tmp / f"{name}_lbl.nii.gz")}


def _load_and_check(entry: dict, num_classes: int = 3) -> dict:
    from monai.transforms import EnsureChannelFirstd

    pipeline = Compose(
        [
            SafeLoadImaged(["image", "label"], image_only=True),
            EnsureChannelFirstd(["image", "label"]),
            CheckImageLabeld(num_classes=num_classes),
        ]
    )
    try:
        return pipeline(entry)
    except RuntimeError as err:  # MONAI's Compose wraps transform errors
        raise err.__cause__ or err from None


def _flip_x(shape):
    a = np.eye(4)
    a[0, 0], a[0, 3] = -1.0, shape[0] - 1.0
    return a


BAD_PAIRS = {
    # name: (image, label, label affine, expected message)
    "flipped_affine": ((10, 9, 8), np.uint8, None, _flip_x((10, 9, 8)), r"image and label affines differ"),
    "2mm_label": ((10, 9, 8), np.uint8, None, np.diag([2.0, 2.0, 2.0, 1.0]), r"image and label affines differ"),
    "shape": ((10, 9, 8), np.uint8, (10, 9, 7), None, r"image shape \(10, 9, 8\) and label shape \(10, 9, 7\) differ"),
    "label_7": ((10, 9, 8), np.uint8, 7, None, r"label values \[7\] are not classes 0\.\.2"),
    "label_-1": ((10, 9, 8), np.int16, -1, None, r"label values \[-1\] are not classes 0\.\.2"),
    "label_256": ((10, 9, 8), np.int16, 256, None, r"label values \[256\] are not classes 0\.\.2"),
    "label_0.5": ((10, 9, 8), np.float32, 0.5, None, r"label has non-integer values, e\.g\. \[0\.5\]"),
    "label_nan": ((10, 9, 8), np.float32, np.nan, None, r"label has 1 NaN/Inf voxels"),  # was: background
    "label_inf": ((10, 9, 8), np.float32, -np.inf, None, r"label has 1 NaN/Inf voxels"),
    "2d": ((10, 9), np.uint8, None, None, r"image is 2D \(spatial shape \(10, 9\)\), 3D is needed"),
    "4d": ((10, 9, 8, 3), np.uint8, None, None, r"image has 3 channels \(a 4D file\?\), 1 expected"),
}


@pytest.mark.parametrize("name", sorted(BAD_PAIRS))
def test_bad_image_label_pairs_name_the_case_and_the_values(tmp_path, name):
    image_shape, label_dtype, label_change, label_affine, expected = BAD_PAIRS[name]
    image = np.random.RandomState(0).rand(*image_shape).astype(np.float32)
    label_shape = label_change if isinstance(label_change, tuple) else image_shape[:3]
    label = np.zeros(label_shape, dtype=label_dtype)
    label[(slice(2, 4),) * label.ndim] = 1
    if label_change is not None and not isinstance(label_change, tuple):
        label[(5,) * label.ndim] = label_change
    entry = _pair(tmp_path, name, image, label, label_affine)
    with pytest.raises(ValueError, match=rf"^case {re.escape(entry['image'])} \(with {re.escape(entry['label'])}\): "
                       rf".*{expected}"):  # fmt: skip
        _load_and_check(entry)


def test_nan_label_voxels_are_counted_and_the_key_named():
    """NaN compares false with every class bound: it must be refused, not cast to background (0) later."""
    label = torch.zeros(1, 6, 5, 4)
    label[0, :2, 0, 0] = float("nan")
    label[0, 3, 3, 3] = float("inf")
    assert label_value_problems(label, 3, "seg") == ["seg has 3 NaN/Inf voxels"]
    data = {"image": torch.zeros(1, 6, 5, 4), "seg": label, "case": "case_7"}
    check = CheckImageLabeld(keys=("image", "seg"), label_key="seg", num_classes=3)
    with pytest.raises(ValueError, match=r"seg has 3 NaN/Inf voxels"):
        check(data)
    assert label_value_problems(torch.ones(2, 2), 3) == []


def test_a_good_pair_passes_unchanged(tmp_path):
    image = np.random.RandomState(0).rand(10, 9, 8).astype(np.float32)
    label = np.zeros((10, 9, 8), np.int16)
    label[1, 2, 3], label[4, 5, 6] = 1, 2
    out = _load_and_check(_pair(tmp_path, "good", image, label))
    assert tuple(out["image"].shape) == (1, 10, 9, 8) and set(np.unique(out["label"]).tolist()) == {0, 1, 2}


@FAST
@given(
    shapes,
    st.integers(1, 3),
    st.sets(st.integers(-3, 300), min_size=1, max_size=4),
    st.sampled_from([np.uint8, np.int16, np.float32]),
    st.floats(-0.01, 0.01),
    seeds,
)
def test_check_image_label_accepts_exactly_consistent_pairs(shape, channels, values, dtype, shift, seed):
    """Property: the check passes iff dims/channels/shapes/affines agree and the values are classes 0..2."""
    rng = np.random.RandomState(seed % 2**32)
    if dtype is np.uint8:
        values = {v % 256 for v in values}
    label = rng.choice(sorted(values), size=(1, *shape)).astype(dtype)
    affine = np.eye(4)
    label_affine = affine.copy()
    label_affine[0, 3] += shift
    data = {
        "image": MetaTensor(rng.rand(channels, *shape).astype(np.float32), affine=torch.as_tensor(affine),
                            meta={"filename_or_obj": "img.nii.gz"}),
        "label": MetaTensor(label, affine=torch.as_tensor(label_affine), meta={"filename_or_obj": "lbl.nii.gz"}),
    }  # fmt: skip
    good = channels == 1 and abs(shift) <= 1e-3 and values <= {0, 1, 2}
    if good:
        assert CheckImageLabeld(num_classes=3)(data) is data
    else:
        with pytest.raises(ValueError, match=r"^case img\.nii\.gz \(with lbl\.nii\.gz\): "):
            CheckImageLabeld(num_classes=3)(data)


# ------------------------------------------------------------------------- a failing case exits 1 (issue 12 15)

_FAILING_CACHE = """
import sys, time, torch
from monai.transforms import Compose, Lambda
from jcsaug.data import CacheDataset

def load(x):
    if x == 0:
        raise ValueError("bad case 0")
    a, end = torch.randn(200, 200), time.monotonic() + 2.0
    while time.monotonic() < end and not sys.is_finalizing():  # the next case is busy in torch ops (GIL released)
        a = torch.tanh(a @ a.T / 200)
    return x

torch.set_num_threads(1)
CacheDataset(list(range(4)), Compose([Lambda(load)]), num_workers=int(sys.argv[1]), progress=False)
"""


@pytest.mark.parametrize("workers", [1])
def test_a_failing_case_while_caching_exits_1_not_134(tmp_path, workers):
    """MONAI's CacheDataset leaves its ThreadPool by terminate() without joining: a thread still transforming the next
    case takes the GIL back during interpreter shutdown and the process aborts ("terminate called without an active
    exception", exit 134; almost every time with this busy next case). jcsaug's joins its threads first."""
    import subprocess
    import sys

    script = tmp_path / "failing_cache.py"
    script.write_text(_FAILING_CACHE)
    result = subprocess.run([sys.executable, str(script), str(workers)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "ValueError: bad case 0" in result.stderr and "terminate called" not in result.stderr


def test_no_caching_thread_outlives_a_failing_cache():
    import threading

    from jcsaug.data import CacheDataset

    def load(x):
        if x == 1:
            raise ValueError("bad case 1")
        return x

    before = set(threading.enumerate())
    with pytest.raises(RuntimeError, match="applying transform") as err:
        CacheDataset(list(range(50)), Compose([Lambda(load)]), num_workers=3, progress=False)
    assert str(err.value.__cause__) == "bad case 1"
    assert set(threading.enumerate()) == before
    assert list(CacheDataset(list(range(5)), Compose([Lambda(lambda x: x * 2)]), num_workers=2, progress=False)) == [
        0, 2, 4, 6, 8
    ]  # fmt: skip


# ------------------------------------------------------------------------------- policy logits (issue 12 item 10)


@FAST
@given(st.data())
def test_policy_logits_load_iff_finite_float32_numbers(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("logits") / "policies.json"
    save_policies(path, tra=make_tra_policy("nnunet", num_groups=2))
    doc = json.loads(path.read_text())
    for group in doc["tra"]["groups"]:  # the logits alone: stated probabilities must agree with them (test_policy.py)
        for series in group["series"]:
            for entry in series["ops"]:
                del entry["probability"]
    value = data.draw(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(10**40), 10**40),
                                st.booleans(), st.none(), st.text(max_size=3)))  # fmt: skip
    g, s = data.draw(st.integers(0, 1)), data.draw(st.integers(0, 14))
    op = data.draw(st.integers(0, len(doc["tra"]["groups"][g]["series"][s]["ops"]) - 1))
    doc["tra"]["groups"][g]["series"][s]["ops"][op]["logit"] = value
    path.write_text(json.dumps(doc))
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and np.isfinite(float(value))
        and abs(float(value)) <= float(np.finfo(np.float32).max)
    )
    if ok:
        tra, _ = load_policies(path)
        assert torch.isfinite(tra.logits).all()
    else:
        with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: ") as err:
            load_policies(path)
        assert "\n" not in str(err.value)
