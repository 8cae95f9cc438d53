"""Issue 12 items 3, 4, 7, 8, 9: the checks a bundle runs before its first iteration (jcsaug.engine.preflight)."""

from __future__ import annotations

import json
import math
import re
import sys
import warnings
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from ignite.engine import Engine
from monai.networks.nets import UNet

from helpers import BUNDLES, CONFIGS
from jcsaug.engine import (
    PreflightError,
    ResumeCheckpoint,
    check_data,
    check_evaluation_data,
    check_output_dir,
    check_override_ids,
    check_patch_size,
    check_settings,
    save_checkpoint_atomic,
)
from jcsaug.networks import get_network, make_network

BUNDLE_MAIN = str(Path(sys.modules["monai"].__file__).parent / "bundle" / "__main__.py")


def _argv(*args: str) -> list[str]:
    return [BUNDLE_MAIN, "run", "--config_file", str(CONFIGS / "train.yaml"), *args]


# ----------------------------------------------------------------------------------------------- settings and ids
def test_bad_settings_are_listed_together_with_the_valid_values():
    with pytest.raises(PreflightError) as err:
        check_settings(argv=[], network="nonsense", tea_z=100, tra_mode="nope", tea_mode="joint", max_epochs=0,
                       learning_rate=float("nan"), resume="maybe", patch_size=[32, 0, 32], other=object(),
                       augment_on="gpu", hypergradient="exact")  # fmt: skip
    message = str(err.value)
    assert message.splitlines()[0] == "bad settings:"
    for expected in (
        "--network 'nonsense': must be one of deepmedic, transformer, unet3d",
        "--tea_z 100: must be an integer in 1..84 (the TEA catalogue has 84 ops)",
        "--tra_mode 'nope': must be one of none, heuristic, randaugment-s, randaugment-m, randaugment-l, fixed, "
        "learned, class-specific",
        "--max_epochs 0: must be an integer >= 1",
        "--learning_rate nan: must be a finite number > 0",
        "--resume 'maybe': must be true or false",
        "--patch_size [32, 0, 32]: must be a list of positive integers",
        "--augment_on 'gpu': must be one of auto, worker, device",
        "--hypergradient 'exact': must be one of finite-difference, jvp, equal-norm",
    ):
        assert expected in message, expected
    assert "tea_mode" not in message and "other" not in message


def test_good_settings_pass():
    check_settings(argv=[], network="UNet3D", tea_z=84, tra_mode="class-specific", tea_mode="none",
                   max_epochs=1, epoch_length=3, learning_rate=0.01, num_workers=0, resume="false", overwrite=True,
                   patch_size=7)  # fmt: skip
    check_settings(argv=[], network="unet3d", patch_size=[32, 32, 16])


_BUDGET = "must be a finite number > 0, or None (no budget: the learning rate is used; None on the command line)"


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        ("tra_update_every", 0, "must be an integer >= 1"),
        ("tea_update_every", 1.5, "must be an integer >= 1"),
        ("num_tea_copies", 0, "must be an integer >= 1"),
        ("val_batch_size", 0, "must be an integer >= 1"),
        ("samples_per_case", -2, "must be an integer >= 1"),
        ("cases_per_batch", 0, "must be an integer >= 1"),
        ("val_batches", 0, "must be an integer >= 1"),
        ("tea_patches", 0, "must be an integer >= 1"),
        ("seed", -1, "must be an integer >= 0"),
        ("stop_after_epochs", -1, "must be an integer >= 0"),
        ("planned_epochs", 0, "must be an integer >= 1, or None"),
        ("planned_epochs", 2.5, "must be an integer >= 1, or None"),
        ("tra_counterfactuals", -1, "must be an integer >= 0"),
        ("tra_lr", -0.1, "must be a finite number >= 0"),
        ("tea_lr", float("inf"), "must be a finite number >= 0"),
        ("posthoc_lr", "fast", "must be a finite number >= 0"),
        ("tea_poly_power", -1, "must be a finite number >= 0"),
        ("tra_poly_power", float("nan"), "must be a finite number >= 0"),
        ("tra_start", 1, "must be a number in [0, 1) (the share of the run before the first update)"),
        ("tra_start", -0.25, "must be a number in [0, 1) (the share of the run before the first update)"),
        ("tra_lookahead", 0.5, "must be a finite number >= 1"),
        ("tra_pull", -1, "must be a finite number >= 0"),
        ("val_average", 0, "must be a number in (0, 1]"),
        ("val_average", 1.5, "must be a number in (0, 1]"),
        ("cache_rate", 2, "must be a number in [0, 1]"),
        ("tra_logit_budget", 0, _BUDGET),
        ("tea_logit_budget", "null", _BUDGET),  # fire reads the word null as a string (None is None)
        ("tra_estimator", "gumble", "must be one of gumbel, paired"),
        ("tra_step", "sgd", "must be one of adam, natural, natural-series, natural-recent, natural-unbiased"),
        ("tea_estimator", "pair", "must be one of gumbel, paired"),
        ("tra_direction", "orthogonal", "must be one of validation, beyond-training"),
        ("tra_exploration", "everywhere", "must be one of drawn, uniform"),
        ("tea_op_score", "pair",
         "must be one of alone, alone-logits, alone-hard, with-identity, with-identity-hard, ensemble"),
        ("tea_sliding_window", "sometimes", "must be true or false"),
        ("tra_val_tea", "maybe", "must be true, false or a number in [0, 1]"),
        ("tra_val_tea", 1.5, "must be true, false or a number in [0, 1]"),
        ("tea_mask_out_of_view", "partly", "must be true or false"),
        ("tea_volume_stats", "volume", "must be true or false"),
        ("tra_meta_mode", "training", "must be one of eval, train"),
        ("grad_clip_norm", 0, "must be a finite number > 0, or None"),
        ("roi_threshold", "body", "must be a finite number, or None"),
        ("tea_identity_weight", 1.0, "must be a number in (0, 1), 'equal', or None"),
        ("tea_identity_weight", "half", "must be a number in (0, 1), 'equal', or None"),
        ("tea_identity_weight", "0.5", "must be a number in (0, 1), 'equal', or None"),  # as the inferers refuse it
        ("train_loss", "focal", "must be one of ce, ce+dice, dice"),
        ("val_loss", "focal", "must be one of batch-dice, ce+batch-dice, ce, ce+dice, dice"),
        ("tea_patch_size", [48, 0, 48], "must be a list of positive integers, one per spatial axis, e.g. [32, 32, 32], "
                                        "or None"),
    ],
)  # fmt: skip
def test_every_setting_the_updaters_check_is_checked_first_naming_the_id_and_value(key, value, reason):
    """The ranges the updaters and modes accept (engine/base.py, tra_updater.py, tea_updater.py, modes.py)."""
    with pytest.raises(PreflightError) as err:
        check_settings(argv=[], **{key: value})
    assert str(err.value) == f"bad settings:\n  --{key} {value!r}: {reason}"


