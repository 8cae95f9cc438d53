"""The six dataset bundles: one shared machinery (bundles/_common/configs) tested once in depth, each task's own
files cheaply.

* each task folder holds only its task: links to the shared configs and a metadata.json naming the task;
* every merged config (train, + evaluate, + inference, + multi-GPU) parses, for every network, with the task's
  facts from its TaskSpec and the network's defaults from the network registry;
* every task trains a tiny 3D U-Net on prepared fake volumes larger than its patches, so both class groups occur:
  TRA and TEA policy updates happen (counts from metrics.json), with at most the share of skipped TRA updates
  stated in MAX_SKIPPED_TRA;
* in depth, on KiTS: evaluate.yaml and inference.yaml after training, DeepMedic, the transformer, the handler
  order, and the multi-GPU config under torchrun (which learns as well).
"""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from monai.bundle import ConfigParser

from fake_raw import TASK_NAMES
from helpers import BUNDLES, bundle_parser, bundle_run_args, env_without_gpus
from jcsaug.networks import get_network, list_networks
from jcsaug.tasks import get_task
from preloaded import run_module

COMMON = BUNDLES / "_common" / "configs"
SHARED_FILES = ("train.yaml", "evaluate.yaml", "inference.yaml", "multi_gpu_train.yaml", "logging.conf")

#: tiny U-Nets (4 base filters) on patches smaller than the fake volumes (about 30³; cardiac 32 x 32 x 6 slices)
UNET = {"network": "unet3d", "network_kwargs": "{'base_filters': 4}"}
UNET_PATCH = {"cardiac_crosssequence": "[16,16,4]", "cardiac_crosssite": "[16,16,4]"}
#: a DeepMedic with the paper's layout and patch sizes but 4 feature maps per layer (CPU test speed)
SMALL_DEEPMEDIC = "{'feature_maps': [4,4,4,4,4,4,4,4], 'fc_feature_maps': [8,8]}"
#: a small UNETR (the transformer of 16-divisible patches)
SMALL_UNETR = "{'hidden_size': 16, 'mlp_dim': 16, 'num_heads': 2, 'feature_size': 2}"
TINY = {"max_epochs": 1, "epoch_length": 4, "num_workers": 0, "cases_per_batch": 2, "samples_per_case": 4,
        "val_batch_size": 4, "num_tea_copies": 2, "tea_z": 2, "tra_update_every": 1, "tea_update_every": 1,
        "plots": False}  # fmt: skip
#: the share of TRA updates a tiny run may skip ("the training batch holds one class group only"): patch centres
#: are drawn class by class with equal ratios, so a batch of 8 patches holds no background patch with probability
#: ((C-1)/C)^8 for C classes: 0.004 (2 classes), 0.04 (KiTS), 0.1 (cardiac), 0.55 (BTCV, 14 classes)
MAX_SKIPPED_TRA = {"btcv_abdomen": 0.75}
DEFAULT_MAX_SKIPPED_TRA = 0.5


