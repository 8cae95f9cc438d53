"""Initial probabilities of policies (SPEC §2 and §3), as a registry of named presets.

A TRA preset gives, per series, the heuristic probability ``q`` of "apply something": the identity
gets ``1 - q`` and every other op ``q / (n - 1)``. RandAugment presets keep the nnU-Net-like ``q`` but
put all of it on the smallest / middle / largest magnitude level of the series.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from jcsaug.ops.catalogue import Series
from jcsaug.registry import Registry

_SERIES_ORDER = (
    "scale", "rotate_frontal", "rotate_sagittal", "rotate_longitudinal",
    "mirror_sagittal", "mirror_frontal", "mirror_axial", "gamma", "inverted_gamma",
    "intensity_shift", "intensity_scale", "contrast", "blur_sharpen", "noise", "low_resolution",
)  # fmt: skip

# q per series in the order above (reference code's values, SPEC §2)
_NNUNET_Q = (0.2, 0.1, 0.1, 0.1, 0.5, 0.5, 0.5, 0.3, 0.1, 0.05, 0.15, 0.15, 0.2, 0.1, 0.1)
_DEEPMEDIC_Q = (0.2, 0.2, 0.2, 0.2, 0.5, 0.05, 0.05, 0.05, 0.05, 0.15, 0.05, 0.05, 0.05, 0.05, 0.05)

NNUNET_Q = dict(zip(_SERIES_ORDER, _NNUNET_Q))
DEEPMEDIC_Q = dict(zip(_SERIES_ORDER, _DEEPMEDIC_Q))


def heuristic_probs(n: int, q: float) -> np.ndarray:
    """Identity ``1 - q``, every other op ``q / (n - 1)``."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"probability of applying an op must be in [0, 1], got {q}")
    p = np.full(n, q / max(n - 1, 1))
    p[0] = 1.0 - q if n > 1 else 1.0
    return p


def _q_preset(table: Mapping[str, float] | float) -> Callable[[Sequence[Series]], list[np.ndarray]]:
    def build(series: Sequence[Series]) -> list[np.ndarray]:
        return [heuristic_probs(s.size, table if isinstance(table, float) else _q_of(table, s)) for s in series]

    return build


def _q_of(table: Mapping[str, float], series: Series) -> float:
    if series.name not in table:
        raise KeyError(f"preset has no probability for series {series.name!r}")
    return float(table[series.name])


def _uniform(series: Sequence[Series]) -> list[np.ndarray]:
    return [np.full(s.size, 1.0 / s.size) for s in series]