def test_settings_the_updaters_accept_pass():
    check_settings(argv=[], tra_update_every=10, seed=0, stop_after_epochs=0, tra_counterfactuals=0, tra_lr=0.0,
                   tea_lr=5e-5, posthoc_lr=5e-3, tea_poly_power=0, tra_lookahead=1.5, val_average=1, cache_rate=0.0,
                   tra_logit_budget=None, tea_logit_budget=6, tra_estimator="paired", tea_estimator="gumbel",
                   train_loss="CE + DSC", val_loss="batch-dice", tea_patch_size=None, tra_mode="heuristic")  # fmt: skip
    check_settings(argv=[], val_loss="DSC", tea_patch_size=[48, 48, 48], tra_poly_power=0, tra_start=0.25)


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"tra_mode": "class-specific", "tra_lr": 0, "tra_logit_budget": None},
         "--tra_lr 0: tra_mode 'class-specific' learns the TRA policy, but a learning rate of 0 with no "
         "tra_logit_budget never changes it; set tra_lr > 0 or a tra_logit_budget (to keep a policy as it is: "
         "tra_mode heuristic or fixed)"),
        ({"tra_mode": "learned", "tra_lr": 0.0}, "--tra_lr 0.0: tra_mode 'learned' learns the TRA policy"),
        ({"tea_mode": "joint", "tea_lr": 0}, "--tea_lr 0: tea_mode 'joint' learns the TEA policy, but a learning rate"
                                             " of 0 with no tea_logit_budget never changes it"),
        ({"tea_mode": "learned-posthoc", "posthoc_lr": 0}, "--posthoc_lr 0: tea_mode 'learned-posthoc' learns the TEA "
                                                           "policy, but a learning rate of 0 never changes it; set "
                                                           "posthoc_lr > 0 (to keep a policy as it is: tea_mode"),
        ({"tea_mode": "joint", "tea_estimator": "paired", "num_tea_copies": 84},
         "--num_tea_copies 84: the paired TEA estimator (tea_estimator paired) scores each copy with another "
         "non-identity op: at most 83"),
        ({"tra_mode": "class-specific", "tra_estimator": "paired", "tra_counterfactuals": 0},
         "--tra_counterfactuals 0: the paired TRA estimator (tra_estimator paired) of tra_mode 'class-specific' needs "
         "at least 1 counterfactual copy per training patch"),
        ({"tra_mode": "class-specific", "tra_estimator": "paired", "tra_counterfactuals": 3,
          "tra_exploration": "uniform"},
         "--tra_counterfactuals 3: tra_exploration 'uniform' makes the counterfactual copies in pairs: give an even "
         "number"),
        ({"tra_mode": "class-specific", "tra_estimator": "gumbel", "tra_step": "natural"},
         "--tra_step 'natural': steps on the op effects of the paired TRA estimator, but tra_estimator is 'gumbel'; "
         "use tra_estimator paired, or tra_step adam"),
        ({"tea_z": 1, "tea_identity_weight": 0.5},
         "--tea_z 1: with a tea_identity_weight (0.5) the learned TTA holds the identity and at least one op: tea_z "
         "must be >= 2"),
    ],
)  # fmt: skip
def test_settings_that_do_not_go_together_are_refused(settings, expected):
    """A learning rate of 0 where it is used would leave a policy the run reports as learned at its preset."""
    with pytest.raises(PreflightError) as err:
        check_settings(argv=[], **settings)
    assert str(err.value).startswith(f"bad settings:\n  {expected}")


