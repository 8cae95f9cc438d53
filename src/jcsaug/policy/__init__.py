"""Learnable categorical policies and the MONAI dictionary transforms they drive."""

from jcsaug.policy.cascade import BatchTRACascaded, TRACascaded, making_counterfactuals
from jcsaug.policy.categorical import NOT_APPLIED, CategoricalPolicy, sampling_from
from jcsaug.policy.changes import OpChange, policy_changes
from jcsaug.policy.factory import make_tea_policy, make_tra_policy
from jcsaug.policy.gumbel import conditional_gumbel_softmax, gumbel_softmax, straight_through_weight
from jcsaug.policy.lockstep import LockstepThreadDataLoader, PolicyHistory
from jcsaug.policy.presets import (
    TEA_PRESETS,
    TRA_PRESETS,
    get_tea_preset,
    get_tra_preset,
    list_tea_presets,
    list_tra_presets,
    register_tea_preset,
    register_tra_preset,
    series_probs,
    tea_probs,
)
from jcsaug.policy.snapshots import PolicySnapshotDataset, PolicySnapshotSampler, SnapshotIndex
from jcsaug.policy.transforms import ClassGroupd, LearnableOneOfd, centre_class

__all__ = [
    "BatchTRACascaded",
    "NOT_APPLIED",
    "TEA_PRESETS",
    "TRA_PRESETS",
    "CategoricalPolicy",
    "ClassGroupd",
    "LearnableOneOfd",
    "LockstepThreadDataLoader",
    "OpChange",
    "PolicyHistory",
    "PolicySnapshotDataset",
    "PolicySnapshotSampler",
    "SnapshotIndex",
    "TRACascaded",
    "centre_class",
    "conditional_gumbel_softmax",
    "get_tea_preset",
    "get_tra_preset",
    "gumbel_softmax",
    "list_tea_presets",
    "list_tra_presets",
    "make_tea_policy",
    "make_tra_policy",
    "making_counterfactuals",
    "policy_changes",
    "sampling_from",
    "register_tea_preset",
    "register_tra_preset",
    "series_probs",
    "straight_through_weight",
    "tea_probs",
]
