"""Scoring whole cases segmented with one or more (TTA) inferers, and the files that hold the scores.

:func:`score_case` predicts one loaded case with every inferer (a blend's members once: :class:`MemberOutputs`) and
scores it; :func:`summarize_methods` turns the cases' rows into each method's metrics (mean Dice, over all foreground
classes and over the class subsets a task reports, per-metric summaries, per-case values, failed cases);
:func:`write_metrics` writes them as ``metrics.json`` and the per-case, per-class ``per_case.csv`` (the input of
``jcsaug report``). The loop over the cases is a MONAI evaluator: :mod:`jcsaug.evaluation.evaluator`. Metric
conventions for empty masks are those of :mod:`jcsaug.evaluation.metrics`; undefined values are NaN in memory and in
the CSV, ``null`` in JSON.
"""

from __future__ import annotations

import csv
import io
import json
import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from monai.inferers import Inferer
from monai.metrics import DiceMetric
from monai.networks.utils import one_hot

from jcsaug.data.roi import ROI_KEY, mask_outside_roi
from jcsaug.evaluation.class_maps import class_map
from jcsaug.evaluation.metrics import (
    METRICS,
    case_metrics,
    count_statuses,
    nanmean,
    summarize_cases,
)
from jcsaug.inference.tta import BlendedTTAInferer
from jcsaug.utils import atomic_write_text

CSV_COLUMNS: tuple[str, ...] = ("method", "case", "class", *METRICS, "status")
"""Columns of ``per_case.csv``: one row per method, case and foreground class."""


def case_dice(pred_logits: torch.Tensor, label: torch.Tensor, num_classes: int) -> list[float]:
    """Dice per foreground class of one case (``[1, C, ...]`` logits, ``[1, 1, ...]`` label).

    A class absent from both label and prediction scores 1 (nothing to find, nothing found); absent
    from the label only, 0. MONAI's ``DiceMetric(ignore_empty=False)`` implements exactly this.
    """
    return label_map_dice(pred_logits.argmax(1, keepdim=True), label, num_classes)


def label_map_dice(pred_labels: torch.Tensor, label: torch.Tensor, num_classes: int) -> list[float]:
    """Dice per foreground class of a predicted label map against the label (both ``[1, 1, ...]``), scored as
    :func:`case_dice` scores the argmax of logits."""
    pred = one_hot(pred_labels.long(), num_classes)
    truth = one_hot(label.long(), num_classes)
    metric = DiceMetric(include_background=False, reduction="none", ignore_empty=False)
    return [float(v) for v in metric(pred, truth)[0]]


def _mean(values: Sequence[float]) -> float:
    return nanmean(values)


def _spacing_from_affine(affine, spatial_dims: int) -> list[float]:
    a = np.asarray(affine, dtype=float)[:spatial_dims, :spatial_dims]
    return [float(v) for v in np.sqrt((a**2).sum(axis=0))]


def _spacing_from_file(path: str | Path, spatial_shape: Sequence[int]) -> list[float] | None:
    """Voxel size of an image file (nibabel header), in the axis order of the loaded array.

    The load transform may keep the file's axis order or reorient to RAS (``Orientationd``): the order
    whose shape matches ``spatial_shape`` is used; None when the file cannot tell (e.g. resampled data).
    """
    try:
        import nibabel as nib

        image = nib.load(str(path))
    except Exception:  # not a file nibabel reads: no spacing from here
        return None
    n = len(spatial_shape)
    file_shape = tuple(int(s) for s in image.shape[:n])
    if len(image.shape) < n:
        return None
    zooms = _spacing_from_affine(image.affine, n)
    ras_zooms, ras_shape = [0.0] * n, [0] * n
    for axis, (target, _flip) in enumerate(nib.orientations.io_orientation(np.asarray(image.affine)[: n + 1, : n + 1])):
        ras_zooms[int(target)], ras_shape[int(target)] = zooms[axis], file_shape[axis]
    loaded = tuple(int(s) for s in spatial_shape)
    as_file, as_ras = loaded == file_shape, loaded == tuple(ras_shape)
    if not (as_file or as_ras):
        return None
    if np.allclose(zooms, ras_zooms) or (as_file and not as_ras):
        return zooms
    if as_ras and not as_file:
        return ras_zooms
    warnings.warn(
        f"{path}: anisotropic spacing and an ambiguous axis order; assuming the loader reorients to RAS "
        f"({ras_zooms} mm). Pass spacing= to evaluate_cases to be explicit.",
        stacklevel=3,
    )
    return ras_zooms


