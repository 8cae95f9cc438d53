"""The task's region of interest (KiTS: the reference code's body mask): computed at load, background patch centres
drawn inside it, predictions outside it set to background in the evaluation, the post-processing choice and the
saved segmentations."""

from __future__ import annotations

import json

import nibabel as nib
import numpy as np
import pytest
import torch
from monai.inferers import SimpleInferer

from jcsaug.data import ROI_KEY, ThresholdROId, mask_outside_roi, threshold_roi
from jcsaug.tasks import get_task


def _body(shape=(20, 18, 16)) -> tuple[torch.Tensor, np.ndarray]:
    """A CT-like volume in HU: air (-1000) around a body (40 HU) holding an air pocket (a hole), a bright blob
    apart from the body (smaller: not the largest component) and a voxel at exactly -200; and the expected ROI."""
    image = np.full(shape, -1000.0, np.float32)
    image[3:17, 3:15, 2:14] = 40.0  # the body
    image[8:11, 7:10, 6:9] = -950.0  # a closed air pocket: a hole, filled
    image[0:2, 0:2, 0:2] = 300.0  # a separate blob (a table, another object): left out
    image[3, 3, 1] = -200.0  # touches the body but is not above the threshold
    expected = np.zeros(shape, np.uint8)
    expected[3:17, 3:15, 2:14] = 1
    return torch.as_tensor(image)[None], expected


def test_the_roi_is_the_largest_component_above_the_threshold_with_its_holes_filled():
    image, expected = _body()
    np.testing.assert_array_equal(threshold_roi(image, -200.0)[0].numpy(), expected)
    assert threshold_roi(image, -200.0).dtype == torch.uint8 and threshold_roi(image, -200.0).shape == image.shape
    assert not threshold_roi(image, 1000.0).any()  # nothing above: empty, the transform refuses it


def test_the_roi_transform_adds_the_roi_or_nothing_and_names_the_file_of_an_image_without_one():
    image, expected = _body()
    out = ThresholdROId("image", -200.0)({"image": image, "label": torch.zeros_like(image)})
    np.testing.assert_array_equal(out[ROI_KEY][0].numpy(), expected)
    assert ROI_KEY not in ThresholdROId("image", None)({"image": image})  # no threshold: the data unchanged
    with pytest.warns(UserWarning, match=r"every voxel of 'image' is in the ROI \(threshold -2000, image minimum "
                                         r"-1000\): nothing is masked"):  # fmt: skip
        assert ThresholdROId("image", -2000.0)({"image": image})[ROI_KEY].all()
    from monai.data import MetaTensor

    mr = MetaTensor(
        torch.linspace(0, 1, 512).reshape(1, 8, 8, 8), meta={"filename_or_obj": "/data/images/case_7.nii.gz"}
    )
    with pytest.raises(ValueError, match=r"case /data/images/case_7.nii.gz: no voxel of 'image' is above the ROI "
                                         r"threshold 5 \(its range is \[0, 1\]\)"):  # fmt: skip
        ThresholdROId("image", 5.0)({"image": mr})
    for bad in (float("nan"), "abc", True, [1]):
        with pytest.raises(ValueError, match=r"^roi_threshold must be a finite number \(HU for CT\) or None, not "):
            ThresholdROId("image", bad)
    assert ThresholdROId("image", "-200").threshold == -200.0  # a command line's string


def test_mask_outside_roi_clears_the_predictions_outside_and_checks_shapes():
    seg = torch.ones(4, 5, 6, dtype=torch.long)
    roi = torch.zeros(1, 4, 5, 6, dtype=torch.uint8)
    roi[0, 1:3, 1:4, 2:5] = 1
    masked = mask_outside_roi(seg, roi)
    assert masked.sum() == 2 * 3 * 3 and masked.dtype == seg.dtype
    assert torch.equal(mask_outside_roi(seg[None, None], roi)[0, 0], masked)  # (N, 1, *spatial) as the argmax keeps
    assert mask_outside_roi(seg, None) is seg
    with pytest.raises(ValueError, match=r"ROI of shape \(4, 5, 7\) does not match the segmentation's \(4, 5, 6\)"):
        mask_outside_roi(seg, torch.ones(1, 4, 5, 7))


class _Everywhere(torch.nn.Module):
    """Logits of class 1 at every voxel: every prediction outside the ROI is a false positive."""

    def forward(self, x):
        return torch.stack([torch.zeros_like(x[:, 0]), torch.ones_like(x[:, 0])], 1)


def test_evaluation_and_the_post_processing_choice_mask_predictions_outside_the_roi(tmp_path):
    from jcsaug.evaluation import choose_component_classes, evaluate_cases

    image, roi = _body()
    label = torch.as_tensor(roi)[None]  # the truth is the body: inside the ROI the prediction is right
    data = {"image": image, "label": label, ROI_KEY: torch.as_tensor(roi)[None]}
    args = (_Everywhere(), [{"image": "a"}])
    masked = evaluate_cases(*args, lambda e: data, {"none": SimpleInferer()}, 2, spacing=1.0, progress=False)
    row = masked["none"]["per_case"][0]
    assert row["dice"] == [pytest.approx(1.0)] and row["roi_masked"] is True
    without = {k: v for k, v in data.items() if k != ROI_KEY}
    plain = evaluate_cases(*args, lambda e: without, {"none": SimpleInferer()}, 2, spacing=1.0, progress=False)
    assert plain["none"]["per_case"][0]["dice"][0] < 0.8 and plain["none"]["per_case"][0]["roi_masked"] is False
    ignored = evaluate_cases(*args, lambda e: data, {"none": SimpleInferer()}, 2, spacing=1.0, progress=False,
                             roi_key=None)  # fmt: skip
    assert ignored["none"]["per_case"][0]["dice"] == plain["none"]["per_case"][0]["dice"]
    # the choice of post-processed classes is made on the masked predictions too
    dice = {}
    for name, case in (("masked", data), ("plain", without)):
        out = tmp_path / f"{name}.json"
        choose_component_classes(_Everywhere(), [{"image": "a"}], lambda e, case=case: case, SimpleInferer(), 2,
                                 progress=False, output_path=out)  # fmt: skip
        dice[name] = json.loads(out.read_text())["validation_dice"]["1"]["without"]
    assert dice["masked"] == pytest.approx(1.0) and dice["plain"] < 0.8


def test_predict_cases_masks_the_saved_segmentation_with_the_roi_of_the_image_as_read(tmp_path):
    from jcsaug.inference import predict_cases

    image, roi = _body()
    path = tmp_path / "case.nii.gz"
    nib.save(nib.Nifti1Image(image[0].numpy(), np.diag([1.6, 1.6, 3.2, 1.0])), path)
    for threshold, expected in ((-200.0, roi), (None, np.ones_like(roi))):
        out = tmp_path / f"out_{threshold}"
        (written,) = predict_cases(_Everywhere(), [{"image": str(path)}], SimpleInferer(), out, progress=False,
                                   roi_threshold=threshold)  # fmt: skip
        np.testing.assert_array_equal(np.asarray(nib.load(str(written)).dataobj), expected)


def test_kits_has_the_reference_body_roi_and_no_other_task_an_roi():
    from jcsaug.tasks import TASKS

    assert get_task("kits19_tumor").roi_threshold == -200.0
    assert {name for name in TASKS if get_task(name).roi_threshold is not None} == {"kits19_tumor"}
