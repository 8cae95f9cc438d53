"""Intensity ops on batches ``[B, C, X, Y, Z]`` with one parameter per sample, on any device.

They compute what MONAI's ``AdjustContrast``, ``ScaleIntensityFixedMean`` and ``ShiftIntensity`` compute
on one sample (reductions such as min, max and mean are taken per sample, over all its channels). Written
here because MONAI's transforms take one parameter per call and reduce over the whole tensor they get;
tests compare every op with the MONAI transform it stands for. Blur and sharpening are in
:mod:`jcsaug.ops.filters`.

Every op returns a new tensor and applies to the whole batch; :func:`select` applies an op to the samples
that drew it and leaves the others untouched, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

_EPSILON = 1e-7  # MONAI AdjustContrast's


def _per_sample(v: torch.Tensor | Sequence[float] | float, x: torch.Tensor) -> torch.Tensor:
    """Parameters ``[B]`` as a tensor broadcasting over ``x`` [B, ...]."""
    v = torch.as_tensor(v, dtype=x.dtype, device=x.device).reshape(-1)
    if v.numel() == 1 and x.shape[0] != 1:
        v = v.expand(x.shape[0])
    if v.shape[0] != x.shape[0]:
        raise ValueError(f"{v.shape[0]} parameters for a batch of {x.shape[0]} samples")
    return v.view(-1, *([1] * (x.ndim - 1)))


def gamma(x: torch.Tensor, exponent: torch.Tensor | float, invert: bool = False) -> torch.Tensor:
    """``((x - min) / (range + 1e-7)) ** exponent * range + min`` per sample (MONAI ``AdjustContrast``);
    ``invert`` applies it to ``-x`` and negates the result (``AdjustContrast(invert_image=True)``)."""
    if invert:
        x = -x
    flat = x.reshape(x.shape[0], -1)
    low, high = torch.aminmax(flat, dim=1)
    shape = (-1, *([1] * (x.ndim - 1)))
    low, span = low.view(shape), (high - low).view(shape)
    out = (x - low).div_(span + _EPSILON).pow_(_per_sample(exponent, x)).mul_(span).add_(low)
    return out.neg_() if invert else out


def inverted_gamma(x: torch.Tensor, exponent: torch.Tensor | float) -> torch.Tensor:
    """:func:`gamma` on the inverted image (MONAI ``AdjustContrast(invert_image=True)``)."""
    return gamma(x, exponent, invert=True)


def shift(x: torch.Tensor, offset: torch.Tensor | float) -> torch.Tensor:
    """``x + offset`` (MONAI ``ShiftIntensity``)."""
    return x + _per_sample(offset, x)


def scale(x: torch.Tensor, factor: torch.Tensor | float) -> torch.Tensor:
    """``x * factor``."""
    return x * _per_sample(factor, x)


def contrast(x: torch.Tensor, factor: torch.Tensor | float) -> torch.Tensor:
    """``(x - mean) * factor + mean`` per sample (MONAI ``ScaleIntensityFixedMean(factor=factor - 1)``)."""
    mean = x.reshape(x.shape[0], -1).mean(1).view(-1, *([1] * (x.ndim - 1)))
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
    1 then 0). One pair of ``interpolate`` calls per sample: the intermediate sizes differ."""
    spatial = list(x.shape[2:])
    out = []
    for i, z in enumerate(zoom):
        small = [max(1, int(round(s * float(z)))) for s in spatial]
        y = F.interpolate(x[i : i + 1], size=small, mode="trilinear", align_corners=False)
        out.append(F.interpolate(y, size=spatial, mode="nearest"))
    return torch.cat(out)


def select(x: torch.Tensor, mask, fn, *params, inplace: bool = False) -> torch.Tensor:  # noqa: ANN001
    """Apply ``fn(x[mask], *params[mask])`` to the samples where ``mask`` (a sequence of bools or a bool tensor)
    is set, leaving the others untouched (bit for bit); ``params`` are per-sample sequences or tensors. Returns
    ``x`` itself when no sample is set. ``inplace`` writes the selected samples' results into ``x`` (which the
    caller owns) instead of a copy."""
    flags = mask.tolist() if isinstance(mask, torch.Tensor) else mask
    idx = [i for i, m in enumerate(flags) if m]
    if not idx:
        return x
    if len(idx) == x.shape[0]:
        return fn(x, *params)
    picked = [p[torch.tensor(idx, device=p.device)] if isinstance(p, torch.Tensor) else [p[i] for i in idx]
              for p in params]  # fmt: skip
    out = x if inplace else x.clone()
    dev_idx = torch.tensor(idx, device=x.device)
    out[dev_idx] = fn(x[dev_idx], *picked)
    return out