def run_task_bundle(
    task: str, tmp_path: Path, dataset_dir: Path, *configs: str, launcher: tuple[str, ...] = (), **overrides
) -> str:
    """``python -m monai.bundle run`` on the task's own config files (the links), as a user runs it."""
    args = bundle_run_args(BUNDLES / task / "configs", *configs)
    for key, value in {"dataset_dir": dataset_dir, **TINY, **overrides}.items():
        args += [f"--{key}", str(value)]
    if launcher:  # torchrun here: gloo ranks on the CPU, in fresh interpreters
        env = env_without_gpus(OMP_NUM_THREADS="1")
        result = subprocess.run([*launcher, "-m", "monai.bundle", *args], capture_output=True, text=True, cwd=tmp_path,
                                timeout=900, env=env)  # fmt: skip
    else:  # forked from the preloaded test server (tests/preloaded.py)
        result = run_module("monai.bundle", args, cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    return result.stdout + result.stderr


def assert_learned(run: Path, max_skipped: float = DEFAULT_MAX_SKIPPED_TRA, methods=("none", "learned")) -> dict:
    """metrics.json: the test-time methods, Dice in [0, 1], and TRA and TEA updates done, few skipped."""
    metrics = json.loads((run / "metrics.json").read_text())
    updates = metrics.pop("policy_updates")
    assert set(metrics) == set(methods)
    for method, values in metrics.items():
        assert 0.0 <= values["mean_dice"] <= 1.0, method
    assert set(updates) == {"TRA", "TEA"}
    assert updates["TEA"]["updates"] >= 1 and updates["TEA"]["skipped"] == 0, updates
    tra = updates["TRA"]
    assert tra["updates"] >= 1 and tra["skipped"] <= max_skipped * (tra["updates"] + tra["skipped"]), updates
    return updates


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory, prepared):
    """task -> (run folder, log) of a tiny U-Net training with joint class-specific TRA and TEA, made once."""
    runs: dict[str, tuple[Path, str]] = {}

    def get(task: str) -> tuple[Path, str]:
        if task not in runs:
            work = tmp_path_factory.mktemp(task)
            log = run_task_bundle(task, work, prepared[task][1], "train.yaml", output_dir=work / "run",
                                  patch_size=UNET_PATCH.get(task, "[16,16,16]"), **UNET)  # fmt: skip
            runs[task] = (work / "run", log)
        return runs[task]

    return get


# ------------------------------------------------------------------------------------------ each task's own files
@pytest.mark.parametrize("task", TASK_NAMES)
def test_each_task_folder_holds_only_its_task(task):
    """The shared configs are links to bundles/_common/configs; metadata.json names the task, whose labels are
    those of its TaskSpec (nothing else in the folder is the task's own)."""
    folder = BUNDLES / task / "configs"
    assert sorted(p.name for p in folder.iterdir()) == sorted((*SHARED_FILES, "metadata.json"))
    for name in SHARED_FILES:
        assert (folder / name).is_symlink() and (folder / name).resolve() == (COMMON / name).resolve(), name
    metadata = json.loads((folder / "metadata.json").read_text())
    assert [k for k in metadata if k.startswith("jcsaug")] == ["jcsaug_task"] and metadata["jcsaug_task"] == task
    output = metadata["network_data_format"]["outputs"]["pred"]
    spec = get_task(task)
    assert output["num_channels"] == spec.num_classes and len(output["channel_def"]) == spec.num_classes
    assert (BUNDLES / task / "docs" / "README.md").is_file()


def test_the_synthetic_bundle_shares_evaluation_inference_multi_gpu_and_logging():
    folder = BUNDLES / "synthetic_lesion" / "configs"
    for name in SHARED_FILES[1:]:
        assert (folder / name).resolve() == (COMMON / name).resolve(), name
    config = ConfigParser.load_config_file(folder / "train.yaml")
    assert {"network_def", "model", "cases_per_batch", "image_orientation", "image_preprocess"} <= set(config)


FACT_IDS = ("task", "num_classes", "spacing", "max_epochs", "train_on_val", "val_loss", "tra_lr", "patch_size",
            "train_loss", "tea_z", "tra_preset")  # fmt: skip


@pytest.mark.parametrize("task", TASK_NAMES)
def test_every_merged_config_parses_with_the_task_facts(task):
    """Classes, spacing, the paper's L_val/beta, patch sizes, epochs and the train + validation default come from
    the TaskSpec; loss, TEA z and initial preset from the network registry: for every network and merged config."""
    spec = get_task(task)
    for extra in ((), ("evaluate.yaml",), ("inference.yaml",), ("multi_gpu_train.yaml",)):
        for network in list_networks():
            parser = bundle_parser(task, *extra, network=network)
            parser.parse()
            net = get_network(network)
            facts = {k: parser.get_parsed_content(k) for k in FACT_IDS}
            assert facts == {
                "task": task, "num_classes": spec.num_classes, "spacing": spec.planning_spacing,
                "max_epochs": spec.max_epochs, "train_on_val": spec.train_on_val,
                "val_loss": spec.paper_setting(network, 1.0)[0], "tra_lr": spec.paper_setting(network, 1.0)[1],
                "patch_size": spec.patch_size(network, net.default_patch), "train_loss": net.train_loss,
                "tea_z": net.tea_z, "tra_preset": net.tra_preset,
            }, (extra, network)  # fmt: skip
            assert "run" in parser and parser.get_parsed_content("dataset_dir") == f"data/{task}"


