"""Learnable categorical policies and the MONAI dictionary transforms they drive."""

from jcsaug.policy.cascade import BatchTRACascaded, TRACascaded
from jcsaug.policy.categorical import NOT_APPLIED, CategoricalPolicy
from jcsaug.policy.factory import make_tea_policy, make_tra_policy
from jcsaug.policy.gumbel import conditional_gumbel_softmax, gumbel_softmax, straight_through_weight
from jcsaug.policy.presets import TEA_PRESETS, TRA_PRESETS, series_probs, tea_probs
from jcsaug.policy.transforms import ClassGroupd, LearnableOneOfd, centre_class

__all__ = [
    "BatchTRACascaded",
    "NOT_APPLIED",
    "TEA_PRESETS",
    "TRA_PRESETS",
    "CategoricalPolicy",
    "ClassGroupd",
    "LearnableOneOfd",
    "TRACascaded",
    "centre_class",
    "conditional_gumbel_softmax",
    "gumbel_softmax",
    "make_tea_policy",
    "make_tra_policy",
    "series_probs",
    "straight_through_weight",
    "tea_probs",
]
