"""Issue 12 reproduced on the bundles, as a user runs them (``B`` = the synthetic bundle on a small dataset).

Checks that fail before the first iteration run in this process (``ConfigWorkflow.initialize``, with the command
line the bundle would see); runs that train or must show their exit status run as ``python -m monai.bundle run``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from monai.bundle import ConfigParser, ConfigWorkflow

from helpers import CONFIGS, SMALL_DATASET_KEPT, bundle_run_args, small_dataset
from jcsaug.engine import nonfinite_entries, read_checkpoint, save_checkpoint_atomic
from jcsaug.engine.preflight import PreflightError, check_override_ids
from jcsaug.inference import TEAInferer
from preloaded import run_module

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.filterwarnings(SMALL_DATASET_KEPT),
]

BUNDLES = CONFIGS.parents[1]
BUNDLE_MAIN = str(Path(sys.modules["monai"].__file__).parent / "bundle" / "__main__.py")
#: the issue's B: small and fast, on small_dataset's 32³ volumes
B = {"max_epochs": 1, "epoch_length": 1, "num_workers": 0, "patch_size": [24, 24, 24], "num_tea_copies": 2}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hardening")
    small_dataset(root)
    return root / "data"


def _copy(dataset: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(dataset, tmp_path / "data"))


def _workflow(monkeypatch, tmp_path: Path, data: Path, bundle: str = "synthetic_lesion", **overrides):
    """The bundle's workflow as ``python -m monai.bundle run`` builds it, before ``initialize`` (values as fire parses
    them, the command line as the process would see it)."""
    configs = BUNDLES / bundle / "configs"
    settings = {**B, "dataset_dir": str(data), "output_dir": str(tmp_path / "run"), **overrides}
    argv = [BUNDLE_MAIN, "run", "--config_file", str(configs / "train.yaml")]
    for key, value in settings.items():
        argv += [f"--{key}", str(value).replace(" ", "")]
    monkeypatch.setattr(sys, "argv", argv)
    return ConfigWorkflow(config_file=str(configs / "train.yaml"), meta_file=str(configs / "metadata.json"),
                          logging_file=False, **settings)  # fmt: skip


def _refused(monkeypatch, tmp_path, data, bundle="synthetic_lesion", **overrides) -> str:
    workflow = _workflow(monkeypatch, tmp_path, data, bundle, **overrides)
    with pytest.raises(SystemExit) as err:
        workflow.initialize()
    return str(err.value)


def _messages(err: BaseException) -> list[str]:
    """The messages of an error and of the errors it came from (MONAI wraps config errors in RuntimeErrors)."""
    messages = []
    while err is not None:
        messages.append(str(err))
        err = err.__cause__ or err.__context__
    return messages


def _files(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _cli(tmp_path: Path, data: Path, **overrides) -> subprocess.CompletedProcess:
    args = bundle_run_args(CONFIGS, "train.yaml")
    for key, value in {**B, "dataset_dir": data, "output_dir": tmp_path / "run", **overrides}.items():
        args += [f"--{key}", str(value).replace(" ", "")]
    return run_module("monai.bundle", args, cwd=tmp_path, timeout=900)


# ----------------------------------------------------------------------------------------------- item 1
def test_1_corrupt_datalist_is_an_error_and_the_cases_survive(monkeypatch, tmp_path, dataset):
    data = _copy(dataset, tmp_path)
    (data / "dataset.json").write_text("")  # `: > D/dataset.json`
    before = _files(data)
    workflow = _workflow(monkeypatch, tmp_path, data)
    with pytest.raises(RuntimeError) as err:
        workflow.initialize()
    chain = _messages(err.value)
    assert any(f"cannot read the datalist {data / 'dataset.json'}" in m for m in chain), chain
    assert _files(data) == before


# ----------------------------------------------------------------------------------------------- item 2
def test_2_a_diverged_run_exits_non_zero_and_saves_no_nan(tmp_path, dataset):
    result = _cli(tmp_path, dataset, learning_rate=1e12, max_epochs=3, epoch_length=3)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "TrainingDiverged: training diverged: the loss is nan at epoch " in result.stderr
    run = tmp_path / "run"
    for path in run.glob("*.pt"):
        assert not nonfinite_entries(read_checkpoint(path)), path
    assert not (run / "metrics.json").exists()


# ----------------------------------------------------------------------------------------------- items 3 and 4
def _previous_run(run: Path) -> None:
    """What a finished `B --max_epochs 1 --epoch_length 2` leaves (checkpoint contents do not matter here)."""
    trainer = {"iteration": 2, "epoch_length": 2, "max_epochs": 1}
    save_checkpoint_atomic(run / "resume.pt", {"trainer": trainer, "network": torch.nn.Linear(1, 1)})
    save_checkpoint_atomic(run / "checkpoint_final_iteration=2.pt", {"network": torch.nn.Linear(1, 1)})
    (run / "policy_history.jsonl").write_text('{"epoch": 1, "iteration": 2, "probabilities": {}}\n')
    (run / "metrics.json").write_text("{}")


def test_3_a_fresh_run_into_a_folder_holding_a_run_is_refused(monkeypatch, tmp_path, dataset):
    run = tmp_path / "run"
    _previous_run(run)
    before = _files(run)
    message = _refused(monkeypatch, tmp_path, dataset, epoch_length=2)
    assert message.startswith(f"error: {run} holds another run (checkpoint_final_iteration=2.pt, metrics.json, ")
    assert "pass --resume true to continue it, --overwrite true to replace it" in message
    assert _files(run) == before
    _workflow(monkeypatch, tmp_path, dataset, epoch_length=2, resume=True).initialize()  # resume: accepted
    assert _files(run) == before
    _workflow(monkeypatch, tmp_path, dataset, epoch_length=2, overwrite=True).initialize()  # replace: the old goes
    assert not any(run.iterdir())


def test_4_resume_with_a_larger_max_epochs_is_refused(monkeypatch, tmp_path, dataset):
    run = tmp_path / "run"
    _previous_run(run)
    message = _refused(monkeypatch, tmp_path, dataset, epoch_length=2, max_epochs=6, resume=True)
    assert message.startswith(f"error: cannot resume {run / 'resume.pt'} with --max_epochs 6: that run was saved "
                              "with max_epochs 1")  # fmt: skip
    assert "start a longer run in another --output_dir" in message


def test_4_resume_with_another_seed_or_update_interval_is_refused(monkeypatch, tmp_path, dataset):
    """The run's settings are saved in resume.pt (``resume_settings``) and checked before anything is loaded."""
    run = tmp_path / "run"
    _previous_run(run)
    state = read_checkpoint(run / "resume.pt")
    workflow = _workflow(monkeypatch, tmp_path, dataset, epoch_length=2, resume=True)
    context = list(workflow.parser.get_parsed_content("context"))  # the TRA context this run's patches have
    state["run_settings"] = {"seed": 0, "tra_mode": "class-specific", "tea_mode": "joint", "tra_update_every": 2,
                             "tea_update_every": 2, "tra_context": context}  # fmt: skip
    torch.save(state, run / "resume.pt")
    workflow.initialize()  # the same: accepted
    message = _refused(monkeypatch, tmp_path, dataset, epoch_length=2, resume=True, seed=1, tra_update_every=4)
    assert "--seed 1" in message and "seed 0" in message
    assert "--tra_update_every 4" in message and "tra_update_every 2" in message
    message = _refused(monkeypatch, tmp_path, dataset, epoch_length=2, resume=True, tra_context=0)
    assert "--tra_context [0, 0, 0]" in message and f"tra_context {context}" in message


