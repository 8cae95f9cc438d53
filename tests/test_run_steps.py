"""A run's augmentation in three separate steps (policies, updaters with their checkpoint items, the test-time TEA
policy), what it logs (a line per epoch at INFO, per update at DEBUG, TensorBoard per update) and the summary it
ends with."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
from ignite.engine import Engine

from helpers import lesion_batch, tiny_unet, train_engine
from jcsaug.engine import (
    AugmentationSetup,
    PolicyExporter,
    PolicyUpdaters,
    RunSummary,
    TEAPolicyUpdater,
    TRAPolicyUpdater,
    get_tea_mode,
    get_tra_mode,
    key_test_method,
    list_tea_modes,
    list_tra_modes,
)
from jcsaug.policy import make_tea_policy, make_tra_policy, policy_changes
from jcsaug.policy.io import save_policies

pytestmark = pytest.mark.usefixtures("single_thread")


def _updaters(setup: AugmentationSetup, net: torch.nn.Module) -> PolicyUpdaters:
    batch = lesion_batch(4, 16)
    return setup.updaters(net, torch.optim.SGD(net.parameters(), lr=0.01), [batch], num_copies=2)


@pytest.mark.parametrize("tra_mode", list_tra_modes())
def test_every_tra_mode_builds_its_policy_and_updater(tra_mode, tmp_path):
    mode = get_tra_mode(tra_mode)
    learned = save_policies(tmp_path / "policies.json", make_tra_policy("uniform", num_groups=3))  # for `fixed`
    setup = AugmentationSetup(tra_mode, "none", tra_policy_file=learned)
    assert setup.tra_policy.num_groups == (3 if mode.from_file else 2 if mode.class_specific else 1)
    updaters = _updaters(setup, tiny_unet())
    assert (updaters.tra is not None) == mode.learned == setup.learn_tra
    assert list(updaters.checkpoint_items()) == ["tra_updater" if mode.learned else "tra_policy"]  # TEA none


@pytest.mark.parametrize("tea_mode", list_tea_modes())
def test_every_tea_mode_builds_its_updater_test_policy_and_methods(tea_mode, tmp_path):
    mode = get_tea_mode(tea_mode)
    learned = make_tea_policy("uniform")
    with torch.no_grad():
        learned.logits[0, 3] += 1.0
    path = save_policies(tmp_path / "policies.json", None, learned)  # for `fixed`
    setup = AugmentationSetup("heuristic", tea_mode, tea_policy_file=path)
    assert setup.test_methods == ["none"] + ([mode.test_method] if mode.test_method else [])
    # the evaluation's key metric is the run's own method, or none where it was not evaluated
    assert key_test_method(tea_mode, ["heuristic", "none", "learned"]) == setup.test_methods[-1]
    assert key_test_method(tea_mode, ["heuristic", "none"]) == (
        setup.test_methods[-1] if mode.test_method != "learned" else "none"
    )
    updaters = _updaters(setup, tiny_unet())
    assert (updaters.tea is not None) == mode.joint
    # checkpoints hold the TEA policy only where it is learned in training or tested as read from a file
    tea_items = [k for k in updaters.checkpoint_items() if k.startswith("tea")]
    assert tea_items == (["tea_updater"] if mode.joint else ["tea_policy"] if mode.from_file else [])
    assert setup.tests_learned_tea == (mode.joint or mode.posthoc or mode.from_file)
    assert torch.equal(setup.tea_policy.logits, learned.logits) == mode.from_file


def test_checkpoint_items_do_not_depend_on_the_order_of_the_steps():
    """Updaters and their checkpoint items come from one call: nothing to call first."""
    setup = AugmentationSetup("class-specific", "joint")
    updaters = _updaters(setup, tiny_unet())
    items = updaters.checkpoint_items()
    assert items["tra_updater"] is updaters.tra and items["tea_updater"] is updaters.tea
    assert isinstance(updaters.tra, TRAPolicyUpdater) and isinstance(updaters.tea, TEAPolicyUpdater)
    assert list(updaters) == [updaters.tra, updaters.tea] and not hasattr(setup, "checkpoint_items")


def test_posthoc_tea_is_learned_once_when_asked_for_the_test_policy():
    setup = AugmentationSetup("heuristic", "learned-posthoc")
    start = setup.tea_policy.logits.detach().clone()
    batch = lesion_batch(4, 16)
    policy = setup.test_tea_policy(tiny_unet(), [batch], posthoc_iterations=2, num_copies=2)
    assert policy is setup.tea_policy and not torch.equal(policy.logits, start)
    learned = policy.logits.detach().clone()
    assert setup.test_tea_policy(tiny_unet(), [batch], posthoc_iterations=2) is policy  # not learned twice
    assert torch.equal(policy.logits, learned)
    assert torch.equal(setup.initial_policies[1].logits, start)  # the start is kept for the summary
    with pytest.raises(ValueError, match="needs the trained network"):
        AugmentationSetup("heuristic", "learned-posthoc").test_tea_policy()
    assert AugmentationSetup("heuristic", "joint").test_tea_policy() is not None  # learned during training
    assert AugmentationSetup("heuristic", "heuristic").test_tea_policy() is None


def _train(updaters, epochs=2, length=2, loss="ce+dice"):
    net = updaters.tra.model
    engine = train_engine(net, updaters.tra.model_optimizer, loss)
    updaters.attach(engine)
    batch = lesion_batch(4, 16, tra_policy=updaters.tra.policy)
    engine.run([batch] * length, max_epochs=epochs)
    return engine


def test_policy_changes_are_logged_once_per_epoch_at_info_and_per_update_at_debug(caplog):
    setup = AugmentationSetup("class-specific", "joint")
    updaters = _updaters(setup, tiny_unet())
    with caplog.at_level(logging.INFO, logger="jcsaug.engine"):
        _train(updaters)
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert [m.split(";")[0] for m in info] == [
        f"epoch {e}: {n} policy 2 updates, 0 skipped" for e in (1, 2) for n in ("TRA", "TEA")
    ]
    assert all("most changed this epoch: " in m and ("(+" in m or "(-" in m) for m in info)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="jcsaug.engine"):
        _train(_updaters(AugmentationSetup("class-specific", "joint"), tiny_unet()), epochs=1)
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert len([m for m in debug if "TRA update" in m and "most changed" in m]) == 2


def test_skipped_updates_are_counted_by_reason_and_survive_a_checkpoint():
    setup = AugmentationSetup("class-specific", "none")
    updaters = _updaters(setup, tiny_unet())
    net = updaters.tra.model
    engine = train_engine(net, updaters.tra.model_optimizer)
    updaters.attach(engine)
    one_group = lesion_batch(4, 16, tra_policy=setup.tra_policy)
    one_group["class_group"] = torch.ones(4, dtype=torch.long)
    with pytest.warns(UserWarning, match="one class group only"):
        engine.run([one_group, lesion_batch(4, 16, tra_policy=setup.tra_policy)], max_epochs=1)
    counts = updaters.counts()
    assert counts == {"TRA": {"updates": 1, "skipped": 1,
                              "skip_reasons": {"the training batch holds one class group only": 1}}}  # fmt: skip
    fresh = _updaters(AugmentationSetup("class-specific", "none"), tiny_unet())
    fresh.tra.load_state_dict(updaters.tra.state_dict())
    assert fresh.counts() == counts


def test_policy_changes_from_the_start_are_sorted_by_size():
    start = make_tra_policy("nnunet", num_groups=2)
    policy = make_tra_policy("nnunet", num_groups=2)
    with torch.no_grad():
        policy.logits[1, policy.offsets[13] + 2] += 1.0  # group 1, noise level 2: up
    changes = policy_changes(policy, start)
    assert (changes[0].group, changes[0].series, changes[0].op) == (1, "noise", "noise_std[0.05,0.1)")
    assert changes[0].delta > 0 and changes[0].start == pytest.approx(0.1 / 3)
    assert {c.group for c in changes[:4]} == {1} and all(c.delta == 0 for c in changes if c.group == 0)
    assert policy_changes(policy, start, group=0)[0].delta == 0


def test_run_summary_reports_dice_changes_skips_and_files(tmp_path):
    tra, tea = make_tra_policy("nnunet", 2), make_tea_policy()
    start = (make_tra_policy("nnunet", 2), make_tea_policy())
    with torch.no_grad():
        tra.logits[0, tra.offsets[7] + 1] += 2.0  # group 0, gamma level 1
        tea.logits[0, 40] += 1.0  # mirror_axial
    for name in ("metrics.json", "policies.json", "policies.png"):
        (tmp_path / name).write_text("{}")
    updater = types.SimpleNamespace(name="TRA", updates=7, skipped=3, skip_reasons={"one class group only": 3})
    metrics = {"none": {"mean_dice": 0.5, "per_case": [{}] * 4}, "learned": {"mean_dice": 0.625, "per_case": []},
               "policy_updates": {}}  # fmt: skip
    text = RunSummary(tmp_path, tra, tea, start, [updater]).report(metrics)
    lines = text.splitlines()
    assert lines[1] == "  test Dice (mean of 4 cases; no TTA = none): none 0.500, learned 0.625 (+0.125)"
    assert lines[2].startswith("  TRA group 0 (background), most changed: gamma/gamma±[0,0.2) 0.100->")
    assert lines[3] == "  TRA group 1 (foreground), unchanged"  # unchanged ops are not listed as "most changed"
    assert lines[4].startswith("  TEA, most changed: mirror_axial 0.100->")
    assert lines[5] == "  TRA policy updates: 7 done, 3 skipped (30 %) (one class group only: 3)"
    files = ", ".join(str(tmp_path / name) for name in ("metrics.json", "policies.json", "policies.png"))
    assert lines[6] == f"  files: {files}"
    assert RunSummary(tmp_path).report() == f"run summary ({tmp_path})\n" + lines[6]  # evaluate.yaml: files only


def test_run_summary_has_no_most_changed_line_for_a_policy_that_did_not_change(tmp_path):
    """--tea_mode fixed (or TRA not learned): no "most changed" line listing ops at +0.0e+00."""
    start = (make_tra_policy("nnunet", 2), make_tea_policy())
    tra, tea = make_tra_policy("nnunet", 2), make_tea_policy()
    text = RunSummary(tmp_path, tra, tea, start).report({"none": {"mean_dice": 0.5, "per_case": [{}]}})
    assert "most changed" not in text and "unchanged" not in text and "+0.0e+00" not in text
    with torch.no_grad():
        tea.logits[0, 40] += 1.0
    lines = RunSummary(tmp_path, tra, tea, start).report().splitlines()
    assert [line for line in lines if "changed" in line] == [lines[1]] and lines[1].startswith("  TEA, most changed: ")
    assert lines[1].count("->") == 3 and "+0.0e+00" not in lines[1]  # the moved op and two that lost mass to it


def test_run_summary_gives_the_dice_of_the_reported_classes(tmp_path):
    """KiTS: the tumour Dice (metrics.json "mean_dice_reported") gets a line; a subset of all classes does not."""

    def method(all_classes: float, tumour: float) -> dict:
        return {"mean_dice": all_classes, "mean_dice_per_class": [0.9, tumour], "per_case": [{}] * 3,
                "mean_dice_reported": {"tumour": {"classes": [2], "mean_dice": tumour},
                                       "both": {"classes": [1, 2], "mean_dice": all_classes}}}  # fmt: skip

    lines = RunSummary(tmp_path).lines({"none": method(0.7, 0.5), "learned": method(0.75, 0.6)})
    assert lines[1] == "  test Dice (mean of 3 cases; no TTA = none): none 0.700, learned 0.750 (+0.050)"
    assert lines[2] == "  test Dice, tumour (class 2): none 0.500, learned 0.600 (+0.100)"
    assert len(lines) == 3
    lines = RunSummary(tmp_path, split="validation").lines({"none": method(0.7, 0.5)})  # evaluate_split validation
    assert lines[1].startswith("  validation Dice (mean of 3 cases") and lines[2].startswith(
        "  validation Dice, tumour"
    )


def test_run_summary_says_when_predictions_were_masked_by_the_roi(tmp_path):
    """KiTS's body ROI: the summary says how many cases' predictions were masked; no line where none was."""
    rows = [{"roi_masked": True}, {"roi_masked": True}]
    lines = RunSummary(tmp_path).lines({"none": {"mean_dice": 0.5, "per_case": rows}})
    assert lines[2] == "  predictions outside the task's ROI are background (2 of 2 cases)"
    plain = RunSummary(tmp_path).lines({"none": {"mean_dice": 0.5, "per_case": [{"roi_masked": False}]}})
    assert not any("ROI" in line for line in plain)


def test_tensorboard_gets_the_probabilities_after_every_policy_update(tmp_path, monkeypatch):
    written = []

    class Writer:
        def __init__(self, log_dir):
            pass

        def add_scalar(self, tag, value, step):
            written.append(step)

        def flush(self):
            pass

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = Writer
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    tra = make_tra_policy("nnunet", 2)

    def step(engine, batch):
        if engine.state.iteration in (2, 5):  # a policy update on these iterations only
            with torch.no_grad():
                tra.logits[0, 0] += 0.1

    engine = Engine(step)
    PolicyExporter(tmp_path, tra, tensorboard_dir=tmp_path / "tb").attach(engine)
    engine.run(range(3), max_epochs=2)
    assert sorted(set(written)) == [0, 2, 5] and written.count(5) == 62 * 2
