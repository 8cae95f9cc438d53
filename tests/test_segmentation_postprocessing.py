"""The user's MONAI post-processing of each prediction (``class_map``): what the evaluation scores, the
largest-component choice reads and the inference saves, so the three agree; bad results refused naming the method."""

from __future__ import annotations

import re

import nibabel as nib
import numpy as np
import pytest
import torch
from monai.data import MetaTensor
from monai.inferers import SimpleInferer
from monai.transforms import Activationsd, AsDiscreted, Compose, FillHolesd

from jcsaug.engine import RunSummary
from jcsaug.evaluation import choose_component_classes, class_map, evaluate_cases

ARGMAX = Compose([Activationsd("pred", softmax=True), AsDiscreted("pred", argmax=True)])
FILLED = Compose([AsDiscreted("pred", argmax=True), FillHolesd("pred")])


def test_the_class_map_is_the_argmax_or_what_the_postprocessing_makes_of_the_prediction():
    torch.manual_seed(0)
    logits = torch.randn(1, 3, 4, 5, 6)
    label = torch.randint(0, 3, (1, 4, 5, 6))
    image = MetaTensor(torch.rand(1, 4, 5, 6), affine=torch.diag(torch.tensor([2.0, 1.5, 1.0, 1.0])))
    data = {"image": image, "label": label}
    assert torch.equal(class_map(logits, 3), logits.argmax(1)[0])
    assert torch.equal(class_map(logits, 3, ARGMAX, data), logits.argmax(1)[0])  # one channel of class ids
    assert torch.equal(class_map(logits, 3, lambda d: {**d, "pred": -d["pred"]}, data), logits.argmin(1)[0])
    assert torch.equal(class_map(logits, 3, lambda d: {**d, "pred": d["label"]}, data), label[0])  # the case's keys
    seen = {}

    def spy(d):
        seen.update(d)
        d["pred"].zero_()  # changed in place: the output (a blend's member output is kept) must not be
        return d

    before = logits.clone()
    assert torch.equal(class_map(logits, 3, spy, data), torch.zeros(4, 5, 6, dtype=torch.long))
    assert torch.equal(logits, before)
    assert isinstance(seen["pred"], MetaTensor) and torch.equal(seen["pred"].affine, image.affine)


@pytest.mark.parametrize(
    "result, message",
    [
        (lambda d: d["pred"], "must return a dict holding 'pred', not a Tensor"),
        (lambda d: {"seg": d["pred"]}, r"not a dict without it \(keys \['seg'\]\)"),
        (lambda d: {"pred": d["pred"][:2]}, r"'pred' of shape \(2, 4, 5, 6\); expected \(3, 4, 5, 6\) class scores"),
        (lambda d: {"pred": d["pred"][:1, :3]}, r"'pred' of shape \(1, 3, 5, 6\); expected"),
        (lambda d: {"pred": d["pred"] * float("nan")}, r"class scores that are not all finite \(360 NaN or infinite"),
        (lambda d: {"pred": torch.full((1, 4, 5, 6), 0.5)}, r"values that are not class ids 0..2 \(from 0.5 to 0.5\)"),
        (lambda d: {"pred": torch.full((1, 4, 5, 6), 3)}, r"not class ids 0..2 \(from 3 to 3\)"),
        (lambda d: {"pred": torch.full((1, 4, 5, 6), -1)}, r"not class ids 0..2 \(from -1 to -1\)"),
    ],
)
def test_a_postprocessing_result_that_is_no_class_map_is_refused_naming_the_method(result, message):
    with pytest.raises(ValueError, match=f"^the postprocessing of method 'learned' .*{message}"):
        class_map(torch.randn(1, 3, 4, 5, 6), 3, result, {}, "method 'learned'")


def _case(hole: bool = False, island: bool = False) -> dict:
    """A cube (the label) and the image the oracle network segments: the cube with a voxel missing inside it, and a
    one-voxel false positive apart from it, as asked."""
    label = torch.zeros(1, 8, 8, 8)
    label[0, 2:5, 2:5, 2:5] = 1
    image = label.clone()
    if hole:
        image[0, 3, 3, 3] = 0
    if island:
        image[0, 7, 7, 7] = 1
    return {"image": image * 2 - 1, "label": label}


class _Oracle(torch.nn.Module):
    """Logits whose argmax is the (binary) image itself."""

    def forward(self, x):
        return torch.cat([-x, x], dim=1)


