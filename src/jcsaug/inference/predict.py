"""Predict whole cases with any (TTA) inferer and save the segmentations as NIfTI."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import nibabel as nib
import numpy as np
import torch
from monai.data import MetaTensor
from monai.inferers import Inferer
from monai.transforms import (
    Compose,
    EnsureChannelFirstd,
    EnsureTyped,
    LoadImaged,
    Orientation,
    Orientationd,
    SaveImage,
)
from tqdm.auto import tqdm

from jcsaug.data.roi import ROI_KEY, ThresholdROId, mask_outside_roi
from jcsaug.evaluation.metrics import (
    ComponentClasses,
    component_classes,
    largest_connected_component,
    parse_component_classes,
)

#: the axis labels of ``Orientationd`` and ``nib.aff2axcodes`` (RAS+ world: the first label is the negative end)
_AXIS_LABELS = (("L", "R"), ("P", "A"), ("I", "S"))


def _case_name(entry: Mapping, image_key: str) -> str:
    return Path(str(entry[image_key])).name.replace(".nii.gz", "").replace(".nii", "")


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
) -> list[Path]:
    """Segment every case (``{"image": path}``) and write ``<name>_seg.nii.gz`` files (uint8 class maps) to
    ``output_dir``.

    Images are read in ``orientation`` (RAS, as in training; ``None`` keeps the stored axes) and passed through
    ``preprocess`` (e.g. the dataset's intensity normalisation); the segmentation is turned back to the image's
    stored axes before it is saved, so it has the input's shape and affine voxel for voxel.
    ``keep_largest_component``: post-process as the evaluation does
    (:func:`~jcsaug.evaluation.metrics.largest_connected_component`): False, True (every foreground class) or the
    foreground class ids to post-process, e.g. ``[1, 3]`` (:func:`~jcsaug.evaluation.metrics.component_classes`;
    its form is checked first, its classes against the network's on the first case, before anything is written).
    ``roi_threshold``: the task's region of interest (:class:`~jcsaug.data.ThresholdROId`, computed on the image as
    read, before ``preprocess``: HU for CT): the segmentation is background outside it, as in the evaluation;
    None: not masked. The network is moved to ``device`` and put in eval mode. Two inputs whose file names give the
    same output name are refused before anything is written.
    """
    missing = [dict(entry) for entry in cases if image_key not in entry]
    if missing:
        raise KeyError(f"case {missing[0]} has no {image_key!r} entry")
    clashes = sorted(name for name, n in Counter(_case_name(e, image_key) for e in cases).items() if n > 1)
    if clashes:
        raise ValueError(
            f"several input images are named {clashes}: their segmentations would overwrite each other in "
            f"{output_dir}; give the images distinct file names"
        )
    parse_component_classes(keep_largest_component)  # a bad form fails before any inference
    steps = [LoadImaged(image_key, image_only=True), EnsureChannelFirstd(image_key)]
    if orientation:
        steps.append(Orientationd(image_key, axcodes=orientation, labels=_AXIS_LABELS))
    steps.append(ThresholdROId(image_key, roi_threshold))  # a no-op without a threshold
    if preprocess is not None:
        steps.append(preprocess)
    load = Compose([*steps, EnsureTyped(image_key, dtype=torch.float32)])
    saver = SaveImage(
        output_dir=str(output_dir), output_postfix="seg", separate_folder=False, resample=False, print_log=False,
        output_dtype=np.uint8,
    )  # fmt: skip
    written = []
    network.to(device).eval()  # a network built on the CPU (a bundle's network_def) follows its inputs to the GPU
    with torch.no_grad():
        for entry in tqdm(cases, desc="predict", disable=not progress):
            data = load(dict(entry))
            image = data[image_key]
            logits = inferer(image.unsqueeze(0).to(device), network)
            roi = data.get(ROI_KEY) if roi_threshold is not None else None
            seg = mask_outside_roi(logits.argmax(1).to(torch.uint8).cpu(), roi)
            classes = component_classes(keep_largest_component, logits.shape[1])
            if classes:
                seg = largest_connected_component(seg[0], logits.shape[1], classes=classes).to(torch.uint8)[None]
            out = MetaTensor(seg, meta=dict(image.meta)) if isinstance(image, MetaTensor) else seg
            if orientation and isinstance(image, MetaTensor) and "original_affine" in image.meta:
                # back to the stored axes: the saved map has the input's shape and affine, not the RAS grid's
                stored = "".join(nib.aff2axcodes(np.asarray(image.meta["original_affine"]), labels=_AXIS_LABELS))
                out = Orientation(axcodes=stored, labels=_AXIS_LABELS)(out)
            saver(out)
            written.append(Path(output_dir) / f"{_case_name(entry, image_key)}_seg.nii.gz")
    return written
