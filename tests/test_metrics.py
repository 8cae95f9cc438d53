"""Per-case metrics (SPEC §6) against hand-computed values, empty-mask conventions, LCC and evaluate_cases."""

from __future__ import annotations

import csv
import json
import logging
import math
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from monai.data import MetaTensor
from monai.inferers import Inferer, SimpleInferer
from scipy import ndimage

from jcsaug.evaluation import (
    build_report,
    case_dice,
    case_metrics,
    case_spacing,
    evaluate_cases,
    largest_connected_component,
    summarize_cases,
)


def _vol(shape=(10, 10, 10)) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.long)


def _brute_force_hd95(pred: np.ndarray, true: np.ndarray, spacing) -> float:
    """Symmetric HD95 by hand: edges = mask minus its erosion, all pairwise distances in mm."""

    def edge_points(mask):
        padded = np.pad(mask, 1)
        edges = padded & ~ndimage.binary_erosion(padded)
        return np.argwhere(edges) * np.asarray(spacing, dtype=float)

    p, t = edge_points(pred.astype(bool)), edge_points(true.astype(bool))
    d = np.sqrt(((p[:, None, :] - t[None, :, :]) ** 2).sum(-1))
    return float(max(np.percentile(d.min(1), 95), np.percentile(d.min(0), 95)))


def test_overlapping_cubes_match_hand_computed_values():
    pred, true = _vol(), _vol()
    pred[2:6, 2:6, 2:6] = 1  # 64 voxels
    true[2:8, 2:6, 2:6] = 1  # 96 voxels, containing the prediction: TP 64, FP 0, FN 32
    m = case_metrics(pred, true, num_classes=2, spacing=(1.0, 1.0, 1.0))
    assert m["dice"] == pytest.approx([2 * 64 / (64 + 96)])
    assert m["sensitivity"] == pytest.approx([64 / 96])
    assert m["precision"] == pytest.approx([1.0])
    assert m["status"] == ["ok"]
    # the true cube extends 2 voxels further along axis 0; with 2.5 mm there, HD95 <= 5 mm and > 0
    m = case_metrics(pred, true, 2, spacing=(2.5, 1.0, 1.0))
    assert 0 < m["hd95"][0] <= 5.0
    assert m["hd95"][0] == pytest.approx(_brute_force_hd95(pred.numpy(), true.numpy(), (2.5, 1, 1)), abs=1e-4)
    # agrees with the Dice used so far
    logits = torch.nn.functional.one_hot(pred, 2).permute(3, 0, 1, 2)[None].float()
    assert case_dice(logits, true[None, None], 2) == pytest.approx(m["dice"])


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_hd95_of_shifted_planes_uses_anisotropic_spacing(axis):
    spacing = [1.0, 1.0, 1.0]
    spacing[axis] = 3.0
    pred, true = _vol((6, 6, 6)), _vol((6, 6, 6))
    index = [slice(None)] * 3
    index[axis] = 2
    pred[tuple(index)] = 1
    index[axis] = 3
    true[tuple(index)] = 1
    assert case_metrics(pred, true, 2, spacing)["hd95"] == pytest.approx([3.0])  # one voxel along the 3 mm axis
    other = [0.5, 0.5, 0.5]
    other[(axis + 1) % 3] = 3.0  # the 3 mm axis is another one: the planes are 0.5 mm apart
    assert case_metrics(pred, true, 2, other)["hd95"] == pytest.approx([0.5])


def test_hd95_matches_brute_force_on_irregular_masks():
    rng = np.random.RandomState(0)
    spacing = (0.8, 1.5, 3.0)
    for _ in range(3):
        pred = ndimage.binary_dilation(rng.rand(9, 8, 7) > 0.93, iterations=1)
        true = ndimage.binary_dilation(rng.rand(9, 8, 7) > 0.93, iterations=1)
        m = case_metrics(torch.as_tensor(pred.astype(np.int64)), true.astype(np.int64), 2, spacing)
        assert m["hd95"][0] == pytest.approx(_brute_force_hd95(pred, true, spacing), rel=1e-5)


def test_empty_mask_conventions():
    true, pred = _vol(), _vol()
    true[1:4, 1:4, 1:4] = 1  # class 1 only in the label
    pred[6:9, 6:9, 6:9] = 2  # class 2 only in the prediction; class 3 absent from both
    m = case_metrics(pred, true, num_classes=4, spacing=1.0)
    assert m["status"] == ["prediction_empty", "label_empty", "both_empty"]
    assert m["dice"] == [0.0, 0.0, 1.0]
    assert m["sensitivity"][0] == 0.0 and math.isnan(m["sensitivity"][1]) and m["sensitivity"][2] == 1.0
    assert math.isnan(m["precision"][0]) and m["precision"][1] == 0.0 and m["precision"][2] == 1.0
    assert math.isnan(m["hd95"][0]) and math.isnan(m["hd95"][1]) and m["hd95"][2] == 0.0