#: the reference's samplers (REFERENCE_CODE_NOTES §1, DATASETS.md §7): the U-Net's (sampling_Unet.py, also the
#: transformer's) centres half the patches on background, DeepMedic's (sampling_DM.py) equal numbers per class
REFERENCE_BACKGROUND_SHARE = {"unet3d": lambda c: 0.5, "transformer": lambda c: 0.5, "deepmedic": lambda c: 1 / c}


@pytest.mark.parametrize("task", TASK_NAMES)
def test_patch_centres_fall_on_classes_as_the_reference_samples_them(task):
    """For the training and the validation crop, every network: background's share of the patch centres is the
    reference sampler's, the foreground classes share the rest equally (equal ratios for every network would give
    the U-Net's background-centred group 1/14 of BTCV's patches)."""
    classes = get_task(task).num_classes
    assert set(REFERENCE_BACKGROUND_SHARE) == set(list_networks())
    for network, background in REFERENCE_BACKGROUND_SHARE.items():
        parser = bundle_parser(task, network=network)
        for crop_id in ("random_crop", "val_random_crop"):
            (crop,) = [f"{crop_id}#{i}" + ("#crop" if "crop" in t else "") for i, t in enumerate(parser[crop_id])
                       if (t.get("crop") or t)["_target_"] == "RandCropByLabelClassesd"]  # fmt: skip
            ratios = parser.get_parsed_content(f"{crop}#ratios")  # alone: the rest needs prepared data
            assert ratios is not None, (network, crop_id)
            share = [float(r) / sum(ratios) for r in ratios]
            assert len(share) == classes, (network, crop_id, ratios)
            assert share[0] == pytest.approx(background(classes)), (network, crop_id, ratios)
            rest = (1 - background(classes)) / (classes - 1)
            assert share[1:] == pytest.approx([rest] * (classes - 1)), (network, crop_id, ratios)


def test_centre_class_ratios_name_a_task_without_foreground():
    with pytest.raises(ValueError, match="num_classes must be >= 2"):
        get_network("unet3d").centre_class_ratios(1)
    assert get_network("unet3d").centre_class_ratios(3) == [0.5, 0.25, 0.25]
    assert get_network("deepmedic").centre_class_ratios(3) == [1.0, 1.0, 1.0]


def test_every_bundle_evaluates_with_its_reported_classes():
    """Defect 4: the evaluation (train.yaml and the shared evaluate.yaml) gets the task's report_classes, so
    metrics.json has e.g. the KiTS tumour Dice; the synthetic bundle, which shares evaluate.yaml, has none."""
    for task in TASK_NAMES:
        train, evaluate = bundle_parser(task), bundle_parser(task, "evaluate.yaml")
        assert "report_classes=@report_classes" in train["evaluate"], task
        assert evaluate["validate#metrics#report_classes"] == "@report_classes", task
        for parser in (train, evaluate):
            assert parser.get_parsed_content("report_classes") == get_task(task).report_classes
    assert dict(get_task("kits19_tumor").report_classes) == {"tumour": (2,)}
    synthetic = ConfigParser()
    synthetic.read_config(
        [str(BUNDLES / "synthetic_lesion" / "configs" / name) for name in ("train.yaml", "evaluate.yaml")]
    )
    assert synthetic.get_parsed_content("report_classes") == {}


def test_every_task_names_its_single_component_classes():
    """The classes one connected structure anatomically (what ``--keep_largest_component task`` post-processes):
    not KiTS's kidney (both kidneys) or tumour, not stroke lesions; a bad list is refused by the TaskSpec."""
    cardiac = (1, 2, 3)  # LV blood pool, myocardium, RV blood pool
    expected = {"atlas_stroke": (), "kits19_tumor": (), "btcv_abdomen": tuple(range(1, 14)),
                "prostate_crosssite": (1,), "cardiac_crosssequence": cardiac, "cardiac_crosssite": cardiac}  # fmt: skip
    assert {task: get_task(task).single_component_classes for task in TASK_NAMES} == expected
    for bad in ((0,), (3,), (1, 1)):
        with pytest.raises(ValueError, match=r"single_component_classes = .* are not distinct foreground classes"):
            dataclasses.replace(get_task("kits19_tumor"), single_component_classes=bad)


