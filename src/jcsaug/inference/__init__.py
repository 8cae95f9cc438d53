"""Test-time augmentation inferers, built by method name with :func:`make_tta_inferer`, and whole-case prediction
(:func:`predict_cases`, and its MONAI parts for ``inference.yaml``)."""

from jcsaug.inference.pipeline import (
    LogitsToSegmentationd,
    check_prediction_cases,
    prediction_evaluator,
    prediction_postprocessing,
    prediction_preprocessing,
)
from jcsaug.inference.predict import predict_cases, report_predictions
from jcsaug.inference.tta import (
    EQUAL_WEIGHTS,
    TTA_INFERERS,
    BlendedTTAInferer,
    MirrorTTAInferer,
    NoTTAInferer,
    PolicyFileTEAInferer,
    TEAInferer,
    TEAPolicyFile,
    get_tta_inferer,
    list_tta_inferers,
    load_tea_policy,
    make_tta_inferer,
    make_tta_inferers,
    register_tta_blend,
    register_tta_inferer,
)

__all__ = [
    "EQUAL_WEIGHTS",
    "LogitsToSegmentationd",
    "TTA_INFERERS",
    "BlendedTTAInferer",
    "MirrorTTAInferer",
    "NoTTAInferer",
    "PolicyFileTEAInferer",
    "TEAInferer",
    "TEAPolicyFile",
    "check_prediction_cases",
    "get_tta_inferer",
    "list_tta_inferers",
    "load_tea_policy",
    "make_tta_inferer",
    "make_tta_inferers",
    "predict_cases",
    "prediction_evaluator",
    "prediction_postprocessing",
    "prediction_preprocessing",
    "register_tta_blend",
    "register_tta_inferer",
    "report_predictions",
]
