"""DeepMedic (Kamnitsas et al. 2017; the paper's "default config" variant) and valid-convolution tiling.

MONAI has no DeepMedic, so it is written here from the numbers in ``shared/DATASETS.md`` §7 (paper model =
DeepMedic default config):

* **Pathways.** A normal (full-resolution) pathway plus one subsampled context pathway per factor in
  ``subsample_factors`` (default ``(3, 5)``; ``(3,)`` gives the 2017 "original" layout, see
  :meth:`DeepMedic.original`). Each pathway has 8 unpadded 3³ convolutions with 30, 30, 40, 40, 40, 40, 50, 50
  feature maps and residual connections after layers 4, 6 and 8 (output of layer L + the centre-cropped input of
  layer L-1, missing channels zero-filled). Pathway receptive field: 1 + 8·2 = 17 voxels (low-res voxels for the
  context pathways, i.e. 51 / 85 full-resolution voxels).
* **Blocks.** Pre-activation: norm → activation → dropout → conv; the first block of each image pathway is a bare
  conv on the raw image. Norm = BatchNorm, activation = per-channel PReLU (MONAI ``get_norm_layer`` /
  ``get_act_layer`` factories), He (fan-in) initialisation. BN running statistics: an exponential moving average
  with momentum 2/61 (``bn_momentum``), the same mean age as the reference's 60-batch moving average.
* **Context.** Each context pathway reads a larger centred crop subsampled by taking every f-th voxel with no
  smoothing, like the reference sampler (``subsample_mode="strided"``, the default; ``"avg"`` average-pools f³
  blocks instead); its output is upsampled ×f by repetition (nearest)
  and centre-cropped to the normal output, then all pathways are concatenated (50·(1+#factors) channels).
* **"FC" layers.** 250, 250 feature maps, the first with a 3³ kernel and mirror (reflect) padding, then 1³,
  residual at FC layer 2; dropout on the inputs of the FC layers and the classifier = (0, 0.5, 0.5); a final 1³
  conv classifier returns logits (no softmax).

**Input/output contract.** ``forward(x)`` takes one patch ``[B, C_in, *input_size]`` that contains the whole
context. The module crops the central ``segment_size`` (37³) region for the normal pathway and the central
context crop of each subsampled pathway itself, and returns logits ``[B, C_out, *output_size]`` for the central
``output_size = segment_size - 16`` (21³) voxels. A single large patch (rather than separate normal/context inputs)
keeps the pathways geometrically aligned by construction and lets every MONAI crop/sampler transform treat the
model like any other network: sample ``input_size`` patches and crop labels with :func:`crop_label_to_output`.

The margin ``(input_size - output_size) / 2`` is a constant of the architecture (44 voxels for factors (3, 5),
26 for (3,)), so ``output_size_for(s) = s - 2·margin`` for any input size. The context grid is centred on the output
region: a pathway with factor f predicts ``ceil(out / f)`` low-res voxels (one more when needed to make the excess
even) and the upsampled map is cropped symmetrically (the reference cuts only trailing voxels). For the default
21³ output this gives exactly the reference's low-res pathway inputs (23³ for ×3, 21³ for ×5, covering 69³ and
105³), i.e. ``input_size`` 109³ whose outer 2 voxels per side are unused at this output size; the constant margin is
what makes the output size a simple function of the input size for all output sizes.
"""

from __future__ import annotations

import logging
import math
import numbers
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from monai.inferers import Inferer
from monai.networks.layers import Conv
from monai.networks.layers.utils import get_act_layer, get_norm_layer

from jcsaug.ops.resample import centre_crop, centre_crop_tensor  # the package's centre crop (re-exported here)

logger = logging.getLogger(__name__)
#: how a context pathway subsamples its crop: every f-th voxel (the reference), or f³ average pooling
SUBSAMPLE_MODES = ("strided", "avg")

__all__ = [
    "DeepMedic",
    "ValidConvSlidingWindowInferer",
    "centre_crop",
    "crop_label_to_output",
    "deepmedic_margin",
]

SizeLike = int | Sequence[int]