# ----------------------------------------------------------------------------------------------- items 5 and 6
def _edit_label(data: Path, split: str, edit) -> Path:
    entry = json.loads((data / "dataset.json").read_text())[split][0]
    path = data / entry["label"]
    label = nib.load(str(path))
    array, affine = edit(np.asarray(label.dataobj).copy(), label.affine.copy())
    nib.save(nib.Nifti1Image(array, affine), str(path))
    return path


def test_5_a_label_with_another_affine_is_named_before_training(monkeypatch, tmp_path, dataset):
    data = _copy(dataset, tmp_path)
    label = _edit_label(data, "training", lambda a, aff: (a, np.diag([2.0, 2.0, 2.0, 1.0])))  # saved at 2 mm
    message = _refused(monkeypatch, tmp_path, data)
    assert message.startswith("error: 1 problem(s) in the data, found before the run:\n  training: case ")
    assert "image and label affines differ (tolerance 0.001 mm)" in message and "case_000.nii.gz" in message
    assert not (tmp_path / "run").exists(), label


@pytest.mark.parametrize(("value", "dtype", "found"), [(7, np.uint8, "[7]"), (256, np.int16, "[256]")])
def test_6_bad_label_values_name_the_case_before_training(monkeypatch, tmp_path, dataset, value, dtype, found):
    data = _copy(dataset, tmp_path)

    def bad(array, affine):
        array = array.astype(dtype)
        array[0, 0, 0] = value
        return array, affine

    label = _edit_label(data, "training", bad)
    workflow = _workflow(monkeypatch, tmp_path, data)
    workflow.initialize()  # headers are fine; the values are checked when the cases are cached
    with pytest.raises(RuntimeError) as err:
        workflow.run()
    text = _messages(err.value)
    assert any(f"(with {label}): label values {found} are not classes 0..1 (num_classes 2)" in t for t in text), text
    assert not list((tmp_path / "run").glob("*.pt"))