@pytest.mark.parametrize(
    "settings",
    [
        {"tra_mode": "class-specific", "tra_lr": 0, "tra_logit_budget": 6.0},  # the budget sets the learning rate
        {"tra_mode": "heuristic", "tra_lr": 0},  # nothing learns the TRA policy
        {"tea_mode": "joint", "tea_lr": 0, "tea_logit_budget": 6.0},
        {"tea_mode": "heuristic", "tea_lr": 0, "posthoc_lr": 0},
        {"tea_mode": "joint", "tea_lr": 0.01, "posthoc_lr": 0},  # posthoc_lr is learned-posthoc's only
        {"tea_mode": "joint", "tea_estimator": "gumbel", "num_tea_copies": 84},
        {"tea_mode": "heuristic", "tea_estimator": "paired", "num_tea_copies": 84},
        {"tra_mode": "heuristic", "tra_estimator": "paired", "tra_counterfactuals": 0},
        {"tra_mode": "class-specific", "tra_estimator": "gumbel", "tra_counterfactuals": 0},
        {"tra_mode": "heuristic", "tra_estimator": "paired", "tra_counterfactuals": 3, "tra_exploration": "uniform"},
        {"tra_mode": "heuristic", "tra_estimator": "gumbel", "tra_step": "natural"},  # no TRA is learned
        {"tea_z": 1, "tea_identity_weight": None},
        {"tea_z": 2, "tea_identity_weight": 0.5},
        {"tea_z": 8, "tea_identity_weight": "equal"},
    ],
)
def test_the_same_values_pass_where_they_are_not_used(settings):
    check_settings(argv=[], **settings)


def test_a_bad_value_is_reported_once_not_again_with_the_settings_it_goes_with():
    with pytest.raises(PreflightError) as err:
        check_settings(argv=[], tra_mode="class-specific", tra_lr=0, tra_logit_budget="null")
    assert str(err.value).count("\n") == 1 and "--tra_logit_budget 'null'" in str(err.value)


def test_keep_largest_component_takes_a_flag_task_or_foreground_class_ids():
    """False / True, ``task`` (the task's single-component classes) or class ids, also as the command line's string."""
    for value in (False, "true", "NO", True, None, "task", [1, 3], (2,), "[1, 3]", "[3,1]", []):
        check_settings(argv=[], keep_largest_component=value, num_classes=4)
        check_settings(argv=[], keep_largest_component=value)


_CLASS_IDS = "must be true, false, task, validation or a list of distinct foreground class ids, e.g. [1, 3]"


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ([0, 1], f"class 0 is the background; {_CLASS_IDS}"),
        ([1, 1], f"class 1 is given twice; {_CLASS_IDS}"),
        ([1.5], f"class id 1.5 is not an integer; {_CLASS_IDS}"),
        ("[1, x]", f"not a list; {_CLASS_IDS}"),
        ("maybe", _CLASS_IDS),
        ([1, 4], "class 4 is not a foreground class 1..3 (num_classes 4)"),
        (1, f"a bare number is ambiguous (the flag, or class 1?): write true/false or [1]; {_CLASS_IDS}"),
    ],
)
def test_bad_keep_largest_component_is_refused_saying_what_it_must_be(value, reason):
    with pytest.raises(PreflightError) as err:
        check_settings(argv=[], keep_largest_component=value, num_classes=4)
    assert str(err.value) == f"bad settings:\n  --keep_largest_component {value!r}: {reason}"


def test_keep_largest_component_classes_are_checked_against_a_valid_num_classes_only():
    check_settings(argv=[], keep_largest_component=[7])  # no num_classes: the range is checked where it is used
    with pytest.raises(PreflightError) as err:
        check_settings(argv=[], keep_largest_component=[7], num_classes=0)
    assert str(err.value) == "bad settings:\n  --num_classes 0: must be an integer >= 1"


def test_segmentation_postprocessing_must_be_transforms_or_none():
    """Refused before the run (the evaluation that applies it comes after the training), the forgotten ``$`` of an
    expression named."""
    from monai.transforms import FillHolesd

    for good in (None, FillHolesd("pred"), lambda d: d):
        check_settings(argv=[], segmentation_postprocessing=good)
    must = "must be MONAI transforms, e.g. \"$monai.transforms.FillHolesd('pred')\", or None"
    for bad, hint in (("monai.transforms.FillHolesd('pred')", " (an expression starts with $)"), (3, "")):
        with pytest.raises(PreflightError) as err:
            check_settings(argv=[], segmentation_postprocessing=bad)
        assert str(err.value) == f"bad settings:\n  --segmentation_postprocessing {bad!r}: {must}{hint}"