def test_keep_largest_component_task_takes_the_tasks_classes_in_every_merged_config():
    """``--keep_largest_component task | true | "[2]"``: the evaluation after training, evaluate.yaml and
    inference.yaml post-process the same classes (``largest_component_classes``); false by default (the paper)."""
    for task in TASK_NAMES:
        for extra, target, reference in (
            ((), "evaluate", "keep_largest_component=@largest_component_classes"),
            (("evaluate.yaml",), "validate#evaluator#keep_largest_component", "@largest_component_classes"),
            (("inference.yaml",), "postprocessing", "keep_largest_component=@largest_component_classes"),
        ):
            parser = bundle_parser(task, *extra, keep_largest_component="task")
            assert reference in parser[target], (task, extra)
            classes = parser.get_parsed_content("largest_component_classes")
            assert classes == get_task(task).single_component_classes, (task, extra)
    kits = [bundle_parser("kits19_tumor", "evaluate.yaml", keep_largest_component=value).get_parsed_content(
        "largest_component_classes") for value in (False, True, "true", [2], "[2]")]  # fmt: skip
    assert kits == [(), (1, 2), (1, 2), (2,), (2,)]
    assert bundle_parser("kits19_tumor").get_parsed_content("keep_largest_component") is False


@pytest.mark.parametrize("bundle", [*TASK_NAMES, "synthetic_lesion"])
def test_segmentation_postprocessing_reaches_every_step_that_makes_a_segmentation(bundle):
    """``--segmentation_postprocessing`` (MONAI transforms; default none): the evaluation after training, its
    largest-component choice, ``evaluate.yaml``'s evaluator (``validate#postprocessing``, MONAI's id) and
    ``inference.yaml``'s saved segmentations take the same object (built here in the synthetic bundle, whose
    preprocessing needs no prepared data)."""
    from jcsaug.inference.pipeline import LogitsToSegmentationd

    assert bundle_parser(bundle).get_parsed_content("segmentation_postprocessing") is None
    text = "postprocessing=@segmentation_postprocessing"
    train = bundle_parser(bundle)
    assert text in train["evaluate"] and text in train["choose_postprocessing"]
    evaluation = bundle_parser(bundle, "evaluate.yaml")
    assert evaluation["validate#postprocessing"] == "@segmentation_postprocessing"
    assert evaluation["validate#evaluator#postprocessing"] == "$@validate#postprocessing"
    inference = bundle_parser(bundle, "inference.yaml", segmentation_postprocessing="$lambda d: d")
    assert text in inference["postprocessing"]
    if bundle != "synthetic_lesion":
        return
    first = inference.get_parsed_content("postprocessing").transforms[0]
    assert isinstance(first, LogitsToSegmentationd)
    assert first.postprocessing is inference.get_parsed_content("segmentation_postprocessing")


def test_paper_bundles_learn_with_the_paired_estimators_and_the_papers_budgets():
    """Issue 10: the estimators the synthetic benchmark chose, with the paper's beta and gamma (no logit budget)."""
    parser = bundle_parser("kits19_tumor", network="deepmedic")
    parser.parse()
    setup = parser.get_parsed_content("augmentation")
    assert (setup.tra_estimator, setup.tea_estimator, setup.counterfactuals) == ("paired", "paired", 2)
    assert [parser.get_parsed_content(f"{p}_logit_budget") for p in ("tra", "tea")] == [None, None]
    for cascade in ("tra_cascade", "device_augmentation#transform"):
        assert parser.get_parsed_content(cascade).counterfactuals == 2, cascade


@pytest.mark.parametrize("task", TASK_NAMES)
def test_paper_bundles_score_the_teas_copies_on_the_voxels_in_view(task):
    """The reference masks what a TEA op moved out of the patch: the dataset bundles do by default (the TEA scores
    training-size patches there); ``--tea_mask_out_of_view false`` scores every voxel."""
    assert bundle_parser(task).get_parsed_content("augmentation").tea_mask_out_of_view is True
    off = bundle_parser(task, tea_mask_out_of_view="false").get_parsed_content("augmentation")  # as fire passes it
    assert off.tea_mask_out_of_view is False