def test_summary_counts_undefined_values_instead_of_averaging_them():
    rows = [
        {"dice": [0.5, 1.0], "sensitivity": [0.5, math.nan], "precision": [1.0, 0.0], "hd95": [2.0, math.nan]},
        {"dice": [0.7, 0.0], "sensitivity": [0.9, 0.0], "precision": [0.5, math.nan], "hd95": [4.0, math.nan]},
    ]
    s = summarize_cases(rows, num_classes=3)
    assert s["dice"]["mean"] == pytest.approx((0.75 + 0.35) / 2) and s["dice"]["n_undefined"] == 0
    assert s["sensitivity"]["per_class"] == pytest.approx([0.7, 0.0])
    assert s["sensitivity"]["n_undefined"] == 1 and s["sensitivity"]["n_undefined_per_class"] == [0, 1]
    assert s["sensitivity"]["mean"] == pytest.approx((0.5 + 0.45) / 2)
    assert s["hd95"]["mean"] == pytest.approx(3.0) and s["hd95"]["n_undefined"] == 2
    assert math.isnan(s["hd95"]["per_class"][1])


def test_largest_component_removes_a_small_island_per_class():
    pred, true = _vol(), _vol()
    true[2:5, 2:5, 2:5] = 1
    pred[2:5, 2:5, 2:5] = 1
    pred[8, 8, 8] = 1  # an island of class 1
    pred[0:2, 8:10, 0:2] = 2  # class 2: its only component stays
    kept = largest_connected_component(pred, num_classes=3)
    assert kept[8, 8, 8] == 0 and int((kept == 1).sum()) == 27 and int((kept == 2).sum()) == 8
    assert case_metrics(pred, true, 3, 1.0)["precision"][0] == pytest.approx(27 / 28)
    lcc = case_metrics(pred, true, 3, 1.0, keep_largest_component=True)
    assert lcc["precision"][0] == pytest.approx(1.0) and lcc["hd95"][0] == pytest.approx(0.0)
    assert lcc["status"] == ["ok", "label_empty"]
    with pytest.raises(ValueError, match="outside 0..1"):
        case_metrics(pred, true, 2, 1.0)


def _two_classes_two_components() -> torch.Tensor:
    """Classes 1 and 2, each a 27-voxel cube and a one-voxel island apart from it."""
    labels = _vol()
    labels[1:4, 1:4, 1:4] = 1
    labels[8, 8, 1] = 1
    labels[5:8, 5:8, 5:8] = 2
    labels[1, 8, 8] = 2
    return labels


#: where the islands of _two_classes_two_components are
_ISLANDS = {1: (8, 8, 1), 2: (1, 8, 8)}


def test_largest_component_only_of_the_chosen_classes():
    """A class that is rightly several components (both kidneys, multifocal lesions) is left alone: ``classes``
    (``keep_largest_component``) names the classes post-processed; True / None: all, False / []: none."""
    from jcsaug.evaluation import component_classes

    labels = _two_classes_two_components()
    for classes, removed in (([2], {2}), ((1, 2), {1, 2}), (None, {1, 2}), ([], set())):
        kept = largest_connected_component(labels, 3, classes=classes)
        expected = labels.clone()
        for c in removed:
            expected[_ISLANDS[c]] = 0
        assert torch.equal(kept, expected), classes
    truth = labels.clone()
    for at in _ISLANDS.values():
        truth[at] = 0
    island, none = 27 / 28, 1.0  # precision of a class with its island kept / removed
    cases = (([2], [island, none]), ("[2]", [island, none]), ((2,), [island, none]), (True, [none, none]),
             ("yes", [none, none]), ([1, 2], [none, none]), (False, [island, island]), ("false", [island, island]),
             ([], [island, island]))  # fmt: skip
    for value, precision in cases:
        values = case_metrics(labels, truth, 3, 1.0, keep_largest_component=value)
        assert values["precision"] == pytest.approx(precision), value
    assert component_classes(True, 3) == (1, 2) and component_classes(None, 3) == () == component_classes("0", 3)
    assert component_classes("[2, 1]", 3) == (1, 2) and component_classes([np.int64(2)], 3) == (2,)
    assert component_classes("task", 3, task_classes=[2]) == (2,) == component_classes(" Task", 4, (2,))
    with pytest.raises(ValueError, match=r"^keep_largest_component 'task': no task here"):
        component_classes("task", 3)  # a library call has no task: the bundles pass theirs