_TRA_PRESETS = "all-0.05, all-0.1, deepmedic, nnunet, randaugment-l, randaugment-m, randaugment-s, uniform"


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        ("tra_preset", "nnUNet", f"must be one of {_TRA_PRESETS}, or a mapping series -> probability"),
        ("tra_preset", 0.1, f"must be one of {_TRA_PRESETS}, or a mapping series -> probability"),
        ("tra_preset", {"gama": 0.3}, "unknown series ['gama'] in preset mapping; series are"),
        ("tra_preset", {"base": "nnunet", "gamma": [0.5, 0.5]}, "series 'gamma': expected 4 non-negative "
                                                                "probabilities"),
        ("tea_preset", "deepmedic", "must be one of nnunet, uniform, or 84 probabilities"),
        ("tea_preset", [0.5, 0.5], "TEA probabilities must be 84 non-negative numbers"),
        ("train_fraction", 0.7, "must be one of 0.5, 1.0 (the training fractions of the paper's table)"),
        ("train_fraction", 0, "must be one of 0.5, 1.0 (the training fractions of the paper's table)"),
        ("train_fraction", True, "must be one of 0.5, 1.0 (the training fractions of the paper's table)"),
        ("train_fraction", "0.5", "must be one of 0.5, 1.0 (the training fractions of the paper's table)"),
        ("tea_preset", [math.nan] * 84, "series 'tea': probabilities must be finite and >= 0"),
        ("tra_preset", {"gamma": [0.5, 0.5, 0, math.nan]}, "series 'gamma': "),
        ("tea_policy", 3, "must be None or the path of a policies.json file"),
        ("tea_policy", "", "must be None or the path of a policies.json file"),
    ],
)  # fmt: skip
def test_bad_presets_fractions_and_policy_files_are_refused_naming_the_id(key, value, reason):
    """tra_preset, tea_preset, train_fraction, tra_policy and tea_policy had no rule: a bad value failed late
    inside a config expression (or, for a train_fraction, at a split the data does not have)."""
    with pytest.raises(PreflightError) as err:
        check_settings(argv=[], **{key: value})
    assert str(err.value).startswith(f"bad settings:\n  --{key} {value!r}: {reason}")
    assert str(err.value).count("\n") == 1


def _policies_file(tmp_path, tra=True, tea=True) -> str:
    from jcsaug.policy import make_tea_policy, make_tra_policy
    from jcsaug.policy.io import save_policies

    path = tmp_path / "policies.json"
    save_policies(path, make_tra_policy("nnunet") if tra else None, make_tea_policy() if tea else None)
    return str(path)


def test_good_presets_fractions_and_policy_files_pass(tmp_path):
    policies = _policies_file(tmp_path)
    check_settings(argv=[], tra_preset="deepmedic", tea_preset="uniform", train_fraction=0.5, tra_policy=None,
                   tea_policy=None)  # fmt: skip
    check_settings(argv=[], tra_preset={"base": "nnunet", "rotate_frontal": [0.5, 0, 0, 0, 0.5]}, tra_policy=policies,
                   tea_preset=[1 / 84] * 84, train_fraction=1, tea_policy=Path(policies), tra_mode="fixed",
                   tea_mode="fixed")  # fmt: skip
    check_settings(argv=[], tra_preset={}, tea_preset=np.full(84, 1 / 84), train_fraction=1.0, tra_mode="fixed",
                   tra_policy=policies)  # fmt: skip


def test_a_preset_mapping_is_checked_in_the_runs_tra_catalogue():
    """A mapping sized for ``split-signs`` (the zoom's 11 choices: identity and 5 bins x 2 signs) passes with that
    catalogue and is refused with ``spec`` (6 choices), naming the catalogue; a ``spec`` mapping the other way round.
    (The learning-quality benchmark's oracle under ``split-signs`` was refused here before the run.)"""
    split = {"base": "nnunet", "scale": [0.5] + [0.0] * 9 + [0.5]}
    spec = {"base": "nnunet", "scale": [0.5, 0, 0, 0, 0, 0.5]}
    check_settings(argv=[], tra_preset=split, tra_catalogue="split-signs")
    check_settings(argv=[], tra_preset=spec, tra_catalogue="spec")
    check_settings(argv=[], tra_preset=spec)  # no catalogue given: the default, spec
    for preset, catalogue, size in ((split, "spec", 6), (spec, "split-signs", 11)):
        with pytest.raises(PreflightError) as err:
            check_settings(argv=[], tra_preset=preset, tra_catalogue=catalogue)
        assert str(err.value) == (f"bad settings:\n  --tra_preset {preset!r}: series 'scale': expected {size} "
                                  f"non-negative probabilities, got {preset['scale']} (in the tra_catalogue "
                                  f"{catalogue!r})")  # fmt: skip
    with pytest.raises(PreflightError) as err:  # a bad catalogue is reported once, the preset not checked against it
        check_settings(argv=[], tra_preset=split, tra_catalogue="signs")
    assert str(err.value).count("\n") == 1 and "--tra_catalogue 'signs'" in str(err.value)


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"tra_mode": "fixed", "tra_policy": "no/such.json"}, "--tra_policy 'no/such.json': no file no/such.json "
                                                              "(tra_mode 'fixed' reads the policy from it)"),
        ({"tea_mode": "fixed", "tea_policy": "TRA_ONLY"}, "--tea_policy 'TRA_ONLY': TRA_ONLY holds no TEA policy "
                                                          "(tea_mode 'fixed')"),
        ({"tra_mode": "fixed", "tra_policy": "BROKEN"}, "--tra_policy 'BROKEN': cannot read policy file BROKEN: not "
                                                        "valid JSON"),
    ],
)  # fmt: skip
def test_a_fixed_mode_needs_a_policy_file_holding_its_policy(tmp_path, settings, expected):
    """AugmentationSetup refuses these when it is built, after the data is cached; preflight says it first."""
    tra_only = _policies_file(tmp_path, tea=False)
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    names = {"TRA_ONLY": tra_only, "BROKEN": str(broken)}
    settings = {k: names.get(v, v) for k, v in settings.items()}
    expected = expected.replace("TRA_ONLY", tra_only).replace("BROKEN", str(broken))
    with pytest.raises(PreflightError) as err:
        check_settings(argv=[], **settings)
    assert str(err.value).startswith(f"bad settings:\n  {expected}"), str(err.value)


