"""Which split an evaluation of a trained run reads, and the files it writes (``evaluate.yaml``'s
``evaluate_split``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["EVALUATION_SPLITS", "evaluation_file_names", "evaluation_split"]

#: the splits ``evaluate.yaml`` evaluates: the held-out test cases (the default), or the validation cases the
#: learned policies were scored on (their Dice beside the test's shows how much the policies fit those cases)
EVALUATION_SPLITS = ("test", "validation")


def _check(split: str) -> str:
    if split not in EVALUATION_SPLITS:
        raise ValueError(f"evaluate_split must be one of {', '.join(EVALUATION_SPLITS)}; got {split!r}")
    return split


def evaluation_split(split: str, files: Mapping[str, Sequence[Any]]) -> list[Any]:
    """The datalist entries of ``split`` (a name of :data:`EVALUATION_SPLITS`) from ``files`` (split name ->
    entries, e.g. ``{"test": ..., "validation": ...}``).

    Raises:
        ValueError: ``split`` is not an evaluation split, or it has no cases (naming ``evaluate_split``).
    """
    entries = list(files.get(_check(split)) or [])
    if not entries:
        raise ValueError(f"evaluate_split {split!r}: the {split} split has no cases to evaluate")
    return entries


def evaluation_file_names(split: str) -> tuple[str, str]:
    """``(metrics file, per-case CSV)`` an evaluation of ``split`` writes in the run's folder: the test split's
    ``metrics_evaluate.json`` / ``per_case_evaluate.csv``, another split's with its name appended
    (``metrics_evaluate_validation.json``), so evaluating one split never overwrites another's results."""
    suffix = "" if _check(split) == "test" else f"_{split}"
    return f"metrics_evaluate{suffix}.json", f"per_case_evaluate{suffix}.csv"