def test_no_config_or_module_asks_which_network_it_has():
    """Per-network defaults live in the network registry: no branch on a network's name in the YAML or the code."""
    root = BUNDLES.parent
    sources = [*BUNDLES.rglob("*.yaml"), *(root / "src").rglob("*.py"), *(root / "benchmarks").rglob("*.py")]
    branching = re.compile(r"==\s*['\"](deepmedic|unet3d|transformer)['\"]|isinstance\([^)]*DeepMedic\)")
    assert [str(p) for p in sources if branching.search(p.read_text())] == []


def test_cardiac_crosssequence_keeps_its_slices_and_plans_networks_for_10_mm():
    spec = get_task("cardiac_crosssequence")
    assert spec.spacing == (1.25, 1.25, 0.0) and spec.planning_spacing == (1.25, 1.25, 10.0)
    assert bundle_parser("cardiac_crosssequence").get_parsed_content("spacing") == (1.25, 1.25, 10.0)


# ------------------------------------------------------------------------------------------ tiny trainings
@pytest.mark.parametrize("task", TASK_NAMES)
def test_every_task_trains_and_learns_both_policies(task, tiny_runs):
    run, log = tiny_runs(task)
    assert_learned(run, MAX_SKIPPED_TRA.get(task, DEFAULT_MAX_SKIPPED_TRA))
    assert json.loads((run / "policies.json").read_text())["tea"]
    assert "run summary" in log and "test Dice" in log and str(run / "metrics.json") in log
    assert len(re.findall(r"epoch 1: TRA policy \d+ updates", log)) == 1  # INFO: a line per epoch, not per update
    assert not re.search(r"TRA update \d+; most changed", log)


def test_evaluate_and_inference_after_training(tiny_runs, prepared, tmp_path):
    run, _ = tiny_runs("kits19_tumor")
    data = prepared["kits19_tumor"][1]
    common = {"output_dir": run, "patch_size": "[16,16,16]", **UNET}
    log = run_task_bundle("kits19_tumor", tmp_path, data, "train.yaml", "evaluate.yaml", **common)
    metrics = json.loads((run / "metrics_evaluate.json").read_text())
    assert set(metrics) == {"none", "heuristic", "learned", "learned+mirror"}  # every method; training: none + its own
    assert metrics["none"]["mean_dice_reported"]["tumour"]["classes"] == [2]  # the paper reports the tumour
    trained = json.loads((run / "metrics.json").read_text())
    for result in (metrics, trained):  # KiTS: predictions outside the body ROI are background, as the reference's
        assert all(row["roi_masked"] for method in ("none", "learned") for row in result[method]["per_case"])
    assert "test Dice, tumour (class 2): " in log  # run summary
    assert (run / "per_case.csv").is_file() and (run / "per_case_evaluate.csv").is_file()
    assert "run summary" in log and "metrics_evaluate.json" in log
    run_task_bundle("kits19_tumor", tmp_path, data, "train.yaml", "inference.yaml", **common)
    test_cases = json.loads((data / "dataset.json").read_text())["test"]
    predicted = sorted(p.name for p in (run / "predictions").glob("*_seg.nii.gz"))
    assert predicted == sorted(f"{c['case']}_seg.nii.gz" for c in test_cases)


def test_deepmedic_trains_and_learns(tmp_path, prepared):
    """DeepMedic: 37³ segments (109³ input patches over the context margin), CE, z = 4, its own inferer."""
    run = tmp_path / "deepmedic"
    log = run_task_bundle("atlas_stroke", tmp_path, prepared["atlas_stroke"][1], "train.yaml", network="deepmedic",
                          network_kwargs=SMALL_DEEPMEDIC, output_dir=run, epoch_length=2)  # fmt: skip
    assert_learned(run)
    assert "TRA group 1 (foreground), most changed" in log


