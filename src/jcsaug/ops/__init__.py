"""Operation catalogues: the 15 TRA series (SPEC §2) and the 84 TEA operations (SPEC §3)."""

from jcsaug.ops.axes import AXIS_NAMES, FRONTAL, LONGITUDINAL, SAGITTAL
from jcsaug.ops.catalogue import OpSpec, Series
from jcsaug.ops.tea import TEA_OPS, apply_tea_ops, in_view_masks
from jcsaug.ops.tra import (
    TRA_SERIES,
    TRAParams,
    apply_tra,
    apply_tra_batch,
    resolve_tra_context,
    sample_tra_params,
    tra_catalogue_json,
    tra_context,
)

__all__ = [
    "AXIS_NAMES",
    "FRONTAL",
    "LONGITUDINAL",
    "SAGITTAL",
    "OpSpec",
    "Series",
    "TEA_OPS",
    "TRA_SERIES",
    "TRAParams",
    "apply_tea_ops",
    "apply_tra",
    "apply_tra_batch",
    "in_view_masks",
    "resolve_tra_context",
    "sample_tra_params",
    "tra_catalogue_json",
    "tra_context",
]
