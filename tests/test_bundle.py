"""The default bundle end to end: train (tiny override), evaluate, infer — through `python -m monai.bundle`."""

from __future__ import annotations

import json
import re

import nibabel as nib
import pytest
import torch
from scipy import ndimage

from helpers import run_bundle, small_dataset, synthetic_tra_policy
from jcsaug.policy import make_tea_policy
from jcsaug.policy.io import load_policies
from preloaded import run_module


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("bundle")
    small_dataset(tmp_path)
    result = run_bundle(tmp_path, "train.yaml", max_epochs=2, epoch_length=2, num_workers=0,
                     tra_update_every=1, tea_update_every=1, plots=True)  # fmt: skip
    return tmp_path, result


def test_train_writes_checkpoints_policies_and_metrics(trained):
    tmp_path, result = trained
    run = tmp_path / "run"
    assert list(run.glob("checkpoint_final_iteration=4.pt"))
    tra, tea = load_policies(run / "policies.json")
    assert tra is not None and tra.num_groups == 2 and tea is not None
    metrics = json.loads((run / "metrics.json").read_text())
    updates = metrics.pop("policy_updates")
    assert set(metrics) == {"none", "learned"}
    assert updates["TRA"]["updates"] + updates["TRA"]["skipped"] == 4 and updates["TEA"]["updates"] == 4
    for method in metrics.values():
        assert len(method["per_case"]) == 2
        assert 0.0 <= method["mean_dice"] <= 1.0
    history = [json.loads(line) for line in (run / "policy_history.jsonl").read_text().splitlines()]
    assert len(history) == 2
    effects = history[-1]["op_effects"]  # the paired estimators' op effects, by the probabilities' names
    assert {tag.split("/")[0] for tag in effects} == {"tra", "tea"}
    assert set(effects) <= set(history[-1]["probabilities"])
    assert all(e["measurements"] >= 1 and abs(e["estimate"]) < float("inf") for e in effects.values())
    log = result.stdout + result.stderr
    assert len(re.findall(r"epoch \d: TRA policy \d+ updates, \d+ skipped; most changed this epoch: \S+", log)) == 2
    assert len(re.findall(r"epoch \d: TEA policy \d+ updates", log)) == 2  # INFO: a line per epoch, not per update
    assert not re.search(r"TRA update \d+; most changed", log)  # the per-update lines are DEBUG
    summary = log[log.index("run summary") :]
    assert re.search(r"test Dice .*: none \d\.\d{3}, learned \d\.\d{3}", summary)
    assert "TRA group 1 (foreground), most changed: " in summary and "TEA, most changed: " in summary
    assert "TRA policy updates: " in summary and str(run / "policies.png") in summary
    assert (run / "policies.png").stat().st_size and (run / "policy_history.png").stat().st_size
    shown = run_module("jcsaug.cli", ["policy", "show", run / "policies.json"])
    assert shown.returncode == 0, shown.stderr
    assert "TRA policy, class group 1" in shown.stdout and "TEA policy" in shown.stdout


def test_evaluate_and_inference_configs(trained):
    tmp_path, _ = trained
    run_bundle(tmp_path, "train.yaml", "evaluate.yaml", num_workers=0)
    metrics = json.loads((tmp_path / "run" / "metrics_evaluate.json").read_text())
    assert set(metrics) == {"none", "heuristic", "learned", "learned+mirror"}  # every method; training: none + its own
    # the validation cases the policies learned from, into files of their own (the test split's are kept)
    result = run_bundle(tmp_path, "train.yaml", "evaluate.yaml", num_workers=0, evaluate_split="validation")
    on_validation = json.loads((tmp_path / "run" / "metrics_evaluate_validation.json").read_text())
    assert set(on_validation) == set(metrics) and len(on_validation["none"]["per_case"]) == 2
    validation_cases = json.loads((tmp_path / "data" / "dataset.json").read_text())["validation"]
    assert [c["case"] for c in on_validation["none"]["per_case"]] == [
        str(tmp_path / "data" / c["image"]) for c in validation_cases
    ]
    assert json.loads((tmp_path / "run" / "metrics_evaluate.json").read_text()) == metrics
    assert (tmp_path / "run" / "per_case_evaluate_validation.csv").is_file()
    assert "validation Dice (mean of 2 cases" in result.stdout + result.stderr
    refused = run_bundle(tmp_path, "train.yaml", "evaluate.yaml", check=False, evaluate_split="train")
    assert refused.returncode == 1 and "evaluate_split must be one of test, validation; got 'train'" in refused.stderr
    # the class list as a user types it (fire passes a list): the saved maps keep one component of class 1
    run_bundle(tmp_path, "train.yaml", "inference.yaml", num_workers=0, keep_largest_component="[1]")
    predictions = sorted((tmp_path / "run" / "predictions").glob("*_seg.nii.gz"))
    assert len(predictions) == 2
    seg = nib.load(predictions[0])
    assert seg.shape[:3] == (32, 32, 32)
    assert set(seg.get_fdata().ravel().tolist()) <= {0.0, 1.0}
    full = ndimage.generate_binary_structure(3, 3)  # the post-processing's connectivity
    assert all(ndimage.label(nib.load(p).get_fdata() == 1, structure=full)[1] <= 1 for p in predictions)