def case_spacing(
    data: Mapping, entry: Mapping, image_key: str = "image", spacing_key: str | None = None
) -> tuple[list[float] | None, str]:
    """Voxel size (mm, array axis order) of a loaded case and where it came from.

    Tried in order: ``data[spacing_key]`` / ``entry[spacing_key]``; the affine of a MetaTensor image;
    ``data["<image_key>_meta_dict"]`` (``affine``, else NIfTI ``pixdim``); the header of the image file named
    by ``entry[image_key]`` (nibabel). Returns ``(None, "unknown")`` when none of these is available.
    """
    image = data[image_key]
    spatial_dims = image.ndim - 1  # channel first
    if spacing_key is not None:
        for source, mapping in (("data", data), ("entry", entry)):
            if spacing_key in mapping and mapping[spacing_key] is not None:
                values = np.asarray(mapping[spacing_key], dtype=float).ravel().tolist()
                return (values * spatial_dims if len(values) == 1 else values), f"{source}[{spacing_key!r}]"
    if getattr(image, "affine", None) is not None and hasattr(image, "meta"):  # MetaTensor
        return _spacing_from_affine(image.affine, spatial_dims), "MetaTensor affine"
    meta = data.get(f"{image_key}_meta_dict")
    if isinstance(meta, Mapping):
        if meta.get("affine") is not None:
            return _spacing_from_affine(meta["affine"], spatial_dims), "meta_dict affine"
        if meta.get("pixdim") is not None:
            pixdim = np.asarray(meta["pixdim"], dtype=float).ravel()
            return pixdim[1 : spatial_dims + 1].tolist(), "meta_dict pixdim"
    path = entry.get(image_key) if isinstance(entry, Mapping) else None
    if isinstance(path, (str, Path)) and Path(path).is_file():
        spacing = _spacing_from_file(path, tuple(image.shape[1:]))
        if spacing is not None:
            return spacing, "image file header"
    return None, "unknown"


def _json_safe(value):
    """NaN/inf -> None (strict JSON), recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def per_case_csv(metrics: Mapping[str, Mapping]) -> str:
    """The ``per_case.csv`` text of an :func:`evaluate_cases` result (undefined values written as ``nan``)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for method, result in metrics.items():
        for row in result["per_case"]:
            for c, status in enumerate(row["status"]):
                writer.writerow([method, row["case"], c + 1, *(repr(float(row[m][c])) for m in METRICS), status])
    return buffer.getvalue()


def summarize_methods(
    per_method: Mapping[str, Sequence[dict]],
    failed: Sequence[dict],
    num_classes: int,
    largest_component_classes: Sequence[int] = (),
    report_subsets: Mapping[str, Sequence[int]] | None = None,
    postprocessing: str | None = None,
) -> dict:
    """The metrics of every method from its cases' rows (see :func:`~jcsaug.evaluation.evaluate_cases`).

    ``per_method``: method -> the rows :func:`score_case` gave; ``failed``: ``{"case", "error"}`` of the cases that
    could not be loaded or segmented (listed under every method); ``report_subsets``: named foreground class subsets
    (:func:`report_subsets`) whose mean Dice is given as ``"mean_dice_reported"``; ``postprocessing``: how the
    predictions' postprocessing is named (:func:`~jcsaug.evaluation.class_maps.describe_postprocessing`).
    """
    metrics = {
        name: {
            "mean_dice": _mean([r["mean_dice"] for r in rows]),
            "mean_dice_per_class": [_mean([r["dice"][c] for r in rows]) for c in range(num_classes - 1)],
            "summary": summarize_cases(rows, num_classes),
            "empty_cases": count_statuses(rows, num_classes),
            "per_case": list(rows),
            "failed_cases": list(failed),
            "largest_component_classes": list(largest_component_classes),
            "segmentation_postprocessing": postprocessing,
        }
        for name, rows in per_method.items()
    }
    if report_subsets:  # per case over the subset, then over the cases (as `jcsaug report --classes`)
        for name, rows in per_method.items():
            metrics[name]["mean_dice_reported"] = {
                subset: {"classes": list(classes),
                         "mean_dice": _mean([_mean([r["dice"][c - 1] for c in classes]) for r in rows])}
                for subset, classes in report_subsets.items()
            }  # fmt: skip
    return metrics


def write_metrics(
    metrics: Mapping[str, Mapping],
    output_path: str | Path | None = None,
    csv_path: str | Path | None = None,
    extra: Mapping | None = None,
) -> None:
    """Write ``metrics.json`` (``metrics`` and the ``extra`` top-level entries, strict JSON) and the per-case CSV
    (default: ``per_case.csv`` next to ``output_path``), each atomically; a name of ``extra`` that is also a method
    is refused before anything is written."""
    if output_path is not None:
        check_extra_names(extra, metrics)
        atomic_write_text(output_path, json.dumps(_json_safe({**metrics, **(extra or {})}), indent=1))
    if csv_path is None and output_path is not None:
        csv_path = Path(output_path).with_name("per_case.csv")
    if csv_path is not None:
        atomic_write_text(csv_path, per_case_csv(metrics))