def _randaugment(which: str) -> Callable[[Sequence[Series]], list[np.ndarray]]:
    def build(series: Sequence[Series]) -> list[np.ndarray]:
        out = []
        for s in series:
            q = _q_of(NNUNET_Q, s)
            levels = sorted({op.level for op in s.ops if op.level is not None})
            level = {"s": levels[0], "m": levels[len(levels) // 2], "l": levels[-1]}[which]
            chosen = [i + 1 for i, op in enumerate(s.ops) if op.level == level]
            p = np.zeros(s.size)
            p[0] = 1.0 - q
            p[chosen] = q / len(chosen)
            out.append(p)
        return out

    return build


PresetBuilder = Callable[[Sequence[Series]], list[np.ndarray]]

#: TRA preset name -> builder of per-series probabilities.
TRA_PRESETS: Registry[PresetBuilder] = Registry("TRA preset")
for _name, _builder in (
    ("nnunet", _q_preset(NNUNET_Q)),
    ("deepmedic", _q_preset(DEEPMEDIC_Q)),
    ("uniform", _uniform),
    ("all-0.1", _q_preset(0.1)),
    ("all-0.05", _q_preset(0.05)),
    ("randaugment-s", _randaugment("s")),
    ("randaugment-m", _randaugment("m")),
    ("randaugment-l", _randaugment("l")),
):
    TRA_PRESETS.register(_name, _builder)


#: ``register_tra_preset(name, builder)`` with ``builder(series) -> [probabilities per series]``,
#: ``get_tra_preset(name)``, ``list_tra_presets()``
register_tra_preset, get_tra_preset, list_tra_presets = TRA_PRESETS.register, TRA_PRESETS.get, TRA_PRESETS.names


def series_probs(preset: str | Mapping[str, float | Sequence[float]], series: Sequence[Series]) -> list[np.ndarray]:
    """Initial probabilities of ``series`` from a preset name or a user mapping.

    A mapping gives per series name either ``q`` (heuristic probability of applying an op) or a full
    probability vector (identity first). Series it leaves out are never applied (identity only), unless the
    mapping names a preset under ``"base"``: then they keep that preset's probabilities (e.g.
    ``{"base": "nnunet", "rotate_frontal": [0.5, 0, 0, 0, 0.5]}``).
    """
    if isinstance(preset, str):
        return get_tra_preset(preset)(series)
    if not isinstance(preset, Mapping):
        raise TypeError(f"preset must be a name or a mapping of series -> probability, got {type(preset).__name__}")
    preset = dict(preset)
    base = preset.pop("base", None)
    base_probs = series_probs(base, series) if base is not None else None
    names = {s.name for s in series}
    unknown = sorted(set(preset) - names)
    if unknown:
        raise KeyError(f"unknown series {unknown} in preset mapping; series are {[s.name for s in series]}")
    out = []
    for i, s in enumerate(series):
        if s.name not in preset and base_probs is not None:
            out.append(base_probs[i])
            continue
        value = preset.get(s.name, 0.0)
        if np.ndim(value) == 0:
            out.append(heuristic_probs(s.size, float(value)))
        else:
            p = np.asarray(value, dtype=np.float64)
            if p.shape != (s.size,) or (p < 0).any() or p.sum() <= 0:
                raise ValueError(f"series {s.name!r}: expected {s.size} non-negative probabilities, got {value!r}")
            out.append(p / p.sum())
    return out


# ---------------------------------------------------------------------------- TEA
#: ids of the identity and the 7 flip combinations in the TEA catalogue (SPEC §3): identity, the
#: three single mirrors, mirroring all three axes, and the three 180-degree rotations (double flips).
TEA_FLIP_IDS = (0, 15, 24, 33, 38, 39, 40, 41)


def _tea_nnunet(num_ops: int) -> np.ndarray:
    favoured = [i for i in TEA_FLIP_IDS if i < num_ops]
    p = np.full(num_ops, 0.2 / max(num_ops - len(favoured), 1))
    p[favoured] = 0.1
    return p / p.sum()


#: TEA preset name -> builder ``num_ops -> probabilities``.
TEA_PRESETS: Registry[Callable[[int], np.ndarray]] = Registry("TEA preset")
TEA_PRESETS.register("nnunet", _tea_nnunet)
TEA_PRESETS.register("uniform", lambda num_ops: np.full(num_ops, 1.0 / num_ops))


#: ``register_tea_preset(name, builder)`` with ``builder(num_ops) -> probabilities``, ``get_tea_preset(name)``,
#: ``list_tea_presets()``
register_tea_preset, get_tea_preset, list_tea_presets = TEA_PRESETS.register, TEA_PRESETS.get, TEA_PRESETS.names


def tea_probs(preset: str | Sequence[float] = "nnunet", num_ops: int = 84) -> np.ndarray:
    """Initial TEA probabilities: ``nnunet`` gives the 8 flip combinations 0.1 each and shares 0.2
    among the others; ``uniform``; or an explicit vector."""
    if isinstance(preset, str):
        return get_tea_preset(preset)(num_ops)
    p = np.asarray(preset, dtype=np.float64)
    if p.shape != (num_ops,) or (p < 0).any() or p.sum() <= 0:
        raise ValueError(f"TEA probabilities must be {num_ops} non-negative numbers")
    return p / p.sum()
