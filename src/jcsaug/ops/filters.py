"""Filters for batches of 3D volumes ``[B, C, X, Y, Z]``, one sigma per sample, on any device.

* :func:`gaussian_blur_batch` is MONAI's ``GaussianSmooth`` (erf kernels truncated at 4 sigma, zero padding);
* :func:`laplacian_of_gaussian_batch` and :func:`log_sharpen_batch` are the paper's sharpening ``x - LoG(x)``,
  which MONAI lacks (its ``GaussianSharpen`` is an unsharp mask, two blurs).

Kernel values come from MONAI's ``gaussian_1d``; the filtering is written here as sums of shifted slices
because MONAI's ``separable_filtering`` (``conv3d`` with 1D kernels) is about 6x slower on the CPU and takes
one kernel per call. :func:`log_sharpen` / :func:`laplacian_of_gaussian` are the one-sample forms.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from monai.networks.layers import gaussian_1d


def _stack_kernels(kernels: Sequence[torch.Tensor]) -> torch.Tensor:
    """Odd 1D kernels of different lengths, zero-padded around their centres into one ``[B, K]`` tensor."""
    radius = max((k.numel() - 1) // 2 for k in kernels)
    return torch.stack([F.pad(k, (radius - (k.numel() - 1) // 2,) * 2) for k in kernels])


def filter_axis(x: torch.Tensor, weights: torch.Tensor, dim: int, padding: str = "zeros") -> torch.Tensor:
    """Correlate ``x`` [B, C, ...] along ``dim`` with sample ``i``'s odd kernel ``weights[i]`` ([B, K] or [K]).

    Written as a sum of shifted slices (``K`` fused multiply-adds over the volume, no padded copy) rather than
    MONAI's ``separable_filtering`` (``conv3d`` with a 1D kernel), which is several times slower on the CPU.
    ``padding``: ``"zeros"`` or ``"replicate"`` (edge values repeated).
    """
    k = weights.shape[-1]
    radius = (k - 1) // 2
    n = x.shape[dim]
    single = weights.ndim == 1 or weights.shape[0] == 1
    if single:  # one kernel: python-float weights, the fastest path
        w = weights.reshape(-1).tolist()
    else:
        w = weights.to(x.dtype).view(weights.shape[0], k, *([1] * (x.ndim - 1))).unbind(1)

    def accumulate(target: torch.Tensor, source: torch.Tensor, j: int) -> None:
        if single:
            target.add_(source, alpha=w[j])
        else:
            target.addcmul_(source, w[j])

    out = x * w[radius]
    for j in range(k):
        o = j - radius  # out[i] += w[j] * x[i + o]
        if o == 0 or (single and w[j] == 0.0):
            continue
        span = n - abs(o)
        if span > 0:
            accumulate(out.narrow(dim, max(0, -o), span), x.narrow(dim, max(0, o), span), j)
        if padding == "replicate":  # positions whose neighbour i + o lies outside take the edge value
            edge = x.narrow(dim, n - 1 if o > 0 else 0, 1)
            count = min(abs(o), n)
            accumulate(out.narrow(dim, n - count if o > 0 else 0, count), edge, j)
        elif padding != "zeros":
            raise ValueError(f"padding must be 'zeros' or 'replicate', got {padding!r}")
    return out


def gaussian_kernels(sigma: Sequence[float], approx: str = "erf", device: torch.device | None = None) -> torch.Tensor:
    """MONAI's ``gaussian_1d`` kernels (truncated at 4 sigma), one per sigma, stacked as ``[B, K]``."""
    kernels = [gaussian_1d(torch.tensor(float(s)), truncated=4.0, approx=approx, normalize=approx != "erf")
               for s in sigma]  # fmt: skip
    return _stack_kernels(kernels).to(device)


def gaussian_blur_batch(x: torch.Tensor, sigma: Sequence[float]) -> torch.Tensor:
    """Gaussian smoothing with sample ``i``'s ``sigma[i]``, zero padding (MONAI ``GaussianSmooth``)."""
    w = gaussian_kernels(sigma, "erf", x.device).to(x.dtype)
    for dim in range(2, x.ndim):
        x = filter_axis(x, w, dim, "zeros")
    return x


def _log_kernels(sigma: Sequence[float], device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled Gaussian and second-derivative kernels ``[B, K]`` of the LoG, one pair per sigma."""
    gs, d2s = [], []
    for s in sigma:
        g = gaussian_1d(torch.tensor(float(s)), truncated=4.0, approx="sampled", normalize=True)
        radius = (g.numel() - 1) // 2
        t = torch.arange(-radius, radius + 1, dtype=g.dtype)
        d2 = (t**2 / s**4 - 1.0 / s**2) * g
        gs.append(g)
        d2s.append(d2 - d2.mean())  # a constant image has zero Laplacian
    return _stack_kernels(gs).to(device), _stack_kernels(d2s).to(device)


def laplacian_of_gaussian_batch(x: torch.Tensor, sigma: Sequence[float]) -> torch.Tensor:
    """LoG of a batch of 3D volumes ``[B, C, X, Y, Z]``, replicate padding: the sum over axes of the second
    derivative along that axis times the Gaussian along the other two, sharing intermediate smoothings
    (8 one-dimensional passes instead of 9)."""
    if x.ndim != 5:
        raise ValueError(f"expected [B, C, X, Y, Z], got shape {tuple(x.shape)}")
    g, d2 = (k.to(x.dtype) for k in _log_kernels(sigma, x.device))
    gz = filter_axis(x, g, 4, "replicate")
    out = filter_axis(filter_axis(gz, g, 3, "replicate"), d2, 2, "replicate")  # d2x Gy Gz
    out += filter_axis(filter_axis(gz, g, 2, "replicate"), d2, 3, "replicate")  # d2y Gx Gz
    out += filter_axis(filter_axis(filter_axis(x, g, 2, "replicate"), g, 3, "replicate"), d2, 4, "replicate")
    return out


def log_sharpen_batch(
    x: torch.Tensor,
    sigma: Sequence[float],
    *,
    low: torch.Tensor | None = None,
    high: torch.Tensor | None = None,
) -> torch.Tensor:
    """The paper's sharpening ``x - LoG(x, sigma)``, clipped to each sample's input range (or to ``low`` / ``high``
    ``[B]``, a patch's volume's range)."""
    out = x - laplacian_of_gaussian_batch(x, sigma)
    if low is None or high is None:
        low, high = torch.aminmax(x.reshape(x.shape[0], -1), dim=1)
    low, high = low.to(x), high.to(x)
    shape = (-1, *([1] * (x.ndim - 1)))
    return torch.maximum(torch.minimum(out, high.view(shape)), low.view(shape))


def laplacian_of_gaussian(img: torch.Tensor, sigma: float) -> torch.Tensor:
    """LoG of one channel-first volume ``[C, X, Y, Z]``, replicate padding."""
    return laplacian_of_gaussian_batch(img[None], [sigma])[0]


def log_sharpen(img: torch.Tensor, sigma: float) -> torch.Tensor:
    """The paper's sharpening ``x - LoG(x, sigma)`` of one volume ``[C, X, Y, Z]``, clipped to its range."""
    return log_sharpen_batch(img[None], [sigma])[0]