#: BatchNorm momentum approximating the reference's BN inference statistics, a simple moving average over the last
#: 60 batches (``shared/DATASETS.md`` §7). PyTorch's BN only keeps an exponential moving average (or, with
#: ``momentum=None``, the cumulative average), not a 60-slot buffer; an EMA with momentum m weights a batch k steps
#: old by m(1-m)^k, mean age (1-m)/m, which equals the 60-batch window's mean age (60-1)/2 for m = 2/(60+1).
DEFAULT_BN_MOMENTUM = 2 / (60 + 1)

DEFAULT_FEATURE_MAPS = (30, 30, 40, 40, 40, 40, 50, 50)
DEFAULT_RESIDUAL_LAYERS = (4, 6, 8)


def _as_tuple(value: SizeLike, n: int, what: str = "size") -> tuple[int, ...]:
    if isinstance(value, (int, np.integer)):
        return (int(value),) * n
    out = tuple(int(v) for v in value)
    if len(out) != n:
        raise ValueError(f"{what} {tuple(value)} must have {n} entries")
    return out


def crop_label_to_output(label: torch.Tensor | np.ndarray, output_size: SizeLike) -> torch.Tensor | np.ndarray:
    """Centre-crop a label (``[..., *spatial]``, tensor or array) to a valid-convolution network's output region.

    ``output_size`` is one size per spatial axis (the trailing ``len(output_size)`` axes are cropped) or an int for
    an isotropic 3D crop of the last three axes. DeepMedic's output region is the centre of its input patch, so this
    aligns label and logits.
    """
    return centre_crop(label, output_size)


def _lowres_output(out: int, factor: int) -> tuple[int, int]:  # TorchScript: called from DeepMedic.forward
    """Low-res output size ``n`` of a ×``factor`` pathway and the leading crop ``a`` of its upsampled map.

    ``n = ceil(out / factor)``, plus one when ``factor * n - out`` is odd, so the excess is even and the
    upsampled map (``factor * n`` voxels) can be cropped symmetrically: ``a = (factor * n - out) / 2 <= factor - 1``.
    """
    n = math.ceil(out / factor)
    if (factor * n - out) % 2:
        n += 1
    return n, (factor * n - out) // 2


