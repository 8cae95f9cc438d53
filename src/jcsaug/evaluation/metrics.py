"""Per-case, per-class segmentation metrics (SPEC §6): Dice, sensitivity, precision and HD95 in mm.

Conventions for empty masks (per foreground class ``c``; "label" = ground truth, "prediction" = output):

- both non-empty (``status="ok"``): Dice, TP/(TP+FN), TP/(TP+FP) and HD95 computed by MONAI;
- both empty (``"both_empty"``): Dice 1, sensitivity 1, precision 1, HD95 0 mm;
- label empty, prediction not (``"label_empty"``): Dice 0, precision 0, sensitivity and HD95 undefined;
- prediction empty, label not (``"prediction_empty"``): Dice 0, sensitivity 0, precision and HD95 undefined.

"Both empty" is a perfect answer (nothing to find, nothing found), so every metric takes its best value;
this keeps Dice identical to MONAI's ``DiceMetric(ignore_empty=False)`` used so far. A ratio whose
denominator is zero (sensitivity without any true voxel, precision without any predicted voxel) and a
distance to an empty surface are *undefined*: they are stored as NaN, summaries average over the defined
values only and report how many were undefined (``n_undefined``) — NaN is never averaged away silently.

HD95 is MONAI's symmetric percentile Hausdorff distance: the larger of the two directed 95th percentiles
of the distances between the mask edges (prediction -> label and label -> prediction), with the voxel
spacing in mm, so anisotropic images are measured correctly.
"""

from __future__ import annotations

import ast
import math
import numbers
import warnings
from collections.abc import Sequence

import numpy as np
import torch
from monai.metrics import (
    compute_confusion_matrix_metric,
    compute_dice,
    compute_hausdorff_distance,
    get_confusion_matrix,
)
from monai.networks.utils import one_hot
from scipy import ndimage

from jcsaug.utils import as_flag

METRICS: tuple[str, ...] = ("dice", "sensitivity", "precision", "hd95")
"""The metrics computed per case and class, in table order."""

HIGHER_IS_BETTER: dict[str, bool] = {"dice": True, "sensitivity": True, "precision": True, "hd95": False}

STATUSES: tuple[str, ...] = ("ok", "both_empty", "label_empty", "prediction_empty")

Spacing = float | Sequence[float] | None

#: a ``keep_largest_component`` setting: a flag, ``"task"``, ``"validation"`` or foreground class ids (see
#: :func:`component_classes`)
ComponentClasses = bool | str | Sequence[int] | None

TASK_COMPONENT_CLASSES = "task"
"""``keep_largest_component="task"``: the task's :attr:`~jcsaug.tasks.TaskSpec.single_component_classes`."""

VALIDATION_COMPONENT_CLASSES = "validation"
"""``keep_largest_component="validation"``: the classes chosen on the validation cases after training
(:func:`jcsaug.evaluation.postprocessing.choose_component_classes`, nnU-Net's choice)."""

_COMPONENT_FORMS = "true, false, task, validation or a list of distinct foreground class ids, e.g. [1, 3]"


def _as_label_map(labels: torch.Tensor | np.ndarray, spatial_dims: int | None) -> torch.Tensor:
    """A ``(*spatial)`` integer tensor; leading singleton (batch/channel) dims beyond ``spatial_dims`` squeezed."""
    t = torch.as_tensor(np.asarray(labels) if not isinstance(labels, torch.Tensor) else labels).detach().cpu()
    if spatial_dims is not None:
        while t.ndim > spatial_dims and t.shape[0] == 1:
            t = t[0]
        if t.ndim != spatial_dims:
            raise ValueError(f"expected a label map with {spatial_dims} spatial dims, got shape {tuple(t.shape)}")
    return t.long()


def _spacing_list(spacing: Spacing, spatial_dims: int) -> list[float]:
    if spacing is None:
        return [1.0] * spatial_dims
    if isinstance(spacing, (int, float)):
        return [float(spacing)] * spatial_dims
    values = [float(s) for s in spacing]
    if len(values) == 1:
        return values * spatial_dims
    if len(values) != spatial_dims:
        raise ValueError(f"spacing {values} does not match {spatial_dims} spatial dims")
    return values