def test_the_evaluation_scores_every_methods_prediction_after_the_postprocessing(tmp_path):
    """MONAI's ``FillHolesd`` as the postprocessing fills the prediction's hole before it is scored, for every
    method; the built-in largest component follows it; a postprocessing that reads the case's label scores 1; a bad
    one fails the case, named with its method."""
    inferers = {"none": SimpleInferer(), "other": SimpleInferer()}

    def evaluate(case, **kwargs):
        return evaluate_cases(_Oracle(), [{"image": "a"}], lambda e: case, inferers, 2, spacing=1.0, progress=False,
                              **kwargs)  # fmt: skip

    holed = _case(hole=True, island=True)
    plain = evaluate(holed)
    assert plain["none"]["per_case"][0]["dice"] == pytest.approx([2 * 26 / (27 + 27)])
    filled = evaluate(holed, postprocessing=FILLED)
    assert [filled[m]["per_case"][0]["dice"] for m in inferers] == [pytest.approx([2 * 27 / (27 + 28)])] * 2
    both = evaluate(holed, postprocessing=FILLED, keep_largest_component=True)
    assert [both[m]["mean_dice"] for m in inferers] == [1.0, 1.0]
    # recorded in metrics.json and named by the run summary
    assert plain["none"]["segmentation_postprocessing"] is None
    assert filled["none"]["segmentation_postprocessing"] == "AsDiscreted, FillHolesd"
    lines = RunSummary(tmp_path).lines(filled)
    assert "  predictions post-processed by AsDiscreted, FillHolesd (segmentation_postprocessing)" in lines
    assert not [line for line in RunSummary(tmp_path).lines(plain) if "post-processed" in line]
    truth = evaluate(holed, postprocessing=lambda d: {**d, "pred": d["label"]})
    assert {m: r["mean_dice"] for m, r in truth.items()} == {"none": 1.0, "other": 1.0}
    with pytest.raises(ValueError, match=r"a: .*the postprocessing of method 'none' returned 'pred' of shape"):
        with pytest.warns(UserWarning, match="evaluation of case a failed"):
            evaluate(holed, postprocessing=lambda d: {**d, "pred": d["pred"][None]},
                     output_path=tmp_path / "metrics.json")  # fmt: skip
    assert (tmp_path / "metrics.json").is_file()  # the failure is recorded in the files, then raised


def test_the_largest_component_is_chosen_on_the_postprocessed_predictions():
    """Without postprocessing the island makes the largest component help; after a postprocessing that leaves no
    island it does not, so the choice is made on what the evaluation will score."""
    case = _case(island=True)
    choose = dict(network=_Oracle(), cases=[{"image": "a"}], load=lambda e: case, inferer=SimpleInferer(),
                  num_classes=2, progress=False)  # fmt: skip
    assert choose_component_classes(**choose) == (1,)
    assert choose_component_classes(**choose, postprocessing=lambda d: {**d, "pred": d["label"]}) == ()