def check_extra_names(extra: Mapping | None, methods: Iterable[str]) -> None:
    """Refuse ``extra`` top-level entries of ``metrics.json`` named as one of the ``methods`` (they would replace
    its metrics)."""
    clash = sorted(set(extra or {}) & set(methods))
    if clash:
        raise ValueError(f"extra metrics.json entries {clash} clash with method names")


def report_subsets(report_classes: Mapping[str, Sequence[int]] | None, num_classes: int) -> dict[str, list[int]]:
    """``report_classes`` as lists of ints, refused unless every class is a foreground class ``1..num_classes-1``
    (checked before any case is segmented, not after hours of inference)."""
    subsets = {str(name): [int(c) for c in classes] for name, classes in (report_classes or {}).items()}
    for name, classes in subsets.items():
        if not classes or any(not 1 <= c < num_classes for c in classes):
            raise ValueError(f"report_classes[{name!r}] = {classes}: not foreground classes 1..{num_classes - 1}")
    return subsets


def score_case(
    network: torch.nn.Module,
    data: Mapping,
    entry: Mapping,
    inferers: Mapping[str, Inferer],
    num_classes: int,
    device: torch.device,
    case: str,
    *,
    image_key: str = "image",
    label_key: str = "label",
    spacing: float | Sequence[float] | None = None,
    spacing_key: str | None = None,
    largest_component_classes: Sequence[int] = (),
    roi_key: str | None = ROI_KEY,
    postprocessing: Callable[[dict], Mapping] | None = None,
) -> tuple[dict[str, dict], bool]:
    """One loaded case (``data``, from the datalist ``entry``) under every inferer: ``({method: row}, whether its
    spacing was unknown`` (then 1 mm voxels)); the rows are those of :func:`~jcsaug.evaluation.evaluate_cases`.
    ``postprocessing`` turns each method's output into its class map (:func:`class_map`) before the ROI mask and
    the largest component."""
    unknown_spacing = False
    if spacing is not None:
        voxel = np.broadcast_to(np.asarray(spacing, dtype=float), (data[image_key].ndim - 1,)).tolist()
    else:
        voxel, _source = case_spacing(data, entry, image_key, spacing_key)
        if voxel is None:
            unknown_spacing = True
            voxel = [1.0] * (data[image_key].ndim - 1)
    image = torch.as_tensor(data[image_key]).unsqueeze(0).to(device)
    label = torch.as_tensor(data[label_key]).cpu()
    roi = data.get(roi_key) if roi_key is not None else None
    rows = {}
    outputs = MemberOutputs(inferers.values())
    for name, inferer in inferers.items():
        output = outputs.predict(inferer, image, network)
        segmentation = class_map(output, num_classes, postprocessing, data, f"method {name!r}", image_key=image_key)
        pred = mask_outside_roi(segmentation, roi)
        values = case_metrics(pred, label[0], num_classes, voxel,
                              keep_largest_component=tuple(largest_component_classes))  # fmt: skip
        row = {"case": case, "dice": values["dice"], "mean_dice": _mean(values["dice"])}
        row.update({m: values[m] for m in METRICS[1:]}, status=values["status"], spacing=voxel)
        row["roi_masked"] = roi is not None
        rows[name] = row
    return rows, unknown_spacing


class MemberOutputs:
    """One case's outputs of the inferers that a blend among ``inferers`` averages (:class:`BlendedTTAInferer`,
    e.g. ``learned+mirror`` of ``learned`` and ``heuristic``, built by ``make_tta_inferers`` from the same member
    objects), each kept until the last blend that uses it: a blend then combines them instead of predicting its
    members' copies again. A member listed after its blend is predicted twice (the registry lists members first)."""

    def __init__(self, inferers: Iterable[Inferer]) -> None:
        self._uses: dict[int, int] = {}  # id(member) -> blends still to come that average it
        for inferer in inferers:
            if isinstance(inferer, BlendedTTAInferer):
                for member in inferer.members:
                    self._uses[id(member)] = self._uses.get(id(member), 0) + 1
        self._kept: dict[int, torch.Tensor] = {}

    def predict(self, inferer: Inferer, image: torch.Tensor, network: torch.nn.Module) -> torch.Tensor:
        if not isinstance(inferer, BlendedTTAInferer):
            output = self._kept.get(id(inferer))
            if output is None:
                output = inferer(image, network)
                if self._uses.get(id(inferer)):
                    self._kept[id(inferer)] = output
            return output
        outputs = [self._kept.get(id(member)) for member in inferer.members]
        outputs = [member(image, network) if out is None else out for member, out in zip(inferer.members, outputs)]
        for member in inferer.members:
            self._uses[id(member)] -= 1
            if not self._uses[id(member)]:
                self._kept.pop(id(member), None)  # no later blend needs it: freed now, not at the case's end
        return inferer.combine(outputs)
