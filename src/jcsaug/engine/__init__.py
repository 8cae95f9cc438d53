"""Ignite handlers that learn TRA and TEA policies during training, and the maths behind them."""

from jcsaug.engine.base import POLICY_STEPS, StepRule
from jcsaug.engine.checkpoints import (
    AtomicCheckpointSaver,
    SafeCheckpointLoader,
    latest_checkpoint,
    load_checkpoint,
    nonfinite_entries,
    read_checkpoint,
    save_checkpoint_atomic,
)
from jcsaug.engine.clipping import GradientClipping
from jcsaug.engine.device_augmentation import AUGMENT_ON, DeviceAugmentation, resolve_augment_on
from jcsaug.engine.distributed import rank_device, release_ddp, shutdown_distributed
from jcsaug.engine.divergence import StopOnNonFiniteLoss, TrainingDiverged
from jcsaug.engine.export import PolicyExporter
from jcsaug.engine.hypergradient import (
    HYPERGRADIENTS,
    finite_difference_hypergradient,
    get_hypergradient,
    jvp_hypergradient,
    list_hypergradients,
    normalise_hypergradient,
    register_hypergradient,
)
from jcsaug.engine.lookahead import NeumannLookAhead, hessian_vector_products
from jcsaug.engine.losses import LOSSES, SegmentationLoss, get_loss, list_losses, register_loss
from jcsaug.engine.modes import (
    TEA_MODES,
    TRA_MODES,
    AugmentationSetup,
    PolicyUpdaters,
    TEAMode,
    TRAMode,
    get_tea_mode,
    get_tra_mode,
    initial_tea_policy,
    key_test_method,
    list_tea_modes,
    list_tra_modes,
    register_tea_mode,
    register_tra_mode,
)
from jcsaug.engine.posthoc import learn_tea_posthoc
from jcsaug.engine.preflight import (
    PreflightError,
    check_data,
    check_evaluation_data,
    check_output_dir,
    check_override_ids,
    check_patch_size,
    check_settings,
)
from jcsaug.engine.resume import EpochReseeder, ResumeCheckpoint, StopAfterEpochs
from jcsaug.engine.schedule import WarnAfterSchedule
from jcsaug.engine.summary import RunSummary
from jcsaug.engine.tea_updater import TEAPolicyUpdater
from jcsaug.engine.tra_updater import TRAPolicyUpdater
from jcsaug.engine.worker_counterfactuals import CounterfactualDataset, CounterfactualSampler

__all__ = [
    "CounterfactualDataset",
    "CounterfactualSampler",
    "AUGMENT_ON",
    "resolve_augment_on",
    "HYPERGRADIENTS",
    "POLICY_STEPS",
    "StepRule",
    "PolicyUpdaters",
    "RunSummary",
    "TEAMode",
    "TRAMode",
    "get_hypergradient",
    "hessian_vector_products",
    "get_tea_mode",
    "initial_tea_policy",
    "key_test_method",
    "get_tra_mode",
    "list_hypergradients",
    "list_losses",
    "list_tea_modes",
    "list_tra_modes",
    "register_hypergradient",
    "register_loss",
    "register_tea_mode",
    "register_tra_mode",
    "SegmentationLoss",
    "AtomicCheckpointSaver",
    "SafeCheckpointLoader",
    "load_checkpoint",
    "save_checkpoint_atomic",
    "nonfinite_entries",
    "read_checkpoint",
    "StopOnNonFiniteLoss",
    "WarnAfterSchedule",
    "GradientClipping",
    "TrainingDiverged",
    "PreflightError",
    "check_data",
    "check_evaluation_data",
    "check_output_dir",
    "check_override_ids",
    "check_patch_size",
    "check_settings",
    "LOSSES",
    "TEA_MODES",
    "TRA_MODES",
    "AugmentationSetup",
    "DeviceAugmentation",
    "EpochReseeder",
    "ResumeCheckpoint",
    "StopAfterEpochs",
    "PolicyExporter",
    "TEAPolicyUpdater",
    "TRAPolicyUpdater",
    "NeumannLookAhead",
    "finite_difference_hypergradient",
    "get_loss",
    "jvp_hypergradient",
    "latest_checkpoint",
    "learn_tea_posthoc",
    "normalise_hypergradient",
    "rank_device",
    "release_ddp",
    "shutdown_distributed",
]