_FORMS = "must be true, false, task, validation or a list of distinct foreground class ids, e.g. [1, 3]"


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ([0, 2], f"class 0 is the background; {_FORMS}"),
        ([3], "class 3 is not a foreground class 1..2 (num_classes 3)"),
        ("[1, 3]", "class 3 is not a foreground class 1..2 (num_classes 3)"),
        ([-1], f"class id -1 is negative; {_FORMS}"),
        ([1.5], f"class id 1.5 is not an integer; {_FORMS}"),
        (["1"], f"class id '1' is not an integer; {_FORMS}"),
        ([True], f"class id True is not an integer; {_FORMS}"),
        ([2, 1, 2], f"class 2 is given twice; {_FORMS}"),
        ("maybe", _FORMS),
        (2, f"a bare number is ambiguous (the flag, or class 2?): write true/false or [2]; {_FORMS}"),
        (1, f"a bare number is ambiguous (the flag, or class 1?): write true/false or [1]; {_FORMS}"),  # was "true"
        ("[1,", f"not a list; {_FORMS}"),
        ({"classes": [1]}, _FORMS),
    ],
)  # fmt: skip
def test_bad_component_classes_are_refused_naming_the_value(value, reason):
    labels = _two_classes_two_components()
    message = f"keep_largest_component {value!r}: {reason}"
    with pytest.raises(ValueError) as err:
        case_metrics(labels, labels, 3, 1.0, keep_largest_component=value)
    assert str(err.value) == message
    if isinstance(value, list):
        with pytest.raises(ValueError) as err:
            largest_connected_component(labels, 3, classes=value)
        assert str(err.value) == message


class _OneHot(torch.nn.Module):
    """Logits whose argmax is the image's class map (3 classes)."""

    def forward(self, x):
        return torch.nn.functional.one_hot(x[:, 0].long(), 3).permute(0, 4, 1, 2, 3).float()


def test_evaluate_cases_keeps_the_largest_component_of_the_chosen_classes(tmp_path):
    labels = _two_classes_two_components()
    truth = labels.clone()
    for at in _ISLANDS.values():
        truth[at] = 0
    data = {"image": labels[None].float(), "label": truth[None]}
    for value, precision in (([2], [27 / 28, 1.0]), ("[2]", [27 / 28, 1.0]), (True, [1.0, 1.0]),
                             ("false", [27 / 28, 27 / 28])):  # fmt: skip
        metrics = evaluate_cases(_OneHot(), [{"image": "a"}], lambda e: data, {"none": SimpleInferer()}, 3,
                                 spacing=1.0, progress=False, keep_largest_component=value)  # fmt: skip
        assert metrics["none"]["per_case"][0]["precision"] == pytest.approx(precision), value
    out = tmp_path / "metrics.json"
    with pytest.raises(ValueError, match=r"^keep_largest_component \[3\]: class 3 is not a foreground class 1..2"):
        evaluate_cases(_OneHot(), [{"image": "a"}], lambda e: data, {"none": SimpleInferer()}, 3, spacing=1.0,
                       progress=False, output_path=out, keep_largest_component=[3])  # fmt: skip
    assert not out.exists()  # refused before any case is segmented


def test_case_spacing_sources(tmp_path):
    image = torch.zeros(1, 4, 5, 6)
    assert case_spacing({"image": image, "sp": [2.0, 2.0, 3.0]}, {}, spacing_key="sp") == (
        [2.0, 2.0, 3.0],
        "data['sp']",
    )
    meta = MetaTensor(image, affine=torch.diag(torch.tensor([2.0, 3.0, 4.0, 1.0])))
    assert case_spacing({"image": meta}, {})[0] == pytest.approx([2.0, 3.0, 4.0])
    assert case_spacing({"image": image, "image_meta_dict": {"pixdim": [1, 0.5, 0.6, 0.7, 1]}}, {})[0] == pytest.approx(
        [0.5, 0.6, 0.7]
    )
    path = tmp_path / "img.nii.gz"
    nib.save(nib.Nifti1Image(np.zeros((4, 5, 6), np.float32), np.diag([1.0, 2.0, 3.0, 1.0])), path)
    assert case_spacing({"image": image}, {"image": str(path)}) == ([1.0, 2.0, 3.0], "image file header")
    # stored in LPS-like order (axes permuted): a loader reorienting to RAS sees the zooms permuted too
    affine = np.array([[0, 0, 3.0, 0], [1.0, 0, 0, 0], [0, 2.0, 0, 0], [0, 0, 0, 1]])
    nib.save(nib.Nifti1Image(np.zeros((4, 5, 6), np.float32), affine), path)
    assert case_spacing({"image": image}, {"image": str(path)})[0] == pytest.approx([1.0, 2.0, 3.0])
    assert case_spacing({"image": torch.zeros(1, 6, 4, 5)}, {"image": str(path)})[0] == pytest.approx([3.0, 1.0, 2.0])
    assert case_spacing({"image": torch.zeros(1, 7, 7, 7)}, {"image": str(path)}) == (None, "unknown")


class _EmptyInferer(Inferer):
    """Predicts background everywhere."""

    def __call__(self, inputs, network, *args, **kwargs):
        logits = torch.zeros(inputs.shape[0], 2, *inputs.shape[2:])
        logits[:, 0] = 1.0
        return logits


