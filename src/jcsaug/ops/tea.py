"""The test-time augmentation (TEA) catalogue of SPEC §3: 84 deterministic operations.

Ids and order follow the paper's numbering:

* 0 identity;
* 1-5 / 6-10 scale down / up by ``1 + M`` (``M`` = .05 .15 .25 .35 .45): the content shrinks / grows;
* 11-15 rotate about the frontal axis anticlockwise 5, 15, 25, 90, 180 degrees, 16-19 clockwise
  5, 15, 25, 90 degrees; 20-28 the same about the sagittal axis, 29-37 about the longitudinal axis;
* 38-41 mirror in the sagittal / frontal / axial plane (array axis 0 / 1 / 2) and in all three;
* 42-44 / 45-47 gamma expansion ``x ** (1 + g)`` / compression ``x ** (1 / (1 + g))``, ``g`` = .1 .3 .5,
  on the sample rescaled to [0, 1] and back, then moved back to its mean and std (MONAI
  ``AdjustContrast(retain_stats=True)``); 48-53 the same on the inverted sample (``invert_image=True``);
* 54-56 / 57-59 add / subtract .05 .15 .25; 60-62 / 63-65 multiply / divide by ``1 + s``;
* 66-68 / 69-71 contrast about the mean up ``(x - m)(1 + s) + m`` / down with ``1 / (1 + s)``;
* 72-74 Gaussian blur sigma .5 .7 .9; 75-77 sharpening ``x - LoG(x, sigma)``, sigma .9 .7 .5;
* 78-80 Gaussian noise std .025 .075 .125 with a fixed seed per op (the same image always gets the
  same noise); 81-83 low resolution (zoom .9 .7 .5 down linearly, back up with nearest neighbour).

Conventions (see :mod:`jcsaug.ops.axes`): images are ``[..., X, Y, Z]`` with any leading dims.
"Anticlockwise" about an axis is the sense of ``torch.rot90(k=1, dims=rotation_plane(axis))``: a
point on the positive first axis of the plane moves towards the positive second axis.

Inversion guarantees (:meth:`TEAOp.invert` maps a prediction made on the transformed image back to
the original grid):

* mirrors and 90/180-degree rotations are exact array operations and are inverted exactly (shapes
  of non-cubic volumes are restored);
* scalings and 5/15/25-degree rotations are one affine about the volume centre (MONAI ``Affine``'s
  convention, resampled by :func:`jcsaug.ops.resample.resample` with a grid built once per op and shape
  and cached); the inverse resamples the prediction with the exact inverse matrix (bilinear,
  ``"border"`` padding), so it is exact up to two linear interpolations, except near the border where
  content left the field of view (:func:`in_view_masks` marks the voxels that stayed in view);
* intensity ops have an identity inverse.

Padding: images are resampled with ``"border"`` padding (edge values are repeated rather than
inventing a zero intensity that may not be background after normalisation), labels with
``"zeros"`` (background) and nearest neighbour, so labels keep their values and dtype.

Intensity ops act on each ``[C, X, Y, Z]`` sample (the last four dims) separately, like the TRA
pipeline acts on a sample: min/max (gamma), mean (contrast) and range (sharpening clip) are per sample
(or, for a patch, its volume's, given to :func:`apply_tea_ops` as ``stats``), and every sample of a batch
gets the op's fixed noise.

:func:`apply_tea_ops` applies a different op to each row of a batch (the Z copies of a TEA update, the z
ops of test-time inference) on the batch's device: all affine rows in one ``grid_sample`` call, intensity
ops vectorised over the rows of each kind. ``TEAOp``'s methods are the same code on one op.
"""

from __future__ import annotations

import math
import operator
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from monai.transforms.utils import create_rotate, create_scale

from jcsaug.ops import intensity
from jcsaug.ops.axes import AXIS_NAMES, FRONTAL, LONGITUDINAL, SAGITTAL, rotation_plane
from jcsaug.ops.resample import affine_grid, resample

