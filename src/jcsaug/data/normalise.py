"""nnU-Net intensity normalisation as a MONAI transform, from the statistics ``jcsaug prepare`` stored."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from monai.transforms import MapTransform, NormalizeIntensityd, ScaleIntensityRanged

__all__ = ["intensity_normalisation"]


def intensity_normalisation(dataset_dir: str | Path, keys: str | Sequence[str] = ("image",)) -> MapTransform:
    """The dataset's normalisation (``dataset.json`` ``normalisation``) as a MONAI dictionary transform.

    MR (``zscore``): case-wise z-score, MONAI ``NormalizeIntensityd``. CT (``ct``): clip to the 0.5-99.5
    percentiles of the training and validation cases' foreground (``jcsaug prepare``; every training fraction of a
    task shares them), then subtract the foreground mean and divide by its std -- one linear map with clipping,
    i.e. MONAI ``ScaleIntensityRanged`` with ``b_min/b_max`` = the normalised clip bounds.
    """
    from jcsaug.tasks.settings import read_datalist

    info = read_datalist(dataset_dir).get("normalisation")
    scheme = (info or {}).get("scheme")
    if scheme == "zscore":
        return NormalizeIntensityd(keys=keys, channel_wise=True)
    if scheme == "ct":
        (lo, hi), mean, std = info["clip"], float(info["mean"]), float(info["std"])
        return ScaleIntensityRanged(
            keys=keys, a_min=lo, a_max=hi, b_min=(lo - mean) / std, b_max=(hi - mean) / std, clip=True
        )
    raise ValueError(f"{Path(dataset_dir) / 'dataset.json'}: unknown normalisation {info!r}")