def parse_component_classes(value: ComponentClasses) -> bool | str | tuple[int, ...]:
    """The form of a ``keep_largest_component`` setting, before its classes are checked against a task
    (:func:`component_classes` does both).

    A flag (:func:`~jcsaug.utils.as_flag`: bools, ``true``/``false``/... in any case, None; not a bare 0/1, which
    could mean a class) is returned as a bool, ``"task"`` and ``"validation"`` as they are, a list or tuple of
    distinct integer class ids >= 1 (also written as a string, ``"[1, 3]"``) as a sorted tuple.

    Raises:
        ValueError: ``keep_largest_component <value>: <what is wrong>; must be ...``.
    """

    def refuse(reason: str) -> ValueError:
        return ValueError(f"keep_largest_component {value!r}: {reason}must be {_COMPONENT_FORMS}")

    parsed: object = value
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in (TASK_COMPONENT_CLASSES, VALIDATION_COMPONENT_CLASSES):
            return text.lower()
        if text.startswith(("[", "(")):
            try:
                parsed = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                raise refuse("not a list; ") from None
    if isinstance(parsed, (list, tuple)):
        for c in parsed:
            if isinstance(c, bool) or not isinstance(c, numbers.Integral):
                raise refuse(f"class id {c!r} is not an integer; ")
            if c < 1:
                raise refuse(f"class {c} is the background; " if c == 0 else f"class id {c} is negative; ")
        ids = [int(c) for c in parsed]
        twice = sorted({c for c in ids if ids.count(c) > 1})
        if twice:
            raise refuse(f"class {twice[0]} is given twice; ")
        return tuple(sorted(ids))
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        # a command line's 1 (or 0) arrives as an int: as a flag it would post-process every class, maybe not meant
        raise refuse(f"a bare number is ambiguous (the flag, or class {value}?): write true/false or [{value}]; ")
    try:
        return as_flag(value)
    except ValueError:
        raise refuse("") from None


def component_classes(
    value: ComponentClasses, num_classes: int, task_classes: Sequence[int] | None = None
) -> tuple[int, ...]:
    """The foreground classes a ``keep_largest_component`` setting post-processes, sorted.

    ``False`` (or a false flag, None, ``[]``): none; ``True``: every foreground class ``1..num_classes-1``; a list of
    class ids (``[1, 3]``, or the string ``"[1, 3]"`` a command line may pass): those; ``"task"``: ``task_classes``
    (a task's :attr:`~jcsaug.tasks.TaskSpec.single_component_classes`, the classes that are one connected
    structure; the dataset bundles pass their task's). ``"validation"`` is resolved elsewhere, after training
    (:func:`~jcsaug.evaluation.postprocessing.choose_component_classes`; later runs read the choice back with
    :func:`~jcsaug.evaluation.postprocessing.read_component_classes`): refused here. The one parser of the setting,
    for the metrics, the saved segmentations and the bundles' checks alike.

    Raises:
        ValueError: naming the value: not one of these forms, a class id that is not an integer, 0 (the
            background), outside ``1..num_classes-1`` or given twice, ``"task"`` without ``task_classes``, or
            ``"validation"``.
    """
    parsed = parse_component_classes(value)
    if parsed == VALIDATION_COMPONENT_CLASSES:
        raise ValueError(
            f"keep_largest_component {value!r}: the classes are chosen on the validation cases after training "
            "(jcsaug.evaluation.choose_component_classes) and read back from the run's postprocessing.json "
            "(read_component_classes); pass the classes they give here"
        )
    if parsed == TASK_COMPONENT_CLASSES:
        if task_classes is None:
            raise ValueError(
                f"keep_largest_component {value!r}: no task here to take its single_component_classes from; "
                f"give the classes, e.g. [1, 3]"
            )
        parsed = parse_component_classes(tuple(task_classes))
    if isinstance(parsed, bool):
        return tuple(range(1, num_classes)) if parsed else ()
    outside = [c for c in parsed if c >= num_classes]
    if outside:
        raise ValueError(
            f"keep_largest_component {value!r}: class {outside[0]} is not a foreground class 1..{num_classes - 1} "
            f"(num_classes {num_classes})"
        )
    return tuple(parsed)


