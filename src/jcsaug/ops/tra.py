"""The training-time augmentation (TRA) catalogue of SPEC §2: 15 series, 47 operations.

Kept apart, as in torchvision v2 / kornia:

* :data:`TRA_SERIES` describes the ops (names, bins, signs);
* :func:`sample_tra_params` draws the concrete magnitudes of the chosen ops into a :class:`TRAParams`;
* :func:`apply_tra` applies a :class:`TRAParams` to images and labels.

* :func:`apply_tra_batch` applies the params of a whole batch ``[B, C, X, Y, Z]`` on its device;
  :func:`apply_tra` is the same code on one sample ``[C, X, Y, Z]``.

All spatial ops drawn for a sample cost **one** resampling: scaling and the three small rotations become
one affine matrix (MONAI's convention, see :mod:`jcsaug.ops.resample`), and all samples of a batch are
resampled by one ``grid_sample`` call per key; 90-degree rotations and mirrors are exact index ops.
Labels are resampled with nearest neighbour, so they keep their set of values.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
from monai.transforms.utils import create_rotate, create_scale

from jcsaug.ops import intensity
from jcsaug.ops.axes import AXIS_NAMES, FRONTAL, LONGITUDINAL, SAGITTAL, rotation_plane
from jcsaug.ops.catalogue import OpSpec, Series, split_signs
from jcsaug.ops.resample import affine_grid as resample_grid
from jcsaug.ops.resample import centre_crop, resample, separable_axis
from jcsaug.registry import Registry

_THREE_BINS = ((0.0, 0.1), (0.1, 0.2), (0.2, 0.3))


def _bin_name(prefix: str, low: float, high: float, signed: bool) -> str:
    sign = "±" if signed else ""
    return f"{prefix}{sign}[{low:g},{high:g})"


def _binned(prefix: str, kind: str, bins: Sequence[tuple[float, float]], signed: bool, **kw) -> list[OpSpec]:
    return [
        OpSpec(_bin_name(prefix, lo, hi, signed), kind, lo, hi, signed, level=i, **kw)
        for i, (lo, hi) in enumerate(bins)
    ]


def _rotation_series(axis: int) -> Series:
    ops = _binned("rotate", "rotate", ((0, 10), (10, 20), (20, 30)), True, axis=axis)
    ops.append(OpSpec("rot90", "rot90", 90, 90, signed=True, level=None, axis=axis))
    return Series(f"rotate_{AXIS_NAMES[axis]}", tuple(ops))


def _build_series() -> tuple[Series, ...]:
    blur = _binned("blur", "blur", ((0.4, 0.6), (0.6, 0.8), (0.8, 1.0)), False)
    sharpen = _binned("sharpen", "sharpen", ((0.8, 1.0), (0.6, 0.8), (0.4, 0.6)), False)
    return (
        Series("scale", tuple(_binned("scale", "scale", [(i / 10, (i + 1) / 10) for i in range(5)], True))),
        _rotation_series(FRONTAL),
        _rotation_series(SAGITTAL),
        _rotation_series(LONGITUDINAL),
        Series("mirror_sagittal", (OpSpec("flip", "flip", axis=SAGITTAL),)),
        Series("mirror_frontal", (OpSpec("flip", "flip", axis=FRONTAL),)),
        Series("mirror_axial", (OpSpec("flip", "flip", axis=LONGITUDINAL),)),
        Series("gamma", tuple(_binned("gamma", "gamma", ((0, 0.2), (0.2, 0.4), (0.4, 0.6)), True))),
        Series(
            "inverted_gamma",
            tuple(_binned("inverted_gamma", "inverted_gamma", ((0, 0.2), (0.2, 0.4), (0.4, 0.6)), True)),
        ),
        Series("intensity_shift", tuple(_binned("shift", "shift", _THREE_BINS, True))),
        Series("intensity_scale", tuple(_binned("scale_intensity", "intensity_scale", _THREE_BINS, True))),
        Series("contrast", tuple(_binned("contrast", "contrast", _THREE_BINS, True))),
        Series("blur_sharpen", tuple(blur + sharpen)),
        Series("noise", tuple(_binned("noise_std", "noise", ((0, 0.05), (0.05, 0.10), (0.10, 0.15)), False))),
        Series(
            "low_resolution",
            tuple(_binned("low_resolution", "low_resolution", ((0.8, 1.0), (0.6, 0.8), (0.4, 0.6)), False)),
        ),
    )


#: The 15 TRA series in SPEC §2's numbering (index = position in a policy's series list).
TRA_SERIES: tuple[Series, ...] = _build_series()
TRA_SERIES_NAMES: tuple[str, ...] = tuple(s.name for s in TRA_SERIES)

#: TRA catalogue name -> its 15 series. ``spec``: SPEC §2, a signed op draws its sign with probability 1/2 each
#: time it is applied. ``split-signs``: every signed op split in its ``+`` and ``-`` half (:func:`split_signs`), so
#: a learned policy can choose the sign (a zoom in, not out; 90 degrees, not 270): the same ops and magnitudes, and
#: under a ``q``-preset the same initial augmentation distribution, with 32 more logits per class group.
TRA_CATALOGUES: Registry[tuple[Series, ...]] = Registry("TRA catalogue")
TRA_CATALOGUES.register("spec", TRA_SERIES)
TRA_CATALOGUES.register("split-signs", split_signs(TRA_SERIES))


def tra_catalogue(name: str) -> tuple[Series, ...]:
    """The series of the TRA catalogue ``name`` (:data:`TRA_CATALOGUES`; an unknown name lists the known ones)."""
    return TRA_CATALOGUES.get(name)


def tra_catalogue_name(op_names: Sequence[Sequence[str]]) -> str:
    """The name of the registered catalogue with these op names per series (a policy's ``op_names``); for a policy
    whose ops are not named so (e.g. a plain ``CategoricalPolicy``), the one catalogue of these series sizes; else an
    error naming the sizes of each catalogue."""
    wanted = [list(names) for names in op_names]
    for name, series in TRA_CATALOGUES.items():
        if wanted == [s.op_names for s in series]:
            return name
    by_size = [name for name, series in TRA_CATALOGUES.items() if [len(n) for n in wanted] == [s.size for s in series]]
    if len(by_size) == 1:
        return by_size[0]
    known = {name: [s.size for s in series] for name, series in TRA_CATALOGUES.items()}
    raise ValueError(
        f"no TRA catalogue has these ops (series sizes {[len(n) for n in wanted]}); the catalogues' sizes: {known}"
    )


@dataclass
class TRAParams:
    """Concrete magnitudes of the ops drawn for one sample (defaults = identity)."""

    scale: float = 1.0
    angles: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # radians about array axes 0,1,2
    rot90: list[tuple[int, int]] = field(default_factory=list)  # (axis, k quarter turns)
    noise_std: float = 0.0
    noise_seed: int = 0
    blur_sigma: float = 0.0
    sharpen_sigma: float = 0.0
    shift: float = 0.0
    intensity_factor: float = 1.0
    contrast_factor: float = 1.0
    lowres_zoom: float = 1.0
    inverted_gamma: float = 1.0
    gamma: float = 1.0
    flip_axes: list[int] = field(default_factory=list)

    @property
    def needs_affine(self) -> bool:
        return self.scale != 1.0 or any(a != 0.0 for a in self.angles)


def _magnitude(op: OpSpec, rng: np.random.RandomState) -> float:
    """Stochastic magnitude inside the op's bin, with a random sign for signed ops."""
    value = rng.uniform(op.low, op.high)
    if (op.signed and rng.random_sample() < 0.5) or op.negative:
        value = -value
    return float(value)


def _signed_factor(op: OpSpec, rng: np.random.RandomState) -> float:
    """``(1 + M) ** ±1`` with M drawn in the op's bin."""
    m = _magnitude(op, rng)
    return (1.0 + abs(m)) ** (1 if m >= 0 else -1)


def _sample_rotate(p: TRAParams, op: OpSpec, rng: np.random.RandomState) -> None:
    p.angles[op.axis] = math.radians(_magnitude(op, rng))


def _sample_rot90(p: TRAParams, op: OpSpec, rng: np.random.RandomState) -> None:
    if op.signed:
        p.rot90.append((op.axis, 1 if rng.random_sample() < 0.5 else 3))
    else:
        p.rot90.append((op.axis, 3 if op.negative else 1))


def _sample_flip(p: TRAParams, op: OpSpec, rng: np.random.RandomState) -> None:
    p.flip_axes.append(op.axis)


def _sample_noise(p: TRAParams, op: OpSpec, rng: np.random.RandomState) -> None:
    p.noise_std = _magnitude(op, rng)
    p.noise_seed = int(rng.randint(0, 2**31 - 1))


def _value_sampler(name: str, draw: Callable) -> Callable[[TRAParams, OpSpec, np.random.RandomState], None]:
    """A sampler setting the field ``name`` of the params to ``draw(op, rng)``."""

    def sample(p: TRAParams, op: OpSpec, rng: np.random.RandomState) -> None:
        setattr(p, name, draw(op, rng))

    return sample


#: intensity kind -> the :class:`TRAParams` field holding its value (the kinds of
#: :data:`jcsaug.ops.intensity.INTENSITY_KINDS`, shared with the TEA catalogue)
INTENSITY_FIELDS: dict[str, str] = {
    "noise": "noise_std",
    "blur": "blur_sigma",
    "sharpen": "sharpen_sigma",
    "shift": "shift",
    "intensity_scale": "intensity_factor",
    "contrast": "contrast_factor",
    "low_resolution": "lowres_zoom",
    "inverted_gamma": "inverted_gamma",
    "gamma": "gamma",
}
#: intensity kinds whose value is a factor ``(1 + M) ** ±1``; the others' value is the (signed) magnitude
_FACTOR_KINDS = frozenset({"gamma", "inverted_gamma", "intensity_scale", "contrast"})

#: op kind -> parameter sampler ``(params, op, rng)`` (a registry rather than an if-chain)
PARAM_SAMPLERS: Registry = Registry("TRA op kind")
PARAM_SAMPLERS.register("scale", _value_sampler("scale", _signed_factor))
PARAM_SAMPLERS.register("rotate", _sample_rotate)
PARAM_SAMPLERS.register("rot90", _sample_rot90)
PARAM_SAMPLERS.register("flip", _sample_flip)
PARAM_SAMPLERS.register("noise", _sample_noise)
for _kind, _name in INTENSITY_FIELDS.items():
    if _kind != "noise":
        PARAM_SAMPLERS.register(_kind, _value_sampler(_name, _signed_factor if _kind in _FACTOR_KINDS else _magnitude))


def _reset_scale(p: TRAParams, op: OpSpec) -> None:
    p.scale = 1.0


def _reset_rotate(p: TRAParams, op: OpSpec) -> None:
    p.angles[op.axis] = 0.0


def _reset_rot90(p: TRAParams, op: OpSpec) -> None:
    p.rot90 = [(axis, k) for axis, k in p.rot90 if axis != op.axis]


def _reset_flip(p: TRAParams, op: OpSpec) -> None:
    p.flip_axes = [axis for axis in p.flip_axes if axis != op.axis]


def _reset_field(name: str, identity: float) -> Callable[[TRAParams, OpSpec], None]:
    def reset(p: TRAParams, op: OpSpec) -> None:
        setattr(p, name, identity)

    return reset


#: op kind -> puts the parameters of that kind back to the identity (the inverse of :data:`PARAM_SAMPLERS`).
PARAM_RESETTERS: dict[str, Callable[[TRAParams, OpSpec], None]] = {
    "scale": _reset_scale,
    "rotate": _reset_rotate,
    "rot90": _reset_rot90,
    "flip": _reset_flip,
    **{
        kind: _reset_field(name, intensity.INTENSITY_KINDS.get(kind).identity)
        for kind, name in INTENSITY_FIELDS.items()
    },
}


def replace_series_op(
    params: TRAParams,
    series_index: int,
    op_index: int,
    rng: np.random.RandomState,
    series: Sequence[Series] = TRA_SERIES,
) -> TRAParams:
    """A copy of ``params`` with series ``series_index`` switched to op ``op_index`` (0 = identity).

    The other series keep their drawn magnitudes exactly, so the copy is the same augmented sample except for
    that one series: the counterfactual of paired scoring (:class:`jcsaug.policy.TRACascaded`).
    """
    out = copy.deepcopy(params)
    chosen = series[series_index]
    for op in chosen.ops:  # a series may mix kinds (blur / sharpen): undo all of them
        PARAM_RESETTERS[op.kind](out, op)
    op = chosen.op(int(op_index))
    if op is not None:
        PARAM_SAMPLERS.get(op.kind)(out, op, rng)
    if op is not None and op.kind == "rot90":
        # quarter turns about different axes do not commute: keep them in series order, as the cascade draws them
        order = {o.axis: i for i, s in enumerate(series) for o in s.ops if o.kind == "rot90"}
        out.rot90.sort(key=lambda turn: order.get(turn[0], len(series)))
    return out


def sample_tra_params(
    choices: Sequence[int], rng: np.random.RandomState, series: Sequence[Series] = TRA_SERIES
) -> TRAParams:
    """Draw the magnitudes of the ops chosen per series (``choices[s]`` indexes ``series[s]``)."""
    if len(choices) != len(series):
        raise ValueError(f"expected {len(series)} op choices (one per TRA series), got {len(choices)}")
    params = TRAParams()
    for s, index in zip(series, choices):
        op = s.op(int(index))
        if op is not None:
            PARAM_SAMPLERS.get(op.kind)(params, op, rng)
    return params


def _check_3d(img: torch.Tensor, key: str, batched: bool = False) -> None:
    if img.ndim != (5 if batched else 4):
        layout = "batches of 3D volumes [B, C, X, Y, Z]" if batched else "channel-first 3D volumes [C, X, Y, Z]"
        raise ValueError(f"TRA ops need {layout}; key {key!r} has shape {tuple(img.shape)}")


def affine_matrix(params: TRAParams) -> torch.Tensor:
    """The sample's one affine (scaling + small rotations about the centre) as a ``[3, 3]`` float64 output ->
    input matrix, composed as MONAI's ``AffineGrid(rotate_params=angles, scale_params=[scale] * 3)``."""
    m = create_rotate(3, list(params.angles), backend="numpy") @ create_scale(3, [params.scale] * 3, backend="numpy")
    return torch.as_tensor(np.asarray(m, dtype=np.float64)[:3, :3])


def affine_grid(params: TRAParams, spatial_size: Sequence[int], device: torch.device | None = None) -> torch.Tensor:
    """The sample's affine as a ``grid_sample`` grid ``[1, X, Y, Z, 3]`` (see :mod:`jcsaug.ops.resample`)."""
    return resample_grid(affine_matrix(params)[None], spatial_size, device)


def _as_plain(x: torch.Tensor) -> torch.Tensor:
    return x.as_tensor() if hasattr(x, "as_tensor") else x


def _per_sample_rot90(x: torch.Tensor, params: Sequence[TRAParams], owned: bool) -> torch.Tensor:
    """90-degree rotations, an index op per rotated sample (a quarter turn of a non-square plane becomes a half
    turn: it would change the patch shape, e.g. of 128x128x8 cardiac patches, and break batching)."""
    for i, p in enumerate(params):
        for axis, k in p.rot90:
            a, b = rotation_plane(axis)
            if x.shape[a + 2] != x.shape[b + 2]:
                k = 2
            if not owned:
                x, owned = x.clone(), True
            x[i] = torch.rot90(x[i], k, dims=(a + 1, b + 1))
    return x


def _spatial(
    x: torch.Tensor,
    params: Sequence[TRAParams],
    matrices: torch.Tensor | None,
    affine_mask: list[bool],
    *,
    is_label: bool,
    padding_mode: str,
    grids: dict,
    owned: bool,
    context: Sequence[int] | None = None,
) -> tuple[torch.Tensor, bool]:
    """Spatial part of the cascade: affine (one resampling for the whole batch) -> 90-degree rotations.

    With a ``context`` (voxels per side), the output is the centred region ``in - 2 * context``: the affine reads
    the whole input, the samples without one are cropped. Returns the result and whether the caller owns it."""
    in_size = tuple(int(s) for s in x.shape[2:])
    out_size = in_size if not context else tuple(s - 2 * int(c) for s, c in zip(in_size, context))
    if matrices is not None:
        dtype = x.dtype if x.is_floating_point() else torch.float32
        factored = x.device.type == "cpu" and x.shape[0] == 1 and separable_axis(matrices[0]) is not None
        grid = None
        if not factored:  # one grid per shape, shared by the image and label keys
            key = (in_size, out_size, x.device, dtype)
            if key not in grids:
                grids[key] = resample_grid(matrices, out_size, x.device, dtype, in_size=in_size)
            grid = grids[key]
        mode = "nearest" if is_label else "bilinear"

        def affine(t: torch.Tensor) -> torch.Tensor:
            return resample(t, matrices, mode=mode, padding_mode=padding_mode, grid=grid, out_size=out_size)

        if out_size == in_size:
            x = intensity.select(x, affine_mask, affine, inplace=owned)
        else:
            x, owned = _select_cropped(x, affine_mask, affine, out_size), True
    elif out_size != in_size:
        x = centre_crop(x, out_size)
        x, owned = (x.clone(), True) if x.shape[0] > 1 else (x, False)
    return _per_sample_rot90(x, params, owned), owned  # (a turn copies an unowned tensor: owned stays a safe answer)


def _select_cropped(x: torch.Tensor, mask: list[bool], fn: Callable, out_size: Sequence[int]) -> torch.Tensor:
    """``fn`` (which returns the centred ``out_size``) on the samples of ``mask``, the centred crop elsewhere."""
    idx = [i for i, m in enumerate(mask) if m]
    if len(idx) == x.shape[0]:
        return fn(x)
    out = centre_crop(x, out_size).clone()
    dev_idx = torch.tensor(idx, device=x.device)
    out[dev_idx] = fn(x[dev_idx])
    return out


def _flips(x: torch.Tensor, params: Sequence[TRAParams], owned: bool) -> torch.Tensor:
    for axis in range(3):
        mask = [axis in p.flip_axes for p in params]
        x = intensity.select(x, mask, partial(torch.flip, dims=[axis + 2]), inplace=owned)
    return x


def _intensity(x: torch.Tensor, params: Sequence[TRAParams], owned: bool) -> torch.Tensor:
    """Intensity part of the cascade, in the reference order of :data:`jcsaug.ops.intensity.INTENSITY_KINDS`:
    noise -> blur/sharpen -> shift/scale -> contrast -> low resolution -> inverted gamma -> gamma.
    Each op runs on the samples that drew it (all at once); the others are left untouched."""
    values = {kind: [getattr(p, name) for p in params] for kind, name in INTENSITY_FIELDS.items()}
    return intensity.apply_kinds(x, values, [p.noise_seed for p in params], inplace=owned)


def apply_tra_batch(
    images: dict[str, torch.Tensor],
    labels: dict[str, torch.Tensor],
    params: Sequence[TRAParams],
    padding_mode: str = "zeros",
    context: Sequence[int] | int | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Apply each sample's drawn TRA params to a batch, on the device the tensors are on.

    Inputs are ``[B, C, X, Y, Z]`` (MetaTensors are read as plain tensors), sample ``i`` gets ``params[i]``;
    returns plain tensors: images as float32, labels in their own dtype. All samples' affines go through one
    resampling per key (image bilinear, label nearest, see :func:`jcsaug.ops.resample.resample`); 90-degree
    rotations and mirrors are index ops;
    intensity ops run on the samples that drew them, vectorised over those samples. A sample whose ops
    are all identities comes out bit for bit unchanged.

    ``context``: voxels per side (one number, or one per axis) by which every input extends beyond the patch
    (:func:`tra_context`): the outputs are the centred patches ``in - 2 * context``; the scalings and rotations
    read the context, so what they bring into view is image, not padding (the reference code's enlarged crop).
    """
    params = list(params)
    context = as_context(context)
    context = context if any(context) else None  # no context: the patches as given
    affine_mask = [p.needs_affine for p in params]
    matrices = torch.stack([affine_matrix(p) for p, m in zip(params, affine_mask) if m]) if any(affine_mask) else None
    grids: dict = {}
    out_images, out_labels = {}, {}
    for key, img in {**images, **labels}.items():
        _check_3d(img, key, batched=True)
        if img.shape[0] != len(params):
            raise ValueError(f"key {key!r} holds {img.shape[0]} samples but {len(params)} TRA params were given")
        if context and any(s <= 2 * c for s, c in zip(img.shape[2:], context)):
            raise ValueError(
                f"key {key!r} has spatial shape {tuple(img.shape[2:])}, not larger than twice the TRA context "
                f"{list(context)} per side: give the patch with its context (an enlarged crop, see jcsaug.data."
                "ContextCropd)"
            )
    for key, img in images.items():
        x = _as_plain(img)
        # a batch: one float32 copy, then every op writes its samples in place (with a context the crop is the copy)
        owned = x.shape[0] > 1 and not context
        x = x.float().clone() if owned and x.dtype == torch.float32 else x.float()
        x, owned = _spatial(x, params, matrices, affine_mask, is_label=False, padding_mode=padding_mode, grids=grids,
                            owned=owned, context=context)  # fmt: skip
        out_images[key] = _flips(_intensity(x, params, owned), params, owned)
    for key, lab in labels.items():
        x = _as_plain(lab)
        dtype, owned = x.dtype, x.shape[0] > 1 and not context
        x = x.float().clone() if owned and x.dtype == torch.float32 else x.float()
        x, owned = _spatial(x, params, matrices, affine_mask, is_label=True, padding_mode="zeros", grids=grids,
                            owned=owned, context=context)  # fmt: skip
        out_labels[key] = _flips(x, params, owned).to(dtype)
    return out_images, out_labels


def as_context(context: Sequence[int] | int | None) -> tuple[int, int, int]:
    """A TRA context (voxels per side: one number, one per axis, or ``None`` for none) as three non-negative ints."""
    if context is None:
        return (0, 0, 0)
    values = [context] * 3 if isinstance(context, (int, np.integer)) else context
    values = list(values) if isinstance(values, (Sequence, np.ndarray)) and not isinstance(values, str) else [values]
    if len(values) != 3 or any(isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 0 for c in values):
        raise ValueError(f"the TRA context must be one or three non-negative voxel counts, got {context!r}")
    return tuple(int(c) for c in values)  # type: ignore[return-value]


def apply_tra(
    images: dict[str, torch.Tensor],
    labels: dict[str, torch.Tensor],
    params: TRAParams,
    padding_mode: str = "zeros",
    context: Sequence[int] | int | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Apply drawn TRA params to one sample's images (spatial + intensity) and labels (spatial, nearest).

    Inputs are channel-first ``[C, X, Y, Z]`` tensors (MetaTensors are read as plain tensors); returns plain
    tensors. The same code as :func:`apply_tra_batch`, on a batch of one (``context`` as there).
    """
    for key, x in {**images, **labels}.items():
        _check_3d(x, key)
    out_images, out_labels = apply_tra_batch(
        {k: _as_plain(v)[None] for k, v in images.items()},
        {k: _as_plain(v)[None] for k, v in labels.items()},
        [params],
        padding_mode,
        context,
    )
    return {k: v[0] for k, v in out_images.items()}, {k: v[0] for k, v in out_labels.items()}


def tra_context(patch_size: Sequence[int], series: Sequence[Series] = TRA_SERIES) -> tuple[int, int, int]:
    """Voxels per side by which a patch is enlarged so that the catalogue's scalings and small rotations read image
    rather than padding: its largest zoom-out combined with its largest rotation about any one axis (nnU-Net's rule
    for its enlarged crop; rotations about two or three axes at once may still reach past the corners), plus one
    voxel for the interpolation; at most the patch size per axis (a thin axis, e.g. of 128x128x8 cardiac patches,
    would otherwise need many times its size). 0 where the catalogue has no scaling or rotation."""
    sizes = [int(s) for s in patch_size]
    if len(sizes) != 3 or any(s < 1 for s in sizes):
        raise ValueError(f"patch_size must be three positive sizes, got {list(patch_size)}")
    ops = [op for s in series for op in s.ops]
    zoom_out = max([1.0 + abs(op.high) for op in ops if op.kind == "scale"], default=1.0)
    angles = {axis: max([abs(op.high) for op in ops if op.kind == "rotate" and op.axis == axis], default=0.0)
              for axis in range(3)}  # fmt: skip
    if zoom_out == 1.0 and not any(angles.values()):
        return (0, 0, 0)
    half = np.array([(s - 1) / 2.0 for s in sizes])
    reach = half.copy()
    for axis, top in angles.items():
        for degrees in np.linspace(0.0, top, 31):  # |cos| + |sin| need not peak at the largest angle
            rotation = [0.0, 0.0, 0.0]
            rotation[axis] = math.radians(degrees)
            matrix = np.abs(np.asarray(create_rotate(3, rotation, backend="numpy"))[:3, :3])
            reach = np.maximum(reach, matrix @ half)
    reach = reach * zoom_out
    return tuple(min(s, max(0, math.ceil(r - h - 1e-9) + 1)) for s, r, h in zip(sizes, reach, half))  # type: ignore


#: the ``tra_context`` setting of the bundles: ``auto`` (:func:`tra_context`), a number, or one number per axis
TRA_CONTEXT_AUTO = "auto"


def resolve_tra_context(
    setting: str | int | Sequence[int], patch_size: Sequence[int], catalogue: str = "spec"
) -> tuple[int, int, int]:
    """The TRA context of a bundle setting: ``"auto"`` -> :func:`tra_context` of the patch and catalogue; a number
    or three numbers -> that many voxels per side (0: the patch as cropped, zero-filled where a rotation or zoom-out
    brings the outside into view)."""
    if isinstance(setting, str):
        if setting != TRA_CONTEXT_AUTO:
            raise ValueError(f"tra_context must be {TRA_CONTEXT_AUTO!r}, a voxel count or three, got {setting!r}")
        return tra_context(patch_size, tra_catalogue(catalogue))
    try:
        return as_context(setting)
    except ValueError:
        raise ValueError(
            f"tra_context must be {TRA_CONTEXT_AUTO!r}, a voxel count or three (non-negative integers), got {setting!r}"
        ) from None


def tra_catalogue_json(series: Sequence[Series] = TRA_SERIES) -> list[dict]:
    """Machine-readable catalogue: one entry per series with all its ops, identity included."""
    result = []
    for sid, s in enumerate(series):
        ops = [{"index": 0, "name": "identity", "kind": "identity", "magnitude": [0.0, 0.0], "signed": False}]
        ops += [{"index": i + 1, **op.to_json()} for i, op in enumerate(s.ops)]
        result.append({"id": sid, "series": s.name, "ops": ops})
    return result
