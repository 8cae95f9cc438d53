"""Datasets: datalists, preprocessing and the synthetic dataset of the default bundle."""

from __future__ import annotations

from jcsaug.data.cache import CacheDataset
from jcsaug.data.checks import CheckFinited, CheckImageLabeld, SafeLoadImaged
from jcsaug.data.context_crop import ContextCropd, crop_with_context
from jcsaug.data.normalise import intensity_normalisation
from jcsaug.data.roi import ROI_KEY, ThresholdROId, mask_outside_roi, threshold_roi
from jcsaug.data.synthetic import make_synthetic_dataset, synthetic_datalist
from jcsaug.data.volume_stats import VOLUME_STATS_PREFIX, VolumeStatsd, batch_volume_stats

__all__ = [
    "CacheDataset",
    "CheckFinited",
    "CheckImageLabeld",
    "ROI_KEY",
    "ContextCropd",
    "SafeLoadImaged",
    "ThresholdROId",
    "VOLUME_STATS_PREFIX",
    "VolumeStatsd",
    "batch_volume_stats",
    "crop_with_context",
    "intensity_normalisation",
    "make_synthetic_dataset",
    "mask_outside_roi",
    "synthetic_datalist",
    "threshold_roi",
]