def largest_connected_component(
    labels: torch.Tensor | np.ndarray,
    num_classes: int,
    connectivity: int | None = None,
    classes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Keep, for each of ``classes`` independently, only its largest connected component (rest -> 0).

    ``classes``: foreground class ids (checked as :func:`component_classes` does); None = every foreground class.
    Other classes are left as they are: a class that is rightly several components (both kidneys in one label,
    multifocal lesions) must not be post-processed. Same semantics as MONAI's
    ``KeepLargestConnectedComponent(applied_labels=classes, independent=True)`` (``connectivity``: orthogonal hops
    defining neighbours, None = full connectivity), but implemented with :func:`scipy.ndimage.label` because MONAI's
    CPU implementation needs scikit-image, not a dependency here. ``labels`` is a ``(*spatial)`` label map; ties
    keep the first component in raster order.
    """
    selected = range(1, num_classes) if classes is None else component_classes(list(classes), num_classes)
    t = torch.as_tensor(np.asarray(labels) if not isinstance(labels, torch.Tensor) else labels).detach().cpu()
    array = t.numpy().copy()
    structure = ndimage.generate_binary_structure(array.ndim, connectivity or array.ndim)
    for c in selected:
        components, n = ndimage.label(array == c, structure=structure)
        if n > 1:
            sizes = np.bincount(components.ravel())[1:]
            array[(components > 0) & (components != int(np.argmax(sizes)) + 1)] = 0
    return torch.as_tensor(array)


def case_metrics(
    pred_labels: torch.Tensor | np.ndarray,
    true_labels: torch.Tensor | np.ndarray,
    num_classes: int,
    spacing: Spacing = None,
    keep_largest_component: ComponentClasses = False,
) -> dict[str, list]:
    """Dice, sensitivity, precision and HD95 (mm) of every foreground class of one case.

    Args:
        pred_labels: predicted label map ``(*spatial)`` (integer classes; leading singleton dims are
            squeezed when ``spacing`` is a sequence that fixes the number of spatial dims).
        true_labels: ground-truth label map of the same shape.
        num_classes: number of classes including background (class 0, not scored).
        spacing: voxel size in mm per spatial axis (array order), a single number, or None (1 mm).
        keep_largest_component: post-process the prediction with :func:`largest_connected_component`: False,
            True (every foreground class) or the foreground class ids to post-process (see :func:`component_classes`).

    Returns:
        ``{"dice": [...], "sensitivity": [...], "precision": [...], "hd95": [...], "status": [...]}``, lists
        over classes ``1..num_classes-1``; undefined values are NaN (see the module docstring).
    """
    spatial_dims = None if spacing is None or isinstance(spacing, (int, float)) or len(spacing) == 1 else len(spacing)
    pred = _as_label_map(pred_labels, spatial_dims)
    true = _as_label_map(true_labels, spatial_dims)
    if pred.shape != true.shape:
        raise ValueError(f"prediction shape {tuple(pred.shape)} != label shape {tuple(true.shape)}")
    for name, t in (("prediction", pred), ("label", true)):
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= num_classes):
            raise ValueError(f"{name} has classes outside 0..{num_classes - 1}: {sorted(t.unique().tolist())}")
    classes = component_classes(keep_largest_component, num_classes)
    if classes:
        pred = largest_connected_component(pred, num_classes, classes=classes).long()
    spacing_mm = _spacing_list(spacing, pred.ndim)
    pred_1h = one_hot(pred[None, None], num_classes)  # [1, C, *spatial]
    true_1h = one_hot(true[None, None], num_classes)

    dice = compute_dice(pred_1h, true_1h, include_background=False, ignore_empty=False)[0]
    confusion = get_confusion_matrix(pred_1h, true_1h, include_background=False)
    sensitivity = compute_confusion_matrix_metric("sensitivity", confusion)[0]
    precision = compute_confusion_matrix_metric("precision", confusion)[0]

    result: dict[str, list] = {name: [] for name in (*METRICS, "status")}
    for c in range(1, num_classes):
        has_pred, has_true = bool(pred_1h[0, c].any()), bool(true_1h[0, c].any())
        row = {"dice": float(dice[c - 1])}
        if has_pred and has_true:
            with warnings.catch_warnings():  # MONAI 1.5+ warns about its own internal use of a deprecated argument
                warnings.filterwarnings("ignore", message=".*always_return_as_numpy", category=FutureWarning)
                hd = compute_hausdorff_distance(
                    pred_1h[:, c : c + 1], true_1h[:, c : c + 1], include_background=True, percentile=95,
                    spacing=spacing_mm,
                )  # fmt: skip
            row.update(sensitivity=float(sensitivity[c - 1]), precision=float(precision[c - 1]), hd95=float(hd[0, 0]))
            status = "ok"
        elif not has_pred and not has_true:
            row.update(dice=1.0, sensitivity=1.0, precision=1.0, hd95=0.0)
            status = "both_empty"
        elif has_pred:  # label empty
            row.update(dice=0.0, sensitivity=math.nan, precision=0.0, hd95=math.nan)
            status = "label_empty"
        else:  # prediction empty
            row.update(dice=0.0, sensitivity=0.0, precision=math.nan, hd95=math.nan)
            status = "prediction_empty"
        for name in METRICS:
            result[name].append(row[name])
        result["status"].append(status)
    return result


def nanmean(values: Sequence[float]) -> float:
    """Mean of the finite values; NaN when there are none."""
    finite = [float(v) for v in values if v is not None and math.isfinite(v)]
    return float(sum(finite) / len(finite)) if finite else math.nan


def count_undefined(values: Sequence[float]) -> int:
    """How many values are undefined (NaN/None)."""
    return sum(1 for v in values if v is None or not math.isfinite(v))


def summarize_cases(rows: Sequence[dict], num_classes: int) -> dict:
    """Per-metric summary of per-case rows (each with per-class lists ``dice``, ``sensitivity``, ...).

    For every metric: ``mean`` (over cases of the per-case class mean of the defined values; a case with
    no defined class is left out), ``per_class`` (mean over the cases where the class is defined),
    ``n_undefined`` (undefined (case, class) values) and ``n_undefined_per_class``.
    """
    summary: dict[str, dict] = {}
    classes = range(num_classes - 1)
    for name in METRICS:
        per_class = [[r[name][c] for r in rows] for c in classes]
        summary[name] = {
            "mean": nanmean([nanmean(r[name]) for r in rows]),
            "per_class": [nanmean(v) for v in per_class],
            "n_undefined": sum(count_undefined(v) for v in per_class),
            "n_undefined_per_class": [count_undefined(v) for v in per_class],
        }
    return summary


def count_statuses(rows: Sequence[dict], num_classes: int) -> dict[str, list[int]]:
    """Per class, how many cases had an empty label and/or prediction (keys of :data:`STATUSES` but "ok")."""
    return {
        status: [sum(1 for r in rows if r["status"][c] == status) for c in range(num_classes - 1)]
        for status in STATUSES[1:]
    }
