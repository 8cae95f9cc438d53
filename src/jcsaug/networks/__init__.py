"""Segmentation networks: DeepMedic (MONAI lacks it), valid-convolution tiling, and a factory for the rest."""

from __future__ import annotations

from jcsaug.networks.deepmedic import (
    DeepMedic,
    ValidConvSlidingWindowInferer,
    centre_crop,
    crop_label_to_output,
    deepmedic_margin,
)
from jcsaug.networks.factory import (
    NETWORKS,
    NetworkSpec,
    NnUNetDynUNet,
    deep_supervision_weights,
    get_network,
    list_networks,
    make_network,
    network_patch_sizes,
    nnunet_kernels_strides,
    register_network,
    split_deep_supervision,
)

__all__ = [
    "NETWORKS",
    "DeepMedic",
    "NetworkSpec",
    "NnUNetDynUNet",
    "ValidConvSlidingWindowInferer",
    "centre_crop",
    "crop_label_to_output",
    "deep_supervision_weights",
    "deepmedic_margin",
    "get_network",
    "list_networks",
    "make_network",
    "network_patch_sizes",
    "nnunet_kernels_strides",
    "register_network",
    "split_deep_supervision",
]
