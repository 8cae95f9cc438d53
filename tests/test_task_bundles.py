"""The six dataset bundles: `python -m monai.bundle run` on prepared fake data with DeepMedic and the 3D U-Net,
then `evaluate.yaml`; the configs carry SPEC §6's settings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fake_raw import TASK_NAMES

BUNDLES = Path(__file__).resolve().parents[1] / "bundles"

#: small U-Net patches for the tiny fake volumes (the paper's are 64³ / 64x64x32 / 128x128x8)
UNET_TEST_PATCH = {"prostate_crosssite": "[32,32,16]", "cardiac_crosssequence": "[32,32,8]",
                   "cardiac_crosssite": "[32,32,8]"}  # fmt: skip
#: a DeepMedic with the paper's layout and patch sizes but 4 feature maps per layer (CPU test speed)
SMALL_DEEPMEDIC = "{'feature_maps': [4,4,4,4,4,4,4,4], 'fc_feature_maps': [8,8]}"


def run_task_bundle(task: str, tmp_path: Path, dataset_dir: Path, *configs: str, **overrides) -> None:
    folder = BUNDLES / task / "configs"
    files = [str(folder / c) for c in configs]
    args = [sys.executable, "-m", "monai.bundle", "run", "--config_file", files[0] if len(files) == 1 else str(files),
            "--meta_file", str(folder / "metadata.json"), "--logging_file", str(folder / "logging.conf")]  # fmt: skip
    settings = {"dataset_dir": dataset_dir, "max_epochs": 1, "epoch_length": 2, "num_workers": 0,
                "cases_per_batch": 2, "val_batch_size": 4, "num_tea_copies": 2, **overrides}  # fmt: skip
    for key, value in settings.items():
        args += [f"--{key}", str(value)]
    result = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]


def _metrics(path: Path) -> dict:
    metrics = json.loads(path.read_text())
    for method, values in metrics.items():
        assert 0.0 <= values["mean_dice"] <= 1.0, method
    return metrics


@pytest.mark.parametrize("task", TASK_NAMES)
def test_bundle_trains_and_evaluates_with_unet_and_deepmedic(task, tmp_path, prepared):
    data = prepared[task][1]
    unet = tmp_path / "unet"
    run_task_bundle(task, tmp_path, data, "train.yaml", network="unet3d", output_dir=unet,
                    patch_size=UNET_TEST_PATCH.get(task, "[32,32,32]"))  # fmt: skip
    metrics = _metrics(unet / "metrics.json")
    assert set(metrics) == {"none", "joint"}  # no TTA, and the jointly learned TEA
    assert json.loads((unet / "policies.json").read_text())["tra"]
    run_task_bundle(task, tmp_path, data, "train.yaml", "evaluate.yaml", network="unet3d", output_dir=unet,
                    patch_size=UNET_TEST_PATCH.get(task, "[32,32,32]"))  # fmt: skip
    assert {"none", "learned"} <= set(_metrics(unet / "metrics_evaluate.json"))

    deepmedic = tmp_path / "deepmedic"
    run_task_bundle(task, tmp_path, data, "train.yaml", network="deepmedic", output_dir=deepmedic,
                    network_kwargs=SMALL_DEEPMEDIC, epoch_length=1)  # fmt: skip
    assert _metrics(deepmedic / "metrics.json")


def _config(task: str) -> dict:
    return yaml.safe_load((BUNDLES / task / "configs" / "train.yaml").read_text())


@pytest.mark.parametrize("task", TASK_NAMES)
def test_bundle_configs_carry_the_papers_settings(task):
    config = _config(task)
    assert config["task"] == task
    for key in (
        "dataset_dir",
        "output_dir",
        "max_epochs",
        "epoch_length",
        "seed",
        "num_workers",
        "tra_mode",
        "tea_mode",
        "tra_update_every",
        "tea_update_every",
        "network",
        "train_fraction",
    ):
        assert key in config, key
    assert config["tea_lr"] == 5e-5 and config["val_batch_size"] == 10 and config["num_tea_copies"] == 10
    assert config["cases_per_batch"] * config["samples_per_case"] == 10
    assert config["max_epochs"] == (2000 if task == "kits19_tumor" else 1000) and config["epoch_length"] == 100
    assert config["patch_table"]["deepmedic"] == [37, 37, 37]
    unet_patch = {"prostate_crosssite": [64, 64, 32], "cardiac_crosssequence": [128, 128, 8],
                  "cardiac_crosssite": [128, 128, 8]}.get(task, [64, 64, 64])  # fmt: skip
    assert config["patch_table"]["unet3d"] == unet_patch
    for folder in ("configs/metadata.json", "configs/evaluate.yaml", "configs/inference.yaml",
                   "configs/multi_gpu_train.yaml", "docs/README.md"):  # fmt: skip
        assert (BUNDLES / task / folder).is_file(), folder


def test_settings_tables_match_spec_section_6():
    """SPEC §6 table rows: (task, network, fraction) -> (L_val, beta)."""
    rows = {
        ("atlas_stroke", "deepmedic", "0.5"): ["dice", 1e-3], ("atlas_stroke", "deepmedic", "1.0"): ["dice", 2e-3],
        ("atlas_stroke", "unet3d", "0.5"): ["dice", 5e-4], ("atlas_stroke", "unet3d", "1.0"): ["ce", 1e-3],
        ("atlas_stroke", "transformer", "0.5"): ["dice", 1e-3],
        ("kits19_tumor", "deepmedic", "0.5"): ["dice", 1e-3], ("kits19_tumor", "deepmedic", "1.0"): ["dice", 1e-3],
        ("kits19_tumor", "unet3d", "0.5"): ["ce+dice", 5e-4], ("kits19_tumor", "unet3d", "1.0"): ["ce", 5e-4],
        ("kits19_tumor", "transformer", "0.5"): ["ce", 2e-3],
        ("btcv_abdomen", "deepmedic", "1.0"): ["ce", 2e-3], ("btcv_abdomen", "unet3d", "1.0"): ["dice", 5e-4],
        ("prostate_crosssite", "deepmedic", "1.0"): ["ce", 5e-4],
        ("prostate_crosssite", "unet3d", "1.0"): ["ce", 5e-4],
        ("cardiac_crosssequence", "unet3d", "1.0"): ["ce", 5e-4],
        ("cardiac_crosssite", "unet3d", "1.0"): ["dice", 5e-4],
    }  # fmt: skip
    found = {(task, net, frac): value for task in TASK_NAMES
             for net, fracs in _config(task)["settings_table"].items() for frac, value in fracs.items()}  # fmt: skip
    assert found == rows
