"""A whole volume's intensity statistics, carried by the patches cut from it.

The TEA's intensity ops act on whole volumes at test time; learned on patches, a gamma bent over the patch's own
range (or a contrast about its own mean) is another op than the one the test applies. :class:`VolumeStatsd` records
the volume's min, max and mean before the crop (MONAI ``IntensityStatsd``, into ``{key}_meta_dict``; every crop of a
MONAI random crop keeps the item's other keys, and the ``DataLoader`` collates them to ``[B]``), and
:func:`batch_volume_stats` reads them back from a batch for :func:`jcsaug.ops.apply_tea_ops`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from monai.config import KeysCollection
from monai.transforms import IntensityStatsd

from jcsaug.ops.intensity import VOLUME_STAT_NAMES, VolumeStats

__all__ = ["VOLUME_STATS_PREFIX", "VolumeStatsd", "batch_volume_stats"]

#: Prefix of the statistics' names in the meta dictionary: ``volume_min``, ``volume_max``, ``volume_mean``.
VOLUME_STATS_PREFIX = "volume"


class VolumeStatsd(IntensityStatsd):
    """Record the min, max and mean of each key's volume (over all its channels) in ``{key}_meta_dict`` as
    ``volume_min``, ``volume_max``, ``volume_mean``: MONAI ``IntensityStatsd`` with the ops and prefix the TEA reads
    (:func:`batch_volume_stats`). Put it in a validation pipeline after the intensity normalisation and before the
    padding and the crop."""

    def __init__(self, keys: KeysCollection = "image", allow_missing_keys: bool = False) -> None:
        super().__init__(
            keys, ops=list(VOLUME_STAT_NAMES), key_prefix=VOLUME_STATS_PREFIX, allow_missing_keys=allow_missing_keys
        )


def batch_volume_stats(batch: Mapping, image_key: str = "image") -> VolumeStats | None:
    """The :class:`VolumeStatsd` statistics of a batch's samples as ``{"min", "max", "mean"}`` float32 tensors
    ``[B]`` (on the CPU), or ``None`` when the batch carries none (a pipeline without :class:`VolumeStatsd`: each
    patch's own statistics are meant)."""
    meta = batch.get(f"{image_key}_meta_dict")
    names = {name: f"{VOLUME_STATS_PREFIX}_{name}" for name in VOLUME_STAT_NAMES}
    if not isinstance(meta, Mapping) or not all(key in meta for key in names.values()):
        return None
    stats = {name: torch.as_tensor(meta[key], dtype=torch.float32).reshape(-1) for name, key in names.items()}
    sizes = {len(v) for v in stats.values()}
    if len(sizes) != 1:
        raise ValueError(f"batch {image_key}_meta_dict: volume statistics of unequal lengths {sorted(sizes)}")
    return stats
