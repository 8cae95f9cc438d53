"""``keep_largest_component: validation``: the post-processed classes chosen on validation cases, as nnU-Net does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from jcsaug.engine import PreflightError, check_data, check_settings
from jcsaug.evaluation import (
    choose_component_classes,
    component_classes,
    parse_component_classes,
    read_component_classes,
    resolve_component_classes,
)

SHAPE = (12, 12, 12)


def _case(name: str) -> tuple[dict, torch.Tensor]:
    """A label (class 1: one block; class 2: two blocks, rightly two components) and a prediction that adds a
    one-voxel island of class 1 (the post-processing removes a false positive) and finds both class-2 blocks (it
    would remove a true one)."""
    truth = torch.zeros(SHAPE, dtype=torch.long)
    truth[1:4, 1:4, 1:4] = 1
    truth[6:8, 6:8, 1:3] = 2
    truth[6:8, 6:8, 8:10] = 2
    pred = truth.clone()
    pred[10, 10, 10] = 1
    entry = {"image": torch.zeros(1, *SHAPE), "label": truth[None], "name": name}
    return entry, pred


class _Lookup:
    """An inferer returning each case's prepared prediction as one-hot logits (the image carries the case index)."""

    def __init__(self, predictions: list[torch.Tensor]) -> None:
        self.predictions = predictions

    def __call__(self, image: torch.Tensor, network: torch.nn.Module) -> torch.Tensor:
        pred = self.predictions[int(image.flatten()[0])]
        return F.one_hot(pred, 3).permute(3, 0, 1, 2)[None].float()


def _cases(n: int = 2) -> tuple[list[dict], _Lookup]:
    entries, preds = [], []
    for i in range(n):
        entry, pred = _case(f"case{i}")
        entry["image"] = torch.full((1, *SHAPE), float(i))
        entries.append(entry)
        preds.append(pred)
    return entries, _Lookup(preds)


def test_a_class_is_chosen_where_its_largest_component_raises_its_validation_dice(tmp_path: Path) -> None:
    cases, inferer = _cases()
    out = tmp_path / "postprocessing.json"
    chosen = choose_component_classes(torch.nn.Identity(), cases, lambda e: e, inferer, 3, output_path=out,
                                      progress=False)  # fmt: skip
    assert chosen == (1,)  # class 1 loses a false island; class 2 would lose one of its two true blocks
    record = json.loads(out.read_text())
    assert record["classes"] == [1] and record["cases"] == 2 and record["keep_largest_component"] == "validation"
    dice = record["validation_dice"]
    assert dice["1"]["with"] == 1.0 and dice["1"]["without"] < 1.0 and dice["1"]["chosen"] is True
    assert dice["2"]["without"] == 1.0 and dice["2"]["with"] < 1.0 and dice["2"]["chosen"] is False
    assert choose_component_classes(torch.nn.Identity(), cases, lambda e: e, inferer, 3, candidates=[2],
                                    progress=False) == ()  # fmt: skip
    assert read_component_classes(out, 3) == (1,)


def test_a_tie_keeps_the_prediction_as_it_is() -> None:
    cases, inferer = _cases(1)
    inferer.predictions[0][10, 10, 10] = 0  # no island: the post-processing changes nothing
    assert choose_component_classes(torch.nn.Identity(), cases, lambda e: e, inferer, 3, progress=False) == ()


def test_no_validation_cases_is_refused_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="keep_largest_component 'validation': there are no validation cases"):
        choose_component_classes(torch.nn.Identity(), [], lambda e: e, _Lookup([]), 3)


def test_the_setting_is_parsed_and_resolved_by_choosing_or_reading_the_record(tmp_path: Path) -> None:
    assert parse_component_classes("validation") == parse_component_classes(" Validation ") == "validation"
    with pytest.raises(ValueError, match="chosen on the validation cases after training"):
        component_classes("validation", 3)
    assert resolve_component_classes("[2]", 3) == (2,) and resolve_component_classes("task", 3, (1,)) == (1,)
    assert resolve_component_classes("validation", 3) == ()  # a process that does not evaluate
    cases, inferer = _cases()
    out = tmp_path / "postprocessing.json"
    choose_component_classes(torch.nn.Identity(), cases, lambda e: e, inferer, 3, output_path=out, progress=False)
    assert resolve_component_classes("validation", 3, record=out) == (1,)
    assert resolve_component_classes(False, 3, record=out) == ()  # only 'validation' reads it


@pytest.mark.parametrize(
    ("content", "shown"),
    [(None, r"postprocessing.json not found; a training run with keep_largest_component validation writes it"),
     ("{", "is not a postprocessing.json"), ('{"cases": 2}', "is not a postprocessing.json"),
     ('{"classes": [3]}', r"postprocessing.json: keep_largest_component \[3\]: class 3 is not a foreground class")],
)  # fmt: skip
def test_a_missing_or_bad_record_is_refused_naming_the_file(tmp_path: Path, content: str | None, shown: str) -> None:
    path = tmp_path / "postprocessing.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=shown):
        resolve_component_classes("validation", 3, record=path)


def test_the_preflight_accepts_the_setting_and_needs_validation_cases(tmp_path: Path) -> None:
    check_settings(keep_largest_component="validation", num_classes=2)
    with pytest.raises(PreflightError, match="keep_largest_component"):
        check_settings(keep_largest_component="validations", num_classes=2)
    with pytest.raises(PreflightError, match="split 'validation' is empty: keep_largest_component 'validation'"):
        check_data({"training": [], "validation": []}, keep_largest_component="validation")
    with pytest.raises(PreflightError) as caught:  # without the setting, an empty validation split is allowed
        check_data({"training": [], "validation": []})
    assert "validation" not in str(caught.value)


def test_chooses_on_validation_names_only_the_validation_setting() -> None:
    from jcsaug.evaluation import chooses_on_validation

    assert chooses_on_validation("validation") and chooses_on_validation(" Validation ")
    for value in (False, True, "task", "[1]", [1, 2], None, "bogus", [0]):
        assert not chooses_on_validation(value), value  # a malformed value: the settings check names it
