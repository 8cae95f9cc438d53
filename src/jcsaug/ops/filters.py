"""Filters MONAI lacks.

MONAI's ``GaussianSharpen`` is an unsharp mask (two blurs), not the paper's ``x - LoG(x)``, and MONAI
has no Laplacian-of-Gaussian, so the LoG is written here as a sum of separable filters built with
MONAI's own ``gaussian_1d`` / ``separable_filtering``.
"""

from __future__ import annotations

import torch
from monai.networks.layers import gaussian_1d, separable_filtering


def _second_derivative_1d(sigma: float, truncated: float = 4.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(Gaussian, its second derivative) sampled on the same integer support."""
    g = gaussian_1d(torch.tensor(float(sigma)), truncated=truncated, approx="sampled", normalize=True)
    radius = (g.numel() - 1) // 2
    t = torch.arange(-radius, radius + 1, dtype=g.dtype)
    d2 = (t**2 / sigma**4 - 1.0 / sigma**2) * g
    d2 = d2 - d2.mean()  # a constant image has zero Laplacian
    return g, d2


def laplacian_of_gaussian(img: torch.Tensor, sigma: float) -> torch.Tensor:
    """LoG of a channel-first image ``[C, *spatial]`` (any number of spatial dims), per channel."""
    spatial = img.ndim - 1
    g, d2 = _second_derivative_1d(sigma)
    g, d2 = g.to(img), d2.to(img)
    x = img.unsqueeze(0)
    out = torch.zeros_like(x)
    for axis in range(spatial):
        kernels = [d2 if i == axis else g for i in range(spatial)]
        out = out + separable_filtering(x, kernels, mode="replicate")
    return out.squeeze(0)


def log_sharpen(img: torch.Tensor, sigma: float) -> torch.Tensor:
    """The paper's sharpening ``x - LoG(x, sigma)``, clipped to the input's range."""
    out = img - laplacian_of_gaussian(img, sigma)
    return out.clamp(img.min(), img.max())