def test_modes_are_overridable(tmp_path):
    small_dataset(tmp_path)
    run_bundle(tmp_path, "train.yaml", max_epochs=1, epoch_length=1, num_workers=0, tra_mode="heuristic",
            tea_mode="none")  # fmt: skip
    tra, tea = load_policies(tmp_path / "run" / "policies.json")
    assert tra.num_groups == 1 and tea is None
    assert not list((tmp_path / "run").glob("*.png"))  # run_bundle's plots=False: no figures
    assert set(json.loads((tmp_path / "run" / "metrics.json").read_text())) == {"none", "policy_updates"}


def test_posthoc_tea_and_train_on_val(tmp_path):
    small_dataset(tmp_path)
    run_bundle(tmp_path, "train.yaml", max_epochs=1, epoch_length=1, num_workers=0, tra_mode="randaugment-m",
            tea_mode="learned-posthoc", posthoc_iterations=3, train_on_val=True)  # fmt: skip
    tra, tea = load_policies(tmp_path / "run" / "policies.json")
    assert tea is not None and not torch.allclose(tea.logits, make_tea_policy("nnunet").logits)
    assert set(json.loads((tmp_path / "run" / "metrics.json").read_text())) == {"none", "learned", "policy_updates"}


def test_fixed_modes_reuse_both_policies_of_a_policies_json(trained, tmp_path):
    """``--tra_mode fixed --tra_policy F --tea_mode fixed --tea_policy F``: a new training with the learned policies
    of another run, unchanged: no updates; the run's policies.json holds them as they were; tested with the TEA."""
    run = trained[0] / "run"
    small_dataset(tmp_path)
    run_bundle(tmp_path, "train.yaml", max_epochs=1, epoch_length=2, num_workers=0, tra_mode="fixed",
               tra_policy=run / "policies.json", tea_mode="fixed", tea_policy=run / "policies.json")  # fmt: skip
    tra, tea = load_policies(run / "policies.json")
    reused_tra, reused_tea = load_policies(tmp_path / "run" / "policies.json")
    torch.testing.assert_close(reused_tra.logits, tra.logits)
    torch.testing.assert_close(reused_tea.logits, tea.logits)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert set(metrics) == {"none", "learned", "policy_updates"} and metrics["policy_updates"] == {}


def test_tra_cascade_on_the_device(tmp_path):
    """augment_on: device (the default on a GPU): BatchTRACascaded on every batch, and the TRA update still learns
    (here with the copies in pairs, ``tra_exploration uniform``, that the cascade makes and the updater scores)."""
    small_dataset(tmp_path)
    run_bundle(tmp_path, "train.yaml", max_epochs=1, epoch_length=2, num_workers=0, tra_update_every=1,
               tea_mode="none", augment_on="device", device="cpu", tra_exploration="uniform")  # fmt: skip
    updates = json.loads((tmp_path / "run" / "metrics.json").read_text())["policy_updates"]
    assert updates["TRA"]["updates"] == 2, updates  # the op record reached the updater
    tra, _ = load_policies(tmp_path / "run" / "policies.json")
    assert not torch.allclose(tra.logits, synthetic_tra_policy().logits)


def test_keep_largest_component_validation_is_chosen_after_training_and_read_by_evaluate(tmp_path):
    """``--keep_largest_component validation``: the training run chooses the classes on its validation cases
    (postprocessing.json), post-processes its test metrics with them and names them in the summary; evaluate.yaml
    reads the same choice back, and refuses, naming the file, when the run has none."""
    small_dataset(tmp_path)
    result = run_bundle(tmp_path, "train.yaml", max_epochs=1, epoch_length=2, num_workers=0, tra_mode="heuristic",
                        tea_mode="none", keep_largest_component="validation")  # fmt: skip
    run = tmp_path / "run"
    record = json.loads((run / "postprocessing.json").read_text())
    assert record["cases"] == 2 and set(record["validation_dice"]) == {"1"}
    chosen = record["classes"]
    assert chosen == [1] if record["validation_dice"]["1"]["chosen"] else chosen == []
    assert json.loads((run / "metrics.json").read_text())["none"]["largest_component_classes"] == chosen
    summary = (result.stdout + result.stderr).split("run summary")[-1]
    assert ("(chosen on the validation cases)" in summary) == bool(chosen)
    assert str(run / "postprocessing.json") in summary
    run_bundle(tmp_path, "train.yaml", "evaluate.yaml", num_workers=0, keep_largest_component="validation")
    assert json.loads((run / "metrics_evaluate.json").read_text())["none"]["largest_component_classes"] == chosen
    (run / "postprocessing.json").unlink()
    refused = run_bundle(tmp_path, "train.yaml", "evaluate.yaml", num_workers=0, keep_largest_component="validation",
                         check=False)  # fmt: skip
    assert refused.returncode != 0 and "postprocessing.json not found" in refused.stdout + refused.stderr
