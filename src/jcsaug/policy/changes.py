"""How far a policy has moved from where it started: per (class group, series, op), sorted by the size of the change.

What the end-of-run summary prints and ``policies.png`` draws next to the final probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

from jcsaug.policy.categorical import CategoricalPolicy

__all__ = ["OpChange", "policy_changes"]


@dataclass(frozen=True)
class OpChange:
    """The probability of one op of one class group at the start and now."""

    group: int
    series: str
    op: str
    start: float
    end: float

    @property
    def delta(self) -> float:
        return self.end - self.start

    @property
    def label(self) -> str:
        """``series/op`` (just the op for a one-series policy such as TEA)."""
        return self.op if self.series == "tea" else f"{self.series}/{self.op}"


def policy_changes(policy: CategoricalPolicy, start: CategoricalPolicy, group: int | None = None) -> list[OpChange]:
    """Every op's change of probability from ``start`` (a policy of the same shape) to ``policy``, largest first.

    Args:
        group: only this class group (default: all).
    """
    if policy.logits.shape != start.logits.shape:
        raise ValueError(f"policies of shapes {tuple(policy.logits.shape)} and {tuple(start.logits.shape)} differ")
    now, then = policy.probabilities(), start.probabilities()
    groups = range(policy.num_groups) if group is None else [group]
    out = [
        OpChange(g, policy.series_names[s], policy.op_names[s][j], float(then[s][g, j]), float(now[s][g, j]))
        for g in groups
        for s in range(policy.num_series)
        for j in range(policy.series_sizes[s])
    ]
    return sorted(out, key=lambda c: -abs(c.delta))