# ----------------------------------------------------------------------------------------------- items 7, 8 and 9
def test_8_an_empty_validation_split_trains_with_skipped_updates(monkeypatch, tmp_path, dataset):
    data = _copy(dataset, tmp_path)
    datalist = json.loads((data / "dataset.json").read_text())
    datalist["validation"] = []
    (data / "dataset.json").write_text(json.dumps(datalist))
    workflow = _workflow(monkeypatch, tmp_path, data, epoch_length=2, tra_update_every=1, tea_update_every=1,
                         evaluate="$None")  # fmt: skip
    with pytest.warns(UserWarning, match="the validation split is empty: every policy update"):
        workflow.initialize()
    with pytest.warns(UserWarning, match="update skipped: the validation loader is empty"):
        workflow.run()
    updaters = workflow.parser.get_parsed_content("policy_updaters")
    assert [u.skipped for u in updaters] == [2, 2]
    assert (tmp_path / "run" / "checkpoint_final_iteration=2.pt").is_file()


@pytest.mark.parametrize(
    ("bundle", "overrides", "expected"),
    [
        ("synthetic_lesion", {"max_epoch": 3}, "error: unknown override id(s) --max_epoch (did you mean --max_epochs"),
        ("synthetic_lesion", {"patch_size": 7}, "error: --patch_size 7 does not fit the UNet (logits [8, 8, 8] for a "
                                                "patch of [7, 7, 7]); e.g. [8, 8, 8] fits"),
        ("synthetic_lesion", {"tea_z": 100, "max_epochs": 0},
         "error: bad settings:\n  --tea_z 100: must be an integer in 1..84 (the TEA catalogue has 84 ops)\n"
         "  --max_epochs 0: must be an integer >= 1"),
        ("synthetic_lesion", {"network": "unet3d"}, "error: unknown override id(s) --network (did you mean "),
        ("kits19_tumor", {"network": "nonsense"}, "error: bad settings:\n  --network 'nonsense': must be one of "),
    ],
)  # fmt: skip
def test_9_bad_settings_and_ids_fail_first_with_the_valid_ones(monkeypatch, tmp_path, dataset, bundle, overrides,
                                                               expected):  # fmt: skip
    data = dataset if bundle == "synthetic_lesion" else tmp_path / "not_prepared"  # settings come before data
    assert _refused(monkeypatch, tmp_path, data, bundle, **overrides).startswith(expected)
    assert not (tmp_path / "run").exists()


def test_7_a_missing_test_split_fails_before_training(monkeypatch, tmp_path, prepared):
    workflow = _workflow(monkeypatch, tmp_path, prepared["kits19_tumor"][1], "kits19_tumor", test_split="nosuch",
                         network="unet3d", patch_size=[32, 32, 32])  # fmt: skip
    with pytest.raises(RuntimeError) as err:
        workflow.initialize()
    cause = _messages(err.value)[-1]
    assert "has no split 'nosuch'" in cause and "'test'" in cause
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------------------------- every bundle
ALL_BUNDLES = sorted(p.parents[1].name for p in BUNDLES.glob("*/configs/metadata.json"))


