"""Plain descriptions of operations and series (no learning, no tensors)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class OpSpec:
    """One operation of a series.

    Args:
        name: unique name inside its series, e.g. ``"scale[0.1,0.2)"``.
        kind: what the op does; selects the parameter sampler (``"scale"``, ``"rotate"``, ...).
        low, high: the magnitude bin ``[low, high)`` the magnitude is drawn from each time.
        signed: the sign of the magnitude is drawn with probability 1/2 each.
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

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind,
            "magnitude": [self.low, self.high],
            "signed": self.signed,
        }


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