def test_transformer_trains_and_learns(tmp_path, prepared):
    """The paper's nnFormer rows: a MONAI transformer (UNETR at 16³) on the 50 % split, with its all-0.05 preset."""
    run = tmp_path / "transformer"
    log = run_task_bundle("atlas_stroke", tmp_path, prepared["atlas_stroke"][1], "train.yaml", network="transformer",
                          network_kwargs=SMALL_UNETR, train_fraction=0.5, patch_size="[16,16,16]", output_dir=run,
                          epoch_length=2)  # fmt: skip
    assert_learned(run)
    assert "no L_val/beta" not in log  # the paper has the transformer at 50 %


def test_multi_gpu_config_learns_under_torchrun(tmp_path, prepared):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    launcher = (sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}")  # fmt: skip
    run = tmp_path / "run"
    log = run_task_bundle("kits19_tumor", tmp_path, prepared["kits19_tumor"][1], "train.yaml", "multi_gpu_train.yaml",
                          launcher=launcher, output_dir=run, patch_size="[16,16,16]", cases_per_batch=1,
                          samples_per_case=4, accelerator="cpu", **UNET)  # fmt: skip
    # (--accelerator cpu: two gloo ranks on the CPU also where CUDA is available, e.g. a single-GPU machine)
    assert_learned(run)
    assert (run / "policies.json").is_file()
    assert log.count("epoch 1: TEA policy") == 1 and log.count("run summary") == 1  # rank 0 logs


def test_checkpoints_hold_the_updaters_whatever_the_handler_order(prepared, tmp_path):
    """The updaters and their checkpoint items are built in one step: resolving the checkpoint dict before the
    handlers, or attaching the handlers in reverse order, gives the same checkpoint contents."""
    parser = bundle_parser("kits19_tumor", dataset_dir=str(prepared["kits19_tumor"][1]), output_dir=str(tmp_path),
                     patch_size=[16, 16, 16], network_kwargs={"base_filters": 4}, num_workers=0)  # fmt: skip
    parser["train_handlers"] = list(reversed(parser["train_handlers"]))
    checkpoint = parser.get_parsed_content("checkpoint_dict")  # before the handlers and updaters are used
    updaters = parser.get_parsed_content("policy_updaters")
    assert checkpoint["tra_updater"] is updaters.tra and checkpoint["tea_updater"] is updaters.tea
    handlers = parser.get_parsed_content("train_handlers")
    assert handlers[0].__class__.__name__ == "AtomicCheckpointSaver"  # the saver is attached first now


def test_deepmedic_patches_are_centred_inside_the_volume_and_labels_stay_classes(prepared):
    """DeepMedic's margin padding is labelled 255 (no class) so no patch centre falls in it, and is background
    again in the cropped label the loss sees."""
    import numpy as np

    parser = bundle_parser("kits19_tumor", dataset_dir=str(prepared["kits19_tumor"][1]), network="deepmedic",
                           network_kwargs={"feature_maps": [4] * 8, "fc_feature_maps": [8, 8]},
                           augment_on="worker")  # the workers' cut patches (auto cuts on a GPU's batches)  # fmt: skip
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


@pytest.mark.parametrize("network", ["unet3d", "deepmedic"])
def test_kits_background_centres_are_drawn_inside_the_body_roi(prepared, network):
    """KiTS (``roi_threshold`` -200 HU, the reference's body mask): no patch centre of any class falls on the air
    around the body, which the centres include with ``roi_threshold`` null; the ROI is not kept after the centres
    are indexed (neither cached nor cropped)."""
    import numpy as np

    kw = {
        "dataset_dir": str(prepared["kits19_tumor"][1]),
        "network": network,
        "network_kwargs": {"feature_maps": [4] * 8, "fc_feature_maps": [8, 8]} if network == "deepmedic" else {},
    }
    centres_in_air = {}
    for threshold in ("$@task_spec.roi_threshold", None):
        parser = bundle_parser("kits19_tumor", **kw, roi_threshold=threshold)
        entry = dict(parser.get_parsed_content("train_files")[0])
        prefix = parser.get_parsed_content("load_transforms")
        loaded = entry
        for transform in prefix[:4]:  # read, checked, channel first, checked: the image still in HU
            loaded = transform(loaded)
        item = dict(entry)
        for transform in prefix + parser.get_parsed_content("patch_sampling"):
            item = transform(item)
        assert "roi" not in item
        padded = {"image": loaded["image"], "label": loaded["label"]}
        for transform in parser.get_parsed_content("patch_sampling")[:4]:  # the pads, in HU (padding: 0 HU, no class)
            padded = transform(padded)
        air = (np.asarray(padded["image"][0]) <= -200).ravel()
        centres = np.concatenate([np.asarray(i) for i in item["label_cls_indices"]])
        centres_in_air[threshold is None] = int(air[centres].sum())
    assert centres_in_air[False] == 0 and centres_in_air[True] > 0