class _Oracle(torch.nn.Module):
    """Logits whose argmax is the (binary) image itself."""

    def forward(self, x):
        return torch.cat([-x, x], dim=1)


def test_evaluate_cases_writes_csv_and_summaries(tmp_path):
    volumes = {}
    for name, offset in (("a", 0), ("b", 2)):
        label = torch.zeros(1, 8, 8, 8)
        label[0, 2 + offset : 5 + offset, 2:5, 2:5] = 1
        image = label.clone()
        image[0, 0, 0, 0] = 1  # a false-positive island, removed by LCC
        volumes[name] = {
            "image": MetaTensor(image * 2 - 1, affine=torch.diag(torch.tensor([2.0, 1, 1, 1]))),
            "label": label,
        }
    cases = [{"image": "a"}, {"image": "b"}]
    inferers = {"none": SimpleInferer(), "empty": _EmptyInferer()}
    out = tmp_path / "run" / "metrics.json"

    def load(entry):
        return volumes[entry["image"]]

    metrics = evaluate_cases(_Oracle(), cases, load, inferers, 2, output_path=out, progress=False)

    assert set(metrics) == {"none", "empty"}
    none, empty = metrics["none"], metrics["empty"]
    assert none["per_case"][0]["dice"] == pytest.approx([2 * 27 / 55])
    assert none["per_case"][0]["precision"] == pytest.approx([27 / 28])
    assert none["per_case"][0]["spacing"] == [2.0, 1.0, 1.0]
    assert none["mean_dice"] == pytest.approx(2 * 27 / 55) and len(none["per_case"]) == 2
    assert none["summary"]["hd95"]["n_undefined"] == 0
    assert empty["mean_dice"] == 0.0
    assert empty["summary"]["precision"]["n_undefined"] == 2 and math.isnan(empty["summary"]["precision"]["mean"])
    assert empty["summary"]["hd95"]["n_undefined"] == 2 and empty["summary"]["sensitivity"]["mean"] == 0.0
    assert empty["empty_cases"]["prediction_empty"] == [2]

    written = json.loads(out.read_text())
    assert written["empty"]["summary"]["precision"]["mean"] is None  # strict JSON: undefined -> null
    assert written["none"]["per_case"][1]["mean_dice"] == pytest.approx(none["per_case"][1]["mean_dice"])
    with (tmp_path / "run" / "per_case.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["method", "case", "class", "dice", "sensitivity", "precision", "hd95", "status"]
    assert [(r["method"], r["case"], r["class"]) for r in rows] == [
        ("none", "a", "1"), ("none", "b", "1"), ("empty", "a", "1"), ("empty", "b", "1"),
    ]  # fmt: skip
    assert rows[2]["precision"] == "nan" and rows[2]["status"] == "prediction_empty"

    lcc = evaluate_cases(_Oracle(), cases, load, {"none": SimpleInferer()}, 2,
                         keep_largest_component=True, csv_path=tmp_path / "lcc.csv", progress=False)  # fmt: skip
    assert lcc["none"]["mean_dice"] == pytest.approx(1.0) and (tmp_path / "lcc.csv").is_file()

    report = build_report([tmp_path / "run"], baseline="empty")
    assert report.dice_improvement["none"] == pytest.approx(100 * 2 * 27 / 55)


def test_evaluate_cases_warns_when_spacing_is_unknown():
    data = {"image": torch.ones(1, 4, 4, 4), "label": torch.ones(1, 4, 4, 4)}
    with pytest.warns(UserWarning, match="spacing unknown"):
        metrics = evaluate_cases(_Oracle(), [{"image": "x"}], lambda e: data, {"none": SimpleInferer()}, 2,
                                 progress=False)  # fmt: skip
    assert metrics["none"]["per_case"][0]["spacing"] == [1.0, 1.0, 1.0]
    metrics = evaluate_cases(_Oracle(), [{"image": "x"}], lambda e: data, {"none": SimpleInferer()}, 2,
                             spacing=(1.0, 2.0, 3.0), progress=False)  # fmt: skip
    assert metrics["none"]["per_case"][0]["spacing"] == [1.0, 2.0, 3.0]


def _load_good_or_bad(entry):
    """A case's tensors, or the error of an unreadable file for ``bad.nii.gz`` (module level: workers import it)."""
    if entry["image"] == "bad.nii.gz":
        raise RuntimeError("applying transform") from ValueError("cannot read bad.nii.gz: EOFError")
    return {"image": torch.ones(1, 4, 4, 4), "label": torch.ones(1, 4, 4, 4)}


@pytest.mark.parametrize(("strict", "workers"), [(True, 0), (False, 0), (False, 2)])
def test_a_failing_case_is_recorded_and_the_others_are_evaluated(tmp_path, strict, workers):
    """Issue 12 item 7: evaluation names a bad case, goes on, and writes the metrics of the good ones; so too when
    DataLoader workers load the cases (the error comes back from the worker as the case's record)."""
    cases = [{"image": "a.nii.gz"}, {"image": "bad.nii.gz"}, {"image": "c.nii.gz"}]
    out = tmp_path / "metrics.json"
    args = (_Oracle(), cases, _load_good_or_bad, {"none": SimpleInferer()}, 2)
    with pytest.warns(UserWarning, match=r"evaluation of case bad\.nii\.gz failed: ValueError: cannot read bad"):
        if strict:
            with pytest.raises(ValueError, match=r"evaluation failed for 1 of 3 cases .*\n  bad\.nii\.gz: ValueError"):
                evaluate_cases(*args, output_path=out, spacing=1.0, progress=False, num_workers=workers)
        else:
            evaluate_cases(*args, output_path=out, spacing=1.0, progress=False, strict=False, num_workers=workers)
    written = json.loads(out.read_text())["none"]
    assert [r["case"] for r in written["per_case"]] == ["a.nii.gz", "c.nii.gz"] and written["mean_dice"] == 1.0
    assert written["failed_cases"] == [{"case": "bad.nii.gz", "error": "ValueError: cannot read bad.nii.gz: EOFError"}]
    assert (tmp_path / "per_case.csv").read_text().count("nii.gz") == 2


class _DeviceSpy(_Oracle):
    """Records the devices it is moved to (CI has no GPU: the call is what can be checked)."""

    def __init__(self):
        super().__init__()
        self.moved_to: list[torch.device] = []
        self.trained_while_predicting: list[bool] = []

    def to(self, *args, **kwargs):
        self.moved_to.append(torch.device(args[0] if args else kwargs["device"]))
        return super().to(*args, **kwargs)

    def forward(self, x):
        self.trained_while_predicting.append(self.training)
        return super().forward(x)


def test_evaluation_and_prediction_move_the_network_to_their_device(tmp_path):
    """A bundle's evaluate / inference config passes ``network_def``, built on the CPU, with ``device`` cuda:
    both functions move the network there (on a GPU they failed with 'Input type (torch.cuda.FloatTensor) and
    weight type (torch.FloatTensor) should be the same')."""
    from jcsaug.inference import predict_cases

    data = {"image": torch.ones(1, 4, 4, 4), "label": torch.ones(1, 4, 4, 4)}
    network = _DeviceSpy()
    evaluate_cases(network, [{"image": "x"}, {"image": "y"}], lambda e: data, {"none": SimpleInferer()}, 2,
                   device="cpu", spacing=1.0, progress=False)  # fmt: skip
    assert network.moved_to == [torch.device("cpu")] and network.trained_while_predicting == [False, False]
    assert network.training  # (the evaluator, as MONAI's, gives the network back in the mode it was in)

    path = tmp_path / "case.nii.gz"
    nib.save(nib.Nifti1Image(np.ones((4, 4, 4), np.float32), np.eye(4)), path)
    network = _DeviceSpy()
    written = predict_cases(network, [{"image": str(path)}], SimpleInferer(), tmp_path / "out", device="cpu",
                            progress=False)  # fmt: skip
    assert network.moved_to == [torch.device("cpu")] and network.trained_while_predicting == [False]
    assert written[0].is_file()  # (MONAI's evaluator gives the network back in the mode it was in)


def test_evaluate_cases_gives_the_mean_dice_of_the_reported_classes(tmp_path):
    """Defect 4: a task's report_classes (KiTS: tumour) get their mean Dice in metrics.json, beside the all-class
    mean, equal to what ``jcsaug report --classes`` computes from per_case.csv."""
    volumes = []
    for offset in (0, 3):
        label = torch.zeros(1, 10, 10, 10)
        label[0, 1:5, 1:5, 1:5] = 1
        label[0, 5 + offset // 3 : 8, 5:8, 5:8] = 2
        volumes.append({"image": label.clone(), "label": label})

    class Shrunk(torch.nn.Module):  # predicts class 2 one voxel layer short: kidney perfect, tumour not
        def forward(self, x):
            pred = x.clone()
            pred[:, :, 5] = torch.where(pred[:, :, 5] == 2, torch.zeros_like(pred[:, :, 5]), pred[:, :, 5])
            return torch.nn.functional.one_hot(pred[:, 0].long(), 3).permute(0, 4, 1, 2, 3).float()

    cases = [{"image": "a", "i": 0}, {"image": "b", "i": 1}]
    out = tmp_path / "run" / "metrics.json"
    metrics = evaluate_cases(Shrunk(), cases, lambda e: volumes[e["i"]], {"none": SimpleInferer()}, 3,
                             output_path=out, spacing=1.0, progress=False,
                             report_classes={"tumour": (2,), "both": [1, 2]})  # fmt: skip
    reported = metrics["none"]["mean_dice_reported"]
    tumour = [row["dice"][1] for row in metrics["none"]["per_case"]]
    assert reported["tumour"] == {"classes": [2], "mean_dice": pytest.approx(sum(tumour) / 2)}
    assert reported["tumour"]["mean_dice"] < 1.0 and metrics["none"]["mean_dice_per_class"][0] == 1.0
    assert reported["both"]["mean_dice"] == pytest.approx(metrics["none"]["mean_dice"])
    assert json.loads(out.read_text())["none"]["mean_dice_reported"]["tumour"]["classes"] == [2]
    report = build_report([tmp_path / "run"], classes=[2])
    assert report.means["none"]["dice"] == pytest.approx(reported["tumour"]["mean_dice"])
    plain = evaluate_cases(Shrunk(), cases, lambda e: volumes[e["i"]], {"none": SimpleInferer()}, 3, spacing=1.0,
                           progress=False)  # fmt: skip
    assert "mean_dice_reported" not in plain["none"]  # without report_classes: metrics.json as before
    for bad in ({"x": [3]}, {"x": [0]}, {"x": []}):
        with pytest.raises(ValueError, match="not foreground classes 1..2"):
            evaluate_cases(Shrunk(), cases, lambda e: volumes[e["i"]], {"none": SimpleInferer()}, 3, spacing=1.0,
                           progress=False, report_classes=bad)  # fmt: skip


class _Threshold(torch.nn.Module):
    """Voxel-wise 'network': class 1 where the image is above 0.5."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([0.5 - x, x - 0.5], dim=1)


def test_saved_predictions_have_the_input_grid_uint8_and_optional_largest_component(tmp_path):
    """Read in RAS for the network, saved back on the image's own axes (shape, affine, voxel order), as uint8 class
    maps; ``keep_largest_component`` as the evaluation does; inputs of the same file name refused."""
    from monai.inferers import SimpleInferer

    from jcsaug.inference import predict_cases

    raw = np.zeros((12, 10, 8), np.float32)
    raw[2:6, 3:7, 1:4] = 1.0  # the lesion
    raw[10, 8, 6] = 1.0  # a one-voxel blob apart from it
    affine = np.array([[0, 0, -2.0, 10], [-1.5, 0, 0, 5], [0, 1.0, 0, -3], [0, 0, 0, 1]])  # axes permuted, flipped
    path = tmp_path / "in" / "case.nii.gz"
    path.parent.mkdir()
    nib.save(nib.Nifti1Image(raw, affine), path)
    for keep, out_dir in ((False, tmp_path / "plain"), (True, tmp_path / "largest")):
        written = predict_cases(_Threshold(), [{"image": str(path)}], SimpleInferer(), out_dir, progress=False,
                                keep_largest_component=keep)  # fmt: skip
        saved = nib.load(str(written[0]))
        np.testing.assert_allclose(saved.affine, affine, atol=1e-5)
        assert saved.get_data_dtype() == np.uint8
        expected = (raw > 0.5).astype(np.uint8)
        if keep:
            expected[10, 8, 6] = 0
        np.testing.assert_array_equal(np.asarray(saved.dataobj), expected)
    other = tmp_path / "other" / "case.nii.gz"
    other.parent.mkdir()
    nib.save(nib.Nifti1Image(raw, affine), other)
    with pytest.raises(
        ValueError, match=r"several input images would give the segmentation files \['case_seg.nii.gz'\]"
    ):
        predict_cases(_Threshold(), [{"image": str(path)}, {"image": str(other)}], SimpleInferer(), tmp_path / "x",
                      progress=False)  # fmt: skip
    assert not (tmp_path / "x").exists()
    # the paths returned are those MONAI's SaveImaged names: one extension less (two for .gz), dots kept
    for name, expected in (("scan.nii", "scan_seg.nii.gz"), ("case.v2.nii.gz", "case.v2_seg.nii.gz")):
        nib.save(nib.Nifti1Image(raw, affine), tmp_path / "in" / name)
        (written,) = predict_cases(_Threshold(), [{"image": str(tmp_path / "in" / name)}], SimpleInferer(),
                                   tmp_path / "names", progress=False)  # fmt: skip
        assert written == tmp_path / "names" / expected and written.is_file()
    from jcsaug.inference.pipeline import segmentation_path

    assert segmentation_path({"image": "a/img.mha"}, "out") == Path("out/img_seg.nii.gz")  # any reader's format


def test_predict_cases_reads_the_image_under_its_key(tmp_path):
    """Cases whose image is under another key than ``"image"`` (MONAI's engines read ``"image"`` by default)."""
    from jcsaug.inference import predict_cases

    raw = np.zeros((6, 5, 4), np.float32)
    raw[1:3, 2:4, 1:3] = 1.0
    nib.save(nib.Nifti1Image(raw, np.diag([-1.0, 1.0, 2.0, 1.0])), tmp_path / "t1.nii.gz")
    (written,) = predict_cases(_Threshold(), [{"t1": str(tmp_path / "t1.nii.gz")}], SimpleInferer(), tmp_path / "out",
                               image_key="t1", progress=False)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(nib.load(str(written)).dataobj), raw.astype(np.uint8))
    with pytest.raises(KeyError, match="has no 'image' entry"):
        predict_cases(_Threshold(), [{"t1": str(tmp_path / "t1.nii.gz")}], SimpleInferer(), tmp_path / "x",
                      progress=False)  # fmt: skip


def test_report_predictions_names_where_the_segmentations_are_and_a_missing_one(tmp_path, caplog):
    from jcsaug.inference import report_predictions

    cases = [{"image": "in/a.nii.gz"}, {"image": "in/b.nii"}]
    (tmp_path / "a_seg.nii.gz").touch()
    with pytest.raises(FileNotFoundError, match=r"1 of 2 segmentations were not written: \['.*b_seg.nii.gz'\]"):
        report_predictions(cases, tmp_path)
    (tmp_path / "b_seg.nii.gz").touch()
    with caplog.at_level("INFO", logger="jcsaug.inference"):
        paths = report_predictions(cases, tmp_path, "learned")
    assert paths == [tmp_path / "a_seg.nii.gz", tmp_path / "b_seg.nii.gz"]
    assert f"predicted 2 cases (test-time method learned): segmentations in {tmp_path}" in caplog.text


def test_saved_predictions_keep_the_largest_component_of_the_chosen_classes(tmp_path):
    """The saved maps are post-processed as the metrics are: the classes named only; bad classes refused before
    anything is written."""
    from jcsaug.inference import predict_cases

    labels = _two_classes_two_components().numpy().astype(np.float32)
    path = tmp_path / "case.nii.gz"
    nib.save(nib.Nifti1Image(labels, np.eye(4)), path)
    for i, (value, removed) in enumerate((([2], {2}), ("[2]", {2}), ((1, 2), {1, 2}), (True, {1, 2}), (False, ()))):
        written = predict_cases(_OneHot(), [{"image": str(path)}], SimpleInferer(), tmp_path / f"out{i}",
                                progress=False, keep_largest_component=value)  # fmt: skip
        expected = labels.astype(np.uint8)
        for c in removed:
            expected[_ISLANDS[c]] = 0
        np.testing.assert_array_equal(np.asarray(nib.load(str(written[0])).dataobj), expected, err_msg=str(value))
    for value, message in (([3], r"keep_largest_component \[3\]: class 3 is not a foreground class 1..2"),
                           ([0], r"keep_largest_component \[0\]: class 0 is the background"),
                           ("task", "keep_largest_component 'task': no task here")):  # fmt: skip
        with pytest.raises(ValueError, match=f"^{message}"):
            predict_cases(_OneHot(), [{"image": str(path)}], SimpleInferer(), tmp_path / "bad", progress=False,
                          keep_largest_component=value)  # fmt: skip
        assert not list(tmp_path.glob("bad/*"))


def test_the_evaluation_is_a_monai_evaluator_whose_handlers_see_each_methods_mean_dice(tmp_path):
    """``evaluate_cases`` is a :class:`CaseEvaluator` run with :class:`CaseMetrics`: built by hand (as evaluate.yaml
    builds them), a handler attached after ``CaseMetrics`` reads ``<method>_mean_dice`` from the state's metrics, as
    MONAI's ``StatsHandler`` and MONAI FL do; each value is the mean Dice of the metrics file. The first method's
    is MONAI's key metric (``state.best_metric``), or the one given as ``key_val_metric``; a case that fails is
    left out of the means, as of the file's."""
    from ignite.engine import Events
    from monai.data import DataLoader

    from jcsaug.evaluation import CaseEvaluator, CaseMetrics, EvaluationCases, method_mean_dice, one_case

    label = torch.zeros(1, 8, 8, 8)
    label[0, 2:6, 2:6, 2:6] = 1
    data = {"image": label * 2 - 1, "label": label}
    out = tmp_path / "metrics.json"
    metrics = CaseMetrics(out)
    seen: dict = {}

    class Reader:
        def attach(self, engine):
            engine.add_event_handler(Events.EPOCH_COMPLETED, lambda e: seen.update(e.state.metrics))

    loader = DataLoader(EvaluationCases([{"image": "a"}, {"image": "b"}], lambda e: data), batch_size=1,
                        collate_fn=one_case)  # fmt: skip
    evaluator = CaseEvaluator("cpu", loader, _Oracle(), {"none": SimpleInferer(), "empty": _EmptyInferer()}, 2,
                              spacing=1.0, val_handlers=[metrics, Reader()])  # fmt: skip
    assert evaluator.methods == ["none", "empty"]
    evaluator.run()
    assert seen == {"none_mean_dice": 1.0, "empty_mean_dice": 0.0}
    assert (evaluator.state.key_metric_name, evaluator.state.best_metric) == ("none_mean_dice", 1.0)
    written = json.loads(out.read_text())
    assert {m: written[m]["mean_dice"] for m in ("none", "empty")} == {"none": 1.0, "empty": 0.0}
    assert metrics.metrics["none"]["per_case"][1]["case"] == "b"
    evaluator.run()  # a second evaluation (MONAI FL evaluates every round) starts from no cases
    assert len(metrics.metrics["none"]["per_case"]) == 2

    # the key metric chosen; a case that fails to load is left out of every mean, as it is of the file's
    half = {"image": label * 2 - 1, "label": torch.zeros_like(label)}
    half["label"][0, 2:6, 2:6, 2:4] = 1  # half of the predicted cube: Dice 2/3

    def load(entry):
        if entry["image"] == "broken":
            raise OSError("no such file: broken")
        return half if entry["image"] == "half" else data

    loader = DataLoader(EvaluationCases([{"image": "a"}, {"image": "broken"}, {"image": "half"}], load),
                        batch_size=1, collate_fn=one_case)  # fmt: skip
    metrics = CaseMetrics(out, strict=False)
    methods = {"none": SimpleInferer(), "empty": _EmptyInferer()}
    evaluator = CaseEvaluator("cpu", loader, _Oracle(), methods, 2, spacing=1.0, val_handlers=[metrics],
                              key_val_metric=method_mean_dice("empty"))  # fmt: skip
    with pytest.warns(UserWarning, match="broken"):
        evaluator.run()
    assert evaluator.state.key_metric_name == "empty_mean_dice" and evaluator.state.best_metric == 0.0
    written = json.loads(out.read_text())
    assert evaluator.state.metrics == {f"{m}_mean_dice": written[m]["mean_dice"] for m in ("none", "empty")}
    assert evaluator.state.metrics["none_mean_dice"] == pytest.approx((1.0 + 2 / 3) / 2)


def test_the_evaluators_settings_are_checked_before_any_case_is_segmented():
    """A class subset, a largest-component class, an extra entry named as a method, an empty method list, a key
    metric of a method not evaluated or no cases: refused when the evaluator is built (before hours of inference),
    naming the value; ``CaseMetrics`` only gathers a ``CaseEvaluator``'s cases."""
    from monai.data import DataLoader
    from monai.engines import SupervisedEvaluator

    from jcsaug.evaluation import CaseEvaluator, CaseMetrics, EvaluationCases, method_mean_dice, one_case

    def loader(n=1):
        return DataLoader(EvaluationCases([{"image": "a"}] * n, lambda e: {}), batch_size=1, collate_fn=one_case)

    methods = {"none": SimpleInferer()}
    with pytest.raises(ValueError, match=r"report_classes\['x'\] = \[2\]"):
        CaseEvaluator("cpu", loader(), _Oracle(), methods, 2, val_handlers=[CaseMetrics(report_classes={"x": [2]})])
    with pytest.raises(ValueError, match="class 3"):
        CaseEvaluator("cpu", loader(), _Oracle(), methods, 3, keep_largest_component=[3])
    with pytest.raises(ValueError, match=r"extra metrics.json entries \['none'\] clash with method names"):
        CaseEvaluator("cpu", loader(), _Oracle(), methods, 2, val_handlers=[CaseMetrics("m.json", extra={"none": 1})])
    with pytest.raises(ValueError, match="inferers is empty"):
        CaseEvaluator("cpu", loader(), _Oracle(), {}, 2)
    with pytest.raises(
        ValueError, match=r"metric 'learned_mean_dice': no test-time method 'learned'; evaluated: \['none'\]"
    ):
        CaseEvaluator("cpu", loader(), _Oracle(), methods, 2, key_val_metric=method_mean_dice("learned"))
    with pytest.raises(ValueError, match="no cases to evaluate"):
        CaseEvaluator("cpu", loader(0), _Oracle(), methods, 2)
    with pytest.raises(TypeError, match="SupervisedEvaluator"):
        SupervisedEvaluator("cpu", loader(), _Oracle(), val_handlers=[CaseMetrics()])


def test_evaluate_cases_makes_the_method_named_the_key_metric(caplog):
    """``key_method``: the method whose mean Dice MONAI logs as the best (the bundles: the run's own test-time method);
    one that is not evaluated is refused before any case is segmented."""
    data = {"image": torch.ones(1, 4, 4, 4), "label": torch.ones(1, 4, 4, 4)}
    methods = {"none": SimpleInferer(), "empty": _EmptyInferer()}
    with caplog.at_level(logging.INFO):
        evaluate_cases(_Oracle(), [{"image": "a"}], lambda e: data, methods, 2, spacing=1.0, progress=False,
                       key_method="empty")  # fmt: skip
    assert "new best metric of empty_mean_dice: 0.0" in caplog.text
    with pytest.raises(ValueError, match=r"no test-time method 'learned'; evaluated: \['none', 'empty'\]"):
        evaluate_cases(_Oracle(), [{"image": "a"}], lambda e: pytest.fail("segmented"), methods, 2, progress=False,
                       key_method="learned")  # fmt: skip