def test_a_policy_file_is_only_required_where_it_is_read():
    """evaluate.yaml / inference.yaml run these checks with the training run's settings (a fixed mode names the run's
    folder) but never read a policy file: no file, or a path the mode ignores, passes (AugmentationSetup names a
    training run's missing file when it is built)."""
    with pytest.warns(UserWarning, match=r"--tra_policy 'gone\.json' is ignored"):
        check_settings(argv=[], tra_mode="class-specific", tra_policy="gone.json")
    check_settings(argv=[], tra_mode="fixed", tra_policy=None, tea_mode="fixed", tea_policy=None)


def test_a_policy_file_the_mode_does_not_read_is_a_warning(tmp_path):
    """AugmentationSetup ignores a policies.json in modes other than fixed: allowed, but said."""
    policies = _policies_file(tmp_path)
    with pytest.warns(
        UserWarning,
        match=rf"--tra_policy {re.escape(repr(policies))} is ignored: tra_mode "
        r"'class-specific' does not read a policy file \(tra_mode fixed does\)",
    ):
        check_settings(argv=[], tra_mode="class-specific", tra_policy=policies)
    with pytest.warns(UserWarning, match=r"--tea_policy .* is ignored: tea_mode 'joint'"):
        check_settings(argv=[], tea_mode="joint", tea_policy=policies)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_settings(argv=[], tra_mode="fixed", tra_policy=policies, tea_mode="joint", tea_policy=None)


def test_misspelled_override_id_is_refused_with_a_suggestion():
    suggestion = r"unknown override id\(s\) --max_epoch \(did you mean --max_epochs or --planned_epochs\?\)"
    with pytest.raises(PreflightError, match=suggestion):
        check_override_ids(_argv("--max_epoch", "3", "--num_workers", "0"))
    with pytest.raises(PreflightError) as err:
        check_override_ids(_argv("--max_epoch=3", "--nonsense_id", "1"))
    message = str(err.value)
    assert message.startswith("unknown override id(s) --max_epoch (did you mean --max_epochs or --planned_epochs?), ")
    assert re.search(r"Its settings: .*\bmax_epochs\b.*\btra_mode\b", message)
    # the bundle's own ids, nested ids and `monai.bundle run`'s arguments pass; other processes are not checked
    check_override_ids(_argv("--max_epochs", "3", "--network_def#channels", "[8,16,32]", "--meta_file", "m.json"))
    check_override_ids(["/usr/bin/pytest", "--max_epoch", "3"])


def test_override_ids_of_merged_configs_and_args_file(tmp_path):
    files = str([str(CONFIGS / "train.yaml"), str(CONFIGS / "inference.yaml")])
    check_override_ids([BUNDLE_MAIN, "run", "--config_file", files, "--tea_inference", "none"])
    with pytest.raises(PreflightError, match="--tea_inference"):
        check_override_ids(_argv("--tea_inference", "none"))  # an id of inference.yaml only
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"config_file": str(CONFIGS / "train.yaml"), "max_epochz": 2}))
    with pytest.raises(PreflightError, match=r"--max_epochz \(did you mean --max_epochs\?\)"):
        check_override_ids([BUNDLE_MAIN, "run", "--args_file", str(args)])


def test_override_ids_that_monais_tracking_adds_are_known_with_it(tmp_path):
    """``--tracking mlflow`` adds ``tracking_uri``, ``experiment_name``, ... to the config when missing, so they may be
    given with it (MONAI keeps a given value); without ``--tracking`` they are not ids; a settings file adds its own."""
    check_override_ids(_argv("--tracking", "mlflow", "--tracking_uri", "file:///tmp/mlruns", "--run_name", "a"))
    check_override_ids(_argv("--tracking=mlflow", "--experiment_name", "jcsaug"))
    with pytest.raises(PreflightError, match="--tracking_uri"):
        check_override_ids(_argv("--tracking_uri", "file:///tmp/mlruns"))
    with pytest.raises(PreflightError, match=r"--tracking_urx \(did you mean --tracking_uri"):
        check_override_ids(_argv("--tracking", "mlflow", "--tracking_urx", "file:///tmp/mlruns"))
    settings = tmp_path / "tracking.json"
    settings.write_text(json.dumps({"handlers_id": {}, "configs": {"my_tracking_folder": "runs/tracking"}}))
    check_override_ids(_argv("--tracking", str(settings), "--my_tracking_folder", "elsewhere"))
    with pytest.raises(PreflightError, match="--tracking_uri"):
        check_override_ids(_argv("--tracking", str(settings), "--tracking_uri", "x"))


