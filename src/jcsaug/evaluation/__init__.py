"""Evaluation of segmentations: per-case metrics and summaries."""

from jcsaug.evaluation.segmentation import case_dice, evaluate_cases

__all__ = ["case_dice", "evaluate_cases"]