SPATIAL_KINDS = frozenset({"scale", "rotate", "rot90", "flip"})

#: Base of the per-op noise seed (the seed of op ``i`` is ``NOISE_SEED_BASE + i``).
NOISE_SEED_BASE = 1234

#: Sign to give MONAI's rotation angle about each array axis so that a positive TEA angle turns the
#: content like ``torch.rot90(k=1)`` on ``rotation_plane(axis)``. MONAI's ``Affine`` maps output
#: coordinates to input coordinates (the content moves by the inverse matrix) and ``create_rotate``
#: uses right-handed rotations, whose in-plane sense about the middle axis is opposite to the
#: other two; the sign is checked numerically in ``tests/test_tea_ops.py``.
_MONAI_ANGLE_SIGN = {SAGITTAL: -1.0, FRONTAL: 1.0, LONGITUDINAL: -1.0}

_SCALE_MAGNITUDES = (0.05, 0.15, 0.25, 0.35, 0.45)
_ANGLES = (5.0, 15.0, 25.0)
_GAMMAS = (0.1, 0.3, 0.5)
_STEPS = (0.05, 0.15, 0.25)


def _plain(x: torch.Tensor) -> torch.Tensor:
    """A MetaTensor as a plain tensor (plain tensors unchanged)."""
    return x.as_tensor() if hasattr(x, "as_tensor") else x


def _check_spatial(x: torch.Tensor, what: str) -> None:
    if x.ndim < 3:
        raise ValueError(
            f"TEA ops need 3D volumes [..., X, Y, Z] (at least 3 dims); the {what} has shape {tuple(x.shape)}"
        )