def test_under_the_bundle_command_line_a_failed_check_exits_with_its_message(monkeypatch):
    monkeypatch.setattr(sys, "argv", _argv("--tea_z", "100"))
    with pytest.raises(SystemExit, match=r"^error: bad settings:\n  --tea_z 100: must be an integer in 1\.\.84"):
        check_settings(tea_z=100)


# ----------------------------------------------------------------------------------------------- output folder
def _a_run(folder: Path, max_epochs: int = 2, epoch_length: int = 3) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    trainer = {"iteration": 6, "epoch_length": epoch_length, "max_epochs": max_epochs}
    save_checkpoint_atomic(folder / "resume.pt", {"trainer": trainer, "network": torch.nn.Linear(1, 1)})
    save_checkpoint_atomic(folder / "checkpoint_final_iteration=6.pt", {"network": torch.nn.Linear(1, 1)})
    (folder / "policy_history.jsonl").write_text('{"epoch": 1}\n')
    (folder / "tensorboard").mkdir()
    (folder / "tensorboard" / "events").write_text("x")


def test_a_fresh_run_refuses_a_folder_holding_another_run(tmp_path):
    check_output_dir(tmp_path / "new")  # a missing or empty folder is fine
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    check_output_dir(tmp_path / "other")  # files that are no run's are fine
    run = tmp_path / "run"
    _a_run(run)
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    with pytest.raises(PreflightError, match=rf"{run} holds another run \(checkpoint_final_iteration=6\.pt, "
                       r"policy_history\.jsonl, resume\.pt, tensorboard\): pass --resume true to continue it, "
                       r"--overwrite true to replace it"):  # fmt: skip
        check_output_dir(run, resume=False, overwrite="false")
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
    with pytest.raises(PreflightError, match="contradict"):
        check_output_dir(run, resume=True, overwrite=True)


def test_overwrite_deletes_only_the_previous_runs_files(tmp_path):
    _a_run(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "metrics_evaluate_validation.json").write_text("{}")  # evaluate.yaml on the validation split
    (tmp_path / "per_case_evaluate_validation.csv").write_text("")
    check_output_dir(tmp_path, overwrite="true")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_overwrite_refuses_to_delete_a_policy_file_the_run_reads(tmp_path):
    """``--tra_mode fixed --tra_policy runs/x/policies.json --overwrite true`` (into that same folder) deleted the
    policy it was to reuse, then failed: the learned policy was lost."""
    _a_run(tmp_path)
    policies = tmp_path / "policies.json"
    policies.write_text("{}")
    with pytest.raises(PreflightError, match=rf"--overwrite true would delete {re.escape(str(policies))}, which this "
                       rf"run reads .*: copy it out of {re.escape(str(tmp_path))}"):  # fmt: skip
        check_output_dir(tmp_path, overwrite=True, inputs=[None, str(policies)])
    assert policies.is_file() and (tmp_path / "resume.pt").is_file()  # nothing deleted
    check_output_dir(tmp_path, overwrite=True, inputs=[None, str(tmp_path.parent / "elsewhere.json")])
    assert not policies.exists()


def test_resume_needs_resume_pt_with_the_same_length(tmp_path):
    with pytest.raises(PreflightError, match=r"--resume true but .*resume\.pt does not exist"):
        check_output_dir(tmp_path, resume=True)
    _a_run(tmp_path, max_epochs=2, epoch_length=3)
    check_output_dir(tmp_path, resume=True, max_epochs=2, epoch_length=3)
    with pytest.raises(PreflightError, match=r"cannot resume .*resume\.pt with --max_epochs 4: that run was saved "
                       r"with max_epochs 2 \(after 6 iterations\)\. Resume continues a run exactly"):  # fmt: skip
        check_output_dir(tmp_path, resume=True, max_epochs=4, epoch_length=3)
    with pytest.raises(PreflightError, match=r"with --max_epochs 4, --epoch_length 5: that run was saved with "
                       r"max_epochs 2, epoch_length 3"):  # fmt: skip
        check_output_dir(tmp_path, resume=True, max_epochs=4, epoch_length=5)


def test_resume_checkpoint_refuses_another_run_length(tmp_path):
    """The engine-level guard (Python users of ResumeCheckpoint): ignite would silently keep the saved length."""
    net = torch.nn.Linear(1, 1)
    engine = Engine(lambda e, b: None)
    ResumeCheckpoint(tmp_path, {"network": net}).attach(engine)
    engine.run(range(2), max_epochs=1)
    resumed = Engine(lambda e, b: None)
    ResumeCheckpoint(tmp_path, {"network": net}, resume=True).attach(resumed)
    with pytest.raises(ValueError, match=r"cannot resume .*resume\.pt with --max_epochs 3: that run was saved with "
                       r"max_epochs 1"):  # fmt: skip
        resumed.run(range(2), max_epochs=3)


