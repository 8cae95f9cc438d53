"""Affine resampling of batches of 3D volumes: one ``grid_sample`` call for a whole batch, any device.

Convention (MONAI's ``AffineGrid`` + ``Resample``, so results match MONAI's ``Affine``): a matrix ``M``
maps *output* voxel coordinates, centred on the volume centre, to *input* coordinates; sampling is
``grid_sample(align_corners=False)``. Volumes are ``[B, C, X, Y, Z]``; ``matrices`` is ``[B, 3, 3]``.

Written here rather than through MONAI's ``AffineGrid``/``Resample`` because those take one matrix per
call and build the grid with a dense float64 matrix product (about 65 ms at 128³ on one CPU core); a
grid is a sum of three per-axis terms, built here with two broadcast additions (about 7 ms), for a
whole batch at once. On the CPU, a matrix that acts within one plane and along the remaining axis
separately (scaling, and rotations about one axis: nearly every affine the TRA presets draw) is resampled
as a 2D ``grid_sample`` over the plane plus a 1D interpolation along the axis: the same trilinear
(or nearest) interpolation, since it is a tensor product, and about 5x faster than PyTorch's scalar
3D CPU kernel.

The output may be smaller than the input (``out_size``), centred on it: the TRA's spatial ops read an enlarged crop
(the patch and a context around it) and return the patch, so content moved into view comes from the image, not
from padding (:func:`jcsaug.ops.tra.tra_context`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from jcsaug.ops.axes import rotation_plane

#: padding modes of the affine resampling (``grid_sample``'s, minus "reflection": the TRA pads labels with 0)
PADDING_MODES = ("zeros", "border")
_MODES = ("bilinear", "nearest")


def _centred(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.arange(size, dtype=dtype, device=device) - (size - 1) / 2.0


def _three(size: Sequence[int], name: str) -> list[int]:
    sizes = [int(s) for s in size]
    if len(sizes) != 3:
        raise ValueError(f"{name} must have 3 entries, got {list(size)}")
    return sizes


def affine_grid(
    matrices: torch.Tensor,
    spatial_size: Sequence[int],
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    in_size: Sequence[int] | None = None,
) -> torch.Tensor:
    """``grid_sample`` grids ``[B, X, Y, Z, 3]`` of output -> input ``matrices`` ``[B, 3, 3]`` (centred voxels).

    ``spatial_size`` is the output's; ``in_size`` the input's when it differs (the two share their centre)."""
    if matrices.ndim != 3 or tuple(matrices.shape[1:]) != (3, 3):
        raise ValueError(f"matrices must be [B, 3, 3], got {tuple(matrices.shape)}")
    sizes = _three(spatial_size, "spatial_size")
    inputs = sizes if in_size is None else _three(in_size, "in_size")
    device = torch.device(device) if device is not None else matrices.device
    m = matrices.to(device=device, dtype=torch.float64)
    # normalised input coordinate e = sum_d m[e, d] c_d * 2 / max(2, in_size_e); grid_sample wants (z, y, x) last
    norm = torch.tensor([2.0 / max(2, s) for s in inputs], dtype=torch.float64, device=device)
    a = (m * norm[None, :, None])[:, [2, 1, 0], :]  # [B, 3 (grid component), 3 (output axis)]
    b = matrices.shape[0]
    terms = []
    for d, s in enumerate(sizes):
        shape = [b, 1, 1, 1, 3]
        shape[d + 1] = s
        terms.append((_centred(s, torch.float64, device)[None, :, None] * a[:, None, :, d]).to(dtype).view(shape))
    return terms[0] + terms[1] + terms[2]


def check_out_size(in_size: Sequence[int], out_size: Sequence[int]) -> list[int]:
    """``out_size`` as a list, after checking it is a centred region of ``in_size`` (even, non-negative margins)."""
    out = _three(out_size, "out_size")
    if any(i < o or (i - o) % 2 for i, o in zip(in_size, out)):
        raise ValueError(
            f"the output size {out} must be centred in the input size {list(in_size)}: each axis at most as large, "
            "with an even difference (the same margin on both sides)"
        )
    return out


def separable_axis(matrix: torch.Tensor) -> int | None:
    """The axis ``a`` along which ``matrix`` [3, 3] acts on its own (zero off-diagonals in row and column ``a``),
    preferring the one whose diagonal entry is 1 (no 1D pass); ``None`` when there is none."""
    m = matrix.tolist()  # nine Python floats: indexing the tensor element by element cost more than the resampling
    found = None
    for a in (0, 1, 2):
        others = [i for i in range(3) if i != a]
        if all(m[a][i] == 0 and m[i][a] == 0 for i in others):
            if m[a][a] == 1.0:
                return a
            found = a if found is None else found
    return found


def _interp_1d(x: torch.Tensor, dim: int, factor: float, mode: str, padding_mode: str,
               out: int | None = None) -> torch.Tensor:  # fmt: skip
    """Resample ``x`` along ``dim`` at input = ``factor`` * output (centred voxels), like ``grid_sample`` does,
    to ``out`` voxels (default: as many as the input)."""
    n = x.shape[dim]
    out = n if out is None else int(out)
    # grid_sample's unnormalisation with align_corners=False: ((g + 1) * n - 1) / 2
    g = _centred(out, torch.float64, x.device) * factor * (2.0 / max(2, n))
    src = (((g + 1.0) * n - 1.0) / 2.0).to(torch.float32)
    if padding_mode == "border":
        src = src.clamp(0, n - 1)
    if mode == "nearest":
        idx = torch.round(src).long()  # round half to even, as grid_sample's nearbyint
        valid = (idx >= 0) & (idx < n)
        result = x.index_select(dim, idx.clamp(0, n - 1))
        if not bool(valid.all()):
            shape = [1] * x.ndim
            shape[dim] = out
            result = result * valid.view(shape).to(result.dtype)
        return result
    i0 = torch.floor(src)
    w1 = src - i0
    i0 = i0.long()
    weights = torch.zeros(out, n, dtype=x.dtype, device=x.device)  # [out, in]
    rows = torch.arange(out, device=x.device)
    for idx, w in ((i0, 1.0 - w1), (i0 + 1, w1)):
        ok = (idx >= 0) & (idx < n)
        weights.index_put_((rows[ok], idx[ok]), w[ok].to(x.dtype), accumulate=True)
    return torch.movedim(torch.tensordot(weights, x, dims=([1], [dim])), 0, dim).contiguous()


def centre_crop(x: torch.Tensor | np.ndarray, size: int | Sequence[int]) -> torch.Tensor | np.ndarray:
    """Centre crop (a view) of the trailing ``len(size)`` axes (an int: the last ``min(3, ndim)`` axes); start =
    floor of half the excess. The one centre crop of tensors and arrays: the TRA's context, DeepMedic's label
    region and pathways (:func:`centre_crop_tensor` for tensors)."""
    n = min(3, x.ndim) if isinstance(size, (int, np.integer)) else len(size)
    size = [int(size)] * n if isinstance(size, (int, np.integer)) else [int(s) for s in size]
    if isinstance(x, torch.Tensor):
        return centre_crop_tensor(x, size)
    shape = list(x.shape[-n:]) if n else []
    starts = _crop_starts(shape, size)
    if shape == size:
        return x
    return x[(Ellipsis,) + tuple(slice(a, a + o) for a, o in zip(starts, size))]


def _crop_starts(shape: list[int], size: list[int]) -> list[int]:
    """Where the centred ``size`` starts in ``shape`` along each axis (floor of half the excess); refuses a crop
    larger than the shape. The arithmetic of both centre crops (TorchScript-able)."""
    starts: list[int] = []
    for s, o in zip(shape, size):
        if s < o:
            raise ValueError(f"cannot centre-crop spatial shape {shape} to the larger {size}")
        starts.append((s - o) // 2)
    return starts


def centre_crop_tensor(x: torch.Tensor, size: list[int]) -> torch.Tensor:
    """:func:`centre_crop` of a tensor to ``size`` (one entry per trailing axis), a view; TorchScript-able (a
    network's forward calls it: DeepMedic's pathways and residuals)."""
    n = len(size)
    shape = list(x.shape[x.dim() - n :])
    starts = _crop_starts(shape, size)
    for d in range(n):
        if shape[d] > size[d]:
            x = x.narrow(x.dim() - n + d, starts[d], size[d])
    return x


def _resample_factored(x: torch.Tensor, matrix: torch.Tensor, axis: int, mode: str, padding_mode: str,
                       out_size: Sequence[int]) -> torch.Tensor:  # fmt: skip
    """``x`` [1, C, X, Y, Z] resampled by a ``matrix`` acting within the plane normal to ``axis`` and along it,
    to the centred ``out_size``."""
    p, q = rotation_plane(axis)
    sizes = x.shape[2:]
    m2 = matrix[[p, q]][:, [p, q]].to(torch.float64)
    norm = torch.tensor([2.0 / max(2, sizes[p]), 2.0 / max(2, sizes[q])], dtype=torch.float64, device=x.device)
    a = (m2.to(x.device) * norm[:, None])[[1, 0], :]  # grid components (x = q, y = p) of the 2D grid
    cp = _centred(out_size[p], torch.float64, x.device)[:, None] * a[None, :, 0]
    cq = _centred(out_size[q], torch.float64, x.device)[:, None] * a[None, :, 1]
    grid = (cp.to(torch.float32)[:, None, :] + cq.to(torch.float32)[None, :, :])[None]  # [1, Op, Oq, 2]
    factor = float(matrix[axis, axis])
    if factor == 1.0 and sizes[axis] != out_size[axis]:  # no resampling along the axis: crop its slices first
        start = (sizes[axis] - out_size[axis]) // 2
        x = x.narrow(axis + 2, start, out_size[axis])
    n_axis = x.shape[axis + 2]
    # the slices along `axis` (and the channels) become the channels of one 2D grid_sample
    planes = torch.movedim(x[0], axis + 1, 1).reshape(1, -1, sizes[p], sizes[q])
    out = F.grid_sample(planes, grid.to(x.dtype), mode=mode, padding_mode=padding_mode, align_corners=False)
    out = torch.movedim(out.reshape(x.shape[1], n_axis, out_size[p], out_size[q]), 1, axis + 1)
    if factor != 1.0:
        out = _interp_1d(out, axis + 1, factor, mode, padding_mode, out=out_size[axis])
    return out.contiguous()[None]


def resample(
    x: torch.Tensor,
    matrices: torch.Tensor | None,
    mode: str = "bilinear",
    padding_mode: str = "zeros",
    grid: torch.Tensor | None = None,
    out_size: Sequence[int] | None = None,
) -> torch.Tensor:
    """Resample a batch ``x`` [B, C, X, Y, Z] (floating point), sample ``i`` by ``matrices[i]``.

    One ``grid_sample`` call for the whole batch (``grid`` may pass a prebuilt :func:`affine_grid` instead of
    ``matrices``); a single CPU volume whose matrix is separable (see the module docstring) takes the factored
    2D + 1D path instead. ``out_size``: the output's spatial size, centred on the input (default: the input's);
    each axis's margin ``in - out`` must be even and not negative, so an identity matrix gives an exact crop.
    """
    if mode not in _MODES or padding_mode not in PADDING_MODES:
        raise ValueError(
            f"mode must be in {_MODES} and padding_mode in {PADDING_MODES}, got {mode!r}, {padding_mode!r}"
        )
    if x.ndim != 5:
        raise ValueError(f"expected a batch of 3D volumes [B, C, X, Y, Z], got shape {tuple(x.shape)}")
    in_size = [int(s) for s in x.shape[2:]]
    out_size = in_size if out_size is None else check_out_size(in_size, out_size)
    if grid is None and x.device.type == "cpu" and x.shape[0] == 1:
        axis = separable_axis(matrices[0])
        if axis is not None:
            return _resample_factored(x, matrices[0], axis, mode, padding_mode, out_size)
    if grid is None:
        if matrices is None:
            raise ValueError("resample needs matrices or a grid")
        grid = affine_grid(matrices, out_size, x.device, x.dtype, in_size=in_size)
    return F.grid_sample(x, grid.to(x.dtype), mode=mode, padding_mode=padding_mode, align_corners=False)
