"""Intensity ops on batches ``[B, C, X, Y, Z]`` with one parameter per sample, on any device.

They compute what MONAI's ``AdjustContrast(retain_stats=True)``, ``ScaleIntensityFixedMean`` and ``ShiftIntensity``
compute on one sample (reductions such as min, max and mean are taken per sample, over all its channels). Written
here because MONAI's transforms take one parameter per call and reduce over the whole tensor they get;
tests compare every op with the MONAI transform it stands for. Blur and sharpening are in
:mod:`jcsaug.ops.filters`.

Every op returns a new tensor and applies to the whole batch; :func:`select` applies an op to the samples
that drew it and leaves the others untouched, bit for bit.

The ops that read a sample's range or mean (gamma, inverted gamma, contrast, sharpening's clip) take them, when given,
from per-sample :data:`VolumeStats` instead: the statistics of the volume a patch was cut from, so that an op on
the patch bends its intensities as the same op on the whole volume does (the TEA's ops act on whole volumes at test
time; the reference computes its gamma's range on the whole image).

:data:`INTENSITY_KINDS` is the one table of the intensity kinds both catalogues use (TRA series, TEA ops), in the
reference order of application; :func:`apply_kinds` runs them on a batch with one value per sample and kind.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from jcsaug.ops import filters
from jcsaug.registry import Registry

_EPSILON = 1e-7  # MONAI AdjustContrast's
_STD_EPSILON = 1e-8  # MONAI AdjustContrast's, for retain_stats

#: Per-sample statistics of the volume each sample was cut from: ``{"min": [B], "max": [B], "mean": [B]}`` tensors
#: (:func:`jcsaug.data.batch_volume_stats` reads them from a batch); ``None`` where a sample's own are meant.
VolumeStats = Mapping[str, torch.Tensor]

#: The statistics :data:`VolumeStats` holds (MONAI ``IntensityStats`` op names).
VOLUME_STAT_NAMES = ("min", "max", "mean")


def _per_sample(v: torch.Tensor | Sequence[float] | float, x: torch.Tensor) -> torch.Tensor:
    """Parameters ``[B]`` as a tensor broadcasting over ``x`` [B, ...]."""
    v = torch.as_tensor(v, dtype=x.dtype, device=x.device).reshape(-1)
    if v.numel() == 1 and x.shape[0] != 1:
        v = v.expand(x.shape[0])
    if v.shape[0] != x.shape[0]:
        raise ValueError(f"{v.shape[0]} parameters for a batch of {x.shape[0]} samples")
    return v.view(-1, *([1] * (x.ndim - 1)))


def gamma(
    x: torch.Tensor,
    exponent: torch.Tensor | float,
    invert: bool = False,
    retain_stats: bool = True,
    *,
    low: torch.Tensor | None = None,
    high: torch.Tensor | None = None,
) -> torch.Tensor:
    """``((x - min) / (range + 1e-7)) ** exponent * range + min`` per sample, then (``retain_stats``) shifted and
    scaled back to the sample's mean and standard deviation: MONAI ``AdjustContrast(retain_stats=True)``, as the
    reference code's gamma and nnU-Net's (batchgenerators' ``retain_stats``) keep them, so the op bends the
    intensity curve without moving the patch's brightness; ``invert`` applies it to ``-x`` and negates the result
    (``AdjustContrast(invert_image=True)``). ``low`` / ``high`` ``[B]``: the range to bend over (a patch's
    volume's, :data:`VolumeStats`) instead of each sample's own min and max; values below ``low`` are held at it
    (a negative base has no real power)."""
    given = low is not None and high is not None
    if invert:
        x = -x
        if given:  # the range of -x
            low, high = -high, -low
    flat = x.reshape(x.shape[0], -1)
    low, high = (low.to(flat), high.to(flat)) if given else torch.aminmax(flat, dim=1)
    shape = (-1, *([1] * (x.ndim - 1)))
    low, span = low.view(shape), (high - low).view(shape)
    base = (x - low).div_(span + _EPSILON)
    if given:  # a given range may start above a sample's own minimum (a padded patch)
        base = base.clamp_(min=0.0)
    out = base.pow_(_per_sample(exponent, x)).mul_(span).add_(low)
    if retain_stats:
        bent = out.reshape(out.shape[0], -1)
        out = (
            out.sub_(bent.mean(1).view(shape))
            .div_(bent.std(1).view(shape) + _STD_EPSILON)
            .mul_(flat.std(1).view(shape))
            .add_(flat.mean(1).view(shape))
        )
    return out.neg_() if invert else out


def inverted_gamma(
    x: torch.Tensor,
    exponent: torch.Tensor | float,
    *,
    low: torch.Tensor | None = None,
    high: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`gamma` on the inverted image (MONAI ``AdjustContrast(invert_image=True, retain_stats=True)``);
    ``low`` / ``high``: the range of ``x`` (not of ``-x``) to use instead of the sample's own."""
    return gamma(x, exponent, invert=True, low=low, high=high)


def shift(x: torch.Tensor, offset: torch.Tensor | float) -> torch.Tensor:
    """``x + offset`` (MONAI ``ShiftIntensity``)."""
    return x + _per_sample(offset, x)


def scale(x: torch.Tensor, factor: torch.Tensor | float) -> torch.Tensor:
    """``x * factor``."""
    return x * _per_sample(factor, x)


def contrast(x: torch.Tensor, factor: torch.Tensor | float, *, mean: torch.Tensor | None = None) -> torch.Tensor:
    """``(x - mean) * factor + mean`` per sample (MONAI ``ScaleIntensityFixedMean(factor=factor - 1)``); ``mean``
    ``[B]``: the mean to scale about (a patch's volume's) instead of the sample's own."""
    mean = x.reshape(x.shape[0], -1).mean(1) if mean is None else mean.to(x)
    mean = mean.view(-1, *([1] * (x.ndim - 1)))
    return (x - mean).mul_(_per_sample(factor, x)).add_(mean)


def add_noise(x: torch.Tensor, std: Sequence[float], seeds: Sequence[int]) -> torch.Tensor:
    """``x + std_i * N(0, 1)``, sample ``i``'s noise from a generator on ``x``'s device seeded with ``seeds[i]``."""
    noise = torch.empty_like(x)
    for i, seed in enumerate(seeds):
        gen = torch.Generator(device=x.device).manual_seed(int(seed))
        torch.randn(x.shape[1:], generator=gen, device=x.device, dtype=x.dtype, out=noise[i])
    return noise.mul_(_per_sample(list(std), x)).add_(x)


def low_resolution(x: torch.Tensor, zoom: Sequence[float]) -> torch.Tensor:
    """Zoom each sample down by ``zoom[i]`` (trilinear) and back up (nearest), as the reference code (orders
    1 then 0, scikit-image's ``resize``). Both steps align the voxel centres, as ``resize`` does: PyTorch's
    ``"nearest"`` reads voxel ``floor(i * s)`` and so moved the image half a voxel against its label (a centred blob's
    centroid by +0.5 voxel per axis at zooms 0.9 and 0.7); ``"nearest-exact"`` reads ``floor((i + 0.5) * s)``. One pair
    of ``interpolate`` calls per sample: the intermediate sizes differ."""
    spatial = list(x.shape[2:])
    out = []
    for i, z in enumerate(zoom):
        small = [max(1, int(round(s * float(z)))) for s in spatial]
        y = F.interpolate(x[i : i + 1], size=small, mode="trilinear", align_corners=False)
        out.append(F.interpolate(y, size=spatial, mode="nearest-exact"))
    return torch.cat(out)


def select(x: torch.Tensor, mask, fn, *params, inplace: bool = False, **named) -> torch.Tensor:  # noqa: ANN001
    """Apply ``fn(x[mask], *params[mask], **named[mask])`` to the samples where ``mask`` (a sequence of bools or a
    bool tensor) is set, leaving the others untouched (bit for bit); ``params`` and ``named`` are per-sample sequences
    or tensors. Returns ``x`` itself when no sample is set. ``inplace`` writes the selected samples' results into
    ``x`` (which the caller owns) instead of a copy."""
    flags = mask.tolist() if isinstance(mask, torch.Tensor) else mask
    idx = [i for i, m in enumerate(flags) if m]
    if not idx:
        return x
    if len(idx) == x.shape[0]:
        return fn(x, *params, **named)

    def pick(p):  # noqa: ANN001, ANN202
        return p[torch.tensor(idx, device=p.device)] if isinstance(p, torch.Tensor) else [p[i] for i in idx]

    out = x if inplace else x.clone()
    dev_idx = torch.tensor(idx, device=x.device)
    out[dev_idx] = fn(x[dev_idx], *map(pick, params), **{k: pick(v) for k, v in named.items()})
    return out


@dataclass(frozen=True)
class IntensityKind:
    """One intensity kind: the batched op ``op(x [B, C, X, Y, Z], values [B])`` and the value that leaves a
    sample untouched (``noise`` also takes one seed per sample); ``stats``: the op's keyword arguments that take
    :data:`VolumeStats` entries, ``(keyword, statistic)`` pairs."""

    name: str
    op: Callable[..., torch.Tensor]
    identity: float
    stats: tuple[tuple[str, str], ...] = ()


_RANGE = (("low", "min"), ("high", "max"))

#: the intensity kinds of the TRA and TEA catalogues, in the reference order of application (SPEC §2):
#: noise -> blur/sharpen -> shift/scale -> contrast -> low resolution -> inverted gamma -> gamma
INTENSITY_KINDS: Registry[IntensityKind] = Registry("intensity kind")
for _kind in (
    IntensityKind("noise", add_noise, 0.0),
    IntensityKind("blur", filters.gaussian_blur_batch, 0.0),
    IntensityKind("sharpen", filters.log_sharpen_batch, 0.0, _RANGE),
    IntensityKind("shift", shift, 0.0),
    IntensityKind("intensity_scale", scale, 1.0),
    IntensityKind("contrast", contrast, 1.0, (("mean", "mean"),)),
    IntensityKind("low_resolution", low_resolution, 1.0),
    IntensityKind("inverted_gamma", inverted_gamma, 1.0, _RANGE),
    IntensityKind("gamma", gamma, 1.0, _RANGE),
):
    INTENSITY_KINDS.register(_kind)


def apply_kinds(
    x: torch.Tensor,
    values: Mapping[str, Sequence[float]],
    seeds: Sequence[int] = (),
    inplace: bool = False,
    stats: VolumeStats | None = None,
) -> torch.Tensor:
    """Every intensity kind in the reference order, each on the samples whose value is not its identity.

    Args:
        x: a batch ``[B, C, X, Y, Z]``.
        values: kind -> one value per sample (kinds left out apply to none).
        seeds: one noise seed per sample (for ``noise``).
        inplace: write into ``x`` (which the caller owns).
        stats: per-sample :data:`VolumeStats` for the kinds that read a range or a mean (``None``: each sample's own).
    """
    for name, kind in INTENSITY_KINDS.items():
        if name not in values:
            continue
        v = list(values[name])
        extra = (list(seeds),) if name == "noise" else ()
        named = {} if stats is None else {keyword: stats[stat] for keyword, stat in kind.stats}
        x = select(x, [value != kind.identity for value in v], kind.op, v, *extra, inplace=inplace, **named)
    return x