# ----------------------------------------------------------------------------------------------- data
def _nifti(path: Path, shape=(8, 8, 8), affine=None, dtype=np.float32) -> str:
    nib.save(nib.Nifti1Image(np.zeros(shape, dtype), np.eye(4) if affine is None else affine), str(path))
    return str(path)


def test_every_bad_case_of_every_split_is_listed(tmp_path):
    good = {"image": _nifti(tmp_path / "i.nii.gz"), "label": _nifti(tmp_path / "l.nii.gz", dtype=np.uint8)}
    flipped = np.diag([-1.0, 1.0, 1.0, 1.0])
    splits = {
        "training": [good, {"image": good["image"], "label": str(tmp_path / "missing.nii.gz")}],
        "validation": [{"image": good["image"], "label": _nifti(tmp_path / "f.nii.gz", affine=flipped)}],
        "test": [{"image": _nifti(tmp_path / "s.nii.gz", (8, 8, 7)), "label": good["label"]},
                 {"image": _nifti(tmp_path / "2d.nii.gz", (8, 8)), "label": good["label"]},
                 {"image": good["image"]}],
    }  # fmt: skip
    with pytest.raises(PreflightError) as err:
        check_data(splits)
    lines = str(err.value).splitlines()
    assert lines[0] == "5 problem(s) in the data, found before the run:"
    assert lines[1] == f"  training: case {good['image']}: label file {tmp_path / 'missing.nii.gz'} does not exist"
    assert lines[2].startswith(f"  validation: case {good['image']}: image and label affines differ")
    assert lines[3] == f"  test: case {tmp_path / 's.nii.gz'}: image shape (8, 8, 7) and label shape (8, 8, 8) differ"
    assert lines[4] == f"  test: case {tmp_path / '2d.nii.gz'}: image is 2D (spatial shape (8, 8)), 3D is needed"
    assert lines[5] == f"  test: case {good['image']}: no 'label' entry"
    check_data({"training": [good], "test": [good]})
    check_data({"input": [{"image": good["image"]}]}, require=["image"])


def test_empty_splits(tmp_path):
    good = {"image": _nifti(tmp_path / "i.nii.gz"), "label": _nifti(tmp_path / "l.nii.gz")}
    with pytest.raises(PreflightError, match=r"split 'test' is empty: nothing to use"):
        check_data({"training": [good], "validation": [good], "test": []})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # heuristic TRA + no TEA need no validation data at all: no warning
        check_data({"training": [good], "validation": [], "test": [good]}, "heuristic", "none")
    for tra, tea in (("class-specific", "joint"), ("none", "learned-posthoc"), ("learned", "none")):
        with pytest.warns(UserWarning, match="the validation split is empty: every policy update .* is skipped"):
            check_data({"training": [good], "validation": [], "test": [good]}, tra, tea)


# ----------------------------------------------------------------------------------------------- patch size
def test_patch_size_the_network_cannot_take_is_refused_with_one_that_fits():
    unet = UNet(3, 1, 2, channels=(4, 8, 16), strides=(2, 2), num_res_units=1, norm="instance").train()
    check_patch_size(unet, [32, 32, 32])
    with pytest.raises(PreflightError, match=re.escape("--patch_size 7 does not fit the UNet (logits [8, 8, 8] for "
                                                       "a patch of [7, 7, 7]); e.g. [8, 8, 8] fits")):  # fmt: skip
        check_patch_size(unet, 7)
    with pytest.raises(PreflightError, match=r"--patch_size \[30, 32, 32\] does not fit the UNet \(RuntimeError: "):
        check_patch_size(unet, [30, 32, 32])
    with pytest.raises(PreflightError, match=r"--patch_size 'big': must be a list of positive integers"):
        check_patch_size(unet, "big")
    with pytest.raises(PreflightError, match=r"network is 'unet3d', not a network module"):
        check_patch_size("unet3d", [32, 32, 32])  # a name where the built network belongs
    assert unet.training  # the network's mode is left as it was (the check runs it in eval mode)
    deepmedic = make_network("deepmedic", 1, 2, [21, 21, 21], feature_maps=[2] * 8, fc_feature_maps=[2, 2])
    check_patch_size(deepmedic, [21, 21, 21], sizes=get_network("deepmedic").sizes)  # logits cover its output region
    with pytest.raises(PreflightError, match=r"does not fit the DeepMedic \(ValueError: input size \[21, 21, 21\]"):
        check_patch_size(deepmedic, [21, 21, 21])  # without its sizes: the logits must cover the whole input
    dynunet = make_network("unet3d", 1, 2, [32, 32, 32])  # its deep-supervision heads share encoder modules
    check_patch_size(dynunet, [32, 32, 32])
    with pytest.raises(PreflightError, match=r"--patch_size \[36, 32, 32\] does not fit the NnUNetDynUNet"):
        check_patch_size(dynunet, [36, 32, 32])
    for net in (unet, deepmedic, dynunet):  # the networks themselves are untouched (nothing on the meta device)
        assert all(t.device.type == "cpu" for t in [*net.parameters(), *net.buffers()])
        # tensors only: DeepMedic's state also holds its subsampling (extra state)
        assert all(t.device.type == "cpu" for t in net.state_dict().values() if isinstance(t, torch.Tensor))


