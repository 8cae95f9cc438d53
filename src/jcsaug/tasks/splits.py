"""Split rules: the paper's split sizes, scaled down when a raw dataset has fewer cases (e.g. in tests).

Sizes are per *subject group* (all volumes of one subject land in the same split). Random splits are seeded;
ordered splits (cross-domain tasks) take cases in case-id order, as the paper's lists do.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import numpy as np

from jcsaug.tasks.spec import PrepareError, RawCase

__all__ = ["half_subset", "ordered_split", "random_split", "scaled_sizes"]

logger = logging.getLogger(__name__)


def scaled_sizes(n: int, sizes: Sequence[int], what: str = "cases") -> list[int]:
    """``sizes`` if ``n`` is at least their sum (extra cases stay unused), else proportional sizes, each >= 1
    (largest remainders), summing to ``n``, with a warning: the split is then not the paper's."""
    total = sum(sizes)
    if n >= total:
        return list(sizes)
    if n < len(sizes):
        raise PrepareError(f"{n} {what} found, at least {len(sizes)} are needed (one per split; paper: {total})")
    exact = [1 + (n - len(sizes)) * s / total for s in sizes]
    out = [math.floor(e) for e in exact]
    for i in sorted(range(len(sizes)), key=lambda i: out[i] - exact[i])[: n - sum(out)]:
        out[i] += 1
    logger.warning(
        "%d %s found, fewer than the paper's %d: split sizes scaled to %s (paper: %s)",
        n, what, total, " / ".join(map(str, out)), " / ".join(map(str, sizes)),
    )  # fmt: skip
    return out


def _groups(cases: Sequence[RawCase]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for c in sorted(cases, key=lambda c: c.case_id):
        groups.setdefault(c.group, []).append(c.case_id)
    return groups


def _assign(groups: dict[str, list[str]], order: Sequence[str], names: Sequence[str], sizes: Sequence[int]):
    out: dict[str, list[str]] = {}
    start = 0
    for name, size in zip(names, sizes):
        out[name] = sorted(cid for g in order[start : start + size] for cid in groups[g])
        start += size
    return out


def random_split(cases: Sequence[RawCase], sizes: dict[str, int], seed: int) -> dict[str, list[str]]:
    """Seeded random split of the subject groups into ``sizes`` (scaled by :func:`scaled_sizes`)."""
    groups = _groups(cases)
    order = sorted(groups)
    np.random.default_rng(seed).shuffle(order)
    return _assign(groups, order, list(sizes), scaled_sizes(len(order), list(sizes.values()), "subjects"))


def ordered_split(cases: Sequence[RawCase], sizes: dict[str, int], what: str) -> dict[str, list[str]]:
    """The first ``sizes[0]`` subject groups in id order go to the first split, and so on (scaled)."""
    groups = _groups(cases)
    order = sorted(groups)
    return _assign(groups, order, list(sizes), scaled_sizes(len(order), list(sizes.values()), what))


def half_subset(case_ids: Sequence[str], paper_half: int, paper_full: int, seed: int) -> list[str]:
    """The reduced-data training list: ``paper_half`` of ``paper_full`` cases (scaled), a seeded subset."""
    n = max(1, round(len(case_ids) * paper_half / paper_full))
    order = sorted(case_ids)
    np.random.default_rng(seed + 1).shuffle(order)
    return sorted(order[:n])
