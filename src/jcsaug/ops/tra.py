"""The training-time augmentation (TRA) catalogue of SPEC §2: 15 series, 47 operations.

Kept apart, as in torchvision v2 / kornia:

* :data:`TRA_SERIES` describes the ops (names, bins, signs);
* :func:`sample_tra_params` draws the concrete magnitudes of the chosen ops into a :class:`TRAParams`;
* :func:`apply_tra` applies a :class:`TRAParams` to images and labels.

All spatial ops drawn for one sample cost **one** resampling: scaling and the three small rotations
become one affine matrix resampled once by MONAI's ``Affine``; 90-degree rotations and mirrors are
exact array operations. Labels are resampled with nearest neighbour, so they keep their set of values.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from monai.transforms import (
    AdjustContrast,
    AffineGrid,
    GaussianSmooth,
    ScaleIntensityFixedMean,
    ShiftIntensity,
)

from jcsaug.ops.axes import AXIS_NAMES, FRONTAL, LONGITUDINAL, SAGITTAL, rotation_plane
from jcsaug.ops.catalogue import OpSpec, Series
from jcsaug.ops.filters import log_sharpen

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
    if op.signed and rng.random_sample() < 0.5:
        value = -value
    return float(value)


def _signed_factor(op: OpSpec, rng: np.random.RandomState) -> float:
    """``(1 + M) ** ±1`` with M drawn in the op's bin."""
    m = _magnitude(op, rng)
    return (1.0 + abs(m)) ** (1 if m >= 0 else -1)


def _sample_scale(p: TRAParams, op: OpSpec, rng: np.random.RandomState) -> None:
    p.scale = _signed_factor(op, rng)


def _sample_rotate(p: TRAParams, op: OpSpec, rng: np.random.RandomState) -> None:
    p.angles[op.axis] = math.radians(_magnitude(op, rng))


def _sample_rot90(p: TRAParams, op: OpSpec, rng: np.random.RandomState) -> None:
    p.rot90.append((op.axis, 1 if rng.random_sample() < 0.5 else 3))


def _sample_flip(p: TRAParams, op: OpSpec, rng: np.random.RandomState) -> None:
    p.flip_axes.append(op.axis)


def _sample_gamma(p: TRAParams, op: OpSpec, rng: np.random.RandomState) -> None:
    p.gamma = _signed_factor(op, rng)


def _sample_inverted_gamma(p: TRAParams, op: OpSpec, rng: np.random.RandomState) -> None:
    p.inverted_gamma = _signed_factor(op, rng)


def _sample_shift(p: TRAParams, op: OpSpec, rng: np.random.RandomState) -> None:
    p.shift = _magnitude(op, rng)


def _sample_intensity_scale(p: TRAParams, op: OpSpec, rng: np.random.RandomState) -> None:
    p.intensity_factor = _signed_factor(op, rng)


def _sample_contrast(p: TRAParams, op: OpSpec, rng: np.random.RandomState) -> None:
    p.contrast_factor = _signed_factor(op, rng)


def _sample_blur(p: TRAParams, op: OpSpec, rng: np.random.RandomState) -> None:
    p.blur_sigma = _magnitude(op, rng)


def _sample_sharpen(p: TRAParams, op: OpSpec, rng: np.random.RandomState) -> None:
    p.sharpen_sigma = _magnitude(op, rng)


def _sample_noise(p: TRAParams, op: OpSpec, rng: np.random.RandomState) -> None:
    p.noise_std = _magnitude(op, rng)
    p.noise_seed = int(rng.randint(0, 2**31 - 1))


def _sample_low_resolution(p: TRAParams, op: OpSpec, rng: np.random.RandomState) -> None:
    p.lowres_zoom = _magnitude(op, rng)