@pytest.mark.parametrize("augment_on", ["worker", "device"])
def test_training_patches_carry_the_tra_context_until_the_cascade_returns_the_patch(prepared, augment_on):
    """``tra_context: auto``: the workers cut DeepMedic's segment and its label region with the TRA's context on each
    side; the cascade (in the workers or on the device) returns the segment and the label region the loss sees.
    ``tra_context: 0``: no context anywhere."""
    import numpy as np
    from monai.data import list_data_collate

    from jcsaug.ops import tra_context

    kw = {"dataset_dir": str(prepared["kits19_tumor"][1]), "network": "deepmedic", "augment_on": augment_on,
          "network_kwargs": {"feature_maps": [4] * 8, "fc_feature_maps": [8, 8]}}  # fmt: skip
    parser = bundle_parser("kits19_tumor", **kw)
    input_size, output_size = (tuple(s) for s in parser.get_parsed_content("patch_sizes"))
    context = parser.get_parsed_content("context")
    assert context == tra_context(input_size) and min(context) > 0
    samples = parser.get_parsed_content("train_dataset")[0]
    if augment_on == "worker":
        shapes = (input_size, output_size)
    else:
        shapes = tuple(tuple(s + 2 * c for s, c in zip(size, context)) for size in (input_size, output_size))
    for sample in samples:
        assert (tuple(sample["image"].shape[1:]), tuple(sample["label"].shape[1:])) == shapes
        assert set(np.unique(np.asarray(sample["label"])).tolist()) <= {0, 1, 2}
    if augment_on == "device":
        batch = parser.get_parsed_content("device_augmentation").transform(list_data_collate(samples))
        assert tuple(batch["image"].shape[2:]) == input_size and tuple(batch["label"].shape[2:]) == output_size
        assert set(np.unique(np.asarray(batch["label"].cpu())).tolist()) <= {0, 1, 2}  # on the device's GPU, if any
    plain = bundle_parser("kits19_tumor", **kw, tra_context=0)
    assert plain.get_parsed_content("context") == (0, 0, 0)
    for sample in plain.get_parsed_content("train_dataset")[0]:
        assert tuple(sample["image"].shape[1:]) == input_size and tuple(sample["label"].shape[1:]) == output_size


def test_command_line_flags_are_parsed_as_booleans():
    """`--train_on_val false` reaches a bundle as the string 'false'; as_flag reads it as False."""
    from jcsaug.utils import as_flag

    assert [as_flag(v) for v in (True, "true", "True", "yes", "1", 1)] == [True] * 6
    assert [as_flag(v) for v in (False, "false", "False", "no", "0", 0, None)] == [False] * 7
    with pytest.raises(ValueError, match="'maybe'"):
        as_flag("maybe")


def test_command_line_shares_are_parsed_as_numbers_in_zero_one():
    """A setting that is a flag or a share (``--tra_val_tea 0.5``): true is 1, false 0, numbers and numeric strings
    in [0, 1] themselves; anything else is an error naming the value."""
    from jcsaug.utils import as_share

    assert [as_share(v) for v in (True, "true", 1, "1", False, "no", 0, None, 0.5, "0.25")] == [
        1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.25,
    ]  # fmt: skip
    for bad in ("maybe", 1.5, -0.1, float("nan"), "2"):
        with pytest.raises(ValueError, match=repr(bad) if isinstance(bad, str) else "share"):
            as_share(bad)
