"""Plain descriptions of operations and series (no learning, no tensors)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class OpSpec:
    """One operation of a series.

    Args:
        name: unique name inside its series, e.g. ``"scale[0.1,0.2)"``.
        kind: what the op does; selects the parameter sampler (``"scale"``, ``"rotate"``, ...).
        low, high: the magnitude bin ``[low, high)`` the magnitude is drawn from each time.
        signed: the sign of the magnitude is drawn with probability 1/2 each.
        fixed_sign: ``"+"`` or ``"-"`` for a half of a signed op split in two (:func:`split_signs`): its magnitude
            always has that sign (``-``: a factor ``(1 + M) ** -1``, a quarter turn of 270 degrees); ``""`` otherwise.
        level: magnitude level inside the series (0 = smallest), used by RandAugment presets;
            ``None`` for ops outside the magnitude ladder (the 90-degree rotation).
        axis: spatial axis the op refers to (rotations, mirrors), see :mod:`jcsaug.ops.axes`.
    """

    name: str
    kind: str
    low: float = 0.0
    high: float = 0.0
    signed: bool = False
    level: int | None = 0
    axis: int | None = None
    fixed_sign: str = ""

    def __post_init__(self) -> None:
        if self.fixed_sign not in ("", "+", "-") or (self.signed and self.fixed_sign):
            raise ValueError(f"op {self.name!r}: fixed_sign must be '', '+' or '-', and '' for a signed op")

    @property
    def negative(self) -> bool:
        """The magnitude is always negated (the ``-`` half of a split signed op)."""
        return self.fixed_sign == "-"

    def to_json(self) -> dict:
        out = {"name": self.name, "kind": self.kind, "magnitude": [self.low, self.high], "signed": self.signed}
        if self.fixed_sign:
            out["sign"] = self.fixed_sign
        return out


@dataclass(frozen=True)
class Series:
    """A series of mutually exclusive ops; index 0 (identity) is implicit and not in ``ops``."""

    name: str
    ops: tuple[OpSpec, ...] = field(default_factory=tuple)

    @property
    def size(self) -> int:
        """Number of choices including the identity."""
        return len(self.ops) + 1

    @property
    def op_names(self) -> list[str]:
        return ["identity"] + [op.name for op in self.ops]

    def op(self, index: int) -> OpSpec | None:
        """The op at ``index`` (``None`` for the identity)."""
        if not 0 <= index < self.size:
            raise IndexError(f"series {self.name!r} has {self.size} choices, got op index {index}")
        return None if index == 0 else self.ops[index - 1]

    def index_of(self, name: str) -> int:
        try:
            return self.op_names.index(name)
        except ValueError:
            raise KeyError(f"series {self.name!r} has no op {name!r}; ops: {self.op_names}") from None


def find_op(series: Sequence[Series], name: str) -> tuple[int, int]:
    """``"series/op"`` -> (series index, op index) in the catalogue ``series`` (e.g.
    ``"rotate_frontal/rot90"`` -> ``(1, 4)`` in SPEC's TRA catalogue); a ``KeyError`` names the valid series or
    ops."""
    series_name, sep, op = name.partition("/")
    names = [s.name for s in series]
    if not sep or series_name not in names:
        raise KeyError(f"{name!r}: expected 'series/op' with a series of {names}")
    index = names.index(series_name)
    return index, series[index].index_of(op)


def half_names(name: str) -> tuple[str, str]:
    """The names of a signed op's ``+`` and ``-`` halves: its ``±`` replaced by the sign, or the sign appended to a
    name without one (``scale±[0.4,0.5)`` -> ``scale+[0.4,0.5)``, ``scale-[0.4,0.5)``; ``rot90`` -> ``rot90+``,
    ``rot90-``)."""
    plus, minus = (name.replace("±", sign) if "±" in name else name + sign for sign in "+-")
    return plus, minus


def split_signs(series: Sequence[Series]) -> tuple[Series, ...]:
    """The catalogue with every signed op split in two ops, its ``+`` and its ``-`` half (in that order, next to
    each other), so that a policy chooses the sign instead of drawing it.

    The halves are named by :func:`half_names`. Level and axis are kept, so a preset that gives a series' ops equal
    shares (``q / (n - 1)``) or a level's ops its mass (RandAugment) makes the same augmentation distribution as
    with the sign drawn.
    """
    out = []
    for s in series:
        ops: list[OpSpec] = []
        for op in s.ops:
            if not op.signed:
                ops.append(op)
                continue
            for sign, name in zip("+-", half_names(op.name)):
                ops.append(replace(op, name=name, signed=False, fixed_sign=sign))
        out.append(Series(s.name, tuple(ops)))
    return tuple(out)