#: op kind -> parameter sampler (a registry rather than an if-chain).
PARAM_SAMPLERS = {
    "scale": _sample_scale,
    "rotate": _sample_rotate,
    "rot90": _sample_rot90,
    "flip": _sample_flip,
    "gamma": _sample_gamma,
    "inverted_gamma": _sample_inverted_gamma,
    "shift": _sample_shift,
    "intensity_scale": _sample_intensity_scale,
    "contrast": _sample_contrast,
    "blur": _sample_blur,
    "sharpen": _sample_sharpen,
    "noise": _sample_noise,
    "low_resolution": _sample_low_resolution,
}


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
    "gamma": _reset_field("gamma", 1.0),
    "inverted_gamma": _reset_field("inverted_gamma", 1.0),
    "shift": _reset_field("shift", 0.0),
    "intensity_scale": _reset_field("intensity_factor", 1.0),
    "contrast": _reset_field("contrast_factor", 1.0),
    "blur": _reset_field("blur_sigma", 0.0),
    "sharpen": _reset_field("sharpen_sigma", 0.0),
    "noise": _reset_field("noise_std", 0.0),
    "low_resolution": _reset_field("lowres_zoom", 1.0),
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
        PARAM_SAMPLERS[op.kind](out, op, rng)
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
            PARAM_SAMPLERS[op.kind](params, op, rng)
    return params


def _check_3d(img: torch.Tensor, key: str) -> None:
    if img.ndim != 4:
        raise ValueError(
            f"TRA ops need channel-first 3D volumes [C, X, Y, Z]; key {key!r} has shape {tuple(img.shape)}"
        )


def affine_grid(params: TRAParams, spatial_size: Sequence[int], device: torch.device | None = None) -> torch.Tensor:
    """The sample's one affine (scaling + small rotations about the centre) as a ``grid_sample`` grid.

    Built once per sample with MONAI's ``AffineGrid`` and normalised as MONAI's ``Resample`` does, so
    every image and label key of the sample reuses it (MONAI's ``Affine`` rebuilds it per call).
    """
    grid, _ = AffineGrid(rotate_params=list(params.angles), scale_params=[params.scale] * 3, device=device)(
        spatial_size=list(spatial_size)
    )
    grid = torch.as_tensor(grid, dtype=torch.float32)
    grid = torch.movedim(grid[[2, 1, 0]], 0, -1).unsqueeze(0).contiguous()  # [1, X, Y, Z, (z, y, x)]
    for i, dim in enumerate(reversed(list(spatial_size))):
        grid[..., i] *= 2.0 / max(2, dim)
    return grid


def _affine_resample(
    img: torch.Tensor, params: TRAParams, mode: str, padding_mode: str, grid: torch.Tensor | None = None
) -> torch.Tensor:
    """The single resampling of a sample (bilinear for images, nearest for labels)."""
    if grid is None:
        grid = affine_grid(params, img.shape[1:], img.device)
    out = torch.nn.functional.grid_sample(
        img.unsqueeze(0), grid.to(img.device), mode=mode, padding_mode=padding_mode, align_corners=False
    )
    return out[0]


def _as_plain(x: torch.Tensor) -> torch.Tensor:
    return x.as_tensor() if hasattr(x, "as_tensor") else x