def test_the_evaluation_check_names_a_bad_or_empty_split_and_checks_the_cases_of_the_one_evaluated(tmp_path):
    """evaluate.yaml's ``evaluate_split``: an unknown split or one without cases is refused by name, and only the
    evaluated split's cases are read (a broken test case does not stop an evaluation of the validation split)."""
    good = {"image": _nifti(tmp_path / "i.nii.gz"), "label": _nifti(tmp_path / "l.nii.gz")}
    broken = {"image": good["image"], "label": str(tmp_path / "missing.nii.gz")}
    with pytest.raises(PreflightError, match=r"evaluate_split must be one of test, validation; got 'training'"):
        check_evaluation_data("training", {"test": [good], "validation": [good]})
    with pytest.raises(PreflightError, match=r"evaluate_split 'validation': the validation split has no cases"):
        check_evaluation_data("validation", {"test": [good], "validation": []})
    check_evaluation_data("validation", {"test": [broken], "validation": [good]})
    with pytest.raises(PreflightError, match=r"test: case .*missing.nii.gz does not exist"):
        check_evaluation_data("test", {"test": [broken], "validation": [good]})


def _documented_command_line(docs: Path, start: str) -> list[str]:
    """The tokens of the one backticked command line in ``docs`` that begins with ``start``."""
    (line,) = re.findall(rf"`({re.escape(start)}[^`]*)`", docs.read_text())
    return line.split()


def _documented_paper_overrides() -> list[str]:
    """The command-line overrides the synthetic bundle's docs give for the paper's estimators."""
    return _documented_command_line(CONFIGS.parent / "docs" / "README.md", "--tra_estimator gumbel")


def _as_fire_reads(text: str):
    """A command-line value as monai.bundle's command line (fire) reads it: a Python literal, else the string."""
    import ast

    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _checked_synthetic_config(overrides: dict):
    """The synthetic bundle's config with ``overrides`` after its ``check_settings`` ran (raises on a bad value)."""
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config(str(CONFIGS / "train.yaml"))
    parser.update(overrides)
    parser.get_parsed_content("check_settings")
    return parser


def _checked_command_line(tokens: list[str]):
    """A documented ``--id value ...`` line as the bundle's command line takes it: its ids exist and its values pass
    the checks (:func:`_checked_synthetic_config`)."""
    ids, values = tokens[0::2], tokens[1::2]
    assert all(i.startswith("--") for i in ids) and len(ids) == len(values), tokens
    check_override_ids(_argv(*tokens))
    return _checked_synthetic_config({i[2:]: _as_fire_reads(v) for i, v in zip(ids, values)})


def test_the_documented_paper_estimators_pass_the_bundles_checks():
    """The docs' line that restores the paper's estimators is one the bundle accepts: its ids exist and its values
    go together (the line once kept the bundle's natural-gradient step, which gumbel refuses)."""
    from monai.bundle import ConfigParser

    parser = _checked_command_line(_documented_paper_overrides())
    assert parser["tra_estimator"] == parser["tea_estimator"] == "gumbel" and parser["tra_step"] == "adam"
    parser.update({"tra_step": "natural-unbiased"})  # the bundle's own step with gumbel is refused, by name
    with pytest.raises(RuntimeError) as raised:  # monai.bundle wraps the expression's error
        ConfigParser(parser.get()).get_parsed_content("check_settings")
    cause = raised.value.__cause__
    assert isinstance(cause, PreflightError) and "--tra_step 'natural-unbiased'" in str(cause)


def test_the_documented_decision_7_line_passes_the_checks_and_sets_both_settings():
    """bundles/README.md's one-run line for decision 7's package (the TRA scored without the TEA's ops, the learned
    TTA at equal weights) is one the synthetic bundle accepts, and it sets what the benchmark measured."""
    from jcsaug.inference.tta import EQUAL_WEIGHTS
    from jcsaug.utils import as_share

    tokens = _documented_command_line(BUNDLES / "README.md", "--tra_val_tea false --tea_identity_weight")
    parser = _checked_command_line(tokens)
    assert as_share(parser.get_parsed_content("tra_val_tea")) == 0
    assert parser.get_parsed_content("augmentation").tea_identity_weight == EQUAL_WEIGHTS


def test_the_learning_benchmarks_paper_mode_is_the_documented_line_and_passes_the_checks():
    from helpers import load_benchmark

    mode = load_benchmark("bench_learning_quality").MODES["paper"]
    tokens = _documented_paper_overrides()
    documented = {i[2:]: v for i, v in zip(tokens[0::2], tokens[1::2])}
    assert {k: mode[k] for k in documented} == documented  # the benchmark runs what the docs say
    _checked_synthetic_config({k: _as_fire_reads(v) for k, v in mode.items()})
