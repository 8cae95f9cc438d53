"""Evaluation of segmentations: per-case metrics, summaries and the comparison report."""

from jcsaug.evaluation.class_maps import class_map
from jcsaug.evaluation.evaluator import (
    CaseEvaluator,
    CaseMetrics,
    EvaluationCases,
    MethodMeanDice,
    evaluate_cases,
    method_mean_dice,
    one_case,
)
from jcsaug.evaluation.metrics import (
    HIGHER_IS_BETTER,
    METRICS,
    case_metrics,
    component_classes,
    largest_connected_component,
    parse_component_classes,
    summarize_cases,
)
from jcsaug.evaluation.postprocessing import (
    POSTPROCESSING_NAME,
    choose_component_classes,
    chooses_on_validation,
    read_component_classes,
    resolve_component_classes,
)
from jcsaug.evaluation.report import Report, ReportError, build_report, build_report_parser, run_report
from jcsaug.evaluation.segmentation import case_dice, case_spacing, label_map_dice, per_case_csv
from jcsaug.evaluation.splits import EVALUATION_SPLITS, evaluation_file_names, evaluation_split

__all__ = [
    "CaseEvaluator",
    "CaseMetrics",
    "EvaluationCases",
    "EVALUATION_SPLITS",
    "HIGHER_IS_BETTER",
    "METRICS",
    "MethodMeanDice",
    "POSTPROCESSING_NAME",
    "Report",
    "ReportError",
    "build_report",
    "build_report_parser",
    "case_dice",
    "case_metrics",
    "case_spacing",
    "choose_component_classes",
    "chooses_on_validation",
    "class_map",
    "component_classes",
    "evaluate_cases",
    "evaluation_file_names",
    "evaluation_split",
    "label_map_dice",
    "largest_connected_component",
    "method_mean_dice",
    "one_case",
    "parse_component_classes",
    "per_case_csv",
    "read_component_classes",
    "resolve_component_classes",
    "run_report",
    "summarize_cases",
]