def apply_spatial(
    img: torch.Tensor,
    params: TRAParams,
    *,
    is_label: bool,
    padding_mode: str = "zeros",
    grid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Spatial part of the cascade: affine (one resampling) -> 90-degree rotations -> (later) mirrors."""
    if params.needs_affine:
        img = _affine_resample(img, params, "nearest" if is_label else "bilinear", padding_mode, grid)
    for axis, k in params.rot90:
        a, b = rotation_plane(axis)
        if img.shape[a + 1] != img.shape[b + 1]:
            # a quarter turn would change the patch shape (e.g. 128x128x8 cardiac patches) and break batching;
            # a half turn is the only multiple of 90 degrees that keeps it
            k = 2
        img = torch.rot90(img, k, dims=(a + 1, b + 1))
    return img


def apply_flips(img: torch.Tensor, params: TRAParams) -> torch.Tensor:
    if params.flip_axes:
        img = torch.flip(img, dims=[a + 1 for a in params.flip_axes])
    return img


def _low_resolution(img: torch.Tensor, zoom: float) -> torch.Tensor:
    """Zoom down (linear) and back up (nearest), as the reference code (orders 1 then 0)."""
    spatial = img.shape[1:]
    small = [max(1, int(round(s * zoom))) for s in spatial]
    x = torch.nn.functional.interpolate(img.unsqueeze(0), size=small, mode="trilinear", align_corners=False)
    return torch.nn.functional.interpolate(x, size=list(spatial), mode="nearest").squeeze(0)


def apply_intensity(img: torch.Tensor, params: TRAParams) -> torch.Tensor:
    """Intensity part of the cascade, in the reference order:
    noise -> blur/sharpen -> shift/scale -> contrast -> low resolution -> inverted gamma -> gamma."""
    if params.noise_std > 0:
        gen = torch.Generator(device=img.device).manual_seed(params.noise_seed)
        img = img + params.noise_std * torch.randn(img.shape, generator=gen, device=img.device, dtype=img.dtype)
    if params.blur_sigma > 0:
        img = _as_plain(GaussianSmooth(sigma=params.blur_sigma)(img))
    if params.sharpen_sigma > 0:
        img = log_sharpen(img, params.sharpen_sigma)
    if params.shift != 0:
        img = _as_plain(ShiftIntensity(params.shift)(img))
    if params.intensity_factor != 1.0:
        img = img * params.intensity_factor
    if params.contrast_factor != 1.0:
        img = _as_plain(ScaleIntensityFixedMean(factor=params.contrast_factor - 1.0)(img))
    if params.lowres_zoom != 1.0:
        img = _low_resolution(img, params.lowres_zoom)
    if params.inverted_gamma != 1.0:
        img = _as_plain(AdjustContrast(params.inverted_gamma, invert_image=True)(img))
    if params.gamma != 1.0:
        img = _as_plain(AdjustContrast(params.gamma)(img))
    return img


def apply_tra(
    images: dict[str, torch.Tensor],
    labels: dict[str, torch.Tensor],
    params: TRAParams,
    padding_mode: str = "zeros",
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Apply drawn TRA params to images (spatial + intensity) and labels (spatial, nearest).

    Inputs are channel-first ``[C, X, Y, Z]`` tensors (MetaTensors are read as plain tensors);
    returns plain tensors.
    """
    out_images, out_labels = {}, {}
    grids: dict[tuple, torch.Tensor] = {}  # one grid per spatial shape (normally one per sample)

    def grid_for(x: torch.Tensor) -> torch.Tensor | None:
        if not params.needs_affine:
            return None
        shape = tuple(x.shape[1:])
        if shape not in grids:
            grids[shape] = affine_grid(params, shape, x.device)
        return grids[shape]

    for key, img in images.items():
        _check_3d(img, key)
        x = _as_plain(img).float()
        x = apply_spatial(x, params, is_label=False, padding_mode=padding_mode, grid=grid_for(x))
        x = apply_intensity(x, params)
        out_images[key] = apply_flips(x, params)
    for key, lab in labels.items():
        _check_3d(lab, key)
        x = _as_plain(lab)
        dtype = x.dtype
        x = x.float()
        x = apply_spatial(x, params, is_label=True, padding_mode="zeros", grid=grid_for(x))
        out_labels[key] = apply_flips(x, params).to(dtype)
    return out_images, out_labels


def tra_catalogue_json(series: Sequence[Series] = TRA_SERIES) -> list[dict]:
    """Machine-readable catalogue: one entry per series with all its ops, identity included."""
    result = []
    for sid, s in enumerate(series):
        ops = [{"index": 0, "name": "identity", "kind": "identity", "magnitude": [0.0, 0.0], "signed": False}]
        ops += [{"index": i + 1, **op.to_json()} for i, op in enumerate(s.ops)]
        result.append({"id": sid, "series": s.name, "ops": ops})
    return result
