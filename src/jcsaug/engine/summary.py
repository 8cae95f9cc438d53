"""What a user sees at the end of a bundle run: a short summary after the evaluation."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from jcsaug.evaluation.postprocessing import POSTPROCESSING_NAME
from jcsaug.policy.categorical import CategoricalPolicy
from jcsaug.policy.changes import OpChange, policy_changes

logger = logging.getLogger("jcsaug.engine")

__all__ = ["RunSummary"]


def _format_change(change: OpChange) -> str:
    return f"{change.label} {change.start:.3f}->{change.end:.3f} ({change.delta:+.1e})"


class RunSummary:
    """The end of a run in a few lines: test Dice (or another split's) per test-time method, the ops whose
    probabilities changed most from their start (per TRA class group, and TEA; unchanged ops are not listed, and a
    policy that did not change at all, e.g. ``--tea_mode fixed``, gets no line), policy updates done and skipped,
    and where the files are.

    Args:
        output_dir: the run's folder (the files listed are those that exist there).
        tra_policy, tea_policy: the learned policies (``None``: not reported).
        start: the same policies as they were before learning, a ``(tra, tea)`` pair (e.g.
            ``AugmentationSetup.initial_policies``).
        updaters: the policy updaters (with ``name``, ``updates``, ``skipped``, ``skip_reasons``).
        metrics_name: the metrics file of this run (``metrics.json``; ``metrics_evaluate.json`` for evaluate.yaml).
        top_k: changed ops listed per policy.
        split: the split the metrics are of, as the Dice lines name it (``"test"``; evaluate.yaml's
            ``evaluate_split``).
    """

    def __init__(
        self,
        output_dir: str | Path,
        tra_policy: CategoricalPolicy | None = None,
        tea_policy: CategoricalPolicy | None = None,
        start: Sequence[CategoricalPolicy | None] = (None, None),
        updaters: Sequence = (),
        metrics_name: str = "metrics.json",
        top_k: int = 3,
        split: str = "test",
    ) -> None:
        self.output_dir = Path(output_dir)
        self.tra_policy, self.tea_policy = tra_policy, tea_policy
        self.start_tra, self.start_tea = start
        self.updaters = list(updaters)
        self.metrics_name = metrics_name
        self.top_k = int(top_k)
        self.split = str(split)

    def lines(self, metrics: Mapping | None = None) -> list[str]:
        """The summary, one string per line."""
        out = [f"run summary ({self.output_dir})"]
        methods = {k: v for k, v in (metrics or {}).items() if isinstance(v, Mapping) and "mean_dice" in v}
        if methods:
            n = max(len(v.get("per_case", [])) for v in methods.values())
            means = {name: values["mean_dice"] for name, values in methods.items()}
            out.append(f"  {self.split} Dice (mean of {n} cases; no TTA = none): {_dice_changes(means)}")
            out += _reported_dice(methods, self.split)
            first = next(iter(methods.values()))  # what every method shares: cases, ROI, post-processing
            rows = first.get("per_case", [])
            masked = sum(bool(row.get("roi_masked")) for row in rows)
            if masked:
                out.append(f"  predictions outside the task's ROI are background ({masked} of {len(rows)} cases)")
            transforms = first.get("segmentation_postprocessing")
            if transforms:
                out.append(f"  predictions post-processed by {transforms} (segmentation_postprocessing)")
            kept = first.get("largest_component_classes")
            if kept:
                on_validation = (self.output_dir / POSTPROCESSING_NAME).is_file()
                how = " (chosen on the validation cases)" if on_validation else ""
                out.append(f"  post-processed: the largest connected component of classes {kept}{how}")
        if self.tra_policy is not None and self.start_tra is not None:
            groups = [_changed(policy_changes(self.tra_policy, self.start_tra, g), self.top_k)
                      for g in range(self.tra_policy.num_groups)]  # fmt: skip
            if any(groups):  # a policy that did not move (not learned, every update skipped) gets no line
                for g, changes in enumerate(groups):
                    out.append(f"  TRA{_group_name(g, self.tra_policy.num_groups)}, {_format_changes(changes)}")
        if self.tea_policy is not None and self.start_tea is not None:
            changes = _changed(policy_changes(self.tea_policy, self.start_tea), self.top_k)
            if changes:  # e.g. --tea_mode fixed / heuristic: nothing learned, nothing to list
                out.append(f"  TEA, {_format_changes(changes)}")
        for u in self.updaters:
            reasons = ", ".join(f"{reason}: {n}" for reason, n in sorted(u.skip_reasons.items()))
            total = u.updates + u.skipped
            share = f" ({100 * u.skipped / total:.0f} %)" if total else ""
            out.append(
                f"  {u.name} policy updates: {u.updates} done, {u.skipped} skipped{share}"
                + (f" ({reasons})" if reasons else "")
            )
        files = [self.metrics_name, "policies.json", "policies.png", "policy_history.png", POSTPROCESSING_NAME]
        present = [str(self.output_dir / f) for f in files if (self.output_dir / f).is_file()]
        if present:
            out.append("  files: " + ", ".join(present))
        return out

    def report(self, metrics: Mapping | None = None) -> str:
        """Log the summary at INFO (logger ``jcsaug.engine``) and return it; ``metrics`` default: the run's file."""
        if metrics is None:
            path = self.output_dir / self.metrics_name
            metrics = json.loads(path.read_text()) if path.is_file() else None
        text = "\n".join(self.lines(metrics))
        logger.info("%s", text)
        return text


def _changed(changes: list[OpChange], top_k: int) -> list[OpChange]:
    """The ``top_k`` largest changes, leaving out ops that did not change (``changes`` is sorted, largest first)."""
    return [c for c in changes if c.delta != 0][:top_k]


def _format_changes(changes: list[OpChange]) -> str:
    if not changes:
        return "unchanged"  # this class group did not move while another one did
    return "most changed: " + ", ".join(_format_change(c) for c in changes)


def _dice_changes(means: Mapping[str, float | None]) -> str:
    """``none 0.500, learned 0.625 (+0.125)``: each method's Dice and its change from ``none`` (no TTA)."""
    baseline = means.get("none")
    texts = []
    for name, value in means.items():
        text = f"{name} {_dice(value)}"
        if name != "none" and _finite(value, baseline):
            text += f" ({value - baseline:+.3f})"
        texts.append(text)
    return ", ".join(texts)


def _reported_dice(methods: Mapping[str, Mapping], split: str = "test") -> list[str]:
    """One line per class subset the task reports (``mean_dice_reported`` of ``metrics.json``, e.g. the KiTS
    tumour), except a subset of all foreground classes: the line above has that one."""
    lines = []
    first = next(iter(methods.values()))
    num_foreground = len(first.get("mean_dice_per_class", []))
    for subset, entry in first.get("mean_dice_reported", {}).items():
        classes = list(entry["classes"])
        if sorted(classes) == list(range(1, num_foreground + 1)):
            continue
        means = {name: v.get("mean_dice_reported", {}).get(subset, {}).get("mean_dice") for name, v in methods.items()}
        which = f"class{'es' if len(classes) > 1 else ''} {' '.join(map(str, classes))}"
        lines.append(f"  {split} Dice, {subset} ({which}): {_dice_changes(means)}")
    return lines


def _group_name(group: int, num_groups: int) -> str:
    if num_groups == 1:
        return ""
    if num_groups == 2:
        return f" group {group} ({'background' if group == 0 else 'foreground'})"
    return f" group {group}"


def _finite(*values: float | None) -> bool:
    return all(v is not None and math.isfinite(v) for v in values)


def _dice(value: float | None) -> str:
    return f"{value:.3f}" if _finite(value) else "n/a"
