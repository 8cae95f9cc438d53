"""Choosing the classes to post-process on validation data (``keep_largest_component: validation``).

nnU-Net decides on its validation predictions, class by class, whether keeping only the largest connected component
helps; :func:`choose_component_classes` does the same with a trained network: each validation case is segmented
once (the plain sliding window), and a foreground class is chosen when keeping its largest component raises its mean
Dice over the cases (a tie keeps the prediction as it is). The choice and the Dice behind it are written to
``postprocessing.json`` in the run's folder (the bundles' ``choose_postprocessing`` step, after training); the
training run's test metrics and the evaluation and inference configs read it back (:func:`resolve_component_classes`),
so every use of the run post-processes the same classes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from monai.inferers import Inferer
from tqdm.auto import tqdm

from jcsaug.data.roi import ROI_KEY, mask_outside_roi
from jcsaug.evaluation.class_maps import class_map
from jcsaug.evaluation.evaluator import case_name
from jcsaug.evaluation.metrics import (
    VALIDATION_COMPONENT_CLASSES,
    ComponentClasses,
    component_classes,
    largest_connected_component,
    nanmean,
    parse_component_classes,
)
from jcsaug.evaluation.segmentation import label_map_dice
from jcsaug.utils import atomic_write_text

__all__ = [
    "POSTPROCESSING_NAME",
    "choose_component_classes",
    "chooses_on_validation",
    "read_component_classes",
    "resolve_component_classes",
]

POSTPROCESSING_NAME = "postprocessing.json"
"""The file of a run's folder that records the classes chosen on its validation cases."""


def chooses_on_validation(value: ComponentClasses) -> bool:
    """Whether a ``keep_largest_component`` setting is ``"validation"`` (its classes chosen after training); a
    malformed value is not (the settings check names it)."""
    try:
        return parse_component_classes(value) == VALIDATION_COMPONENT_CLASSES
    except ValueError:
        return False


def choose_component_classes(
    network: torch.nn.Module,
    cases: Sequence[Mapping],
    load: Callable[[Mapping], Mapping],
    inferer: Inferer,
    num_classes: int,
    device: torch.device | str = "cpu",
    output_path: str | Path | None = None,
    candidates: Sequence[int] | None = None,
    image_key: str = "image",
    label_key: str = "label",
    progress: bool = True,
    roi_key: str | None = ROI_KEY,
    postprocessing: Callable[[dict], Mapping] | None = None,
) -> tuple[int, ...]:
    """The foreground classes whose largest-component post-processing raises their mean Dice on ``cases``.

    Args:
        network: the trained network (put in eval mode on ``device`` here).
        cases: validation datalist entries with labels (``{"image": path, "label": path}``).
        load: the transform turning an entry into tensors (the bundles' ``load``).
        inferer: the inferer the cases are segmented with once (the bundles pass the plain sliding window).
        num_classes: number of classes including the background.
        output_path: where to write the choice (``postprocessing.json``, atomically): the classes, and per
            candidate class its mean Dice without and with the post-processing and whether it was chosen.
        candidates: the classes considered (default: every foreground class).
        roi_key: where ``load`` gives a case's region of interest: predictions outside it are background before
            the choice, as in the test metrics (:func:`~jcsaug.evaluation.evaluate_cases`); None: never masked.
        postprocessing: MONAI dictionary transforms turning the prediction into its class map before the choice,
            as the test metrics' (:func:`~jcsaug.evaluation.class_maps.class_map`); None: the argmax.

    Returns:
        The chosen classes, sorted (``()`` when none helps).

    Raises:
        ValueError: no cases (naming the setting and what to give instead), or a candidate that is not a
            foreground class.
    """
    if not cases:
        raise ValueError(
            "keep_largest_component 'validation': there are no validation cases to choose the classes on; "
            "give the classes instead, e.g. [1], or true / false"
        )
    classes = component_classes(True if candidates is None else list(candidates), num_classes)
    device = torch.device(device)
    network.to(device).eval()
    without: dict[int, list[float]] = {c: [] for c in classes}
    with_lcc: dict[int, list[float]] = {c: [] for c in classes}
    with torch.no_grad():
        for index, entry in enumerate(tqdm(cases, desc="choose post-processing", disable=not progress)):
            data = load(entry)
            image = torch.as_tensor(data[image_key]).unsqueeze(0).to(device)
            roi = data.get(roi_key) if roi_key is not None else None
            case = f"validation case {case_name(entry, index, image_key)}"
            output = inferer(image, network)
            segmentation = class_map(output, num_classes, postprocessing, data, case, image_key=image_key)
            pred = mask_outside_roi(segmentation, roi)[None, None]
            truth = torch.as_tensor(data[label_key]).cpu()[None]
            # one pass for every class: each keeps its own largest component, independently of the others
            kept = largest_connected_component(pred[0, 0], num_classes, classes=classes)[None, None]
            plain_dice, kept_dice = (label_map_dice(p, truth, num_classes) for p in (pred, kept))
            for c in classes:
                without[c].append(plain_dice[c - 1])
                with_lcc[c].append(kept_dice[c - 1])
    chosen = tuple(c for c in classes if nanmean(with_lcc[c]) > nanmean(without[c]))
    if output_path is not None:
        record = {
            "keep_largest_component": "validation",
            "classes": list(chosen),
            "num_classes": int(num_classes),
            "cases": len(cases),
            "validation_dice": {
                str(c): {"without": nanmean(without[c]), "with": nanmean(with_lcc[c]), "chosen": c in chosen}
                for c in classes
            },
        }
        atomic_write_text(output_path, json.dumps(record, indent=1) + "\n")
    return chosen


def read_component_classes(path: str | Path, num_classes: int) -> tuple[int, ...]:
    """The classes a run chose on its validation cases (:func:`choose_component_classes`'s ``postprocessing.json``
    at ``path``), checked against ``num_classes``.

    Raises:
        ValueError: the file is missing (the run was trained with another ``keep_largest_component``, or has not
            finished), unreadable, or holds classes that are not foreground classes of ``num_classes``; named.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(
            f"keep_largest_component 'validation': {path} not found; a training run with keep_largest_component "
            "validation writes it when it finishes. Give the classes instead, e.g. [1], or true / false"
        )
    try:
        record = json.loads(path.read_text())
        chosen = record["classes"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"keep_largest_component 'validation': {path} is not a postprocessing.json ({err})") from None
    try:
        return component_classes(list(chosen), num_classes)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def resolve_component_classes(
    value: ComponentClasses,
    num_classes: int,
    task_classes: Sequence[int] | None = None,
    record: str | Path | None = None,
) -> tuple[int, ...]:
    """The classes a ``keep_largest_component`` setting post-processes, ``"validation"`` included (the bundles'
    one call).

    Any other value: :func:`~jcsaug.evaluation.metrics.component_classes`. ``"validation"``: read from ``record``,
    the run's ``postprocessing.json`` that :func:`choose_component_classes` wrote after training; ``record=None``:
    no class (a process of a multi-GPU run that does not evaluate).
    """
    if not chooses_on_validation(value):
        return component_classes(value, num_classes, task_classes)
    return () if record is None else read_component_classes(record, num_classes)
