"""MONAI's own bundle tools work on every bundle: ``verify_net_in_out`` checks the network against
``metadata.json`` and ``ckpt_export`` writes a TorchScript network that predicts what the trained one predicts.

* each ``metadata.json`` gives the input and output shapes of the bundle's default network at its patch size (the
  dataset bundles once gave a sentence there, which MONAI's tools read character by character and refused);
* ``verify_net_in_out`` passes on every bundle as it is, and with another network and its input size given as the
  bundles' README shows;
* ``ckpt_export`` of a checkpoint as the bundles save it: scripted for the synthetic bundle's U-Net and a dataset
  bundle's DeepMedic and U-Net (which then take any input size), traced (the README's ``--use_trace``) for a dataset
  bundle's transformer at the size its whole-volume inferer feeds it;
* every ``train.yaml`` has MONAI's training-workflow properties at MONAI's ids (``train#trainer``, ...), and a
  ``ConfigWorkflow(workflow_type="train")`` (what MONAI FL builds) reads and sets them: ``max_epochs`` set through
  the property is what the run trains, schedules and records;
* every ``inference.yaml`` (merged on its ``train.yaml``) has MONAI's inference-workflow properties, and a
  ``ConfigWorkflow(workflow_type="infer")`` of the synthetic bundle runs its ``SupervisedEvaluator``, saving what the
  network and the inferer predict on each test volume's own grid;
* every ``evaluate.yaml`` (merged on its ``train.yaml``) has MONAI's properties of an evaluation workflow and MONAI's
  validation ids of a training workflow; ``ConfigWorkflow(workflow_type="eval")`` of the synthetic bundle scores
  every method as ``evaluate_cases`` does and hands the figures to a handler of the user's; MONAI FL's ``MonaiAlgo``
  evaluates the server's weights with it.
"""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from monai.bundle import ConfigParser, ConfigWorkflow, ckpt_export, verify_net_in_out
from monai.bundle.properties import InferProperties, TrainProperties
from monai.engines import SupervisedEvaluator
from monai.utils import BundleProperty, BundlePropertyConfig

from fake_raw import TASK_NAMES
from helpers import BUNDLES, SMALL_DATASET_KEPT, bundle_parser, small_dataset

ALL_BUNDLES = (*TASK_NAMES, "synthetic_lesion")
INPUT_SHAPE_ID = "_meta_#network_data_format#inputs#image#spatial_shape"
#: a narrow DeepMedic for the export test (the export's mechanics do not depend on the width)
SMALL_DEEPMEDIC = {"feature_maps": [4] * 8, "fc_feature_maps": [8, 8]}


def _files(bundle: str) -> tuple[str, str]:
    folder = BUNDLES / bundle / "configs"
    return str(folder / "train.yaml"), str(folder / "metadata.json")


def _inference_files(bundle: str) -> tuple[list[str], str]:
    config, meta = _files(bundle)
    return [config, str(Path(config).with_name("inference.yaml"))], meta


def _sizes(bundle: str, **overrides) -> tuple[list[int], list[int]]:
    """The network's (input, output) spatial sizes at the bundle's patch size, as its config resolves them."""
    parser = bundle_parser(bundle, **overrides)
    if bundle == "synthetic_lesion":  # a plain U-Net: the output has the input's size
        size = list(parser.get_parsed_content("patch_size"))
        return size, size
    return list(parser.get_parsed_content("input_size")), list(parser.get_parsed_content("output_size"))


@pytest.mark.parametrize("bundle", ALL_BUNDLES)
def test_metadata_gives_the_default_networks_shapes(bundle):
    """A list per input and output that MONAI's tools can read, equal to what the config resolves for its default
    network, so the two cannot drift apart."""
    formats = json.loads(Path(_files(bundle)[1]).read_text())["network_data_format"]
    shapes = [formats["inputs"]["image"]["spatial_shape"], formats["outputs"]["pred"]["spatial_shape"]]
    assert all(isinstance(s, list) and all(isinstance(v, int) for v in s) for s in shapes), shapes
    assert shapes == list(_sizes(bundle))


