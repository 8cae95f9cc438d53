"""Datasets: datalists, preprocessing and the synthetic dataset of the default bundle."""

from __future__ import annotations

from jcsaug.data.synthetic import make_synthetic_dataset

__all__ = ["make_synthetic_dataset"]