@dataclass(frozen=True)
class TEAOp:
    """One deterministic TEA operation.

    Args:
        id: the paper's op id (0..83), also the index in :data:`TEA_OPS`.
        name: unique readable name, e.g. ``"rotate_frontal_acw_5"``.
        kind: ``identity``, ``scale``, ``rotate``, ``rot90``, ``flip``, ``gamma``, ``inverted_gamma``,
            ``shift``, ``intensity_scale``, ``contrast``, ``blur``, ``sharpen``, ``noise`` or
            ``low_resolution``.
        magnitude: the table's magnitude (degrees for rotations; 180 for the half turn).
        sign: direction, +1 = scale up / anticlockwise / gamma expansion / add / multiply / contrast
            up, -1 = scale down / clockwise / compression / subtract / divide / contrast down; +1 for
            unsigned ops.
        axis: rotation axis (spatial index, see :mod:`jcsaug.ops.axes`); ``None`` otherwise.
        flip_axes: spatial axes mirrored by a ``flip`` op.
    """

    id: int
    name: str
    kind: str
    magnitude: float = 0.0
    sign: int = 1
    axis: int | None = None
    flip_axes: tuple[int, ...] = ()

    @property
    def is_spatial(self) -> bool:
        """Whether the op moves voxels (labels and predictions must follow it)."""
        return self.kind in SPATIAL_KINDS

    @property
    def value(self) -> float:
        """The parameter of an intensity op (:data:`jcsaug.ops.intensity.INTENSITY_KINDS`): a gamma or factor
        ``(1 + M) ** sign``, a shift ``sign * M``, a sigma, a noise std or a zoom ``M``."""
        if self.kind in ("gamma", "inverted_gamma", "intensity_scale", "contrast"):
            return (1.0 + self.magnitude) ** self.sign
        if self.kind == "shift":
            return self.sign * self.magnitude
        return self.magnitude

    # ------------------------------------------------------------------ spatial helpers
    @property
    def _spatial_dims(self) -> tuple[int, int]:
        a, b = rotation_plane(self.axis)
        return a - 3, b - 3  # negative dims: independent of the number of leading dims

    @property
    def _quarter_turns(self) -> int:
        return self.sign * int(round(self.magnitude / 90.0))

    def affine_matrix(self) -> np.ndarray:
        """The 4x4 output -> input matrix MONAI's ``Affine`` resamples with (scale / small rotations)."""
        if self.kind == "scale":
            zoom = (1.0 + self.magnitude) ** self.sign  # content zoom: < 1 shrinks
            # MONAI's scale_params act on the sampling grid: a factor s > 1 shrinks the content.
            return np.asarray(create_scale(3, [1.0 / zoom] * 3), dtype=np.float64)
        if self.kind == "rotate":
            angles = [0.0, 0.0, 0.0]
            angles[self.axis] = _MONAI_ANGLE_SIGN[self.axis] * self.sign * math.radians(self.magnitude)
            return np.asarray(create_rotate(3, angles), dtype=np.float64)
        raise ValueError(f"TEA op {self.name!r} ({self.kind}) is not an affine resampling")

    def grid(self, spatial_size: Sequence[int], device: torch.device | str, dtype: torch.dtype = torch.float32,
             inverse: bool = False) -> torch.Tensor:  # fmt: skip
        """The ``grid_sample`` grid ``[1, X, Y, Z, 3]`` of an affine op (or of its inverse), built once per op,
        shape, device and dtype and then taken from a cache (see :func:`clear_grid_cache`)."""
        # keyed on what defines the matrix, not the id alone: a custom catalogue may reuse ids
        key = (self.kind, self.magnitude, self.sign, self.axis, inverse, tuple(int(s) for s in spatial_size),
               torch.device(device), dtype)  # fmt: skip
        grid = _GRID_CACHE.get(key)
        if grid is None:
            matrix = self.affine_matrix()
            matrix = np.linalg.inv(matrix) if inverse else matrix
            grid = affine_grid(torch.as_tensor(matrix[:3, :3])[None], spatial_size, device, dtype)
            _cache_grid(key, grid)
        else:
            _GRID_CACHE.move_to_end(key)
        return grid

    # ------------------------------------------------------------------ public API
    def transform_image(self, img: torch.Tensor) -> torch.Tensor:
        """Apply the op to an image ``[..., X, Y, Z]``; returns a plain floating-point tensor."""
        return _one_op(self, img, "image")

    def transform_label(self, label: torch.Tensor) -> torch.Tensor:
        """The spatial part of the op on a label map ``[..., X, Y, Z]`` (nearest neighbour, zero padding).

        Keeps the label values and dtype; identity for intensity ops.
        """
        return _one_op(self, label, "label")

    def invert(self, pred: torch.Tensor) -> torch.Tensor:
        """Map a prediction ``[..., C, X, Y, Z]`` (probabilities or logits) made on the transformed image
        back to the original grid: exact for mirrors and 90/180-degree rotations, the inverse affine
        (bilinear, border padding) for scalings and small rotations, identity for intensity ops."""
        return _one_op(self, pred, "invert")

    def to_json(self) -> dict:
        return {"id": self.id, "name": self.name, "kind": self.kind, "magnitude": self.magnitude}


