"""The pieces of whole-case prediction as MONAI parts: read a case, predict it with a (TTA) inferer in a MONAI
``SupervisedEvaluator``, turn the logits into a class map and save it on the image's own grid.

:func:`~jcsaug.inference.predict_cases` assembles them in Python; the bundles' ``inference.yaml`` assembles the same
functions into MONAI's inference-workflow properties (``dataset``, ``preprocessing``, ``postprocessing``,
``evaluator``, ``inferer``), so a ``ConfigWorkflow(workflow_type="infer")`` can drive it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from copy import deepcopy
from pathlib import Path

import numpy as np
import torch
from monai.config import KeysCollection
from monai.data import DataLoader, Dataset, MetaTensor
from monai.data.utils import create_file_basename
from monai.engines import SupervisedEvaluator
from monai.inferers import Inferer
from monai.transforms import (
    Compose,
    EnsureChannelFirstd,
    EnsureTyped,
    Invertd,
    InvertibleTransform,
    LoadImaged,
    MapTransform,
    Orientationd,
    SaveImaged,
)

from jcsaug.data.roi import ROI_KEY, ThresholdROId, mask_outside_roi
from jcsaug.evaluation.class_maps import check_postprocessing, class_map
from jcsaug.evaluation.metrics import (
    ComponentClasses,
    component_classes,
    largest_connected_component,
    parse_component_classes,
)

#: the axis labels ``Orientationd`` reads images with (RAS+ world: the first label is the negative end; given, not
#: MONAI's default, which follows a MetaTensor's space and would read an LPS image with LPS labels)
AXIS_LABELS = (("L", "R"), ("P", "A"), ("I", "S"))
#: the key of the network's output in a MONAI engine's output (``monai.utils.CommonKeys.PRED``)
PRED_KEY = "pred"
#: the postfix and extension of a saved segmentation: ``<image name>_seg.nii.gz``
SEG_POSTFIX, SEG_EXTENSION = "seg", ".nii.gz"


def segmentation_path(entry: Mapping, output_dir: str | Path, image_key: str = "image") -> Path:
    """Where :func:`prediction_postprocessing` saves the segmentation of ``entry`` (``{image_key: path}``) in
    ``output_dir``: ``<name>_seg.nii.gz``, ``<name>`` the image's file name less its extension, as MONAI's
    ``SaveImaged`` names it (``monai.data.utils.create_file_basename``)."""
    name = create_file_basename(
        SEG_POSTFIX, str(entry[image_key]), str(output_dir), separate_folder=False, makedirs=False
    )
    return Path(name + SEG_EXTENSION)


def check_prediction_cases(
    cases: Sequence[Mapping],
    output_dir: str | Path,
    image_key: str = "image",
    keep_largest_component: ComponentClasses = False,
) -> list[Path]:
    """The segmentation files ``cases`` will be saved as in ``output_dir``, after checking that every case has an
    ``image_key`` entry, that no two give the same file name, and the form of ``keep_largest_component``; a bad one
    is an error before anything is read or written."""
    missing = [dict(entry) for entry in cases if image_key not in entry]
    if missing:
        raise KeyError(f"case {missing[0]} has no {image_key!r} entry")
    paths = [segmentation_path(entry, output_dir, image_key) for entry in cases]
    clashes = sorted(path.name for path, n in Counter(paths).items() if n > 1)
    if clashes:
        raise ValueError(
            f"several input images would give the segmentation files {clashes}: they would overwrite each other in "
            f"{output_dir}; give the images distinct file names"
        )
    parse_component_classes(keep_largest_component)
    return paths


class LogitsToSegmentationd(MapTransform):
    """A network's ``[C, *spatial]`` logits under ``keys`` as a ``[1, *spatial]`` uint8 class map (argmax), on the
    CPU, background outside the region of interest under ``roi_key`` (if the data has one), and the largest connected
    component kept for the classes ``keep_largest_component`` names
    (:func:`~jcsaug.evaluation.metrics.component_classes`: False, True, or class ids; checked against C on the first
    case), as the evaluation post-processes them. The map is a MetaTensor with the metadata (file name, affine,
    applied operations) of the image under ``meta_key``, so MONAI's ``Invertd`` and ``SaveImaged`` can follow: the
    logits of a TTA or sliding-window inferer are plain tensors.

    Args:
        keys: the logits (a MONAI engine's ``"pred"``).
        keep_largest_component: the classes post-processed to their largest component (False: none).
        roi_key: where the ROI is (:class:`~jcsaug.data.ThresholdROId`); None: not masked.
        meta_key: the image whose metadata the map takes (if it is a MetaTensor; else the logits', if they are one).
        allow_missing_keys: skip absent logits.
        postprocessing: MONAI dictionary transforms turning the logits into the class map before the ROI mask and
            the largest component, as the evaluation's
            (:func:`~jcsaug.evaluation.class_maps.class_map`: the data with the logits under their key in, the key
            as class scores or one channel of class ids out); None: the argmax.
    """

    def __init__(
        self,
        keys: KeysCollection = PRED_KEY,
        keep_largest_component: ComponentClasses = False,
        roi_key: str | None = ROI_KEY,
        meta_key: str | None = "image",
        allow_missing_keys: bool = False,
        postprocessing: Callable[[dict], Mapping] | None = None,
    ) -> None:
        super().__init__(keys, allow_missing_keys)
        self.postprocessing = check_postprocessing(postprocessing)
        parse_component_classes(keep_largest_component)  # a bad form fails when the pipeline is built
        self.keep_largest_component = keep_largest_component
        self.roi_key = roi_key
        self.meta_key = meta_key

    def __call__(self, data: Mapping[Hashable, torch.Tensor]) -> dict:
        d = dict(data)
        roi = d.get(self.roi_key) if self.roi_key is not None else None
        for key in self.key_iterator(d):
            logits = d[key]
            if logits.ndim < 2:
                raise ValueError(f"{key!r} must be [C, *spatial] logits, got shape {tuple(logits.shape)}")
            classes_map = class_map(logits[None], logits.shape[0], self.postprocessing, d, f"{key!r}", pred_key=key,
                                    image_key=self.meta_key or "image")  # fmt: skip
            seg = mask_outside_roi(classes_map[None].to(torch.uint8), roi)
            classes = component_classes(self.keep_largest_component, logits.shape[0])
            if classes:
                seg = largest_connected_component(seg[0], logits.shape[0], classes=classes).to(torch.uint8)[None]
            image = d.get(self.meta_key) if self.meta_key is not None else None
            d[key] = _with_meta_of(image if isinstance(image, MetaTensor) else logits, seg)
        return d


def _with_meta_of(reference: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values`` with ``reference``'s metadata if it is a MetaTensor (a copy of its meta and applied operations)."""
    if isinstance(reference, MetaTensor):
        return MetaTensor(
            values, meta=deepcopy(reference.meta), applied_operations=deepcopy(reference.applied_operations)
        )
    return values


def prediction_preprocessing(
    image_key: str = "image",
    orientation: str | None = "RAS",
    preprocess: Callable[[dict], dict] | None = None,
    roi_threshold: float | None = None,
) -> Compose:
    """How a case is read for prediction, as training reads it: load, channel first, ``orientation`` (None: the stored
    axes), the region of interest (:class:`~jcsaug.data.ThresholdROId`, on the image as read: HU for CT; a no-op
    without a threshold), ``preprocess`` (the dataset's intensity normalisation), float32."""
    steps: list[Callable] = [LoadImaged(image_key, image_only=True), EnsureChannelFirstd(image_key)]
    if orientation:
        steps.append(Orientationd(image_key, axcodes=orientation, labels=AXIS_LABELS))
    steps.append(ThresholdROId(image_key, roi_threshold))
    if preprocess is not None:
        steps.append(preprocess)
    return Compose([*steps, EnsureTyped(image_key, dtype=torch.float32)])


def prediction_postprocessing(
    preprocessing: Compose,
    output_dir: str | Path,
    image_key: str = "image",
    keep_largest_component: ComponentClasses = False,
    roi_threshold: float | None = None,
    postprocessing: Callable[[dict], Mapping] | None = None,
) -> Compose:
    """What becomes of a case's logits: a uint8 class map (:class:`LogitsToSegmentationd`), turned back through the
    invertible steps of ``preprocessing`` (MONAI's ``Invertd``: the reorientation, so the map has the input's shape,
    affine and voxel order) and saved as ``output_dir/<name>_seg.nii.gz`` (MONAI's ``SaveImaged``). ``postprocessing``:
    MONAI dictionary transforms of the logits (``"pred"``) before the class map is made, as the evaluation's."""
    steps: list[Callable] = [
        LogitsToSegmentationd(
            PRED_KEY,
            keep_largest_component,
            roi_key=ROI_KEY if roi_threshold is not None else None,
            meta_key=image_key,
            postprocessing=postprocessing,
        )
    ]
    if any(isinstance(t, InvertibleTransform) for t in preprocessing.flatten().transforms):
        steps.append(Invertd(PRED_KEY, transform=preprocessing, orig_keys=image_key, nearest_interp=True, device="cpu"))
    steps.append(
        SaveImaged(
            PRED_KEY,
            output_dir=str(output_dir),
            output_postfix=SEG_POSTFIX,
            output_ext=SEG_EXTENSION,
            separate_folder=False,
            resample=False,
            output_dtype=np.uint8,
            print_log=False,
        )
    )
    return Compose(steps)


def prediction_evaluator(
    network: torch.nn.Module,
    cases: Sequence[Mapping],
    inferer: Inferer,
    preprocessing: Compose,
    postprocessing: Compose,
    device: torch.device | str = "cpu",
    num_workers: int = 0,
    handlers: Sequence | None = None,
    image_key: str = "image",
) -> SupervisedEvaluator:
    """A MONAI ``SupervisedEvaluator`` that predicts ``cases`` one at a time with ``inferer`` (the image under
    ``image_key``) and applies ``postprocessing`` to each; ``network`` is moved to ``device`` (the evaluator puts it
    in eval mode while it predicts)."""
    loader = DataLoader(Dataset(list(cases), transform=preprocessing), batch_size=1, num_workers=num_workers)
    return SupervisedEvaluator(
        device=torch.device(device), val_data_loader=loader, network=network.to(device), inferer=inferer,
        postprocessing=postprocessing, val_handlers=list(handlers or []), prepare_batch=ImageOnly(image_key),
    )  # fmt: skip


class ImageOnly:
    """A MONAI engine's ``prepare_batch`` for prediction: the batch's image under ``image_key`` on the device, no
    label (MONAI's default reads the key ``"image"`` only)."""

    def __init__(self, image_key: str = "image") -> None:
        self.image_key = image_key

    def __call__(
        self, batchdata: Mapping, device: torch.device | str | None = None, non_blocking: bool = False, **kwargs
    ) -> tuple[torch.Tensor, None]:
        if self.image_key not in batchdata:
            raise KeyError(f"the batch has no {self.image_key!r} entry (it has {sorted(map(str, batchdata))})")
        return batchdata[self.image_key].to(device=device, non_blocking=non_blocking, **kwargs), None