class _Threshold(torch.nn.Module):
    """Voxel-wise 'network': class 1 where the image is above 0.5."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([0.5 - x, x - 0.5], dim=1)


def test_saved_predictions_are_postprocessed_as_the_evaluation_and_keep_the_input_grid(tmp_path):
    """``predict_cases`` (the parts of ``inference.yaml``) with MONAI's ``FillHolesd`` as the postprocessing saves the
    filled map on the image's own axes, the built-in largest component after it; a bad one is refused, nothing
    written."""
    from jcsaug.inference import predict_cases

    raw = np.zeros((12, 10, 8), np.float32)
    raw[2:6, 3:7, 1:5] = 1.0
    raw[3, 4, 2] = 0.0  # a hole in the lesion
    raw[10, 8, 6] = 1.0  # a one-voxel blob apart from it
    affine = np.array([[0, 0, -2.0, 10], [-1.5, 0, 0, 5], [0, 1.0, 0, -3], [0, 0, 0, 1]])  # axes permuted, flipped
    path = tmp_path / "case.nii.gz"
    nib.save(nib.Nifti1Image(raw, affine), path)
    filled = (raw > 0.5).astype(np.uint8)
    filled[3, 4, 2] = 1
    largest = filled.copy()
    largest[10, 8, 6] = 0
    for name, keep, expected in (("filled", False, filled), ("largest", True, largest)):
        (written,) = predict_cases(_Threshold(), [{"image": str(path)}], SimpleInferer(), tmp_path / name,
                                   progress=False, keep_largest_component=keep,
                                   segmentation_postprocessing=FILLED)  # fmt: skip
        saved = nib.load(str(written))
        np.testing.assert_allclose(saved.affine, affine, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(saved.dataobj), expected, err_msg=name)
    with pytest.raises(ValueError, match="the postprocessing of 'pred' returned 'pred' of shape"):
        predict_cases(_Threshold(), [{"image": str(path)}], SimpleInferer(), tmp_path / "bad", progress=False,
                      segmentation_postprocessing=lambda d: {**d, "pred": d["pred"][None]})  # fmt: skip
    assert not list(tmp_path.glob("bad/*"))


def test_the_report_says_when_the_methods_it_compares_were_post_processed_differently(tmp_path):
    """``jcsaug report`` reads each run's ``metrics.json`` beside its ``per_case.csv``: runs evaluated with
    different post-processing get a note naming each method's; alike (or unrecorded), none."""
    from jcsaug.evaluation import build_report

    case = _case(hole=True, island=True)
    for run, settings in (("plain", {}), ("filled", {"postprocessing": FILLED, "keep_largest_component": True})):
        evaluate_cases(_Oracle(), [{"image": "a"}], lambda e: case, {"none": SimpleInferer()}, 2, spacing=1.0,
                       progress=False, output_path=tmp_path / run / "metrics.json", **settings)  # fmt: skip
    both = build_report([tmp_path / "plain", tmp_path / "filled"]).to_markdown()
    assert both.endswith("The methods' predictions were post-processed differently: plain/none: none; filled/none: "
                         "AsDiscreted, FillHolesd then largest component of classes [1].\n")  # fmt: skip
    assert "post-processed" not in build_report([tmp_path / "plain"]).to_markdown()
    (tmp_path / "filled" / "metrics.json").unlink()  # a report needs only the CSV: nothing said then
    assert "post-processed" not in build_report([tmp_path / "plain", tmp_path / "filled"]).to_markdown()


def test_a_postprocessing_that_is_not_callable_is_refused_where_it_is_given():
    """The evaluation and the inference's class map refuse it when built, before any case is segmented."""
    from jcsaug.inference.pipeline import LogitsToSegmentationd

    message = "postprocessing must be callable (MONAI transforms), not str"
    with pytest.raises(TypeError, match=rf"^{re.escape(message)}$"):
        evaluate_cases(_Oracle(), [{"image": "a"}], lambda e: _case(), {"none": SimpleInferer()}, 2, spacing=1.0,
                       progress=False, postprocessing="FillHolesd")  # fmt: skip
    with pytest.raises(TypeError, match=rf"^{re.escape(message)}$"):
        LogitsToSegmentationd("pred", postprocessing="FillHolesd")


def test_the_report_compares_a_run_with_its_evaluation_by_evaluate_yaml(tmp_path):
    """``jcsaug report RUN RUN/per_case_evaluate.csv``: the training run's evaluation beside ``evaluate.yaml``'s
    (written as the bundle writes it: ``evaluation_file_names``), the second named ``run:evaluate``, its
    post-processing read from ``metrics_evaluate.json`` beside it."""
    from jcsaug.evaluation import build_report, evaluation_file_names

    case = _case(hole=True, island=True)
    run = tmp_path / "run"
    metrics_name, csv_name = evaluation_file_names("test")
    for settings, metrics_path, csv_path in (
        ({}, run / "metrics.json", None),
        ({"postprocessing": FILLED}, run / metrics_name, run / csv_name),
    ):
        evaluate_cases(_Oracle(), [{"image": "a"}], lambda e: case, {"none": SimpleInferer()}, 2, spacing=1.0,
                       progress=False, output_path=metrics_path, csv_path=csv_path, **settings)  # fmt: skip
    report = build_report([run, run / csv_name], baseline="run/none")
    assert report.methods == ["run/none", "run:evaluate/none"]
    assert report.dice_improvement["run:evaluate/none"] > 0  # the hole filled
    assert report.to_markdown().endswith("The methods' predictions were post-processed differently: run/none: none; "
                                         "run:evaluate/none: AsDiscreted, FillHolesd.\n")  # fmt: skip
    assert build_report([run / csv_name]).methods == ["none"]  # one input: the CSV's own method names