def _build_ops() -> tuple[TEAOp, ...]:
    """The catalogue in the paper's order (the position in the list is the op id)."""
    ops: list[TEAOp] = []

    def add(name: str, kind: str, magnitude: float = 0.0, **fields) -> None:
        ops.append(TEAOp(id=len(ops), name=name, kind=kind, magnitude=float(magnitude), **fields))

    add("identity", "identity")
    for sign, word in ((-1, "down"), (1, "up")):
        for m in _SCALE_MAGNITUDES:
            add(f"scale_{word}_{m:g}", "scale", m, sign=sign)
    for axis in (FRONTAL, SAGITTAL, LONGITUDINAL):
        axis_name = AXIS_NAMES[axis]
        for sign, word in ((1, "acw"), (-1, "cw")):
            for angle in _ANGLES:
                add(f"rotate_{axis_name}_{word}_{angle:g}", "rotate", angle, sign=sign, axis=axis)
            add(f"rotate_{axis_name}_{word}_90", "rot90", 90.0, sign=sign, axis=axis)
            if sign == 1:
                add(f"rotate_{axis_name}_180", "rot90", 180.0, axis=axis)
    for name, axis in (("sagittal", SAGITTAL), ("frontal", FRONTAL), ("axial", LONGITUDINAL)):
        add(f"mirror_{name}", "flip", axis=axis, flip_axes=(axis,))
    add("mirror_all", "flip", flip_axes=(SAGITTAL, FRONTAL, LONGITUDINAL))
    for kind in ("gamma", "inverted_gamma"):
        for sign, word in ((1, "expand"), (-1, "compress")):
            for g in _GAMMAS:
                add(f"{kind}_{word}_{g:g}", kind, g, sign=sign)
    for kind, prefix, (up, down) in (
        ("shift", "shift", ("add", "sub")),
        ("intensity_scale", "intensity", ("up", "down")),
        ("contrast", "contrast", ("up", "down")),
    ):
        for sign, word in ((1, up), (-1, down)):
            for s in _STEPS:
                add(f"{prefix}_{word}_{s:g}", kind, s, sign=sign)
    for kind, values in (
        ("blur", (0.5, 0.7, 0.9)),
        ("sharpen", (0.9, 0.7, 0.5)),
        ("noise", (0.025, 0.075, 0.125)),
        ("low_resolution", (0.9, 0.7, 0.5)),
    ):
        for v in values:
            add(f"{kind}_{v:g}", kind, v)
    return tuple(ops)


#: The 84 TEA ops of SPEC §3; ``TEA_OPS[i].id == i``.
TEA_OPS: tuple[TEAOp, ...] = _build_ops()
_BY_NAME = {op.name: op for op in TEA_OPS}
if len(TEA_OPS) != 84 or len(_BY_NAME) != 84:  # pragma: no cover - a construction bug
    raise RuntimeError(f"TEA catalogue must have 84 uniquely named ops, built {len(TEA_OPS)}")


def get_tea_op(id_or_name: int | str) -> TEAOp:
    """The TEA op with this paper id (0..83) or name."""
    if isinstance(id_or_name, str):
        try:
            return _BY_NAME[id_or_name]
        except KeyError:
            raise KeyError(
                f"no TEA op named {id_or_name!r} (ids 0..{len(TEA_OPS) - 1}); valid names: {list(_BY_NAME)}"
            ) from None
    try:
        index = operator.index(id_or_name)
    except TypeError:
        raise TypeError(f"TEA op must be given by id (int) or name (str), got {id_or_name!r}") from None
    if not 0 <= index < len(TEA_OPS):
        raise IndexError(f"TEA op id {index} out of range: valid ids are 0..{len(TEA_OPS) - 1}")
    return TEA_OPS[index]


def tea_catalogue_json() -> list[dict]:
    """Machine-readable catalogue: ``{"id", "name", "kind", "magnitude"}`` per op, in id order."""
    return [op.to_json() for op in TEA_OPS]


# ---------------------------------------------------------------------------------------------- batched application
#: grids of affine ops, keyed by (op kind, magnitude, sign, axis, inverse, shape, device, dtype); least recently
#: used dropped past the budget
_GRID_CACHE: OrderedDict[tuple, torch.Tensor] = OrderedDict()
GRID_CACHE_BYTES = 256 * 2**20


def _cache_grid(key: tuple, grid: torch.Tensor) -> None:
    _GRID_CACHE[key] = grid
    total = sum(g.numel() * g.element_size() for g in _GRID_CACHE.values())
    while total > GRID_CACHE_BYTES and len(_GRID_CACHE) > 1:
        _, dropped = _GRID_CACHE.popitem(last=False)
        total -= dropped.numel() * dropped.element_size()


def clear_grid_cache() -> None:
    """Drop the cached grids of the affine TEA ops."""
    _GRID_CACHE.clear()


_WHAT = ("image", "label", "invert")


