"""The six dataset bundles: `python -m monai.bundle run` on prepared fake data with DeepMedic and the 3D U-Net,
then `evaluate.yaml`; the configs carry SPEC §6's settings."""

from __future__ import annotations

import json
import os
import socket
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


def run_task_bundle(
    task: str, tmp_path: Path, dataset_dir: Path, *configs: str, launcher: tuple[str, ...] = (), **overrides
) -> str:
    folder = BUNDLES / task / "configs"
    files = [str(folder / c) for c in configs]
    launch = list(launcher) or [sys.executable]
    args = [*launch, "-m", "monai.bundle", "run", "--config_file", files[0] if len(files) == 1 else str(files),
            "--meta_file", str(folder / "metadata.json"), "--logging_file", str(folder / "logging.conf")]  # fmt: skip
    settings = {"dataset_dir": dataset_dir, "max_epochs": 1, "epoch_length": 2, "num_workers": 0,
                "cases_per_batch": 2, "val_batch_size": 4, "num_tea_copies": 2, **overrides}  # fmt: skip
    for key, value in settings.items():
        args += [f"--{key}", str(value)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if launcher else None
    result = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=900, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    return result.stdout + result.stderr


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
    assert (unet / "per_case.csv").is_file() and (unet / "per_case_evaluate.csv").is_file()
    if task in ("atlas_stroke", "cardiac_crosssite"):  # RAS-oriented and stored-axes tasks
        run_task_bundle(task, tmp_path, data, "train.yaml", "inference.yaml", network="unet3d", output_dir=unet,
                        patch_size=UNET_TEST_PATCH.get(task, "[32,32,32]"))  # fmt: skip
        test_cases = json.loads((data / "dataset.json").read_text())["test"]
        predicted = sorted(p.name for p in (unet / "predictions").glob("*_seg.nii.gz"))
        assert predicted == sorted(f"{c['case']}_seg.nii.gz" for c in test_cases)

    deepmedic = tmp_path / "deepmedic"
    run_task_bundle(task, tmp_path, data, "train.yaml", network="deepmedic", output_dir=deepmedic,
                    network_kwargs=SMALL_DEEPMEDIC, epoch_length=1)  # fmt: skip
    assert _metrics(deepmedic / "metrics.json")


def test_transformer_option_trains(tmp_path, prepared):
    """The paper's nnFormer rows: a MONAI transformer (UNETR at 32³) on the 50 % split, with its all-0.05 preset."""
    run = tmp_path / "transformer"
    log = run_task_bundle("atlas_stroke", tmp_path, prepared["atlas_stroke"][1], "train.yaml", network="transformer",
                          train_fraction=0.5, patch_size="[32,32,32]", output_dir=run, epoch_length=1)  # fmt: skip
    assert _metrics(run / "metrics.json")
    assert "no L_val/beta" not in log  # the paper has the transformer at 50 %


def test_dataset_bundle_multi_gpu_config_runs_under_torchrun(tmp_path, prepared):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    launcher = (sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}")  # fmt: skip
    log = run_task_bundle("kits19_tumor", tmp_path, prepared["kits19_tumor"][1], "train.yaml", "multi_gpu_train.yaml",
                          launcher=launcher, network="unet3d", output_dir=tmp_path / "run", patch_size="[32,32,32]",
                          cases_per_batch=1, tra_update_every=1, tea_update_every=1,
                          accelerator="cpu")  # fmt: skip
    # (--accelerator cpu: two gloo ranks on the CPU also where CUDA is available, e.g. a single-GPU machine)
    assert (tmp_path / "run" / "metrics.json").is_file() and (tmp_path / "run" / "policies.json").is_file()
    assert log.count(": TEA update 2;") == 1  # rank 0 logs, the updates are collective


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


def test_command_line_flags_are_parsed_as_booleans():
    """`--train_on_val false` reaches a bundle as the string 'false'; as_flag reads it as False."""
    from jcsaug.utils import as_flag

    assert [as_flag(v) for v in (True, "true", "True", "yes", "1", 1)] == [True] * 6
    assert [as_flag(v) for v in (False, "false", "False", "no", "0", 0, None)] == [False] * 7
    with pytest.raises(ValueError, match="'maybe'"):
        as_flag("maybe")


#: the ids that make a dataset bundle's train.yaml its own; everything else is shared machinery
TASK_KEYS = {"task", "dataset_dir", "train_fraction", "max_epochs", "train_on_val", "test_split", "num_classes",
             "spacing", "settings_table", "patch_table"}  # fmt: skip


def test_dataset_bundles_share_their_machinery():
    """The six train.yaml files differ only in the task block: a fix to one must be made to all."""
    reference = {k: v for k, v in _config(TASK_NAMES[0]).items() if k not in TASK_KEYS}
    for task in TASK_NAMES[1:]:
        config = {k: v for k, v in _config(task).items() if k not in TASK_KEYS}
        differing = sorted(k for k in set(reference) | set(config) if reference.get(k) != config.get(k))
        assert not differing, f"{task}/configs/train.yaml differs from {TASK_NAMES[0]} in {differing}"
    for name in ("evaluate.yaml", "inference.yaml", "multi_gpu_train.yaml"):
        texts = {t: yaml.safe_load((BUNDLES / t / "configs" / name).read_text()) for t in TASK_NAMES}
        assert all(v == texts[TASK_NAMES[0]] for v in texts.values()), name


def test_deepmedic_patches_are_centred_inside_the_volume_and_labels_stay_classes(prepared):
    """DeepMedic's margin padding is labelled 255 (no class) so no patch centre falls in it, and is background
    again in the cropped label the loss sees."""
    import numpy as np
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config(str(BUNDLES / "kits19_tumor" / "configs" / "train.yaml"))
    parser.update({"dataset_dir": str(prepared["kits19_tumor"][1]), "network": "deepmedic",
                   "network_kwargs": {"feature_maps": [4] * 8, "fc_feature_maps": [8, 8]}})  # fmt: skip
    files = parser.get_parsed_content("train_files")
    prefix = parser.get_parsed_content("load_transforms") + parser.get_parsed_content("patch_sampling")
    item = dict(files[0])
    for transform in prefix:
        item = transform(item)
    label = np.asarray(item["label"]).ravel()
    assert 255 in label  # the margin
    for c, indices in enumerate(item["label_cls_indices"]):
        assert len(indices) and (label[np.asarray(indices)] == c).all()
    dataset = parser.get_parsed_content("train_dataset")
    for sample in dataset[0]:
        assert tuple(sample["label"].shape[1:]) == (21, 21, 21) and tuple(sample["image"].shape[1:]) == (109,) * 3
        assert set(np.unique(np.asarray(sample["label"])).tolist()) <= {0, 1, 2}
