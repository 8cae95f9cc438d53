"""Tiny fake raw datasets in the on-disk layouts of the six public datasets (see shared/DATASETS.md, sections 1-6, 8).

Every labelled volume holds every foreground class of its task; foreground differs in mean intensity from background.
Shapes are chosen so each volume is >= 24 voxels per axis at the task spacing (cardiac slice axis: 6 slices).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import nibabel as nib
import numpy as np

TASK_NAMES = (
    "atlas_stroke",
    "kits19_tumor",
    "btcv_abdomen",
    "prostate_crosssite",
    "cardiac_crosssequence",
    "cardiac_crosssite",
)

_RAW_SUBDIR = {
    "atlas_stroke": "ATLAS_2",
    "kits19_tumor": "kits19/data",
    "btcv_abdomen": "Abdomen/RawData",
    "prostate_crosssite": "Processed_data_nii",
    "cardiac_crosssequence": "mscmrseg",
    "cardiac_crosssite": "MnM",
}

ATLAS_TRAIN = tuple(f"sub-r00{site}s00{i}" for site in (1, 2) for i in range(1, 5))
ATLAS_TEST = ("sub-r003s001",)
KITS_TRAIN = tuple(f"case_{i:05d}" for i in range(8))
KITS_UNLABELLED = ("case_00210",)
KITS_SPACING = (1.6, 1.6, 3.2)  # x, y, slice (mm)
BTCV_TRAIN = ("0001", "0002", "0003", "0004", "0005", "0021", "0022", "0023", "0024", "0025")
BTCV_TEST = ("0061",)
PROSTATE_SITES = {"BMC": 8, "I2CVB": 5, "RUNMC": 2}
PROSTATE_VALUE2_CASE = "BMC_Case01"  # label holds a few voxels of value 2
PROSTATE_SPACING_QUIRK_CASE = "I2CVB_Case01"  # label header zooms 0.8001 instead of the image's 0.8
MSCMR_PATIENTS = tuple(range(1, 9))
MNMS_CSV = "211230_M&Ms_Dataset_information_diagnosis_opendataset.csv"
MNMS_COLUMNS = "External code,VendorName,Vendor,Centre,ED,ES,Age,Pathology,Sex,Height,Weight"
# folder, code, vendor name, vendor, centre, ED, ES (0-based frames)
MNMS_CASES = (
    ("Training/Labeled", "A0S9V9", "Siemens", "A", 1, 0, 3),
    ("Training/Labeled", "A1D2F3", "Siemens", "A", 1, 1, 4),
    ("Training/Labeled", "B4G5H6", "Philips", "B", 2, 0, 3),
    ("Training/Labeled", "B7J8K9", "Philips", "B", 2, 1, 4),
    ("Validation", "C1L2M3", "Siemens", "A", 1, 0, 3),
    ("Validation", "D4N5P6", "Canon", "D", 5, 1, 4),
    ("Validation", "D7Q8R9", "Canon", "D", 5, 0, 3),
    ("Testing", "E1S2T3", "Philips", "B", 2, 1, 4),
    ("Testing", "F4U5V6", "Canon", "D", 5, 0, 3),
    ("Testing", "F7W8X9", "Canon", "D", 5, 1, 4),
    ("Testing", "G1Y2Z3", "Canon", "D", 5, 0, 2),
)

_Case = tuple[str, Path, Path | None]


def _cases(task: str, raw: Path) -> list[_Case]:
    """(case name, image path, label path or None) for every case of `task` under `raw`."""
    if task == "atlas_stroke":
        out: list[_Case] = []
        for split, subjects in (("Training", ATLAS_TRAIN), ("Testing", ATLAS_TEST)):
            for s in subjects:
                d = raw / split / f"R{s[5:8]}" / s / "ses-1" / "anat"
                stem = f"{s}_ses-1_space-MNI152NLin2009aSym"
                lab = d / f"{stem}_label-L_desc-T1lesion_mask.nii.gz" if split == "Training" else None
                out.append((s, d / f"{stem}_T1w.nii.gz", lab))
        return out
    if task == "kits19_tumor":
        return [
            (c, raw / c / "imaging.nii.gz", None if c in KITS_UNLABELLED else raw / c / "segmentation.nii.gz")
            for c in KITS_TRAIN + KITS_UNLABELLED
        ]
    if task == "btcv_abdomen":
        train = [
            (f"img{i}", raw / f"Training/img/img{i}.nii.gz", raw / f"Training/label/label{i}.nii.gz")
            for i in BTCV_TRAIN
        ]
        return train + [(f"img{i}", raw / f"Testing/img/img{i}.nii.gz", None) for i in BTCV_TEST]
    if task == "prostate_crosssite":
        out = []
        for site, n in PROSTATE_SITES.items():
            seg = "Segmentation" if site == "BMC" else "segmentation"
            for i in range(n):
                d, c = raw / site, f"Case{i:02d}"
                out.append((f"{site}_{c}", d / f"{c}.nii.gz", d / f"{c}_{seg}.nii.gz"))
        return out
    if task == "cardiac_crosssequence":
        out = []
        for n in MSCMR_PATIENTS:
            for seq, gt in (("C0", "c0gt"), ("LGE", "lgegt"), ("T2", None)):
                lab = raw / gt / f"patient{n}_{seq}_manual.nii.gz" if gt else None
                out.append((f"patient{n}_{seq}", raw / "c0t2lge" / f"patient{n}_{seq}.nii.gz", lab))
        return out
    if task == "cardiac_crosssite":
        return [
            (c[1], raw / c[0] / c[1] / f"{c[1]}_sa.nii.gz", raw / c[0] / c[1] / f"{c[1]}_sa_gt.nii.gz")
            for c in MNMS_CASES
        ]
    raise ValueError(f"unknown task {task!r}; expected one of {TASK_NAMES}")


def raw_case_files(task: str, raw_dir: Path) -> dict[str, tuple[Path, Path]]:
    """Map case name -> (image path, label path) of the labelled cases written by `make_fake_raw`.

    For cardiac_crosssite the key is the subject code and the files are the 4D ``_sa``/``_sa_gt`` files.
    """
    return {name: (img, lab) for name, img, lab in _cases(task, Path(raw_dir)) if lab is not None}


def _save(arr: np.ndarray, affine: np.ndarray, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(arr, affine), str(path))


def _ellipsoid(shape: tuple[int, ...], centre: np.ndarray, radii: tuple[float, ...]) -> np.ndarray:
    grid = np.ogrid[tuple(slice(0, s) for s in shape)]
    return sum(((g - c) / r) ** 2 for g, c, r in zip(grid, centre, radii)) <= 1.0


def _intensity(rng: np.random.Generator, lab: np.ndarray, means: dict[int, float], sd: float) -> np.ndarray:
    """Gaussian noise around `means[label]` (label 0 = background)."""
    img = rng.normal(means[0], sd, lab.shape)
    for c, m in means.items():
        if c:
            img[lab == c] += m - means[0]
    return img


def _ct(img: np.ndarray, inplane_axes: tuple[int, int]) -> np.ndarray:
    """Air (-1000 HU) on a 2-voxel in-plane border, clipped to int16 HU."""
    for ax in inplane_axes:
        idx = [slice(None)] * img.ndim
        for sl in (slice(0, 2), slice(-2, None)):
            idx[ax] = sl
            img[tuple(idx)] = -1000.0
    return np.clip(np.rint(img), -1000, 1500).astype(np.int16)


def _atlas(rng: np.random.Generator, raw: Path, cases: list[_Case]) -> None:
    aff = np.eye(4)
    shape = (28, 30, 26)
    for _, img_p, lab_p in cases:
        head = _ellipsoid(shape, np.array(shape) / 2 - 0.5, tuple(s * 0.6 for s in shape))
        lab = _ellipsoid(shape, rng.integers(8, np.array(shape) - 8), tuple(rng.uniform(2.5, 4, 3))).astype(np.uint8)
        img = np.where(head, _intensity(rng, lab, {0: 100.0, 1: 40.0}, 10.0), rng.normal(5, 2, shape))
        _save(img.astype(np.float32), aff, img_p)
        if lab_p is not None:
            _save(lab, aff, lab_p)


def _kits(rng: np.random.Generator, raw: Path, cases: list[_Case]) -> None:
    sx, sy, sz = KITS_SPACING
    aff = np.array([[0, 0, -sx, 0], [0, -sy, 0, 0], [-sz, 0, 0, 0], [0, 0, 0, 1]], dtype=float)
    for n, (_, img_p, lab_p) in enumerate(cases):
        shape = (24 + n % 3, 30, 30)  # (z, y, x) as stored by KiTS
        lab = np.zeros(shape, np.uint8)
        for x_lo in (8, 20):  # right and left kidney
            centre = np.array([rng.integers(8, shape[0] - 8), rng.integers(11, 19), rng.integers(x_lo, x_lo + 3)])
            lab[_ellipsoid(shape, centre, (5, 4, 4))] = 1
        tumour = _ellipsoid(shape, centre + rng.integers(-1, 2, 3), (2.5, 2.2, 2.2))
        lab[tumour & (lab == 1)] = 2
        img = _ct(_intensity(rng, lab, {0: 30.0, 1: 180.0, 2: 100.0}, 15.0), (1, 2))
        _save(img, aff, img_p)
        if lab_p is not None:
            _save(lab, aff, lab_p)
    entries = [{"case_id": c[0], "captured_pixel_width": sx, "captured_slice_thickness": sz} for c in cases if c[2]]
    (raw / "kits.json").write_text(json.dumps(entries, indent=2))


def _btcv(rng: np.random.Generator, raw: Path, cases: list[_Case]) -> None:
    aff = np.diag([1.6, 1.6, 3.2, 1.0])
    for n, (_, img_p, lab_p) in enumerate(cases):
        shape = (32, 32, 24 + n % 3)
        lab = np.zeros(shape, np.uint8)
        taken = np.zeros(shape, bool)
        for organ in range(1, 14):  # 13 non-overlapping boxes of >= 3x3x2 voxels
            size = np.array([rng.integers(3, 6), rng.integers(3, 6), rng.integers(2, 5)])
            while True:
                lo = rng.integers([3, 3, 1], np.array(shape) - np.array([3, 3, 1]) - size + 1)
                box = tuple(slice(a, a + s) for a, s in zip(lo, size))
                pad = tuple(slice(max(a - 1, 0), a + s + 1) for a, s in zip(lo, size))
                if not taken[pad].any():
                    break
            lab[box] = organ
            taken[box] = True
        img = _ct(_intensity(rng, lab, {0: -60.0, **{c: 40.0 + 15.0 * c for c in range(1, 14)}}, 15.0), (0, 1))
        _save(img, aff, img_p)
        if lab_p is not None:
            _save(lab, aff, lab_p)


def _prostate(rng: np.random.Generator, raw: Path, cases: list[_Case]) -> None:
    aff = np.diag([0.8, 0.8, 1.5, 1.0])
    site_means = {"BMC": (300.0, 150.0, 40.0), "I2CVB": (500.0, 700.0, 60.0), "RUNMC": (200.0, 120.0, 30.0)}
    for n, (name, img_p, lab_p) in enumerate(cases):
        shape = (30, 30, 24 + n % 3)
        centre = np.array(shape) / 2 + rng.integers(-3, 4, 3)
        lab = _ellipsoid(shape, centre, (rng.uniform(5, 7), rng.uniform(4, 6), rng.uniform(4, 6))).astype(np.uint8)
        bg, fg, sd = site_means[name.split("_")[0]]
        _save(_intensity(rng, lab, {0: bg, 1: fg}, sd).astype(np.float32), aff, img_p)
        if name == PROSTATE_VALUE2_CASE:
            c = centre.astype(int)
            lab[c[0] - 1 : c[0] + 1, c[1] - 1 : c[1] + 1, c[2] - 1 : c[2] + 1] = 2
        lab_aff = np.diag([0.8001, 0.8001, 1.5, 1.0]) if name == PROSTATE_SPACING_QUIRK_CASE else aff
        _save(lab, lab_aff, lab_p)


def _heart(shape: tuple[int, int, int], lv_r: float, centre: np.ndarray, angle: float) -> np.ndarray:
    """Short-axis heart, labels 1 LV cavity, 2 LV myocardium (ring), 3 RV cavity; apex slice smaller."""
    lab = np.zeros(shape, np.uint8)
    rv_centre = centre + (lv_r + 4.0) * np.array([np.cos(angle), np.sin(angle)])
    for z in range(shape[2] - 1):
        r = lv_r - (z >= shape[2] - 2)
        lab[..., z][_ellipsoid(shape[:2], rv_centre, (3.0, 3.0))] = 3
        lab[..., z][_ellipsoid(shape[:2], centre, (r + 2, r + 2))] = 2
        lab[..., z][_ellipsoid(shape[:2], centre, (r, r))] = 1
    return lab


_CARDIAC_MEANS = {  # background, LV, myocardium, RV
    "C0": (60.0, 220.0, 70.0, 200.0),
    "LGE": (80.0, 160.0, 30.0, 150.0),
    "T2": (90.0, 60.0, 130.0, 60.0),
}


def _mscmrseg(rng: np.random.Generator, raw: Path, cases: list[_Case]) -> None:
    aff = np.diag([1.25, 1.25, 10.0, 1.0])
    to_mscmr = np.array([0, 500, 200, 600], np.int16)
    for name, img_p, lab_p in cases:
        lab = _heart((32, 32, 6), rng.uniform(3.5, 5), 16 + rng.integers(-3, 4, 2), rng.uniform(-0.5, 0.5))
        bg, lv, myo, rv = _CARDIAC_MEANS[name.split("_")[1]]
        _save(_intensity(rng, lab, {0: bg, 1: lv, 2: myo, 3: rv}, 12.0).astype(np.float32), aff, img_p)
        if lab_p is not None:
            _save(to_mscmr[lab], aff, lab_p)


def _mnms(rng: np.random.Generator, raw: Path, cases: list[_Case]) -> None:
    aff = np.diag([1.25, 1.25, 10.0, 1.0])
    scale = {"A": 1.0, "B": 1.6, "C": 0.7, "D": 2.5}
    rows = []
    for i, ((_, img_p, lab_p), (_, code, vname, vendor, centre, ed, es)) in enumerate(zip(cases, MNMS_CASES)):
        c, angle = 16 + rng.integers(-3, 4, 2), rng.uniform(-0.5, 0.5)
        frames = [_heart((32, 32, 6), 3.5 if t == es else 5.0, c, angle) for t in range(5)]
        bg, lv, myo, rv = (m * scale[vendor] for m in _CARDIAC_MEANS["C0"])
        img = np.stack([_intensity(rng, f, {0: bg, 1: lv, 2: myo, 3: rv}, 12.0) for f in frames], axis=-1)
        gt = np.stack([f if t in (ed, es) else np.zeros_like(f) for t, f in enumerate(frames)], axis=-1)
        _save(img.astype(np.float32), aff, img_p)
        _save(gt, aff, lab_p)
        rows.append(
            [i, code, vname, vendor, centre, ed, es, 40 + i, "NOR" if i % 2 else "HCM", "MF"[i % 2], 170.0, 70.0]
        )
    with open(raw / MNMS_CSV, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["", *MNMS_COLUMNS.split(",")])
        w.writerows(rows)


_WRITERS = {
    "atlas_stroke": _atlas,
    "kits19_tumor": _kits,
    "btcv_abdomen": _btcv,
    "prostate_crosssite": _prostate,
    "cardiac_crosssequence": _mscmrseg,
    "cardiac_crosssite": _mnms,
}


def make_fake_raw(task: str, root: Path, seed: int = 0) -> Path:
    """Write a tiny raw dataset of `task` under `root`; return the RAW_DIR to pass to `jcsaug prepare`."""
    if task not in _WRITERS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASK_NAMES}")
    raw = Path(root) / _RAW_SUBDIR[task]
    raw.mkdir(parents=True, exist_ok=True)
    _WRITERS[task](np.random.default_rng(seed), raw, _cases(task, raw))
    return raw


#: ATLAS R1.x fake: (site, subject id, timepoints, lesion files)
ATLAS_R1_SUBJECTS = (
    ("Site1", "031768", ("t01",), 1),
    ("Site1", "031806", ("t01",), 2),  # a second lesion in `_LesionSmooth_1_stx`
    ("Site1", "031810", ("t01", "t02"), 1),  # two scans: the first is used
    ("Site1", "031811", ("t01",), 1),
    ("Site2", "031900", ("t01",), 1),
    ("Site2", "031901", ("t01",), 1),
    ("Site2", "031902", ("t01",), 1),
    ("Site2", "031903", ("t01",), 1),
)


def make_fake_atlas_r1(root: Path, seed: int = 0) -> Path:
    """ATLAS R1.1 as public loaders read it (DATASETS.md): ``Site<k>/<ID>/t01/<ID>_t1w_deface_stx.nii.gz`` and
    float lesion masks ``<ID>_LesionSmooth_stx.nii.gz`` (``_LesionSmooth_1_stx`` for a second lesion), each lesion
    1.0 inside and 0.3 on a smooth rim; returns the raw folder."""
    rng = np.random.default_rng(seed)
    raw = Path(root) / "ATLAS_R1.1"
    shape, aff = (28, 30, 26), np.eye(4)
    for site, subject, timepoints, lesions in ATLAS_R1_SUBJECTS:
        for tp in timepoints:
            folder = raw / site / subject / tp
            head = _ellipsoid(shape, np.array(shape) / 2 - 0.5, tuple(s * 0.6 for s in shape))
            masks = []
            for _ in range(lesions):
                centre, radii = rng.integers(8, np.array(shape) - 8), np.array(rng.uniform(2.5, 4, 3))
                mask = np.where(_ellipsoid(shape, centre, tuple(radii + 1.5)), 0.3, 0.0)
                mask[_ellipsoid(shape, centre, tuple(radii))] = 1.0
                masks.append(mask.astype(np.float32))
            lesion = (np.max(masks, axis=0) > 0.5).astype(np.uint8)
            img = np.where(head, _intensity(rng, lesion, {0: 100.0, 1: 40.0}, 10.0), rng.normal(5, 2, shape))
            _save(img.astype(np.float32), aff, folder / f"{subject}_t1w_deface_stx.nii.gz")
            for k, mask in enumerate(masks):
                name = f"{subject}_LesionSmooth_stx.nii.gz" if k == 0 else f"{subject}_LesionSmooth_{k}_stx.nii.gz"
                _save(mask, aff, folder / name)
    return raw