def _spatial_rows(ops: Sequence[TEAOp], x: torch.Tensor, what: str) -> list[torch.Tensor]:
    """The spatial part of ``ops[k]`` on row ``x[k]`` ([K, C, X, Y, Z]): all affine rows in one ``grid_sample``."""
    inverse = what == "invert"
    out: list[torch.Tensor | None] = [None] * len(ops)
    affine = [k for k, op in enumerate(ops) if op.kind in ("scale", "rotate")]
    if affine:
        dtype = x.dtype if x.is_floating_point() else torch.float32
        grid = torch.cat([ops[k].grid(x.shape[2:], x.device, dtype, inverse) for k in affine])
        rows = x[affine] if len(affine) < len(ops) else x
        mode, padding = ("nearest", "zeros") if what == "label" else ("bilinear", "border")
        moved = resample(rows.to(dtype), None, mode, padding, grid=grid)
        if what == "label" and not x.is_floating_point():
            moved = moved.round().to(x.dtype)
        for j, k in enumerate(affine):
            out[k] = moved[j]
    for k, op in enumerate(ops):
        if op.kind == "flip":
            out[k] = torch.flip(x[k], dims=[a - 3 for a in op.flip_axes])
        elif op.kind == "rot90":
            turns = -op._quarter_turns if inverse else op._quarter_turns
            out[k] = torch.rot90(x[k], turns, dims=op._spatial_dims)
        elif out[k] is None:
            out[k] = x[k]
    return out  # type: ignore[return-value]


def _intensity_rows(ops: Sequence[TEAOp], x: torch.Tensor, stats: intensity.VolumeStats | None = None) -> torch.Tensor:
    """The intensity part of ``ops[k]`` on row ``x[k]`` (a [C, X, Y, Z] sample), vectorised per op kind (the
    table :data:`jcsaug.ops.intensity.INTENSITY_KINDS` the TRA cascade uses too); ``stats``: per-row volume
    statistics for the ops that read a range or a mean."""
    kinds = intensity.INTENSITY_KINDS
    values = {
        name: [op.value if op.kind == name else kind.identity for op in ops]
        for name, kind in kinds.items()
        if any(op.kind == name for op in ops)
    }
    return intensity.apply_kinds(x, values, [NOISE_SEED_BASE + op.id for op in ops], stats=stats)


def apply_tea_ops(
    ops: Sequence[TEAOp], x: torch.Tensor, what: str = "image", stats: intensity.VolumeStats | None = None
) -> list[torch.Tensor]:
    """Apply ``ops[k]`` to row ``x[k]`` of a batch ``[K, C, X, Y, Z]``, on its device, all rows at once.

    ``what``: ``"image"`` (spatial and intensity ops; bilinear, border padding), ``"label"`` (spatial ops only;
    nearest, zero padding, values and dtype kept) or ``"invert"`` (map predictions made on transformed images
    back: inverse spatial ops, bilinear, border padding). The affine ops of all rows go through one
    ``grid_sample`` call with their cached grids; mirrors and 90-degree rotations are exact index ops;
    intensity ops are vectorised over the rows of each kind. Returns one tensor per row (90-degree rotations
    of non-cubic volumes change shapes). Ops of a user's own catalogue (objects with ``transform_image``,
    ``transform_label`` and ``invert`` rather than :class:`TEAOp` s) are applied row by row.

    ``stats`` (``what="image"``): :data:`jcsaug.ops.intensity.VolumeStats` with one entry per row, the statistics of
    the volume each row (a patch) was cut from, which the gamma, contrast and sharpening ops then read instead of the
    row's own: the op bends a patch's intensities as it bends them on the whole volume at test time (``None``: each
    row's own, right for whole volumes).
    """
    if what not in _WHAT:
        raise ValueError(f"what must be one of {_WHAT}, got {what!r}")
    x = _plain(x)
    if x.ndim != 5 or x.shape[0] != len(ops):
        raise ValueError(f"expected one [C, X, Y, Z] row per op ({len(ops)} ops), got shape {tuple(x.shape)}")
    if not all(isinstance(op, TEAOp) for op in ops):
        method = {"image": "transform_image", "label": "transform_label", "invert": "invert"}[what]
        return [getattr(op, method)(row) for op, row in zip(ops, x.unbind(0))]
    if what == "image":
        x = x if x.is_floating_point() else x.float()
        intensity_ops = [op if not op.is_spatial else TEA_OPS[0] for op in ops]
        if any(op.kind != "identity" for op in intensity_ops):
            x = _intensity_rows(intensity_ops, x, stats)
    if not any(op.is_spatial for op in ops):
        return list(x.unbind(0))
    return _spatial_rows(ops, x, what)


