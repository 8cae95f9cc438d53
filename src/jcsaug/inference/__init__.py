"""Test-time augmentation inferers."""

from jcsaug.inference.predict import predict_cases
from jcsaug.inference.tta import (
    TTA_INFERERS,
    MirrorTTAInferer,
    NoTTAInferer,
    TEAInferer,
    evaluation_inferers,
    load_tea_policy,
    tta_inferer,
)

__all__ = [
    "evaluation_inferers",
    "TTA_INFERERS",
    "MirrorTTAInferer",
    "NoTTAInferer",
    "TEAInferer",
    "load_tea_policy",
    "predict_cases",
    "tta_inferer",
]