def deepmedic_margin(shrink: int, subsample_factors: Sequence[int]) -> int:
    """Constant per-side margin ``(input - output) / 2`` of a DeepMedic whose pathways shrink by ``shrink`` voxels.

    Normal pathway: ``shrink / 2``; a ×f pathway needs ``f * shrink / 2`` plus at most ``f - 1`` for centring.
    """
    return max([shrink // 2] + [f * shrink // 2 + f - 1 for f in subsample_factors])


def _check_bn_momentum(momentum: Any, norm: str | tuple | None) -> None:
    """ValueError unless ``momentum`` is ``None`` or a real number in (0, 1] and ``norm`` sets no momentum itself."""
    ok = momentum is None or (
        isinstance(momentum, numbers.Real) and not isinstance(momentum, bool) and 0 < float(momentum) <= 1
    )
    if not ok:
        raise ValueError(f"DeepMedic bn_momentum must be in (0, 1] or None (cumulative average), got {momentum!r}")
    if isinstance(norm, (tuple, list)) and len(norm) > 1 and "momentum" in dict(norm[1]):
        raise ValueError("DeepMedic: give the BatchNorm momentum as bn_momentum, not inside norm")


def _make_act(act: str | tuple | None, channels: int) -> nn.Module:
    if act is None:
        return nn.Identity()
    name, args = (act, {}) if isinstance(act, str) else (act[0], dict(act[1]) if len(act) > 1 else {})
    if str(name).lower() == "prelu":
        args.setdefault("num_parameters", channels)  # one slope per feature map, as in DeepMedic
    return get_act_layer((name, args))


class _PreActBlock(nn.Module):
    """norm → activation → dropout → conv (DeepMedic's pre-activation block); optional reflect padding."""

    def __init__(
        self,
        spatial_dims: int,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        *,
        norm: str | tuple | None,
        act: str | tuple | None,
        dropout: float = 0.0,
        mirror_pad: bool = False,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.norm = get_norm_layer(norm, spatial_dims, in_channels) if norm is not None else nn.Identity()
        self.act = _make_act(act, in_channels)
        self.drop = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.conv = Conv[Conv.CONV, spatial_dims](in_channels, out_channels, kernel_size, bias=bias)
        self.pad = (kernel_size - 1) // 2 if mirror_pad else 0
        self.spatial_dims = spatial_dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.act(self.norm(x)))
        if self.pad > 0:
            small = min(x.shape[2:]) <= self.pad  # reflect needs pad < size; fall back to edge replication
            x = F.pad(x, [self.pad] * (2 * self.spatial_dims), mode="replicate" if small else "reflect")
        return self.conv(x)


def _add_residual(out: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    """``out`` + centre-cropped ``skip``; missing skip channels are zero (extra skip channels are dropped)."""
    skip = centre_crop_tensor(skip, out.shape[2:])
    c_out, c_skip = out.shape[1], skip.shape[1]
    if c_skip >= c_out:
        return out + skip[:, :c_out]
    return torch.cat([out[:, :c_skip] + skip, out[:, c_skip:]], dim=1)


class _Pathway(nn.Module):
    """Unpadded conv stack with DeepMedic residuals (layer L gets the input of layer L-1; 1-based)."""

    def __init__(
        self,
        spatial_dims: int,
        in_channels: int,
        feature_maps: Sequence[int],
        kernel_sizes: Sequence[int],
        residual_layers: Sequence[int],
        norm: str | tuple | None,
        act: str | tuple | None,
    ) -> None:
        super().__init__()
        blocks = []
        for i, (c_out, k) in enumerate(zip(feature_maps, kernel_sizes)):
            c_in = in_channels if i == 0 else feature_maps[i - 1]
            first = i == 0  # raw image in: no norm/activation before the first conv
            blocks.append(
                _PreActBlock(
                    spatial_dims,
                    c_in,
                    c_out,
                    k,
                    norm=None if first else norm,
                    act=None if first else act,
                    bias=norm is None,
                )
            )
        self.blocks = nn.ModuleList(blocks)
        self.residual_layers = tuple(int(r) for r in residual_layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inputs: list[torch.Tensor] = []
        for i, block in enumerate(self.blocks):
            inputs.append(x)
            x = block(x)
            if (i + 1) in self.residual_layers:
                x = _add_residual(x, inputs[max(i - 1, 0)])
        return x


class DeepMedic(nn.Module):
    """DeepMedic: a normal and subsampled context pathways of valid 3³ convs, fused by 1³ ("FC") convs.

    Args:
        in_channels: image channels.
        out_channels: classes (logits are returned; apply softmax outside).
        segment_size: normal-pathway input size (DeepMedic's "segment"; 37 → 21³ output). Only sets the default
            ``input_size``/``output_size``; ``forward`` accepts any input size larger than ``2 * margin``.
        feature_maps: feature maps per conv layer of the normal pathway.
        kernel_sizes: conv kernel size per layer (int = all layers; odd).
        residual_layers: 1-based layers receiving a residual from the input of the previous layer.
        subsample_factors: one context pathway per (odd) factor; ``()`` gives a normal-pathway-only network.
        subsampled_feature_maps: feature maps of the context pathways (default: same as ``feature_maps``).
        subsample_mode: ``"strided"`` (centre voxel of each block, like the reference sampler, which takes every
            f-th voxel without smoothing; ``shared/DATASETS.md`` §7) or ``"avg"`` (average pooling f³ blocks).
        fc_feature_maps: hidden "fully connected" layers after concatenation.
        fc_kernel_sizes: their kernel sizes (>1 is mirror-padded, size-preserving).
        fc_residual_layers: 1-based FC layers receiving a residual (from the input of the previous FC layer).
        dropout: dropout on the inputs of each FC layer and the classifier (``len(fc_feature_maps) + 1`` values), or
            one float p meaning ``(0, p, ..., p)``.
        norm: MONAI norm name/tuple (default BatchNorm, as DeepMedic); ``None`` disables it (convs get biases).
        bn_momentum: momentum of every BatchNorm's running statistics, in (0, 1]; default 2/61, an EMA as old on
            average as the reference's 60-batch moving average (:data:`DEFAULT_BN_MOMENTUM`); ``None``: PyTorch's
            cumulative average. (A ``momentum`` inside ``norm`` is refused: give it here.)
        act: MONAI activation name/tuple (default per-channel PReLU, as DeepMedic).
        spatial_dims: 3 (or 2).
    """

    #: Python-side geometry, not part of the TorchScript network (``torch.jit.script`` would compile properties)
    __jit_unused_properties__ = ["output_size", "input_size", "receptive_fields"]

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        segment_size: SizeLike = 37,
        feature_maps: Sequence[int] = DEFAULT_FEATURE_MAPS,
        kernel_sizes: SizeLike = 3,
        residual_layers: Sequence[int] = DEFAULT_RESIDUAL_LAYERS,
        subsample_factors: Sequence[int] = (3, 5),
        subsampled_feature_maps: Sequence[int] | None = None,
        subsample_mode: str = "strided",
        fc_feature_maps: Sequence[int] = (250, 250),
        fc_kernel_sizes: Sequence[int] = (3, 1),
        fc_residual_layers: Sequence[int] = (2,),
        dropout: float | Sequence[float] = (0.0, 0.5, 0.5),
        norm: str | tuple | None = "batch",
        act: str | tuple | None = "prelu",
        spatial_dims: int = 3,
        bn_momentum: float | None = DEFAULT_BN_MOMENTUM,
    ) -> None:
        super().__init__()
        _check_bn_momentum(bn_momentum, norm)
        n_layers = len(feature_maps)
        kernels = _as_tuple(kernel_sizes, n_layers, "kernel_sizes")
        if any(k % 2 == 0 or k < 1 for k in kernels + tuple(fc_kernel_sizes)):
            raise ValueError("kernel sizes must be odd and positive")
        factors = tuple(int(f) for f in subsample_factors)
        if any(f < 2 or f % 2 == 0 for f in factors):
            raise ValueError(f"subsample factors must be odd integers >= 3 (centred grids), got {factors}")
        if subsample_mode not in SUBSAMPLE_MODES:
            raise ValueError(f"subsample_mode must be one of {SUBSAMPLE_MODES}, got {subsample_mode!r}")
        if len(fc_kernel_sizes) != len(fc_feature_maps):
            raise ValueError("fc_kernel_sizes needs one entry per fc_feature_maps entry")
        n_fc = len(fc_feature_maps) + 1
        drops = (0.0,) + (float(dropout),) * (n_fc - 1) if isinstance(dropout, (int, float)) else tuple(dropout)
        if len(drops) != n_fc:
            raise ValueError(f"dropout needs {n_fc} values (FC layers + classifier), got {len(drops)}")
        sub_fms = tuple(subsampled_feature_maps) if subsampled_feature_maps is not None else tuple(feature_maps)
        if len(sub_fms) != n_layers:
            raise ValueError("subsampled_feature_maps must have as many layers as feature_maps")

        self.spatial_dims = spatial_dims
        self.in_channels, self.out_channels = in_channels, out_channels
        self.subsample_factors = factors
        self.subsample_mode = subsample_mode
        self.shrink = sum(k - 1 for k in kernels)  # voxels lost per axis by each pathway (= RF - 1)
        self.margin = deepmedic_margin(self.shrink, factors)
        self.segment_size = _as_tuple(segment_size, spatial_dims, "segment_size")
        if any(s <= self.shrink for s in self.segment_size):
            raise ValueError(f"segment_size {self.segment_size} must exceed the pathway shrinkage {self.shrink}")

        self.normal = _Pathway(spatial_dims, in_channels, feature_maps, kernels, residual_layers, norm, act)
        self.context = nn.ModuleList(
            _Pathway(spatial_dims, in_channels, sub_fms, kernels, residual_layers, norm, act) for _ in factors
        )
        fc_in = feature_maps[-1] + len(factors) * sub_fms[-1]
        fc_blocks = []
        channels = [fc_in, *fc_feature_maps]
        for i, (c_out, k) in enumerate(zip(fc_feature_maps, fc_kernel_sizes)):
            fc_blocks.append(
                _PreActBlock(
                    spatial_dims,
                    channels[i],
                    c_out,
                    int(k),
                    norm=norm,
                    act=act,
                    dropout=drops[i],
                    mirror_pad=True,
                    bias=norm is None,
                )
            )
        self.fc = nn.ModuleList(fc_blocks)
        self.fc_residual_layers = tuple(int(r) for r in fc_residual_layers)
        self.classifier = _PreActBlock(
            spatial_dims, channels[-1], out_channels, 1, norm=norm, act=act, dropout=drops[-1], bias=True
        )
        self._default_input = list(self.input_size)  # named by the error of a too small input
        self._init_weights()
        for m in self.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.momentum = None if bn_momentum is None else float(bn_momentum)

    @classmethod
    def original(cls, in_channels: int, out_channels: int, segment_size: SizeLike = 25, **kwargs) -> DeepMedic:
        """The 2017 "original" config: one ×3 context pathway, no residuals, FC 150, 150 (1³), segments 25³."""
        defaults = dict(
            subsample_factors=(3,),
            residual_layers=(),
            fc_feature_maps=(150, 150),
            fc_kernel_sizes=(1, 1),
            fc_residual_layers=(),
        )
        return cls(in_channels, out_channels, segment_size, **{**defaults, **kwargs})

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Conv3d)):
                nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")  # He, gain sqrt(2)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    # ---- geometry ---------------------------------------------------------------------------------------------
    @property
    def output_size(self) -> tuple[int, ...]:
        """Spatial size of the logits for the default ``segment_size`` (21³ for 37³)."""
        return tuple(s - self.shrink for s in self.segment_size)

    @property
    def input_size(self) -> tuple[int, ...]:
        """Spatial size of the patch ``forward`` expects for the default output (109³ for factors (3, 5))."""
        return self.input_size_for(self.output_size)

    def input_size_for(self, output_size: SizeLike) -> tuple[int, ...]:
        """Input patch size that yields ``output_size`` logits: ``output + 2 * margin``."""
        return tuple(o + 2 * self.margin for o in _as_tuple(output_size, self.spatial_dims, "output_size"))

    def output_size_for(self, input_size: SizeLike) -> tuple[int, ...]:
        """Logit size for an input patch: ``input - 2 * margin`` (ValueError if too small)."""
        return tuple(self._output_size(list(_as_tuple(input_size, self.spatial_dims, "input_size"))))

    @property
    def receptive_fields(self) -> dict[str, int]:
        """Per-pathway receptive field in full-resolution voxels (conv layers only; a k³ FC layer adds k-1)."""
        rf = self.shrink + 1
        fields = {"normal": rf}
        fields.update({f"x{f}": rf * f for f in self.subsample_factors})
        return fields

    def crop_to_output(self, label: torch.Tensor | np.ndarray, input_size: SizeLike | None = None):
        """Centre-crop a label patch of ``input_size`` (default: its own size) to this network's output region."""
        size = tuple(label.shape[-self.spatial_dims :]) if input_size is None else input_size
        return crop_label_to_output(label, self.output_size_for(size))

    # ---- checkpoints: the subsampling is no parameter, but a checkpoint is only the same network with it --------
    def get_extra_state(self) -> dict:
        """Saved as ``_extra_state`` in the state dict: how the context pathways subsample (no weights tell)."""
        return {"subsample_mode": self.subsample_mode}

    def set_extra_state(self, state: Any) -> None:
        """Take the checkpoint's subsampling: its weights were trained with it."""
        mode = state.get("subsample_mode") if isinstance(state, dict) else None
        if mode not in SUBSAMPLE_MODES:
            raise ValueError(f"DeepMedic state: subsample_mode must be one of {SUBSAMPLE_MODES}, got {state!r}")
        if mode != self.subsample_mode:
            logger.info("DeepMedic: subsample_mode %r of the checkpoint replaces %r", mode, self.subsample_mode)
        self.subsample_mode = mode

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:  # fmt: skip
        key = prefix + "_extra_state"
        legacy = key not in state_dict
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if legacy:  # saved before the mode was recorded, when average pooling was the only default
            if key in missing_keys:
                missing_keys.remove(key)
            if self.subsample_mode != "avg":
                warnings.warn(
                    "DeepMedic checkpoint without its subsample_mode (saved before it was recorded): loaded with "
                    "'avg', the default it was trained with",
                    stacklevel=2,
                )
            self.subsample_mode = "avg"

    # ---- forward ----------------------------------------------------------------------------------------------
    def _subsample(self, x: torch.Tensor, f: int) -> torch.Tensor:
        if self.subsample_mode == "avg":
            return F.avg_pool3d(x, f, f) if self.spatial_dims == 3 else F.avg_pool2d(x, f, f)
        a = f // 2  # the centre voxel of each f-wide block (a view, as every f-th voxel)
        return x[:, :, a::f, a::f, a::f] if self.spatial_dims == 3 else x[:, :, a::f, a::f]

    def _output_size(self, input_size: list[int]) -> list[int]:
        """:meth:`output_size_for` of ``forward`` (TorchScript: a list in, a list out)."""
        out = [s - 2 * self.margin for s in input_size]
        if min(out) < 1:
            raise ValueError(
                f"input size {input_size} too small for DeepMedic: need > {2 * self.margin} voxels per axis "
                f"(margin {self.margin}); the default input is {self._default_input}"
            )
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[B, C_in, *input_size]`` → logits ``[B, C_out, *output_size_for(input_size)]``.

        Written for TorchScript (``torch.jit.script``, MONAI's ``ckpt_export`` without ``--use_trace``), so the
        exported network takes any input size as this one does."""
        out = self._output_size(list(x.shape[2:]))
        feats = [self.normal(centre_crop_tensor(x, [o + self.shrink for o in out]))]
        for k, pathway in enumerate(self.context):
            f = self.subsample_factors[k]
            low_out: list[int] = []
            lead: list[int] = []
            for o in out:
                n, a = _lowres_output(o, f)
                low_out.append(n)
                lead.append(a)
            crop = centre_crop_tensor(x, [f * (n + self.shrink) for n in low_out])
            h = pathway(self._subsample(crop, f))  # [B, C, *low_out]
            for d in range(self.spatial_dims):  # nearest ×f upsampling, cropped to the output axis by axis
                h = h.repeat_interleave(f, dim=2 + d).narrow(2 + d, lead[d], out[d])
            feats.append(h)
        h = torch.cat(feats, dim=1)
        fc_inputs: list[torch.Tensor] = []
        for i, block in enumerate(self.fc):
            fc_inputs.append(h)
            h = block(h)
            if (i + 1) in self.fc_residual_layers:
                h = _add_residual(h, fc_inputs[max(i - 1, 0)])
        return self.classifier(h)


def _first_head(pred: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    return pred[0] if isinstance(pred, (list, tuple)) else pred


def _pad_axis(x: torch.Tensor, axis: int, lo: int, hi: int, mode: str, value: float) -> torch.Tensor:
    """Pad one spatial axis (``axis`` counted from the first spatial axis); reflect repeats for large pads."""
    nd = x.ndim - 2
    while lo > 0 or hi > 0:
        size = x.shape[2 + axis]
        if mode == "reflect" and size > 1:
            step_lo, step_hi = min(lo, size - 1), min(hi, size - 1)
            m = "reflect"
        else:
            step_lo, step_hi = lo, hi
            m = "replicate" if mode in ("reflect", "replicate") else "constant"
        pads = [0] * (2 * nd)
        pads[2 * (nd - 1 - axis)], pads[2 * (nd - 1 - axis) + 1] = step_lo, step_hi
        x = F.pad(x, pads, mode=m, value=value) if m == "constant" else F.pad(x, pads, mode=m)
        lo, hi = lo - step_lo, hi - step_hi
    return x


class ValidConvSlidingWindowInferer(Inferer):
    """Sliding-window inference for networks whose output is the centre of their input (valid convolutions).

    The volume is padded by ``margin = (roi_size - output_size) / 2`` per side, windows of ``roi_size`` are run
    whose *outputs* (``output_size``) tile the volume without gaps (the last window per axis is shifted back to end
    at the border, overlapping its neighbour, whose values it overwrites), and the logits are stitched to the input
    volume's spatial size. MONAI's ``SlidingWindowInferer`` cannot do this: it assumes each window's output covers
    the same region as its input (an output of another size is read as a different resolution and resampled onto
    the whole window), so there is no way to express the valid-convolution margin; hence this hand-written loop.

    Args:
        roi_size: network input window (e.g. ``DeepMedic.input_size_for(29)`` = 117³ for the reference's 45³
            inference segments).
        output_size: logits per window (``roi_size - 2 * margin``).
        sw_batch_size: windows per network call.
        padding_mode: ``"reflect"`` (mirror, as DeepMedic), ``"replicate"`` or ``"constant"``.
        cval: fill value for constant padding.
    """

    def __init__(
        self,
        roi_size: SizeLike,
        output_size: SizeLike,
        sw_batch_size: int = 1,
        padding_mode: str = "reflect",
        cval: float = 0.0,
    ) -> None:
        super().__init__()
        sized = [v for v in (roi_size, output_size) if not isinstance(v, (int, np.integer))]
        n = len(sized[0]) if sized else 3  # ints mean an isotropic 3D window
        self.roi_size = _as_tuple(roi_size, n, "roi_size")
        self.output_size = _as_tuple(output_size, n, "output_size")
        diff = [r - o for r, o in zip(self.roi_size, self.output_size)]
        if any(d < 0 or d % 2 for d in diff):
            raise ValueError(f"roi_size {self.roi_size} - output_size {self.output_size} must be even and >= 0")
        if padding_mode not in ("reflect", "replicate", "constant"):
            raise ValueError(f"unknown padding_mode {padding_mode!r}")
        self.margin = tuple(d // 2 for d in diff)
        self.sw_batch_size = int(sw_batch_size)
        self.padding_mode = padding_mode
        self.cval = float(cval)

    @classmethod
    def for_network(
        cls, network: DeepMedic, output_size: SizeLike | None = None, **kwargs
    ) -> ValidConvSlidingWindowInferer:
        """Inferer matching a :class:`DeepMedic` (default window: its training output size)."""
        out = network.output_size if output_size is None else _as_tuple(output_size, network.spatial_dims)
        return cls(network.input_size_for(out), out, **kwargs)

    @staticmethod
    def _starts(size: int, step: int) -> list[int]:
        starts = list(range(0, size - step + 1, step))
        if starts[-1] + step < size:
            starts.append(size - step)
        return starts

    def __call__(
        self, inputs: torch.Tensor, network: Callable[..., torch.Tensor | Sequence[torch.Tensor]], *args, **kwargs
    ) -> torch.Tensor:
        """``inputs`` ``[B, C, *spatial]`` → logits ``[B, C_out, *spatial]`` (first head of list/tuple outputs)."""
        spatial = tuple(inputs.shape[2:])
        if len(spatial) != len(self.roi_size):
            raise ValueError(f"inputs have {len(spatial)} spatial axes, roi_size {len(self.roi_size)}")
        padded_size = tuple(max(s, o) for s, o in zip(spatial, self.output_size))  # tiny volumes: pad up to 1 tile
        x = inputs
        for axis, (m, s, p) in enumerate(zip(self.margin, spatial, padded_size)):
            x = _pad_axis(x, axis, m, m + p - s, self.padding_mode, self.cval)
        grids = [self._starts(p, o) for p, o in zip(padded_size, self.output_size)]
        starts = [
            tuple(int(v) for v in s) for s in np.stack(np.meshgrid(*grids, indexing="ij"), -1).reshape(-1, len(grids))
        ]
        batch = inputs.shape[0]
        result: torch.Tensor | None = None
        for i in range(0, len(starts), self.sw_batch_size):
            chunk = starts[i : i + self.sw_batch_size]
            windows = [x[(Ellipsis,) + tuple(slice(s, s + r) for s, r in zip(st, self.roi_size))] for st in chunk]
            pred = _first_head(network(torch.cat(windows, dim=0), *args, **kwargs))
            if tuple(pred.shape[2:]) != self.output_size:
                raise ValueError(f"network output {tuple(pred.shape[2:])} != output_size {self.output_size}")
            if result is None:
                result = pred.new_zeros((batch, pred.shape[1], *padded_size))
            for j, st in enumerate(chunk):
                index = (slice(None), slice(None)) + tuple(slice(s, s + o) for s, o in zip(st, self.output_size))
                result[index] = pred[j * batch : (j + 1) * batch]
        assert result is not None
        return result[(slice(None), slice(None)) + tuple(slice(0, s) for s in spatial)]
