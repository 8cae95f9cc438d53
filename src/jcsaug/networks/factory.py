"""Networks by name: ``deepmedic`` (ours), ``unet3d`` (MONAI ``DynUNet``, nnU-Net-like) and ``transformer``
(MONAI ``SwinUNETR``, or ``UNETR`` when SwinUNETR cannot take the patch: an axis not divisible by 32, or 32³).

Each kind is a :class:`NetworkSpec` in a registry (``register_network``, ``get_network``, ``list_networks``) that
also carries the kind's defaults: training loss, TEA z, initial TRA preset, default patch, whether it plans from the
voxel spacing, how its patch sizes relate and which whole-volume inferer it uses. Nothing else in the package or the
bundles asks which network it has.

``make_network(name, in_channels, out_channels, patch_size, **kwargs)`` builds one; ``patch_size`` is the training
patch of the U-Net/transformer and the normal-pathway *segment* of DeepMedic (37³ in the paper → logits 21³ from a
109³ input patch). ``network_patch_sizes(name, patch_size)`` tells a pipeline which patch to sample and which
centre region of the label the logits cover.

**Deep supervision (``unet3d``).** MONAI's ``DynUNet`` returns, in training mode with ``deep_supervision=True``,
one stacked tensor ``[B, S+1, C, *spatial]``: index 0 is the full-resolution head and 1..S the auxiliary heads,
already *interpolated to full resolution*; in eval mode it returns only ``[B, C, *spatial]``. The project's losses
read list/tuple outputs through ``jcsaug.engine.losses.main_output`` (first head), so by default the factory's
:class:`NnUNetDynUNet` unbinds the stack into a tuple ``(main, aux_1, ..., aux_S)``; training code that wants the
nnU-Net loss sums each head's loss against the full-resolution label with weights
:func:`deep_supervision_weights` (1/2^k, normalised). Pass ``stacked_deep_supervision=True`` to get DynUNet's raw
stacked tensor instead, and split it with :func:`split_deep_supervision`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
from monai.inferers import Inferer, SlidingWindowInferer
from monai.networks.nets import UNETR, DynUNet, SwinUNETR
from monai.utils import optional_import

from jcsaug.networks.deepmedic import DeepMedic, ValidConvSlidingWindowInferer
from jcsaug.registry import Registry

__all__ = [
    "NETWORKS",
    "NetworkSpec",
    "NnUNetDynUNet",
    "deep_supervision_weights",
    "get_network",
    "list_networks",
    "make_network",
    "network_patch_sizes",
    "nnunet_kernels_strides",
    "register_network",
    "split_deep_supervision",
]

SizeLike = int | Sequence[int]


def _patch(patch_size: SizeLike) -> tuple[int, ...]:
    return (int(patch_size),) * 3 if isinstance(patch_size, int) else tuple(int(p) for p in patch_size)


def nnunet_kernels_strides(
    patch_size: SizeLike,
    spacing: Sequence[float] | None = None,
    min_feature_map_size: int = 4,
    max_pools_per_axis: int = 5,
) -> tuple[list[list[int]], list[list[int]]]:
    """nnU-Net-style ``(kernel_sizes, strides)`` for ``DynUNet`` from the patch size (and optional voxel spacing).

    At each level an axis is downsampled (stride 2) while its size is ≥ ``2 * min_feature_map_size`` (8), its
    spacing is < 2× the current smallest spacing, and it has been pooled fewer than ``max_pools_per_axis`` (5)
    times. Kernels are 3 on the largest group of axes whose spacings are within a factor 2 of each other (all
    axes for isotropic data), 1 elsewhere; the bottleneck is all-3. ``strides[0]`` is 1 (input block).
    """
    size = list(_patch(patch_size))
    dims = len(size)
    sp = [float(s) for s in spacing] if spacing is not None else [1.0] * dims
    if len(sp) != dims:
        raise ValueError(f"spacing {tuple(sp)} must have {dims} entries")
    pools = [0] * dims
    kernels: list[list[int]] = []
    strides: list[list[int]] = [[1] * dims]
    while True:
        group = max(([j for j in range(dims) if sp[j] / sp[i] < 2 and sp[i] / sp[j] < 2] for i in range(dims)), key=len)
        kernel = [3 if j in group else 1 for j in range(dims)]
        smallest = min(sp)
        poolable = [
            j
            for j in range(dims)
            if sp[j] / smallest < 2 and size[j] >= 2 * min_feature_map_size and pools[j] < max_pools_per_axis
        ]
        if not poolable:
            break
        kernels.append(kernel)
        strides.append([2 if j in poolable else 1 for j in range(dims)])
        for j in poolable:
            size[j] = math.ceil(size[j] / 2)
            sp[j] *= 2
            pools[j] += 1
    kernels.append([3] * dims)
    return kernels, strides


def deep_supervision_weights(n_heads: int) -> list[float]:
    """nnU-Net head weights 1, 1/2, 1/4, ... normalised to sum 1 (head 0 = full resolution)."""
    w = [0.5**k for k in range(n_heads)]
    return [v / sum(w) for v in w]


def split_deep_supervision(pred: torch.Tensor | Sequence[torch.Tensor], n_spatial: int = 3) -> list[torch.Tensor]:
    """Heads of a deep-supervision output: a list/tuple as is, DynUNet's stacked ``[B, S+1, C, ...]`` unbound
    along dim 1, a plain ``[B, C, ...]`` tensor as a one-element list."""
    if isinstance(pred, (list, tuple)):
        return list(pred)
    if pred.ndim == n_spatial + 3:
        return list(torch.unbind(pred, dim=1))
    return [pred]


class NnUNetDynUNet(DynUNet):
    """``DynUNet`` whose training-mode deep-supervision output is a tuple ``(main, aux_1, ...)`` (not stacked).

    Same parameters and ``state_dict`` keys as ``DynUNet``; ``stacked_deep_supervision=True`` restores the stacked
    tensor ``[B, S+1, C, ...]``. Eval mode returns ``[B, C, ...]`` either way. ``torch.jit.script`` compiles its
    inference network (:meth:`__prepare_scriptable__`).
    """

    def __init__(self, *args, stacked_deep_supervision: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stacked_deep_supervision = stacked_deep_supervision
        self._dynunet_arguments = inspect.signature(DynUNet).bind(*args, **kwargs).arguments  # for the script

    def __prepare_scriptable__(self) -> DynUNet:
        """What ``torch.jit.script`` (MONAI's ``ckpt_export``) compiles: the inference network, a ``DynUNet``
        without the deep-supervision heads (used in training only; MONAI's ``DynUNet`` cannot script them), with
        this network's weights, mode and device. It predicts what this network predicts in eval mode, at any input
        size the strides divide."""
        plain = DynUNet(**{**self._dynunet_arguments, "deep_supervision": False, "deep_supr_num": 1})
        missing, unexpected = plain.load_state_dict(self.state_dict(), strict=False)
        heads = ("deep_supervision_heads.", ".super_head.")  # the heads and the skip layers' references to them
        if missing or any(not any(h in f".{key}" for h in heads) for key in unexpected):
            raise RuntimeError(f"NnUNetDynUNet: the inference network does not match ({missing}, {unexpected})")
        parameter = next(self.parameters())
        return plain.to(device=parameter.device, dtype=parameter.dtype).train(self.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        out = super().forward(x)
        if self.training and self.deep_supervision and not self.stacked_deep_supervision:
            return tuple(torch.unbind(out, dim=1))
        return out


def build_unet3d(
    in_channels: int,
    out_channels: int,
    patch_size: SizeLike,
    spacing: Sequence[float] | None = None,
    base_filters: int = 32,
    max_filters: int = 320,
    deep_supervision: bool = True,
    deep_supr_num: int | None = None,
    stacked_deep_supervision: bool = False,
    **kwargs,
) -> NnUNetDynUNet:
    """nnU-Net-like ``DynUNet``: kernels/strides from :func:`nnunet_kernels_strides`, filters 32·2^k ≤ 320,
    instance norm + leaky ReLU (DynUNet defaults), deep supervision on all decoder levels but the lowest
    (``deep_supr_num = #pools - 2``, at least 1), as nnU-Net (whose lowest head has weight 0)."""
    patch = _patch(patch_size)
    kernels, strides = nnunet_kernels_strides(patch, spacing)
    n_pools = len(strides) - 1
    if n_pools < 1:
        raise ValueError(f"patch {patch} too small for a U-Net: some axis needs >= 8 voxels")
    total = [math.prod(s[d] for s in strides) for d in range(len(patch))]
    if any(p % t for p, t in zip(patch, total)):
        fixed = tuple(math.ceil(p / t) * t for p, t in zip(patch, total))
        raise ValueError(f"patch {patch} must be divisible by the total strides {tuple(total)}; use e.g. {fixed}")
    if deep_supr_num is None:
        deep_supr_num = max(1, n_pools - 2)
    deep_supervision = deep_supervision and n_pools > 1
    filters = [min(base_filters * 2**k, max_filters) for k in range(len(strides))]
    return NnUNetDynUNet(
        spatial_dims=len(patch),
        in_channels=in_channels,
        out_channels=out_channels,
        kernel_size=kernels,
        strides=strides,
        upsample_kernel_size=strides[1:],
        filters=filters,
        deep_supervision=deep_supervision,
        deep_supr_num=min(deep_supr_num, n_pools - 1) if deep_supervision else 1,
        stacked_deep_supervision=stacked_deep_supervision,
        **kwargs,
    )


def build_transformer(
    in_channels: int, out_channels: int, patch_size: SizeLike, kind: str = "auto", **kwargs
) -> nn.Module:
    """MONAI ``SwinUNETR`` (every patch axis divisible by 32, not 32³) or else ``UNETR`` (divisible by 16).

    ``kind`` = ``"auto"``, ``"swinunetr"`` or ``"unetr"``; other kwargs go to the MONAI class. The paper used
    nnFormer, which MONAI lacks; SwinUNETR is the closest MONAI transformer U-Net.
    """
    if not optional_import("einops")[1]:
        raise ImportError("MONAI's SwinUNETR/UNETR need the 'einops' package: pip install einops")
    patch = _patch(patch_size)
    kind = kind.lower()
    # SwinUNETR: axes divisible by 32, and its instance-normed bottleneck (patch / 32) needs > 1 voxel
    swin_ok = all(p % 32 == 0 for p in patch) and math.prod(p // 32 for p in patch) > 1
    unetr_ok = all(p % 16 == 0 for p in patch)
    if kind == "auto":
        if not (swin_ok or unetr_ok):
            raise ValueError(
                f"patch {patch} fits no MONAI transformer: SwinUNETR needs every axis divisible by 32, "
                "UNETR by 16 (e.g. 64x64x32 works, 128x128x8 does not)"
            )
        kind = "swinunetr" if swin_ok else "unetr"
    if kind == "swinunetr":
        if not swin_ok:
            raise ValueError(f"SwinUNETR needs every patch axis divisible by 32 (and not all 32), got {patch}")
        return SwinUNETR(in_channels=in_channels, out_channels=out_channels, spatial_dims=len(patch), **kwargs)
    if kind == "unetr":
        if not unetr_ok:
            raise ValueError(f"UNETR needs every patch axis divisible by 16, got {patch}")
        return UNETR(in_channels, out_channels, img_size=patch, spatial_dims=len(patch), **kwargs)
    raise ValueError(f"unknown transformer kind {kind!r}; choose 'auto', 'swinunetr' or 'unetr'")


def build_deepmedic(in_channels: int, out_channels: int, patch_size: SizeLike, **kwargs) -> DeepMedic:
    """:class:`DeepMedic` with ``patch_size`` as its normal-pathway segment (input patch = ``net.input_size``)."""
    patch = _patch(patch_size)
    return DeepMedic(in_channels, out_channels, segment_size=patch, spatial_dims=len(patch), **kwargs)


def _same_patch(network: nn.Module, patch_size: SizeLike) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return _patch(patch_size), _patch(patch_size)


def _deepmedic_sizes(network: nn.Module, patch_size: SizeLike) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return network.input_size, network.output_size


def sliding_window_inferer(
    network: nn.Module, patch_size: SizeLike, overlap: float = 0.5, sw_batch_size: int = 4, **_: object
) -> Inferer:
    """MONAI ``SlidingWindowInferer`` over ``patch_size`` windows, Gaussian weighting, ``overlap`` 0.5 (the
    reference's step 0.5, sigma = patch / 8)."""
    return SlidingWindowInferer(
        roi_size=_patch(patch_size), sw_batch_size=sw_batch_size, overlap=overlap, mode="gaussian", sigma_scale=0.125
    )


def deepmedic_inferer(
    network: nn.Module, patch_size: SizeLike, sw_batch_size: int = 4, segment: SizeLike = 45, **_: object
) -> Inferer:
    """:class:`ValidConvSlidingWindowInferer` tiling volumes with normal-pathway segments of ``segment`` (45³ as
    the reference, each predicting 29³). The context beyond the volume is zeros (the mean after z-scoring), as the
    bundles pad the volumes the training patches are cut from (``BorderPadd``): a voxel near the border sees the
    context it was trained with (the reference mirrors at inference)."""
    output = tuple(s - network.shrink for s in _patch(segment))
    return ValidConvSlidingWindowInferer.for_network(
        network, output, sw_batch_size=sw_batch_size, padding_mode="constant", cval=0.0
    )


@dataclass(frozen=True)
class NetworkSpec:
    """A network kind by name, with the defaults that go with it (SPEC §2, §5, §6).

    Args:
        name: the bundles' ``network`` value.
        build: ``(in_channels, out_channels, patch_size, **kwargs) -> nn.Module``.
        train_loss: the training loss (``ce`` for DeepMedic, ``ce+dice`` for the U-Nets, SPEC §6).
        tea_z: TEA ops used at test time (z = 4 for DeepMedic, 8 for the 3D U-Net).
        tra_preset: initial / heuristic TRA preset (SPEC §2).
        default_patch: training patch where a task names none (DeepMedic: its normal-pathway segment).
        uses_spacing: the builder takes the voxel ``spacing`` (nnU-Net-like planning of kernels and pooling).
        patch_sizes: ``(network, patch_size) -> (input_size, output_size)`` for networks whose logits cover less
            than their input (DeepMedic); ``None`` = the output covers the input patch.
        inferer: ``(network, patch_size, **options) -> Inferer`` tiling whole volumes.
        background_centres: the share of training patches centred on background, as the reference's sampler of
            this network draws them (:meth:`centre_class_ratios`): ``0.5`` (the U-Net's: half on background, half
            on a foreground class drawn uniformly) or ``None`` (DeepMedic's: equal numbers per class).
        grad_clip_norm: the training step's gradient-norm clip (:class:`jcsaug.engine.GradientClipping`): 12 for
            the U-Nets (nnU-Net's, the reference's), ``None`` for DeepMedic (the reference does not clip it).
    """

    name: str
    build: Callable[..., nn.Module]
    train_loss: str = "ce+dice"
    tea_z: int = 8
    tra_preset: str = "nnunet"
    default_patch: tuple[int, int, int] = (64, 64, 64)
    uses_spacing: bool = False
    patch_sizes: Callable[[nn.Module, SizeLike], tuple[tuple[int, ...], tuple[int, ...]]] | None = None
    inferer: Callable[..., Inferer] = sliding_window_inferer
    background_centres: float | None = 0.5
    grad_clip_norm: float | None = 12.0

    def make(
        self,
        in_channels: int,
        out_channels: int,
        patch_size: SizeLike | None = None,
        spacing: Sequence[float] | None = None,
        **kwargs,
    ) -> nn.Module:
        """Build the network; ``spacing`` reaches builders that plan from it and is ignored by the others."""
        if self.uses_spacing and spacing is not None:
            kwargs["spacing"] = spacing
        return self.build(in_channels, out_channels, self.default_patch if patch_size is None else patch_size, **kwargs)

    def sizes(self, network: nn.Module, patch_size: SizeLike) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(input_size, output_size)`` of a built ``network`` (DDP-wrapped or not): the patch to sample and the
        centre region of the label its logits cover."""
        return (self.patch_sizes or _same_patch)(getattr(network, "module", network), patch_size)

    def plan(self, patch_size: SizeLike, **kwargs) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """:meth:`sizes` without building weights (the network is built on the meta device if its sizes need it)."""
        if self.patch_sizes is None:
            return _same_patch(None, patch_size)  # type: ignore[arg-type]
        with torch.device("meta"):
            return self.sizes(self.make(1, 2, patch_size, **kwargs), patch_size)

    def centre_class_ratios(self, num_classes: int) -> list[float]:
        """Ratios of the classes of training patch centres (background first; MONAI
        ``RandCropByLabelClassesd(ratios=...)``): background at :attr:`background_centres`, the foreground classes
        sharing the rest equally; equal ratios where it is ``None``."""
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2 (background and a foreground class), got {num_classes}")
        if self.background_centres is None:
            return [1.0] * num_classes
        if not 0.0 < self.background_centres < 1.0:
            raise ValueError(f"{self.name}: background_centres must be in (0, 1), got {self.background_centres}")
        foreground = (1.0 - self.background_centres) / (num_classes - 1)
        return [self.background_centres] + [foreground] * (num_classes - 1)

    def make_inferer(self, network: nn.Module, patch_size: SizeLike, **options) -> Inferer:
        """The whole-volume inferer for ``network`` (DDP-wrapped or not)."""
        return self.inferer(getattr(network, "module", network), patch_size, **options)


#: network name -> :class:`NetworkSpec`
NETWORKS: Registry[NetworkSpec] = Registry("network", normalise=str.lower)


#: ``register_network(spec)`` makes a kind available by name (:func:`make_network`, the bundles' ``network`` id);
#: ``get_network(name)`` (case-insensitive) and ``list_networks()`` look them up
register_network, get_network, list_networks = NETWORKS.register, NETWORKS.get, NETWORKS.names


register_network(
    NetworkSpec(
        "deepmedic", build_deepmedic, train_loss="ce", tea_z=4, tra_preset="deepmedic", default_patch=(37, 37, 37),
        patch_sizes=_deepmedic_sizes, inferer=deepmedic_inferer, background_centres=None, grad_clip_norm=None,
    )
)  # fmt: skip
register_network(NetworkSpec("unet3d", build_unet3d, uses_spacing=True))
register_network(NetworkSpec("transformer", build_transformer, tra_preset="all-0.05"))


def make_network(name: str, in_channels: int, out_channels: int, patch_size: SizeLike, **kwargs) -> nn.Module:
    """Build a network by name (see :func:`list_networks`); unknown names raise ``KeyError`` listing the choices."""
    return get_network(name).make(in_channels, out_channels, patch_size, **kwargs)


def network_patch_sizes(name: str, patch_size: SizeLike, **kwargs) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(input_size, output_size)``: the patch to sample and the centre region its logits cover.

    DeepMedic: ``patch_size`` is the segment, e.g. 37³ → ``((109,)*3, (21,)*3)`` (crop labels with
    ``crop_label_to_output``); the others: ``(patch, patch)``. Nothing is built with weights (see
    :meth:`NetworkSpec.plan`); :meth:`NetworkSpec.sizes` reads them from a network already built.
    """
    return get_network(name).plan(patch_size, **kwargs)