@pytest.mark.parametrize("bundle", ["kits19_tumor", "synthetic_lesion"])
def test_verify_net_in_out_passes_on_a_bundle_as_it_is(bundle):
    """One dataset bundle stands for the six (one machinery; the test above ties each metadata.json to its config),
    at full width: what a user's ``python -m monai.bundle verify_net_in_out network_def ...`` runs."""
    config, meta = _files(bundle)
    verify_net_in_out(net_id="network_def", meta_file=meta, config_file=config, device="cpu")


def test_verify_net_in_out_with_another_network_and_its_input_size():
    """As the bundles' README shows: ``--network deepmedic`` and that network's input size."""
    network = "deepmedic"
    config, meta = _files("kits19_tumor")
    size, _ = _sizes("kits19_tumor", network=network)
    verify_net_in_out(
        net_id="network_def", meta_file=meta, config_file=config, device="cpu", network=network,
        **{INPUT_SHAPE_ID: size},
    )  # fmt: skip
    # the metadata's own size (the U-Net's patch) is refused by DeepMedic, which needs its context
    with pytest.raises(ValueError, match="too small for DeepMedic"):
        verify_net_in_out(net_id="network_def", meta_file=meta, config_file=config, device="cpu", network=network)


def _checkpoint(parser: ConfigParser, path: Path) -> torch.nn.Module:
    """A trained-looking network saved under the key the bundles' checkpoints use (``network``)."""
    torch.manual_seed(0)
    net = parser.get_parsed_content("network_def")
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.01 * torch.randn_like(p))
    torch.save({"network": net.state_dict(), "optimizer": {}}, path)
    return net.eval()