@pytest.mark.parametrize("bundle", ALL_BUNDLES)
@pytest.mark.parametrize("extra", ["", "evaluate.yaml", "inference.yaml", "multi_gpu_train.yaml"])
def test_every_bundle_runs_the_checks_and_guards(bundle, extra):
    """The hardening is wired into every bundle and merged config (the six dataset bundles share _common/configs):
    preflight in initialize, CheckImageLabeld right after loading, StopOnNonFiniteLoss first among the train
    handlers, jcsaug's CacheDataset, empty-validation-safe loader, and the overwrite setting."""
    configs = BUNDLES / bundle / "configs"
    files = [str(configs / "train.yaml")] + ([str(configs / extra)] if extra else [])
    config = ConfigParser.load_config_files(files)
    assert "$@preflight" in config["initialize"]
    assert config["preflight"][-1] == "$@check_output_dir"  # last: --overwrite deletes only after the other checks
    assert {"$@check_settings", "$@check_data", "$@check_patch_size"} <= set(config["preflight"])
    targets = [t.get("_target_") for t in config["load_transforms"] if isinstance(t, dict)]
    assert targets.index("jcsaug.data.CheckImageLabeld") == targets.index("EnsureChannelFirstd") + 1
    assert config["train_handlers"][0]["_target_"] == "jcsaug.engine.StopOnNonFiniteLoss"
    val_cache = config.get("val_volumes", config["val_dataset"])  # synthetic: patches cut from cached volumes
    assert config["train_dataset"]["_target_"] == val_cache["_target_"] == "jcsaug.data.CacheDataset"
    assert config["val_loader"]["shuffle"] == "$len(@val_files) > 0"
    assert config["overwrite"] is False and config["resume"] is False
    if extra in ("evaluate.yaml", "inference.yaml"):  # the run's folder is read, not written
        assert config["check_output_dir"] == "$None" and "'training'" not in config["check_data"]
    # every id of the merged configs is a valid override (issue 10's and 13's settings included); --meta_file too
    argv = [BUNDLE_MAIN, "run", "--config_file", str(files) if extra else files[0], "--meta_file", "m.json"]
    for key in config:
        argv += [f"--{key}", "1"]
    check_override_ids(argv)
    with pytest.raises(PreflightError, match=r"unknown override id\(s\) --max_epoch "):
        check_override_ids([*argv, "--max_epoch", "3"])


@pytest.mark.parametrize(
    ("bundle", "ids"),
    [
        ("synthetic_lesion", ["tra_estimator", "tea_estimator", "tra_counterfactuals", "tra_logit_budget",
                              "tea_logit_budget", "val_batches", "val_average", "tea_patches", "tra_policy",
                              "tea_policy", "tra_lookahead", "tea_patch_size", "tea_poly_power", "augment_on",
                              "network_def#channels", "overwrite", "tra_direction", "tra_exploration",
                              "tra_poly_power", "tra_start", "tra_val_tea", "tea_mask_out_of_view",
                              "tea_volume_stats"]),
        ("kits19_tumor", ["network", "network_kwargs", "tra_policy", "tea_policy", "augment_on", "test_split",
                          "cache_rate", "overwrite", "train_fraction", "tea_poly_power", "tra_direction",
                          "tra_exploration", "tra_poly_power", "tra_start", "tra_val_tea", "tea_mask_out_of_view",
                          "tea_volume_stats"]),
    ],
)  # fmt: skip
def test_the_settings_of_issues_10_and_13_are_known_override_ids(bundle, ids):
    configs = BUNDLES / bundle / "configs"
    argv = [BUNDLE_MAIN, "run", "--config_file", str(configs / "train.yaml")]
    for key in ids:
        argv += [f"--{key}", "1"]
    check_override_ids(argv)


