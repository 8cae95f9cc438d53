"""Test-time augmentation inferers, built by method name with :func:`make_tta_inferer`."""

from jcsaug.inference.predict import predict_cases
from jcsaug.inference.tta import (
    TTA_INFERERS,
    MirrorTTAInferer,
    NoTTAInferer,
    TEAInferer,
    get_tta_inferer,
    list_tta_inferers,
    load_tea_policy,
    make_tta_inferer,
    make_tta_inferers,
    register_tta_inferer,
)

__all__ = [
    "TTA_INFERERS",
    "MirrorTTAInferer",
    "NoTTAInferer",
    "TEAInferer",
    "get_tta_inferer",
    "list_tta_inferers",
    "load_tea_policy",
    "make_tta_inferer",
    "make_tta_inferers",
    "predict_cases",
    "register_tta_inferer",
]