def test_ckpt_export_scripts_the_synthetic_bundles_network(tmp_path):
    config, meta = _files("synthetic_lesion")
    net = _checkpoint(bundle_parser("synthetic_lesion"), tmp_path / "checkpoint.pt")
    ckpt_export(
        net_id="network_def", filepath=str(tmp_path / "model.ts"), ckpt_file=str(tmp_path / "checkpoint.pt"),
        key_in_ckpt="network", meta_file=meta, config_file=config,
    )  # fmt: skip
    exported = torch.jit.load(str(tmp_path / "model.ts"))
    x = torch.rand(1, 1, 32, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(exported(x), net(x))


#: MONAI FL builds the evaluation before the client's first round writes the run's policies.json, and the learned TTA
#: says it starts from the initial TEA policy: expected in these tests
NO_POLICIES_YET = "ignore:.*policies.json does not exist yet:UserWarning"
#: torch's check of MONAI's DynUNet warns on its `heads: list[torch.Tensor]` (torch reads lowercase `list` as empty)
SCRIPT_WARNING = "ignore:The TorchScript type system doesn't support instance-level annotations:UserWarning"
#: narrow networks for the export tests (the export's mechanics do not depend on the width), and a second input
#: size each takes besides the whole-volume inferer's
EXPORTED = {
    "deepmedic": (SMALL_DEEPMEDIC, "input_size"),
    "unet3d": ({"base_filters": 4, "max_filters": 8}, [96, 64, 80]),
}


@pytest.mark.filterwarnings(SCRIPT_WARNING)
@pytest.mark.parametrize("network", sorted(EXPORTED))
def test_ckpt_export_scripts_a_dataset_bundles_network_for_any_input_size(tmp_path, network):
    """DeepMedic and the U-Net are scripted (no ``--use_trace``; the U-Net as its inference network, without the
    training-only deep-supervision heads): the TorchScript network predicts what the trained one predicts in eval mode
    at the size the whole-volume inferer feeds it and at another (DeepMedic: the training patch)."""
    kwargs, other = EXPORTED[network]
    overrides = {"network": network, "network_kwargs": kwargs}
    parser = bundle_parser("kits19_tumor", **overrides)
    net = _checkpoint(parser, tmp_path / "checkpoint.pt")
    config, meta = _files("kits19_tumor")
    ckpt_export(
        net_id="network_def", filepath=str(tmp_path / "model.ts"), ckpt_file=str(tmp_path / "checkpoint.pt"),
        key_in_ckpt="network", meta_file=meta, config_file=config, **overrides,
    )  # fmt: skip
    exported = torch.jit.load(str(tmp_path / "model.ts"))
    other = parser.get_parsed_content(other) if isinstance(other, str) else other
    for size in (parser.get_parsed_content("sw_inferer").roi_size, other):
        x = torch.rand(1, 1, *size)
        with torch.no_grad():
            torch.testing.assert_close(exported(x), net(x))


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
def test_ckpt_export_traces_a_dataset_bundles_transformer_at_its_inferers_size(tmp_path):
    """The transformer (whose checkpointing TorchScript cannot script) is traced, the bundles' README's
    ``--use_trace``, at the size its whole-volume inferer feeds it: the TorchScript network predicts what the trained
    one predicts (a narrow SwinUNETR)."""
    overrides = {"network": "transformer", "network_kwargs": {"feature_size": 12, "depths": [1, 1, 1, 1]}}
    parser = bundle_parser("kits19_tumor", **overrides)
    net = _checkpoint(parser, tmp_path / "checkpoint.pt")
    roi = list(parser.get_parsed_content("sw_inferer").roi_size)
    config, meta = _files("kits19_tumor")
    ckpt_export(
        net_id="network_def", filepath=str(tmp_path / "model.ts"), ckpt_file=str(tmp_path / "checkpoint.pt"),
        key_in_ckpt="network", meta_file=meta, config_file=config, use_trace=True, input_shape=[1, 1, *roi],
        **overrides,
    )  # fmt: skip
    exported = torch.jit.load(str(tmp_path / "model.ts"))
    x = torch.rand(1, 1, *roi)
    with torch.no_grad():
        torch.testing.assert_close(exported(x), net(x))


@pytest.mark.parametrize("bundle", ALL_BUNDLES)
@pytest.mark.parametrize("multi_gpu", [False, True])
def test_training_properties_are_at_monais_ids(bundle, multi_gpu):
    """Each required property's id is in the config (what ``check_properties`` needs, read without building the
    dataset bundles' data), and each optional one that the config refers to is referred to correctly; the multi-GPU
    config's handler override lands on the trainer's own id (a stale ``trainer#...`` would add a stray key)."""
    config, meta = _files(bundle)
    files = [config, str(Path(config).with_name("multi_gpu_train.yaml"))] if multi_gpu else config
    workflow = ConfigWorkflow(config_file=files, meta_file=meta, logging_file=False, workflow_type="train")
    required = [p[BundlePropertyConfig.ID] for p in TrainProperties.values() if p[BundleProperty.REQUIRED]]
    assert [i for i in required if i not in workflow.parser] == []
    assert all(workflow._check_optional_id(name, p) for name, p in workflow.properties.items())
    trainer = workflow.parser["train#trainer"]
    assert isinstance(trainer, dict) and trainer["_target_"] == "SupervisedTrainer"
    assert workflow.parser["trainer"] == "@train#trainer"
    handlers = trainer["train_handlers"]
    assert ("dist.get_rank()" in handlers) == multi_gpu, handlers


#: experiment tracking as MONAI's ``--tracking`` patches a bundle (its ``mlflow`` settings, with a handler that needs
#: no MLflow): a handler for ``train#trainer`` put into ``train#handlers``
TRACKING = {
    "handlers_id": {"trainer": {"id": "train#trainer", "handlers": "train#handlers"}},
    "configs": {"save_execute_config": False,
                "trainer": {"_target_": "ignite.handlers.EpochOutputStore", "output_transform": "$lambda out: 1"}},
}  # fmt: skip


@pytest.mark.filterwarnings(SMALL_DATASET_KEPT)
def test_a_training_workflow_reads_and_sets_the_properties(tmp_path):
    """The synthetic bundle as MONAI FL drives a bundle: ``check_properties`` finds nothing missing, the properties
    are the run's objects, and ``max_epochs`` set through its property is what the trainer runs, the learning-rate
    schedule plans and the checkpoint records (the config's own ``max_epochs`` stays 2); MONAI's experiment
    tracking adds its handler to the trainer's."""
    small_dataset(tmp_path)
    config, meta = _files("synthetic_lesion")
    workflow = ConfigWorkflow(
        config_file=config, meta_file=meta, logging_file=False, workflow_type="train",
        dataset_dir=str(tmp_path / "data"), output_dir=str(tmp_path / "run"), patch_size=[24, 24, 24], plots=False,
        max_epochs=2, epoch_length=1, num_workers=0, tracking=TRACKING,
    )  # fmt: skip
    workflow.initialize()
    assert workflow.check_properties() == []
    assert workflow.max_epochs == 2 and workflow.bundle_root == "."
    assert workflow.trainer is workflow.parser.get_parsed_content("trainer")
    assert workflow.train_dataset is workflow.parser.get_parsed_content("train_dataset")
    workflow.max_epochs = 1
    workflow.initialize()
    assert workflow.parser.get_parsed_content("max_epochs") == 2
    assert workflow.parser.get_parsed_content("lr_scheduler").total_iters == 1
    workflow.run()
    assert workflow.trainer.state.epoch == workflow.trainer.state.max_epochs == 1
    saved = torch.load(tmp_path / "run" / "resume.pt", weights_only=False)  # the checkpoint of the run as trained
    assert saved["trainer"]["max_epochs"] == 1
    # the tracking handler was added to the trainer's own handlers, not put in their place
    (store,) = workflow.parser.get_parsed_content("train#handlers")
    assert store.data == [1]  # the last epoch's one iteration
    assert (tmp_path / "run" / "policies.json").is_file()


@pytest.mark.filterwarnings(NO_POLICIES_YET)
@pytest.mark.filterwarnings(SMALL_DATASET_KEPT)
@pytest.mark.parametrize("planned_epochs", [None, 2])
def test_monai_fl_trains_the_bundle_round_after_round(tmp_path, planned_epochs, caplog):
    """MONAI FL's client (``MonaiAlgo``) on the synthetic bundle, two rounds of one local epoch from the server's
    weights: each round trains and returns the difference of the weights. MonaiAlgo sets ``max_epochs`` to one
    round's, so without ``planned_epochs`` the learning-rate schedule ends with the first round and the second
    trains at learning rate 0, with a warning that names the setting; with ``planned_epochs: 2`` (rounds x local
    epochs) the second round trains at the schedule's second epoch. (With ``planned_epochs``, the client also
    evaluates with ``evaluate.yaml`` after each round: its learned TTA is the one the round's ``policies.json``
    holds.)"""
    import copy
    import logging

    from monai.fl.client import MonaiAlgo
    from monai.fl.utils.constants import WeightType
    from monai.fl.utils.exchange_object import ExchangeObject

    from jcsaug.inference import TEAInferer, load_tea_policy

    small_dataset(tmp_path)
    settings = dict(dataset_dir=str(tmp_path / "data"), output_dir=str(tmp_path / "run"), patch_size=[24, 24, 24],
                    plots=False, epoch_length=1, num_workers=0, planned_epochs=planned_epochs)  # fmt: skip
    evaluate = planned_epochs is not None
    algo = MonaiAlgo(
        bundle_root=str(BUNDLES / "synthetic_lesion"),
        config_train_filename="configs/train.yaml",
        train_kwargs=settings,
        eval_kwargs=settings,
        config_evaluate_filename=["configs/train.yaml", "configs/evaluate.yaml"] if evaluate else None,
    )
    with pytest.warns(UserWarning, match="provisioned by the FL system"):  # MONAI's note on running a bundle's code
        algo.initialize(extra={"client_name": "site1", "app_root": str(tmp_path)})
    server = ExchangeObject(weights=copy.deepcopy(algo.trainer.network.state_dict()), weight_type=WeightType.WEIGHTS)
    rates, trained = [], []
    with caplog.at_level(logging.WARNING, logger="jcsaug.engine"):
        for _ in range(2):
            rates.append(algo.trainer.optimizer.param_groups[0]["lr"])
            algo.train(server)
            update = algo.get_weights()
            assert update.weight_type == WeightType.WEIGHT_DIFF and update.statistics["num_executed_iterations"] == 1
            trained.append(any(bool(diff.abs().sum() > 0) for diff in update.weights.values()))
            if evaluate:
                assert "learned_mean_dice" in algo.evaluate(server).metrics
                learned = algo.eval_workflow.parser.get_parsed_content("validate#inferer")["learned"]
                written = TEAInferer.from_policy(load_tea_policy(tmp_path / "run" / "policies.json"), z=learned.z)
                assert [op.id for op in learned.ops] == [op.id for op in written.ops]
                assert learned.weights == pytest.approx(written.weights)
    algo.finalize()
    assert algo.trainer.state.epoch == 2 and (tmp_path / "run" / "policies.json").is_file()
    warned = [r.getMessage() for r in caplog.records if "learning-rate schedule ended" in r.getMessage()]
    if planned_epochs is None:  # the second round learns nothing
        assert rates == [pytest.approx(0.01), 0.0] and trained == [True, False]
        assert len(warned) == 1 and "Set planned_epochs" in warned[0]
    else:
        assert rates == [pytest.approx(0.01), pytest.approx(0.01 * 0.5**0.9)] and trained == [True, True]
        assert not warned


def test_bundle_root_is_where_data_and_runs_start():
    """MONAI's ``bundle_root`` property moves the default data and output folders; the default (".") gives the
    paths the README's commands use from the repository root."""
    for bundle, data, run in [("synthetic_lesion", "data/synthetic_lesion", "runs/synthetic_lesion"),
                              ("kits19_tumor", "data/kits19_tumor", "runs/kits19_tumor/unet3d_")]:  # fmt: skip
        parser = bundle_parser(bundle)
        assert parser.get_parsed_content("dataset_dir") == data
        assert parser.get_parsed_content("output_dir").startswith(run)
        moved = bundle_parser(bundle, bundle_root="/elsewhere")
        assert moved.get_parsed_content("dataset_dir") == f"/elsewhere/{data}"
        assert moved.get_parsed_content("output_dir").startswith(f"/elsewhere/{run}")


@pytest.mark.parametrize("bundle", ALL_BUNDLES)
def test_inference_properties_are_at_monais_ids(bundle):
    """``inference.yaml`` on its ``train.yaml``: each required inference property's id is in the config and each
    optional one is referred to where MONAI looks for it (``dataset#transform`` is ``@preprocessing``, ...)."""
    files, meta = _inference_files(bundle)
    workflow = ConfigWorkflow(config_file=files, meta_file=meta, logging_file=False, workflow_type="infer")
    required = [p[BundlePropertyConfig.ID] for p in InferProperties.values() if p[BundleProperty.REQUIRED]]
    assert [i for i in required if i not in workflow.parser] == []
    assert all(workflow._check_optional_id(name, p) for name, p in workflow.properties.items())
    assert workflow.parser["evaluator"]["_target_"] == "SupervisedEvaluator"
    assert workflow.parser["evaluator#val_handlers"] == "@handlers"


@pytest.mark.filterwarnings(SMALL_DATASET_KEPT)
def test_an_inference_workflow_saves_what_the_network_predicts(tmp_path):
    """The synthetic bundle's inference as MONAI drives an inference bundle: ``check_properties`` finds nothing
    missing, the properties are the run's objects, and ``run`` loads the run's checkpoint and saves, per test volume,
    the argmax of the inferer's prediction as uint8 on the volume's grid (its affine), under the volume's name."""
    small_dataset(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    files, meta = _inference_files("synthetic_lesion")
    network = _checkpoint(bundle_parser("synthetic_lesion"), run / "checkpoint_final_iteration=1.pt")
    workflow = ConfigWorkflow(
        config_file=files, meta_file=meta, logging_file=False, workflow_type="infer",
        dataset_dir=str(tmp_path / "data"), output_dir=str(run), num_workers=0, tea_inference="heuristic",
    )  # fmt: skip
    workflow.initialize()
    assert workflow.check_properties() == []
    assert isinstance(workflow.evaluator, SupervisedEvaluator)
    assert workflow.dataset is workflow.parser.get_parsed_content("dataset")
    assert workflow.inferer is workflow.parser.get_parsed_content("inferer")
    workflow.run()
    cases = workflow.parser.get_parsed_content("test_files")
    saved = sorted((run / "predictions").glob("*_seg.nii.gz"))
    assert [p.name for p in saved] == sorted(Path(c["image"]).name.replace(".nii.gz", "_seg.nii.gz") for c in cases)
    device = workflow.parser.get_parsed_content("device")  # the workflow's (a GPU's kernels differ from the CPU's)
    network.to(device)
    for case in cases:
        image = nib.load(case["image"])
        assert nib.aff2axcodes(image.affine) == ("R", "A", "S")  # read as stored: the network sees the array as is
        with torch.no_grad():
            volume = torch.as_tensor(image.get_fdata(), dtype=torch.float32)[None, None]
            logits = workflow.inferer(volume.to(device), network).cpu()
        written = nib.load(run / "predictions" / Path(case["image"]).name.replace(".nii.gz", "_seg.nii.gz"))
        assert written.get_data_dtype() == np.uint8
        np.testing.assert_allclose(written.affine, image.affine, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(written.dataobj), logits.argmax(1)[0].numpy())


def _evaluation_files(bundle: str) -> tuple[list[str], str]:
    config, meta = _files(bundle)
    return [config, str(Path(config).with_name("evaluate.yaml"))], meta


@pytest.mark.parametrize("bundle", ALL_BUNDLES)
def test_evaluation_properties_are_at_monais_ids(bundle):
    """``evaluate.yaml`` on its ``train.yaml``: the required properties of an evaluation workflow
    (``workflow_type="eval"``) are in the config, and MONAI's validation ids of a training workflow (what MONAI FL's
    ``MonaiAlgo`` reads for its evaluation: ``validate#evaluator``, ...) refer to one another where MONAI looks."""
    files, meta = _evaluation_files(bundle)
    workflow = ConfigWorkflow(config_file=files, meta_file=meta, logging_file=False, workflow_type="eval")
    required = [p[BundlePropertyConfig.ID] for p in InferProperties.values() if p[BundleProperty.REQUIRED]]
    assert [i for i in required if i not in workflow.parser] == []
    assert all(workflow._check_optional_id(name, p) for name, p in workflow.properties.items())
    assert workflow.parser["evaluator"] == "@validate#evaluator"
    as_training = ConfigWorkflow(config_file=files, meta_file=meta, logging_file=False, workflow_type="train")
    assert all(as_training._check_optional_id(name, p) for name, p in as_training.properties.items())
    evaluator = workflow.parser["validate#evaluator"]
    assert evaluator["_target_"] == "jcsaug.evaluation.CaseEvaluator"
    # (as expressions, which MONAI's check of the ids skips: MONAI >= 1.4 compares them as text with "::")
    assert evaluator["val_handlers"] == "$@validate#handlers" and evaluator["inferers"] == "@validate#inferer"
    assert evaluator["key_val_metric"] == "$@validate#key_metric" and "validate#key_metric" in workflow.parser
    assert evaluator["postprocessing"] == "$@validate#postprocessing" and "validate#postprocessing" in workflow.parser
    assert workflow.parser["validate#dataloader#dataset"] == "$@validate#dataset"
    assert workflow.parser["validate#dataset#transform"] == "$@validate#preprocessing"


@pytest.mark.filterwarnings(SMALL_DATASET_KEPT)
def test_an_evaluation_workflow_scores_every_method_and_reports_it_to_handlers(tmp_path):
    """The synthetic bundle's evaluation as MONAI drives an evaluation bundle: ``check_properties`` finds nothing
    missing, ``run`` loads the run's checkpoint and writes ``metrics_evaluate.json``, the evaluator's state holds
    each method's mean Dice, and a handler added to ``validate#handlers`` (MONAI's ``StatsHandler``) runs with it.
    The figures are those of ``evaluate_cases`` on the checkpoint's network. (The run is a post-hoc one that has
    written no ``policies.json``: its learned methods are not evaluated; a joint run's would test the ``tea_preset``
    until it writes one, ``test_monai_fl_evaluates_the_servers_weights_with_evaluate_yaml``.)"""
    from monai.handlers import StatsHandler

    from jcsaug.evaluation import CaseEvaluator, evaluate_cases

    small_dataset(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    files, meta = _evaluation_files("synthetic_lesion")
    network = _checkpoint(bundle_parser("synthetic_lesion"), run / "checkpoint_final_iteration=1.pt")
    handlers = ["@validate#metrics", {"_target_": "StatsHandler", "iteration_log": False, "name": "evaluation"}]
    workflow = ConfigWorkflow(
        config_file=files, meta_file=meta, logging_file=False, workflow_type="eval",
        dataset_dir=str(tmp_path / "data"), output_dir=str(run), num_workers=0, tea_mode="learned-posthoc",
        **{"validate#handlers": handlers},
    )  # fmt: skip
    workflow.initialize()
    assert workflow.check_properties() == []
    as_training = ConfigWorkflow(
        config_file=files, meta_file=meta, logging_file=False, workflow_type="train",
        dataset_dir=str(tmp_path / "data"), output_dir=str(run), num_workers=0, tea_mode="learned-posthoc",
    )  # fmt: skip
    as_training.initialize()
    assert as_training.check_properties() == [] and isinstance(as_training.evaluator, CaseEvaluator)
    assert isinstance(workflow.evaluator, CaseEvaluator) and workflow.evaluator.methods == ["heuristic", "none"]
    assert workflow.dataset is workflow.parser.get_parsed_content("validate#dataset")
    assert isinstance(workflow.parser.get_parsed_content("validate#handlers")[1], StatsHandler)
    workflow.run()
    written = json.loads((run / "metrics_evaluate.json").read_text())
    reported = {f"{m}_mean_dice": written[m]["mean_dice"] for m in ("none", "heuristic")}
    assert workflow.evaluator.state.metrics == reported
    # the key metric: the run's own method (learned-posthoc: learned), none where it was not evaluated (no TEA policy)
    assert workflow.evaluator.state.key_metric_name == "none_mean_dice"
    assert workflow.evaluator.state.best_metric == reported["none_mean_dice"]
    parser = workflow.parser
    expected = evaluate_cases(network, parser.get_parsed_content("test_files"), parser.get_parsed_content("load"),
                              parser.get_parsed_content("validate#inferer"), 2, progress=False,
                              device=parser.get_parsed_content("device"))  # on the workflow's device  # fmt: skip
    assert reported == pytest.approx({f"{m}_mean_dice": r["mean_dice"] for m, r in expected.items()})
    # segmentation_postprocessing (validate#postprocessing): here a transform that makes each prediction the label
    labelled = ConfigWorkflow(
        config_file=files, meta_file=meta, logging_file=False, workflow_type="eval",
        dataset_dir=str(tmp_path / "data"), output_dir=str(run), num_workers=0, tea_mode="learned-posthoc",
        segmentation_postprocessing="$lambda d: {**d, 'pred': d['label']}",
    )  # fmt: skip
    labelled.initialize()
    assert labelled.evaluator.case_postprocessing is labelled.parser.get_parsed_content("validate#postprocessing")
    labelled.run()
    written = json.loads((run / "metrics_evaluate.json").read_text())
    assert {m: written[m]["mean_dice"] for m in ("none", "heuristic")} == {"none": 1.0, "heuristic": 1.0}


@pytest.mark.filterwarnings(NO_POLICIES_YET)
@pytest.mark.filterwarnings(SMALL_DATASET_KEPT)
def test_monai_fl_evaluates_the_servers_weights_with_evaluate_yaml(tmp_path):
    """MONAI FL's client with the bundle's evaluation config (``train.yaml`` + ``evaluate.yaml``, as MonaiAlgo's
    default ``config_evaluate_filename``): ``evaluate`` scores the server's weights on the test split and returns
    each method's mean Dice (those of ``evaluate_cases`` on a network with the server's weights), weights that
    predict background only score 0, and the learned TTA tests the TEA policy the client's run has learned so far:
    the initial one (``tea_preset``) before the run writes ``policies.json``, then the file's, read again when a
    round rewrites it (the evaluator is built once, at ``initialize``)."""
    from monai.fl.client import MonaiAlgo
    from monai.fl.utils.constants import WeightType
    from monai.fl.utils.exchange_object import ExchangeObject

    from jcsaug.evaluation import evaluate_cases
    from jcsaug.inference import list_tta_inferers, make_tta_inferers
    from jcsaug.policy import make_tea_policy
    from jcsaug.policy.io import save_policies

    small_dataset(tmp_path)
    settings = dict(dataset_dir=str(tmp_path / "data"), output_dir=str(tmp_path / "run"), patch_size=[24, 24, 24],
                    plots=False, epoch_length=1, num_workers=0)  # fmt: skip
    algo = MonaiAlgo(bundle_root=str(BUNDLES / "synthetic_lesion"), config_train_filename="configs/train.yaml",
                     train_kwargs=settings, config_evaluate_filename=["configs/train.yaml", "configs/evaluate.yaml"],
                     eval_kwargs=settings)  # fmt: skip
    with pytest.warns(UserWarning, match="provisioned by the FL system"):
        algo.initialize(extra={"client_name": "site1", "app_root": str(tmp_path)})
    parser = algo.eval_workflow.parser
    start = {k: v.clone() for k, v in parser.get_parsed_content("network_def").state_dict().items()}
    evaluated = parser.get_parsed_content("validate#inferer")
    learned_tea = make_tea_policy("uniform")  # what a round writes: a quarter turn and a zoom on top
    with torch.no_grad():
        learned_tea.logits[0, 6], learned_tea.logits[0, 3] = 4.0, 3.0
    methods = ["none", "heuristic", "learned", "learned+mirror"]
    results = []
    for background, tea_policy in ((False, make_tea_policy("nnunet")), (True, make_tea_policy("nnunet")),
                                   (False, learned_tea)):  # fmt: skip
        if tea_policy is learned_tea:  # a training round of the client writes its policies
            save_policies(tmp_path / "run" / "policies.json", tea=learned_tea)
        torch.manual_seed(0)
        weights = {k: v + 0.05 * torch.randn_like(v) if v.is_floating_point() else v
                   for k, v in start.items()}  # fmt: skip
        if background:
            last_bias = [k for k, v in weights.items() if k.endswith("bias") and v.shape == (2,)][-1]
            weights[last_bias] = torch.tensor([50.0, -50.0])
        result = algo.evaluate(ExchangeObject(weights=weights, weight_type=WeightType.WEIGHTS)).metrics
        check = bundle_parser("synthetic_lesion").get_parsed_content("network_def")  # a network of its own
        check.load_state_dict(weights)
        inferers = make_tta_inferers(
            list_tta_inferers(),
            parser.get_parsed_content("sw_inferer"),
            tea_policy,
            z=parser.get_parsed_content("tea_z"),
        )  # built now from the policy itself
        expected = evaluate_cases(check, parser.get_parsed_content("test_files"), parser.get_parsed_content("load"),
                                  inferers, 2, progress=False,
                                  device=parser.get_parsed_content("device"))  # on the client's device  # fmt: skip
        assert set(result) == {f"{m}_mean_dice" for m in methods}
        assert result == pytest.approx({f"{m}_mean_dice": r["mean_dice"] for m, r in expected.items()})
        assert [op.id for op in evaluated["learned"].ops] == [op.id for op in inferers["learned"].ops]
        results.append(dict(result))  # (the evaluator's state.metrics: the same dict every round)
    assert results[1] == {f"{m}_mean_dice": 0.0 for m in methods} != results[0]
    assert [op.id for op in evaluated["learned"].ops][:2] == [6, 3]  # the file's policy, not the initial one
    assert results[2]["learned_mean_dice"] != results[0]["learned_mean_dice"]
    assert results[2]["none_mean_dice"] == results[0]["none_mean_dice"]
    algo.finalize()