def apply_tea_ops_by_shape(
    ops: Sequence[TEAOp], rows: Sequence[torch.Tensor], what: str = "image"
) -> list[torch.Tensor]:
    """:func:`apply_tea_ops` on rows ``[C, X, Y, Z]`` that may differ in shape: one batched call per shape."""
    if len(ops) != len(rows):
        raise ValueError(f"{len(ops)} ops for {len(rows)} rows")
    by_shape: dict[tuple, list[int]] = {}
    for k, row in enumerate(rows):
        by_shape.setdefault(tuple(row.shape), []).append(k)
    out: list[torch.Tensor | None] = [None] * len(rows)
    for idx in by_shape.values():
        for k, y in zip(idx, apply_tea_ops([ops[k] for k in idx], torch.stack([_plain(rows[k]) for k in idx]), what)):
            out[k] = y
    return out  # type: ignore[return-value]


def in_view_masks(
    ops: Sequence[TEAOp], spatial_size: Sequence[int], device: torch.device | str = "cpu"
) -> list[torch.Tensor]:
    """Per op, a boolean ``[1, X, Y, Z]`` mask of the voxels of the original grid whose mapped-back prediction
    (:meth:`TEAOp.invert`) reads the transformed volume itself (its sampling point at most half a voxel beyond the
    outer voxel centres), not the border padding that fills what the op moved out of the field of view.

    All ``True`` for ops that lose no voxel (mirrors, 90/180-degree turns, intensity ops) and for ops of a user's own
    catalogue (nothing is known of their inverse); for a scale-up or a small rotation, the centre the op kept in view.
    The reference code scores its TEA ops on these voxels only (its inverse fills the rest with zeros, which it masks
    out of the soft Dice); a mask is derived from the op's cached inverse grid, so it costs one comparison."""
    size = [int(s) for s in spatial_size]
    if len(size) != 3:
        raise ValueError(f"spatial_size must have 3 entries, got {list(spatial_size)}")
    everywhere = torch.ones(1, *size, dtype=torch.bool, device=device)
    masks = []
    for op in ops:
        if isinstance(op, TEAOp) and op.kind in ("scale", "rotate"):
            grid = op.grid(size, device, torch.float32, inverse=True)  # normalised (align_corners=False): |g| <= 1
            masks.append((grid.abs() <= 1.0).all(-1))
        else:
            masks.append(everywhere)
    return masks


def _one_op(op: TEAOp, x: torch.Tensor, what: str) -> torch.Tensor:
    """One op on ``x`` [..., X, Y, Z]: spatial ops treat all leading dims as channels, intensity ops treat each
    ``[C, X, Y, Z]`` sample on its own (a 3-dim ``x`` is one sample)."""
    _check_spatial(x, {"image": "image", "label": "label", "invert": "prediction"}[what])
    x = _plain(x)
    if what == "image" and not x.is_floating_point():
        x = x.float()
    if op.kind == "identity" or (what != "image" and not op.is_spatial):
        return x
    if op.is_spatial:
        rows = x.reshape(1, -1, *x.shape[-3:])
        out = _spatial_rows([op], rows, what)[0]
        return out.reshape(*x.shape[:-3], *out.shape[-3:])
    rows = x.reshape(-1, *x.shape[-4:]) if x.ndim >= 4 else x[None, None]
    return _intensity_rows([op] * rows.shape[0], rows).reshape(x.shape)
