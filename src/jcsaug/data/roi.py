"""The region of interest of a case: where background patch centres are drawn and predictions are kept.

The reference code of the paper masks KiTS with a body ROI: the largest connected component of the voxels above
-200 HU, its holes filled (DATASETS.md). Half of its training patches are centred on background voxels inside that
ROI, not on the air around the patient, and its test predictions are set to background outside it.
:class:`ThresholdROId` computes such an ROI from the image at load time (before the intensity normalisation, so the
threshold is in the units of the prepared file: HU for CT) and stores it under its own key; the bundles then draw
patch centres inside it (MONAI's ``ClassesToIndicesd`` with ``image_key``) and :func:`mask_outside_roi` clears the
predictions outside it.
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable, Mapping

import numpy as np
import torch
from monai.config import KeysCollection
from monai.transforms import MapTransform
from scipy import ndimage

from jcsaug.data.checks import case_name

__all__ = ["ROI_KEY", "ThresholdROId", "mask_outside_roi", "threshold_roi"]

ROI_KEY = "roi"
"""The data key the bundles keep the ROI under."""


def threshold_roi(image: torch.Tensor | np.ndarray, threshold: float) -> torch.Tensor:
    """The largest connected component (full connectivity) of the voxels ``> threshold`` of a ``(C, *spatial)``
    image (any channel), with its holes filled in 3D: a ``(1, *spatial)`` uint8 mask, all zeros when no voxel is
    above the threshold.

    The component is :func:`jcsaug.evaluation.metrics.largest_connected_component`'s (the post-processing's, with
    ``scipy.ndimage``); the holes are filled with :func:`scipy.ndimage.binary_fill_holes`.
    """
    # imported here: jcsaug.evaluation imports this module (the evaluation masks its predictions with the ROI)
    from jcsaug.evaluation.metrics import largest_connected_component

    array = image.detach().cpu().numpy() if isinstance(image, torch.Tensor) else np.asarray(image)
    above = (array > threshold).any(axis=0).astype(np.uint8)
    largest = largest_connected_component(above, num_classes=2).numpy() > 0
    return torch.as_tensor(ndimage.binary_fill_holes(largest)[None].astype(np.uint8))


def mask_outside_roi(segmentation: torch.Tensor, roi: torch.Tensor | np.ndarray | None) -> torch.Tensor:
    """``segmentation`` (a class map, ``(*spatial)`` or ``(1, *spatial)``) with every voxel outside ``roi`` (same
    spatial shape, with or without its channel) set to 0, the background; ``roi`` None: unchanged."""
    if roi is None:
        return segmentation
    inside = torch.as_tensor(np.asarray(roi) if not isinstance(roi, torch.Tensor) else roi).to(segmentation.device)
    if inside.ndim == segmentation.ndim + 1 and inside.shape[0] == 1:
        inside = inside[0]
    elif inside.ndim + 1 == segmentation.ndim and segmentation.shape[0] == 1:
        inside = inside[None]
    if inside.shape != segmentation.shape:
        raise ValueError(
            f"ROI of shape {tuple(inside.shape)} does not match the segmentation's {tuple(segmentation.shape)}"
        )
    return torch.where(inside > 0, segmentation, torch.zeros_like(segmentation))


def _finite(threshold: object) -> float:
    try:
        value = float(threshold) if not isinstance(threshold, bool) else float("nan")
    except (TypeError, ValueError):
        value = float("nan")
    if not np.isfinite(value):
        raise ValueError(f"roi_threshold must be a finite number (HU for CT) or None, not {threshold!r}")
    return value


class ThresholdROId(MapTransform):
    """Store the ROI of ``keys``' image (:func:`threshold_roi`) under ``roi_key``; ``threshold`` None: do nothing.

    Put it after ``EnsureChannelFirstd`` and before the intensity normalisation. An image with no voxel above
    the threshold is an error naming its file (a CT not in HU, or an MR image given a CT threshold), not an ROI
    that would leave no background to sample.

    Args:
        keys: the image key (one).
        threshold: the intensity of the ROI's voxels (KiTS: -200 HU); None: no ROI, the data unchanged.
        roi_key: where the ROI goes (``"roi"``): a ``(1, *spatial)`` uint8 tensor.
        allow_missing_keys: skip an absent image.
    """

    def __init__(
        self,
        keys: KeysCollection,
        threshold: float | None,
        roi_key: str = ROI_KEY,
        allow_missing_keys: bool = False,
    ) -> None:
        super().__init__(keys, allow_missing_keys)
        if len(self.keys) != 1:
            raise ValueError(f"ThresholdROId takes one image key, not {list(self.keys)}")
        self.threshold = None if threshold is None else _finite(threshold)
        self.roi_key = roi_key

    def __call__(self, data: Mapping[Hashable, torch.Tensor]) -> dict:
        d = dict(data)
        if self.threshold is None:
            return d
        for key in self.key_iterator(d):
            roi = threshold_roi(d[key], self.threshold)
            if not roi.any():
                image = torch.as_tensor(d[key])
                raise ValueError(
                    f"case {case_name(d, key)}: no voxel of {key!r} is above the ROI threshold {self.threshold:g} "
                    f"(its range is [{float(image.min()):g}, {float(image.max()):g}]); the threshold is in the "
                    "units of the prepared file (HU for CT)"
                )
            if roi.all():  # nothing masked: a threshold below the image's range (not in HU?) or a volume inside a body
                warnings.warn(
                    f"case {case_name(d, key)}: every voxel of {key!r} is in the ROI (threshold {self.threshold:g}, "
                    f"image minimum {float(torch.as_tensor(d[key]).min()):g}): nothing is masked",
                    stacklevel=2,
                )
            d[self.roi_key] = roi
        return d