@pytest.mark.parametrize(
    ("tea_patch_size", "expected"),
    [(None, [24, 24, 24]), ([16, 16, 16], [16, 16, 16]), ([48, 48, 48], [32, 32, 32])],
)
def test_the_tea_scores_its_ops_on_patches_of_tea_patch_size(monkeypatch, tmp_path, dataset, tea_patch_size,
                                                             expected):  # fmt: skip
    """Issue 10: the TEA updater reads ``tea_val_loader`` — lesion-centred validation patches of ``tea_patch_size``
    (None: ``patch_size``; larger than the volume: the volume whole) — while the TRA keeps ``val_loader``'s."""
    parser = _workflow(monkeypatch, tmp_path, dataset, tea_patch_size=tea_patch_size).parser
    tea_loader, val_loader = parser.get_parsed_content("tea_val_loader"), parser.get_parsed_content("val_loader")
    # lesion-centred: each crop starts where a lesion voxel's crop would (MONAI moves a centre near the border of the
    # 32³ volume inside it, so the centre voxel itself need not be lesion); the start is the crop's affine translation
    n = expected[0]
    lesions = [torch.nonzero(torch.as_tensor(v["label"])[0] != 0) for v in tea_loader.dataset.data]
    lesion_starts = [p.clamp(n // 2, 32 - n // 2) - n // 2 for p in lesions]
    for batch in tea_loader:
        assert list(batch["image"].shape[2:]) == list(batch["label"].shape[2:]) == expected
        assert bool((batch["label"] != 0).any())
        for start in batch["label"].affine[:, :3, 3].round().long():
            assert any(bool((s == start).all(dim=1).any()) for s in lesion_starts), start
    assert list(next(iter(val_loader))["image"].shape[2:]) == [24, 24, 24]
    updaters = parser.get_parsed_content("policy_updaters")
    assert updaters.tea.val_stream.loader is tea_loader and updaters.tra.val_stream.loader is val_loader
    assert tea_loader.dataset.data is val_loader.dataset.data  # the validation volumes are loaded and cached once


@pytest.mark.parametrize("tea_sliding_window", [None, "false", "true"])
def test_tea_sliding_window_predicts_the_teas_copies_with_the_test_inferer(monkeypatch, tmp_path, dataset,
                                                                         tea_sliding_window):  # fmt: skip
    """``tea_sliding_window`` (a flag: fire passes ``--tea_sliding_window false`` as the string) gives the TEA updater
    the sliding-window inferer the test predicts with, so its ops are scored as the TTA will use them; off by
    default (one pass of the network over each validation patch)."""
    overrides = {} if tea_sliding_window is None else {"tea_sliding_window": tea_sliding_window}
    parser = _workflow(monkeypatch, tmp_path, dataset, **overrides).parser
    tea = parser.get_parsed_content("policy_updaters").tea
    if tea_sliding_window == "true":
        assert tea.inferer is parser.get_parsed_content("sw_inferer") and tea.inferer is not None
    else:
        assert tea.inferer is None


@pytest.mark.parametrize(("value", "expected"), [(None, False), ("false", False), ("true", True)])
def test_tea_mask_out_of_view_reaches_the_tea_updater(monkeypatch, tmp_path, dataset, value, expected):
    """``tea_mask_out_of_view`` (a flag: fire passes ``--tea_mask_out_of_view false`` as the string): the TEA updater
    scores its copies on the voxels their ops kept in view, off by default in the synthetic bundle."""
    overrides = {} if value is None else {"tea_mask_out_of_view": value}
    tea = _workflow(monkeypatch, tmp_path, dataset, **overrides).parser.get_parsed_content("policy_updaters").tea
    assert tea.mask_out_of_view is expected


@pytest.mark.parametrize("tea_poly_power", [None, 0.9, 2.0])
def test_tea_poly_power_reaches_the_tea_updater_only(monkeypatch, tmp_path, dataset, tea_poly_power):
    """The TEA's gamma is constant by default (issue 10: measured); an override reaches the TEA updater only."""
    overrides = {} if tea_poly_power is None else {"tea_poly_power": tea_poly_power}
    updaters = _workflow(monkeypatch, tmp_path, dataset, **overrides).parser.get_parsed_content("policy_updaters")
    assert updaters.tea.poly_power == (0.0 if tea_poly_power is None else tea_poly_power)
    assert updaters.tra.poly_power == 0.0


@pytest.mark.parametrize(
    ("overrides", "poly_power", "start", "pull"),
    [({}, 0.0, 0.0, 0.0), ({"tra_poly_power": 0.9, "tra_start": 0.25, "tra_pull": 2}, 0.9, 0.25, 2.0)],
)
def test_tra_poly_power_start_and_pull_reach_the_tra_updater_only(
    monkeypatch, tmp_path, dataset, overrides, poly_power, start, pull
):
    """The synthetic bundle's TRA keeps beta constant (issue 10: measured; the paper decays it, poly 0.9), learns
    from the first iteration and pulls nothing back to the preset by default; the overrides reach the TRA updater
    (and its resume settings) only."""
    updaters = _workflow(monkeypatch, tmp_path, dataset, **overrides).parser.get_parsed_content("policy_updaters")
    assert (updaters.tra.poly_power, updaters.tra.start, updaters.tra.pull) == (poly_power, start, pull)
    assert (updaters.tea.poly_power, updaters.tea.start, updaters.tea.pull) == (0.0, 0.0, 0.0)
    assert updaters.tra.resume_settings().get("start", 0.0) == start
    assert updaters.tra.resume_settings().get("pull", 0.0) == pull


@pytest.mark.parametrize(
    ("tra_step", "rule"),
    [(None, "natural-unbiased"), ("adam", "adam"), ("natural", "natural"), ("natural-series", "natural-series"),
     ("natural-recent", "natural-recent"), ("natural-unbiased", "natural-unbiased")],
)  # fmt: skip
def test_tra_step_reaches_the_tra_updater_only(monkeypatch, tmp_path, dataset, tra_step, rule):
    """The synthetic bundle's TRA takes natural-gradient steps with one second moment per class group over the
    last ~50 updates, corrected for the drift noise gives the rare ops, by default (issue 10: measured);
    ``--tra_step adam`` gives each logit its own Adam step; the rule is a resume setting and the TEA keeps Adam."""
    overrides = {} if tra_step is None else {"tra_step": tra_step}
    updaters = _workflow(monkeypatch, tmp_path, dataset, **overrides).parser.get_parsed_content("policy_updaters")
    assert (updaters.tra.step_rule, updaters.tea.step_rule) == (rule, "adam")
    optimiser = updaters.tra.optimizer.param_groups[0]
    assert optimiser["second_moment"] == ("entry" if rule == "adam" else "row")
    assert optimiser["row_blocks"] == (updaters.tra.policy.offsets if rule == "natural-series" else None)
    assert optimiser["betas"] == (0.9, 0.98 if rule in ("natural-recent", "natural-unbiased") else 0.999)
    assert optimiser["convexity_correction"] == (rule == "natural-unbiased")
    assert updaters.tra.resume_settings().get("step_rule", "adam") == rule
    common = ConfigParser()
    common.read_config(BUNDLES / "_common" / "configs" / "train.yaml")
    assert common["tra_step"] == "adam"  # the dataset bundles keep Adam (not measured on their tasks)


@pytest.mark.parametrize(("tra_val_tea", "share"), [(None, 1.0), ("false", 0.0), (True, 1.0), (0.5, 0.5)])
def test_tra_val_tea_decides_whether_the_tra_scores_tea_transformed_validation_patches(
    monkeypatch, tmp_path, dataset, tra_val_tea, share
):
    """Joint mode: the TRA's validation batch is transformed by the TEA policy's ops (the paper's, the default);
    ``--tra_val_tea false`` scores it on the patches as they are, ``--tra_val_tea 0.5`` half its samples on
    average; the share is a resume setting (equal to the True / False a file saved before shares holds)."""
    overrides = {} if tra_val_tea is None else {"tra_val_tea": tra_val_tea}
    updaters = _workflow(monkeypatch, tmp_path, dataset, **overrides).parser.get_parsed_content("policy_updaters")
    assert (updaters.tra.tea_policy is updaters.tea_policy) is (share > 0) and updaters.tea_policy is not None
    assert (updaters.tra.tea_policy is None) is (share == 0)
    assert updaters.tra.tea_share == (share or 1.0)
    assert updaters.tra.resume_settings()["val_tea"] == share


# ----------------------------------------------------------------------------------------------- every setting checked
def _checked_ids(config: dict) -> set[str]:
    """The ids a bundle's settings checks pass to ``check_settings`` (each as ``id=@id``)."""
    import re

    checks = " ".join(v for k, v in config.items() if k.startswith("check_") and "check_settings(" in str(v))
    pairs = re.findall(r"(\w+)=@(\w+)", checks)
    assert all(key == ref for key, ref in pairs), pairs  # each id checked under its own name
    return {key for key, _ in pairs}


@pytest.mark.parametrize("bundle", ["synthetic_lesion", "kits19_tumor"])  # the six task bundles share one train.yaml
def test_every_setting_with_a_rule_is_checked_before_the_run(bundle):
    """Preflight had rules for tra_update_every, val_batch_size, the learning rates, ... that no bundle passed: a
    bad value failed later inside a config expression, or not at all."""
    from jcsaug.engine.preflight import _validators

    config = ConfigParser.load_config_file(BUNDLES / bundle / "configs" / "train.yaml")
    missing = (set(_validators()) & set(config)) - _checked_ids(config)
    assert not missing, f"{bundle}: settings with a preflight rule that check_settings is not given: {sorted(missing)}"


@pytest.mark.parametrize(
    ("bundle", "overrides", "expected"),
    [
        ("synthetic_lesion", {"tra_update_every": 0}, "--tra_update_every 0: must be an integer >= 1"),
        ("synthetic_lesion", {"stop_after_epochs": -1}, "--stop_after_epochs -1: must be an integer >= 0"),
        ("synthetic_lesion", {"val_batch_size": 0}, "--val_batch_size 0: must be an integer >= 1"),
        ("synthetic_lesion", {"tea_poly_power": -1}, "--tea_poly_power -1: must be a finite number >= 0"),
        ("synthetic_lesion", {"tra_logit_budget": "null"}, "--tra_logit_budget 'null': must be a finite number > 0, "
                                                           "or None"),
        ("synthetic_lesion", {"tra_lr": 0, "tra_logit_budget": None}, "--tra_lr 0: tra_mode 'class-specific' learns "
                                                                      "the TRA policy, but a learning rate of 0"),
        ("synthetic_lesion", {"tea_patch_size": [0, 8, 8]}, "--tea_patch_size [0, 8, 8]: must be a list of positive"),
        ("kits19_tumor", {"tea_lr": 0}, "--tea_lr 0: tea_mode 'joint' learns the TEA policy, but a learning rate of 0"),
        ("kits19_tumor", {"train_fraction": 0.7}, "--train_fraction 0.7: must be one of 0.5, 1.0"),
        ("kits19_tumor", {"train_fraction": "half"}, "--train_fraction 'half': must be one of 0.5, 1.0"),  # first
        ("kits19_tumor", {"tra_preset": "nnUNet"}, "--tra_preset 'nnUNet': must be one of"),
        ("kits19_tumor", {"tra_mode": "fixed", "tra_policy": "nope.json"}, "--tra_policy 'nope.json': no file "
                                                                           "nope.json (tra_mode 'fixed' reads"),
        ("synthetic_lesion", {"tea_preset": "flip"}, "--tea_preset 'flip': must be one of nnunet, uniform"),
        ("synthetic_lesion", {"tea_mode": "fixed", "tea_policy": "nope.json"}, "--tea_policy 'nope.json': no file "
                                                                               "nope.json (tea_mode 'fixed' reads"),
        ("kits19_tumor", {"val_average": 2}, "--val_average 2: must be a number in (0, 1]"),
        ("kits19_tumor", {"tra_lookahead": 0}, "--tra_lookahead 0: must be a finite number >= 1"),
        ("kits19_tumor", {"cache_rate": 1.5}, "--cache_rate 1.5: must be a number in [0, 1]"),
        ("kits19_tumor", {"num_tea_copies": 0, "seed": -1}, "--seed -1: must be an integer >= 0\n"
                                                            "  --num_tea_copies 0: must be an integer >= 1"),
    ],
)  # fmt: skip
def test_bad_values_of_any_setting_fail_first_naming_the_id(monkeypatch, tmp_path, dataset, bundle, overrides,
                                                            expected):  # fmt: skip
    data = dataset if bundle == "synthetic_lesion" else tmp_path / "not_prepared"  # settings come before data
    message = _refused(monkeypatch, tmp_path, data, bundle, **overrides)
    assert message.startswith(f"error: bad settings:\n  {expected}"), message
    assert not (tmp_path / "run").exists()


def test_a_tea_patch_size_the_network_cannot_take_is_named_as_such(monkeypatch, tmp_path, dataset):
    assert _refused(monkeypatch, tmp_path, dataset, tea_patch_size=[18, 18, 18]).startswith(
        "error: --tea_patch_size [18, 18, 18] does not fit the UNet"
    )  # was reported as --patch_size


def test_the_synthetic_bundle_reports_its_report_classes(monkeypatch, tmp_path, dataset):
    """``report_classes`` reaches the training run's evaluation, as in the task bundles and evaluate.yaml."""
    import jcsaug.evaluation

    seen = {}
    monkeypatch.setattr(jcsaug.evaluation, "evaluate_cases", lambda *args, **kwargs: seen.update(kwargs))
    parser = _workflow(monkeypatch, tmp_path, dataset, report_classes={"lesion": [1]}).parser
    parser.get_parsed_content("evaluate")
    assert seen["report_classes"] == {"lesion": [1]}


@pytest.mark.parametrize(("value", "expected"), [([1], (1,)), ("[1]", (1,)), ("true", (1,)), ("task", ())])
def test_the_synthetic_bundle_post_processes_the_classes_keep_largest_component_names(
    monkeypatch, tmp_path, dataset, value, expected
):
    """The evaluation gets the classes (``task``: none, the lesions are several per case); evaluate.yaml and
    inference.yaml (the saved segmentations) take the same ``largest_component_classes``."""
    import jcsaug.evaluation

    seen = {}
    monkeypatch.setattr(jcsaug.evaluation, "evaluate_cases", lambda *args, **kwargs: seen.update(kwargs))
    parser = _workflow(monkeypatch, tmp_path, dataset, keep_largest_component=value).parser
    parser.get_parsed_content("evaluate")
    assert seen["keep_largest_component"] == parser.get_parsed_content("largest_component_classes") == expected
    shared = ConfigParser.load_config_files([str(CONFIGS / "evaluate.yaml"), str(CONFIGS / "inference.yaml")])
    assert "keep_largest_component=@largest_component_classes" in shared["postprocessing"]
    assert shared["validate"]["evaluator"]["keep_largest_component"] == "@largest_component_classes"


def test_the_synthetic_bundles_evaluation_takes_the_segmentation_postprocessing(monkeypatch, tmp_path, dataset):
    """The evaluation after training gets ``segmentation_postprocessing`` (None by default: the argmax)."""
    import jcsaug.evaluation

    seen: dict = {}
    monkeypatch.setattr(jcsaug.evaluation, "evaluate_cases", lambda *args, **kwargs: seen.update(kwargs))
    for value in (None, "$lambda d: d"):
        seen.clear()
        overrides = {} if value is None else {"segmentation_postprocessing": value}
        parser = _workflow(monkeypatch, tmp_path, dataset, **overrides).parser
        parser.get_parsed_content("evaluate")
        assert seen["postprocessing"] is parser.get_parsed_content("segmentation_postprocessing")
        assert (seen["postprocessing"] is None) == (value is None)


def test_a_class_the_bundle_does_not_have_is_refused_before_the_run(monkeypatch, tmp_path, dataset):
    assert _refused(monkeypatch, tmp_path, dataset, keep_largest_component=[2]) == (
        "error: bad settings:\n  --keep_largest_component [2]: class 2 is not a foreground class 1..1 (num_classes 2)"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("bundle", ["synthetic_lesion", "kits19_tumor"])
def test_tea_identity_weight_reaches_the_learned_tta_of_the_run_evaluate_and_inference(monkeypatch, tmp_path, bundle):
    """``tea_identity_weight``: the learned TTA of the training run's own evaluation, of evaluate.yaml and of
    inference.yaml holds the identity at that weight (null: the paper's top ``tea_z`` ops)."""
    from jcsaug.policy import make_tea_policy
    from jcsaug.policy.io import save_policies

    configs = BUNDLES / bundle / "configs"
    train = ConfigParser.load_config_file(configs / "train.yaml")
    assert "identity_weight=@tea_identity_weight" in train["test_inferers"]
    shared = ConfigParser.load_config_files([str(configs / "evaluate.yaml"), str(configs / "inference.yaml")])
    assert all("identity_weight=@tea_identity_weight" in shared[k] for k in ("test_inferers", "inferer"))
    (tmp_path / "run").mkdir()
    policy = make_tea_policy("nnunet")
    save_policies(tmp_path / "run" / "policies.json", tea=policy)
    for weight, identity_share in ((0.5, 0.5), (None, None)):
        parser = ConfigParser()
        parser.read_config([str(configs / "train.yaml"), str(configs / "evaluate.yaml")])
        parser.update({"output_dir": str(tmp_path / "run"), "tea_identity_weight": weight, "tea_z": 4,
                       "sw_inferer": "$None"})  # fmt: skip
        learned = parser.get_parsed_content("test_inferers")["learned"]
        if identity_share is None:
            assert learned.weights == TEAInferer.from_policy(policy, 4).weights
        else:
            assert learned.ops[0].name == "identity" and learned.weights[0] == pytest.approx(identity_share)
