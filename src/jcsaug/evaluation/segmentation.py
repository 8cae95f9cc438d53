"""Evaluate a segmentation network on whole cases with one or more (TTA) inferers; write metrics.json."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from monai.inferers import Inferer
from monai.metrics import DiceMetric
from monai.networks.utils import one_hot
from tqdm.auto import tqdm

from jcsaug.policy.io import atomic_write_text


def case_dice(pred_logits: torch.Tensor, label: torch.Tensor, num_classes: int) -> list[float]:
    """Dice per foreground class of one case (``[1, C, ...]`` logits, ``[1, 1, ...]`` label).

    A class absent from both label and prediction scores 1 (nothing to find, nothing found); absent
    from the label only, 0. MONAI's ``DiceMetric(ignore_empty=False)`` implements exactly this.
    """
    pred = one_hot(pred_logits.argmax(1, keepdim=True), num_classes)
    truth = one_hot(label.long(), num_classes)
    metric = DiceMetric(include_background=False, reduction="none", ignore_empty=False)
    return [float(v) for v in metric(pred, truth)[0]]


def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return float(sum(finite) / len(finite)) if finite else float("nan")


def evaluate_cases(
    network: torch.nn.Module,
    cases: Sequence[Mapping],
    load: Callable[[Mapping], Mapping],
    inferers: Mapping[str, Inferer],
    num_classes: int,
    device: torch.device | str = "cpu",
    output_path: str | Path | None = None,
    image_key: str = "image",
    label_key: str = "label",
    progress: bool = True,
) -> dict:
    """Dice of every case under every inferer; returns (and optionally writes) the metrics dictionary.

    Args:
        network: the trained network (put in eval mode here).
        cases: datalist entries (e.g. ``{"image": path, "label": path}``).
        load: transform turning an entry into tensors (``LoadImaged`` ... ``EnsureTyped``).
        inferers: method name -> inferer, e.g. ``{"none": NoTTAInferer(sw), "learned_tea": ...}``.
        num_classes: number of classes including background.
        output_path: where to write ``metrics.json`` (atomically).
    """
    if not cases:
        raise ValueError("no cases to evaluate")
    device = torch.device(device)
    network.eval()
    per_method: dict[str, list[dict]] = {name: [] for name in inferers}
    with torch.no_grad():
        for entry in tqdm(cases, desc="evaluate", disable=not progress):
            data = load(entry)
            image = data[image_key].unsqueeze(0).to(device)
            label = data[label_key].unsqueeze(0).to(device)
            case = str(entry.get(image_key, len(per_method)))
            for name, inferer in inferers.items():
                dice = case_dice(inferer(image, network), label, num_classes)
                per_method[name].append({"case": case, "dice": dice, "mean_dice": _mean(dice)})
    metrics = {
        name: {
            "mean_dice": _mean([r["mean_dice"] for r in rows]),
            "mean_dice_per_class": [_mean([r["dice"][c] for r in rows]) for c in range(num_classes - 1)],
            "per_case": rows,
        }
        for name, rows in per_method.items()
    }
    if output_path is not None:
        atomic_write_text(output_path, json.dumps(metrics, indent=1))
    return metrics
