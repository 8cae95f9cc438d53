"""``jcsaug prepare TASK RAW_DIR --out DATASET_DIR``: raw public data -> resampled NIfTI + MONAI datalist.

Per case: read image and label (a 4D frame where the task says so), check them (label present, same shape and
affine, label values among the task's), map raw label values to classes, reorient (``Orientation``), resample to
the task's spacing (MONAI ``Spacing``: bilinear image, nearest label) and write ``images/<case>.nii.gz`` and
``labels/<case>.nii.gz``. Then split with the paper's rule (seeded) and write ``dataset.json`` (MONAI/Decathlon
datalist: ``training``, ``validation``, ``test``, and ``training_50`` / ``test_source`` ... where the paper has
them) with the nnU-Net intensity statistics that :func:`jcsaug.data.intensity_normalisation` applies at load time
(MR: case-wise z-score; CT: clip to the 0.5-99.5 percentiles of the training and validation cases' foreground
voxels, dataset z-score).

Every file is written through a temporary file and renamed, and a case counts as done only once its record
(``.prepare/cases/<case>.json``) exists, so an interrupted run resumes where it stopped and a re-run skips
finished cases. A record holds the size and modification time of its raw image and label files: a case whose raw
files changed (in place or by a copy) is prepared again. A failing case does not stop the others: every failing case
is reported at the end, in one error.
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import nibabel as nib
import numpy as np
import torch
from monai.data import MetaTensor
from monai.transforms import Orientation, Spacing
from tqdm.auto import tqdm

from jcsaug.tasks.registry import get_task
from jcsaug.tasks.spec import PrepareError, RawCase, TaskSpec
from jcsaug.utils import atomic_write, atomic_write_text

__all__ = ["DATALIST_NAME", "prepare_case", "prepare_task", "source_stamp"]

logger = logging.getLogger(__name__)

DATALIST_NAME = "dataset.json"
STATE_DIR = ".prepare"
FORMAT_VERSION = 1
FOREGROUND_SAMPLES = 10_000  # intensity samples per case for the CT statistics (as nnU-Net)


# ----------------------------------------------------------------------------- one case
def _read(path: Path, what: str, case_id: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        nii = nib.load(str(path))
        return np.asanyarray(nii.dataobj), np.asarray(nii.affine, dtype=np.float64)
    except Exception as err:  # nibabel raises many types for broken files
        raise PrepareError(f"case {case_id}: cannot read {what} {path}: {err}") from err


def _as_3d(array: np.ndarray, frame: int | None, case_id: str, what: str, path: Path) -> np.ndarray:
    if frame is not None:
        if array.ndim != 4:
            raise PrepareError(
                f"case {case_id}: {what} {path} has shape {array.shape}; a 4D (x, y, z, t) cine is needed"
            )
        if not 0 <= frame < array.shape[3]:
            raise PrepareError(f"case {case_id}: frame {frame} is outside the {array.shape[3]} frames of {path}")
        array = array[..., frame]
    while array.ndim > 3 and array.shape[-1] == 1:
        array = array[..., 0]
    if array.ndim != 3:
        raise PrepareError(f"case {case_id}: {what} {path} has shape {array.shape}; a 3D volume is needed")
    return array


def _same_grid(affine: np.ndarray, other: np.ndarray) -> bool:
    """Whether two volumes' affines agree to the tolerance every check of a case's files uses."""
    return bool(np.allclose(affine, other, rtol=1e-3, atol=1e-3))


def _read_label(case: RawCase) -> tuple[np.ndarray, np.ndarray]:
    """The case's 3D label and its affine: ``label`` united voxel by voxel with ``extra_labels`` (each must match
    it in shape and affine), binarised at ``label_threshold`` where the case has one."""
    label, affine = _read(case.label, "label", case.case_id)
    label = _as_3d(label, case.frame, case.case_id, "label", case.label)
    for path in case.extra_labels:
        more, more_affine = _read(path, "label", case.case_id)
        more = _as_3d(more, case.frame, case.case_id, "label", path)
        if more.shape != label.shape or not _same_grid(more_affine, affine):
            raise PrepareError(
                f"case {case.case_id}: label {path} (shape {more.shape}) does not match {case.label} (shape "
                f"{label.shape}) in shape or affine; the lesion files of a case must share one grid"
            )
        label = np.maximum(label, more)
    if case.label_threshold is not None:
        bad = int((~np.isfinite(label)).sum()) if not np.issubdtype(label.dtype, np.integer) else 0
        if bad:  # NaN > threshold is False: it would become background silently
            files = ", ".join(str(p) for p in (case.label, *case.extra_labels))
            raise PrepareError(f"case {case.case_id}: label {files} has {bad} NaN/Inf voxels")
        label = (label > case.label_threshold).astype(np.uint8)
    return label, affine


def _differ_in_spacing_only(image_affine: np.ndarray, label_affine: np.ndarray) -> bool:
    """Whether two affines share their axes' directions (to 1e-3) and origin (to half the image's smallest voxel)
    and differ only in the voxel spacing: the known prostate quirk (DATASETS.md: the reference code overwrites the
    label's spacing with the image's). A flipped or shifted label is a different grid, not that quirk."""
    spacing = [np.linalg.norm(a[:3, :3], axis=0) for a in (image_affine, label_affine)]
    if not all(np.all(s > 0) for s in spacing):
        return False
    directions = [a[:3, :3] / s for a, s in zip((image_affine, label_affine), spacing)]
    shift = np.linalg.norm(image_affine[:3, 3] - label_affine[:3, 3])
    return bool(np.allclose(*directions, atol=1e-3) and shift <= 0.5 * spacing[0].min())


def _classes(label: np.ndarray, spec: TaskSpec, case_id: str, path: Path) -> np.ndarray:
    """Raw label values -> class indices (uint8); non-integer or unknown values are errors naming the case."""
    if not np.issubdtype(label.dtype, np.integer):
        bad = int((~np.isfinite(label)).sum())
        if bad:  # before the int64 cast, which turns NaN into -9223372036854775808
            raise PrepareError(f"case {case_id}: label {path} has {bad} NaN/Inf voxels")
        rounded = np.rint(label)
        off = label[np.abs(label - rounded) > 1e-3]
        if off.size:
            raise PrepareError(f"case {case_id}: label {path} has non-integer values, e.g. {off[:3].tolist()}")
        label = rounded
    label = label.astype(np.int64)
    values = np.unique(label)
    unknown = [int(v) for v in values if spec.class_of(int(v)) is None]
    if unknown:
        if spec.binarise_labels:
            allowed = "0 and positive values"
        else:
            allowed = sorted(spec.label_map) if spec.label_map is not None else sorted(spec.labels)
        raise PrepareError(
            f"case {case_id}: label values {unknown} in {path} are not classes of {spec.name} (allowed: {allowed})"
        )
    out = np.zeros(label.shape, dtype=np.uint8)
    for v in values:
        out[label == v] = spec.class_of(int(v))
    return out


def _integer_image(values: np.ndarray, source: np.dtype) -> np.ndarray:
    """Rounded resampled values of an integer image in the smallest of int16 / the source's integer dtype that holds
    them all, else float32: MR stored as uint16 may exceed 32767, and clipping it would lose values silently."""
    if values.size == 0:
        return values.astype(np.int16)
    lo, hi = float(values.min()), float(values.max())
    # 64-bit integers: int32 at most (NIfTI readers handle int64 poorly; beyond int32 float32 is no worse, as the
    # values were resampled in float32)
    wider = np.dtype(source) if np.dtype(source).itemsize <= 4 else np.dtype(np.int32)
    for dtype in (np.dtype(np.int16), wider):
        info = np.iinfo(dtype)
        if info.min <= lo and hi <= info.max:
            return values.astype(dtype)
    return values.astype(np.float32)


def _save_nifti(array: np.ndarray, affine: np.ndarray, path: Path) -> None:
    atomic_write(path, lambda tmp: nib.save(nib.Nifti1Image(array, affine), str(tmp)), suffix=".nii.gz")


def _resample(array: np.ndarray, affine: np.ndarray, spec: TaskSpec, is_label: bool) -> MetaTensor:
    x = MetaTensor(torch.as_tensor(array[None], dtype=torch.float32), affine=torch.as_tensor(affine))
    if spec.orientation:
        x = Orientation(axcodes=spec.orientation, labels=(("L", "R"), ("P", "A"), ("I", "S")))(x)
    return Spacing(pixdim=spec.spacing, mode="nearest" if is_label else "bilinear", padding_mode="border")(x)


def _paths(out_dir: Path, case_id: str) -> tuple[Path, Path, Path, Path]:
    state = out_dir / STATE_DIR / "cases"
    return (
        out_dir / "images" / f"{case_id}.nii.gz",
        out_dir / "labels" / f"{case_id}.nii.gz",
        state / f"{case_id}.json",
        state / f"{case_id}.npy",
    )


def source_stamp(path: Path | None) -> dict | None:
    """What identifies the version of a raw file: its path, size and modification time (ns)."""
    if path is None:
        return None
    stat = Path(path).stat()
    return {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _sources(case: RawCase) -> dict:
    sources = {"image": source_stamp(case.image), "label": source_stamp(case.label), "frame": case.frame}
    if case.extra_labels:  # only where a case has them, so records written before the field stay valid
        sources["extra_labels"] = [source_stamp(p) for p in case.extra_labels]
    if case.label_threshold is not None:
        sources["label_threshold"] = case.label_threshold
    return sources


def prepare_case(spec: TaskSpec, case: RawCase, out_dir: Path, seed: int = 0) -> dict:
    """Check, convert, reorient and resample one case; write its files and record; return the record."""
    image_path, label_path, record_path, sample_path = _paths(out_dir, case.case_id)
    if case.label is None:
        raise PrepareError(f"case {case.case_id}: no label file")
    sources = _sources(case)  # before reading: a file changed while it is read is prepared again next time
    image, image_affine = _read(case.image, "image", case.case_id)
    label, label_affine = _read_label(case)
    image = _as_3d(image, case.frame, case.case_id, "image", case.image)
    if image.shape != label.shape:
        raise PrepareError(
            f"case {case.case_id}: image shape {image.shape} ({case.image}) != label shape {label.shape} ({case.label})"
        )
    if not _same_grid(image_affine, label_affine):
        if not (spec.copy_image_geometry_to_label and _differ_in_spacing_only(image_affine, label_affine)):
            quirk = " beyond the voxel spacing" if spec.copy_image_geometry_to_label else ""
            raise PrepareError(
                f"case {case.case_id}: image and label affines differ{quirk} ({case.image} vs {case.label}):\n"
                f"{np.round(image_affine, 4)}\nvs\n{np.round(label_affine, 4)}"
            )
        logger.info("case %s: label spacing replaced by the image's (known quirk of %s)", case.case_id, spec.name)
    if not np.isfinite(image).all():
        raise PrepareError(
            f"case {case.case_id}: image {case.image} has {int((~np.isfinite(image)).sum())} NaN/Inf voxels"
        )
    classes = _classes(label, spec, case.case_id, case.label)
    integer_image = np.issubdtype(image.dtype, np.integer)

    image_out = _resample(np.asarray(image, dtype=np.float32), image_affine, spec, is_label=False)
    label_out = _resample(classes, image_affine, spec, is_label=True)
    affine = image_out.affine.numpy()
    image_np = image_out[0].numpy()
    label_np = label_out[0].numpy().round().astype(np.uint8)
    if integer_image:  # keep integers on disk (CT in HU: int16, half the size of float32)
        image_np = _integer_image(np.rint(image_np), image.dtype)

    for path in (image_path, label_path, record_path):
        path.parent.mkdir(parents=True, exist_ok=True)
    _save_nifti(image_np, affine, image_path)
    _save_nifti(label_np, affine, label_path)
    foreground = image_np[label_np > 0].astype(np.float32)
    rng = np.random.default_rng([seed, zlib.crc32(case.case_id.encode())])
    if foreground.size > FOREGROUND_SAMPLES:
        foreground = rng.choice(foreground, FOREGROUND_SAMPLES, replace=False)
    atomic_write(sample_path, lambda tmp: np.save(tmp, foreground), suffix=".npy")
    record = {
        "case": case.case_id,
        "image": str(image_path.relative_to(out_dir)),
        "label": str(label_path.relative_to(out_dir)),
        "shape": list(image_np.shape),
        "spacing": [round(float(s), 6) for s in np.sqrt((affine[:3, :3] ** 2).sum(0))],
        "class_voxels": np.bincount(label_np.ravel(), minlength=spec.num_classes).tolist(),
        "source_image": str(case.image),
        "source_label": str(case.label),
        **({"source_extra_labels": [str(p) for p in case.extra_labels]} if case.extra_labels else {}),
        "frame": case.frame,
        "sources": sources,
        "domain": case.domain,
        "optional": case.optional,
    }
    atomic_write_text(record_path, json.dumps(record, indent=1))  # last: marks the case as done
    return record


def _prepare_one(task: str, case: RawCase, out_dir: Path, seed: int) -> dict:  # top level: picklable for workers
    return prepare_case(get_task(task), case, out_dir, seed)


def _done(out_dir: Path, case: RawCase) -> dict | None:
    image_path, label_path, record_path, sample_path = _paths(out_dir, case.case_id)
    if not all(p.is_file() for p in (image_path, label_path, record_path, sample_path)):
        return None
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError):
        return None
    try:
        same_source = record.get("sources") == _sources(case)
    except OSError:  # a raw file vanished: prepare_case names it
        return None
    return record if same_source else None


# ----------------------------------------------------------------------------- the task
def _check_settings(out_dir: Path, settings: dict) -> None:
    path = out_dir / STATE_DIR / "settings.json"
    if path.is_file():
        previous = json.loads(path.read_text())
        if previous != settings:
            raise PrepareError(
                f"{out_dir} was prepared with other settings ({previous}); use another --out or delete that folder"
            )
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(settings, indent=1))


def _subset(cases: list[RawCase], max_cases: int | None, seed: int) -> list[RawCase]:
    if max_cases is None:
        return cases
    if isinstance(max_cases, bool) or not isinstance(max_cases, (int, np.integer)) or max_cases <= 0:
        # a negative slice end would silently drop subjects (-1: all but one), and 0 would mean "all" by accident
        raise PrepareError(f"max_cases must be a positive number of subjects (or None: all), not {max_cases!r}")
    groups = sorted({c.group for c in cases})
    keep = set(np.random.default_rng(seed + 2).permutation(groups)[:max_cases].tolist())
    return [c for c in cases if c.group in keep]


def normalisation_stats(spec: TaskSpec, out_dir: Path, case_ids: Sequence[str]) -> dict:
    """nnU-Net normalisation: MR ``{"scheme": "zscore"}`` (case-wise); CT ``{"scheme": "ct", "clip": [p0.5,
    p99.5], "mean", "std"}`` from the foreground voxel samples of ``case_ids``."""
    if spec.modality != "CT":
        return {"scheme": "zscore"}
    samples = np.concatenate([np.load(_paths(out_dir, c)[3]) for c in case_ids])
    if samples.size == 0:
        raise PrepareError(
            f"no foreground voxels in the training and validation cases of {out_dir}: cannot compute CT statistics"
        )
    lo, hi = np.percentile(samples, [0.5, 99.5])
    return {
        "scheme": "ct",
        "clip": [float(lo), float(hi)],
        "mean": float(samples.mean()),
        "std": float(max(samples.std(), 1e-8)),
    }


def prepare_task(
    task: str,
    raw_dir: str | Path,
    out_dir: str | Path,
    seed: int = 0,
    num_workers: int = 0,
    skip_unlabelled: bool = False,
    max_cases: int | None = None,
    progress: bool = True,
) -> Path:
    """Prepare ``task`` from ``raw_dir`` into ``out_dir``; returns the path of ``dataset.json``.

    Args:
        task: a name of :data:`jcsaug.tasks.TASKS`.
        raw_dir: the dataset as published (see each bundle's docs for the expected layout).
        out_dir: written: ``images/``, ``labels/``, ``dataset.json``, ``.prepare/`` (resume state).
        seed: seeds the random splits (and the CT intensity samples).
        num_workers: processes for the cases (0: in this process).
        skip_unlabelled: leave out images without a label file instead of stopping with an error.
        max_cases: use a seeded subset of this many subjects (e.g. 220 for the paper's ATLAS size); ``None``: all;
            anything but a positive integer is a :class:`PrepareError`.
        progress: show a progress bar.
    """
    try:
        spec = get_task(task)
    except KeyError as err:
        raise PrepareError(str(err.args[0])) from err
    raw_dir, out_dir = Path(raw_dir), Path(out_dir)
    if not raw_dir.is_dir():
        raise PrepareError(f"raw data folder {raw_dir} does not exist (expected: {spec.layout})")
    cases = _subset(spec.find_cases(raw_dir, skip_unlabelled), max_cases, seed)
    seen: dict[str, Path] = {}
    for c in cases:
        if c.case_id in seen:
            raise PrepareError(f"case {c.case_id} found twice: {seen[c.case_id]} and {c.image}")
        seen[c.case_id] = c.image
    _check_settings(
        out_dir,
        {"task": spec.name, "spacing": list(spec.spacing), "orientation": spec.orientation, "seed": seed,
         "max_cases": max_cases, "format": FORMAT_VERSION},
    )  # fmt: skip

    records = {c.case_id: r for c in cases if (r := _done(out_dir, c)) is not None}
    todo = [c for c in cases if c.case_id not in records]
    if records:
        logger.info("%s: %d cases already prepared, %d to do", spec.name, len(records), len(todo))
    bar = tqdm(total=len(todo), desc=f"prepare {spec.name}", unit="case", disable=not progress or not todo)
    failures: dict[str, str] = {}

    def failed(case: RawCase, err: Exception) -> None:
        message = str(err) if isinstance(err, PrepareError) else f"case {case.case_id}: {type(err).__name__}: {err}"
        failures[case.case_id] = message
        logger.error("%s", message)

    if num_workers > 1 and len(todo) > 1:
        with ProcessPoolExecutor(num_workers) as pool:
            futures = [(c, pool.submit(_prepare_one, spec.name, c, out_dir, seed)) for c in todo]
            for c, future in futures:
                try:
                    records[c.case_id] = future.result()
                except Exception as err:  # noqa: BLE001 - reported with every other failing case below
                    failed(c, err)
                bar.update()
    else:
        for c in todo:
            try:
                records[c.case_id] = prepare_case(spec, c, out_dir, seed)
            except Exception as err:  # noqa: BLE001 - reported with every other failing case below
                failed(c, err)
            bar.update()
    bar.close()
    if failures:
        raise PrepareError(
            f"{len(failures)} of {len(cases)} cases failed (the other cases are prepared; fix these and run again "
            f"to resume):\n" + "\n".join(f"  {failures[c]}" for c in sorted(failures))
        )

    empty_optional = {c.case_id for c in cases if c.optional and sum(records[c.case_id]["class_voxels"][1:]) == 0}
    if empty_optional:
        logger.warning("%d optional cases have empty labels and are left out: %s", len(empty_optional),
                       ", ".join(sorted(empty_optional)))  # fmt: skip
    kept = [c for c in cases if c.case_id not in empty_optional]
    splits = spec.assign_splits(kept, seed)
    for split in spec.foreground_splits + tuple(s for s in splits if s.startswith("training_")):
        for cid in splits.get(split, []):
            if sum(records[cid]["class_voxels"][1:]) == 0:
                raise PrepareError(
                    f"case {cid}: its label has no foreground after resampling, but split {split!r} needs "
                    f"foreground (source: {records[cid]['source_label']})"
                )
    stats_cases = splits["training"] + splits.get("validation", [])
    datalist = {
        "name": spec.name,
        "description": spec.title,
        "modality": {"0": spec.modality},
        "labels": {str(k): v for k, v in spec.labels.items()},
        "spacing": list(spec.spacing),
        "orientation": spec.orientation,
        "normalisation": normalisation_stats(spec, out_dir, stats_cases),
        "seed": seed,
        "source": str(raw_dir),
        "num_cases": {split: len(ids) for split, ids in splits.items()},
    }
    for split, ids in splits.items():
        datalist[split] = [
            {"image": records[c]["image"], "label": records[c]["label"], "case": c, "domain": records[c]["domain"]}
            for c in ids
        ]
    path = out_dir / DATALIST_NAME
    atomic_write_text(path, json.dumps(datalist, indent=1))
    logger.info("%s: wrote %s (%s)", spec.name, path, ", ".join(f"{k} {v}" for k, v in datalist["num_cases"].items()))
    return path
