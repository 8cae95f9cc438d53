"""Predict whole cases with any (TTA) inferer and save the segmentations as NIfTI."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from monai.data import MetaTensor
from monai.inferers import Inferer
from monai.transforms import Compose, EnsureChannelFirstd, EnsureTyped, LoadImaged, Orientationd, SaveImage
from tqdm.auto import tqdm


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
) -> list[Path]:
    """Segment every case (``{"image": path}``) and write ``<name>_seg.nii.gz`` files to ``output_dir``.

    Images are read in ``orientation`` (RAS, as in training; ``None`` keeps the stored axes) and passed through
    ``preprocess`` (e.g. the dataset's intensity normalisation); the saved label carries the image's affine,
    so it overlays the input image in any viewer. The network is moved to ``device`` and put in eval mode.
    """
    steps = [LoadImaged(image_key, image_only=True), EnsureChannelFirstd(image_key)]
    if orientation:
        steps.append(Orientationd(image_key, axcodes=orientation, labels=(("L", "R"), ("P", "A"), ("I", "S"))))
    if preprocess is not None:
        steps.append(preprocess)
    load = Compose([*steps, EnsureTyped(image_key, dtype=torch.float32)])
    saver = SaveImage(
        output_dir=str(output_dir), output_postfix="seg", separate_folder=False, resample=False, print_log=False
    )
    written = []
    network.to(device).eval()  # a network built on the CPU (a bundle's network_def) follows its inputs to the GPU
    with torch.no_grad():
        for entry in tqdm(cases, desc="predict", disable=not progress):
            if image_key not in entry:
                raise KeyError(f"case {dict(entry)} has no {image_key!r} entry")
            image = load(dict(entry))[image_key]
            logits = inferer(image.unsqueeze(0).to(device), network)
            seg = logits.argmax(1).to(torch.uint8).cpu()
            out = MetaTensor(seg, meta=dict(image.meta)) if isinstance(image, MetaTensor) else seg
            saver(out)
            name = Path(str(entry[image_key])).name.replace(".nii.gz", "").replace(".nii", "")
            written.append(Path(output_dir) / f"{name}_seg.nii.gz")
    return written
