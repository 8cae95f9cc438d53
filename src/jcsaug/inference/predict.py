"""Predict whole cases with any (TTA) inferer and save the segmentations as NIfTI."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from ignite.handlers import ProgressBar
from monai.inferers import Inferer

from jcsaug.evaluation.metrics import ComponentClasses
from jcsaug.inference.pipeline import (
    check_prediction_cases,
    prediction_evaluator,
    prediction_postprocessing,
    prediction_preprocessing,
    segmentation_path,
)

logger = logging.getLogger("jcsaug.inference")


def predict_cases(
    network: torch.nn.Module,
    cases: Sequence[Mapping],
    inferer: Inferer,
    output_dir: str | Path,
    device: torch.device | str = "cpu",
    image_key: str = "image",
    progress: bool = True,
    orientation: str | None = "RAS",
    preprocess: Callable[[dict], dict] | None = None,
    keep_largest_component: ComponentClasses = False,
    roi_threshold: float | None = None,
    num_workers: int = 0,
    segmentation_postprocessing: Callable[[dict], Mapping] | None = None,
) -> list[Path]:
    """Segment every case (``{"image": path}``) and write ``<name>_seg.nii.gz`` files (uint8 class maps) to
    ``output_dir``; returns their paths.

    A MONAI ``SupervisedEvaluator`` (:func:`~jcsaug.inference.pipeline.prediction_evaluator`) runs the cases, the
    same parts the bundles' ``inference.yaml`` is made of. Images are read in ``orientation`` (RAS, as in training;
    ``None`` keeps the stored axes) and passed through ``preprocess`` (e.g. the dataset's intensity normalisation);
    the segmentation is turned back to the image's stored axes before it is saved, so it has the input's shape and
    affine voxel for voxel. ``keep_largest_component``: post-process as the evaluation does
    (:func:`~jcsaug.evaluation.metrics.largest_connected_component`): False, True (every foreground class) or the
    foreground class ids to post-process, e.g. ``[1, 3]`` (:func:`~jcsaug.evaluation.metrics.component_classes`;
    its form is checked first, its classes against the network's on the first case, before anything is written).
    ``roi_threshold``: the task's region of interest (:class:`~jcsaug.data.ThresholdROId`, computed on the image as
    read, before ``preprocess``: HU for CT): the segmentation is background outside it, as in the evaluation;
    None: not masked. ``segmentation_postprocessing``: MONAI dictionary transforms turning the logits (``"pred"``)
    into the class map before the ROI mask and the largest component, as the evaluation's
    (:func:`~jcsaug.evaluation.class_map`); None: the argmax. The network is moved to ``device`` and predicts in eval
    mode. Two inputs whose file names give the same output name are refused before anything is written.
    """
    written = check_prediction_cases(cases, output_dir, image_key, keep_largest_component)
    preprocessing = prediction_preprocessing(image_key, orientation, preprocess, roi_threshold)
    postprocessing = prediction_postprocessing(
        preprocessing, output_dir, image_key, keep_largest_component, roi_threshold, segmentation_postprocessing
    )
    handlers = [ProgressBar(desc="predict", persist=True)] if progress else []
    evaluator = prediction_evaluator(
        network, cases, inferer, preprocessing, postprocessing, device, num_workers, handlers, image_key
    )
    try:
        evaluator.run()
    except RuntimeError as error:
        raise _cause(error) from None
    return written


def _cause(error: RuntimeError) -> BaseException:
    """The error a MONAI transform raised, out of the ``RuntimeError("applying transform ...")`` links MONAI's
    ``apply_transform`` wraps it in (one per nested ``Compose``), so a bad case or setting reads as what it is."""
    cause: BaseException = error
    while isinstance(cause, RuntimeError) and str(cause).startswith("applying transform") and cause.__cause__:
        cause = cause.__cause__
    return cause


def report_predictions(
    cases: Sequence[Mapping], output_dir: str | Path, method: str | None = None, image_key: str = "image"
) -> list[Path]:
    """Log at INFO (logger ``jcsaug.inference``) how many of ``cases``' segmentations are in ``output_dir`` and
    where, and return their paths; a missing one is an error naming it (the end of the bundles' inference run)."""
    paths = [segmentation_path(entry, output_dir, image_key) for entry in cases]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"{len(missing)} of {len(paths)} segmentations were not written: {missing[:3]}")
    how = f" (test-time method {method})" if method else ""
    logger.info("predicted %d case%s%s: segmentations in %s", len(paths), "" if len(paths) == 1 else "s", how,
                output_dir)  # fmt: skip
    return paths
