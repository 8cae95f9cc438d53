"""Checks a bundle runs in its ``initialize`` step, before any data is cached or any file is written.

Bad settings, a misspelled override id, a missing or inconsistent case in *any* split, a patch size the network
cannot take, or an output folder holding another run all fail in seconds with one error that names what is wrong
(and the valid choices), instead of after hours of training or, worse, not at all.

* :func:`check_settings`: the values of the bundle's settings (network name, modes, ``tea_z``, counts, learning
  rates and logit budgets, estimators, losses, look-ahead, ...; and the ones that do not go together, such as a
  learning rate of 0 for a policy the run learns) and the ids given on the command line (:func:`check_override_ids`).
* :func:`check_output_dir`: a fresh run never mixes with another run in its ``output_dir``; ``resume`` continues
  it (with its own ``max_epochs``/``epoch_length``), ``overwrite`` replaces it.
* :func:`check_data`: every split's files exist and each image/label pair has the same 3D shape and affine (NIfTI
  headers only; label values are checked when the cases are loaded, by :class:`jcsaug.data.CheckImageLabeld`);
  an empty validation split is only a warning, or nothing where no mode needs it.
* :func:`check_patch_size`: the network's output covers the patch (a forward pass on the meta device: no memory,
  no compute).
"""

from __future__ import annotations

import ast
import copy
import difflib
import functools
import logging
import math
import numbers
import shutil
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import ignite.distributed as idist
import numpy as np
import torch
from torch import nn

from jcsaug.data.checks import pair_problems
from jcsaug.engine.resume import RESUME_FILE, check_resume_matches
from jcsaug.evaluation.postprocessing import POSTPROCESSING_NAME, chooses_on_validation
from jcsaug.evaluation.splits import EVALUATION_SPLITS, evaluation_file_names, evaluation_split
from jcsaug.inference.tta import EQUAL_WEIGHTS, check_identity_weight
from jcsaug.utils import as_flag, as_share

__all__ = [
    "RUN_ARTEFACTS",
    "check_data",
    "check_evaluation_data",
    "check_output_dir",
    "check_override_ids",
    "check_patch_size",
    "check_resume_matches",
    "check_settings",
    "needs_validation",
]

logger = logging.getLogger("jcsaug.engine")

#: What a run writes into its ``output_dir`` (glob patterns): a folder holding any of these holds a run.
RUN_ARTEFACTS = (
    RESUME_FILE,
    "checkpoint_*.pt",
    "policies.json",
    "policies.png",
    "policy_history.jsonl",
    "policy_history.png",
    "metrics.json",
    "per_case.csv",
    *(name for split in EVALUATION_SPLITS for name in evaluation_file_names(split)),  # evaluate.yaml's, per split
    POSTPROCESSING_NAME,
    "tensorboard",
    "predictions",
)

#: ``monai.bundle run`` arguments that are not config ids.
_RUN_ARGUMENTS = frozenset(
    {"run_id", "init_id", "final_id", "meta_file", "config_file", "logging_file", "tracking", "args_file",
     "workflow_name", "workflow_type", "properties_path"}
)  # fmt: skip
_MAX_LISTED = 20


class PreflightError(ValueError):
    """A setting, an id, the data or the output folder is not fit for the run (raised before it starts)."""


def _bundle_command_line() -> bool:
    return _command_line_ids(sys.argv) is not None


def _reported(check: Callable[..., None]) -> Callable[..., None]:
    """Under ``python -m monai.bundle run`` a :class:`PreflightError` ends the process with its message alone
    (``SystemExit``, exit status 1) instead of MONAI's "Failed to evaluate ConfigExpression" traceback; called from
    Python the error is raised as it is."""

    @functools.wraps(check)
    def run(*args: Any, **kwargs: Any) -> None:
        try:
            check(*args, **kwargs)
        except PreflightError as err:
            if not _bundle_command_line():
                raise
            logger.error("%s", err)
            raise SystemExit(f"error: {err}") from None

    return run


# ----------------------------------------------------------------------------------------------- settings
def _positive_int(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        return "must be an integer >= 1"
    return None


def _optional_positive_int(value: Any) -> str | None:
    return None if value is None else (_positive_int(value) and "must be an integer >= 1, or None")


def _non_negative_int(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        return "must be an integer >= 0"
    return None


def _finite(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)


def _positive_finite(value: Any) -> str | None:
    return None if _finite(value) and value > 0 else "must be a finite number > 0"


def _at_least(low: float) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        return None if _finite(value) and value >= low else f"must be a finite number >= {low:g}"

    return check


def _fraction(low_open: bool) -> Callable[[Any], str | None]:
    """A number in ``(0, 1]`` (``low_open``) or ``[0, 1]``."""

    def check(value: Any) -> str | None:
        if _finite(value) and (value > 0 if low_open else value >= 0) and value <= 1:
            return None
        return f"must be a number in {'(' if low_open else '['}0, 1]"

    return check


def _start_share(value: Any) -> str | None:
    """A share of the run before an updater's first update: a number in ``[0, 1)``."""
    if _finite(value) and 0 <= value < 1:
        return None
    return "must be a number in [0, 1) (the share of the run before the first update)"


def _budget(value: Any) -> str | None:
    """A logit budget: ``None`` (the learning rate is used as it is) or a finite number > 0."""
    if value is None or (_finite(value) and value > 0):
        return None
    # fire reads `None` as None but `null` as the word 'null': say which to type
    return "must be a finite number > 0, or None (no budget: the learning rate is used; None on the command line)"


def _parsed_by(parse: Callable[[Any], Any], problem: str) -> Callable[[Any], str | None]:
    """A value that ``parse`` accepts (``problem`` when it raises ``ValueError``)."""

    def check(value: Any) -> str | None:
        try:
            parse(value)
        except ValueError:
            return problem
        return None

    return check


_flag = _parsed_by(as_flag, "must be true or false")
#: true, false or a share in ``[0, 1]``
_share_or_flag = _parsed_by(as_share, "must be true, false or a number in [0, 1]")


def _component_classes(value: Any) -> str | None:
    """``keep_largest_component``'s form (its classes against ``num_classes``: :func:`_relation_problems`)."""
    from jcsaug.evaluation.metrics import parse_component_classes

    try:
        parse_component_classes(value)
    except ValueError as err:
        return str(err).removeprefix(f"keep_largest_component {value!r}: ")
    return None


def _one_of(choices: Iterable[str]) -> Any:
    choices = tuple(choices)

    def check(value: Any) -> str | None:
        return None if value in choices else f"must be one of {', '.join(choices)}"

    return check


def _registered(registry: Any) -> Callable[[Any], str | None]:
    """A name of ``registry`` (its own normalisation, e.g. case, applies)."""

    def check(value: Any) -> str | None:
        return None if isinstance(value, str) and value in registry else f"must be one of {', '.join(registry.names())}"

    return check


def _val_loss(value: Any) -> str | None:
    from jcsaug.engine.losses import BATCH_LOSSES, LOSSES

    if callable(value) or (isinstance(value, str) and (value in BATCH_LOSSES or value in LOSSES)):
        return None
    return f"must be one of {', '.join(BATCH_LOSSES.names() + LOSSES.names())}"


def _network(value: Any) -> str | None:
    from jcsaug.networks import NETWORKS

    if isinstance(value, str) and value in NETWORKS:
        return None
    return f"must be one of {', '.join(sorted(NETWORKS))}"


def _tea_z(value: Any) -> str | None:
    from jcsaug.ops.tea import TEA_OPS

    if _positive_int(value) or value > len(TEA_OPS):
        return f"must be an integer in 1..{len(TEA_OPS)} (the TEA catalogue has {len(TEA_OPS)} ops)"
    return None


def _patch_size(value: Any) -> str | None:
    values = [value] if isinstance(value, numbers.Integral) else value
    if (
        not isinstance(values, Sequence)
        or isinstance(values, str)
        or not values
        or any(_positive_int(v) for v in values)
    ):
        return "must be a list of positive integers, one per spatial axis, e.g. [32, 32, 32]"
    return None


def _identity_weight(value: Any) -> str | None:
    try:
        check_identity_weight(value)  # the rule the inferers and the TEA updater apply
    except ValueError:
        return f"must be a number in (0, 1), {EQUAL_WEIGHTS!r}, or None"
    return None


def _optional_positive(value: Any) -> str | None:
    reason = None if value is None else _positive_finite(value)
    return reason and f"{reason}, or None"


def _optional_finite(value: Any) -> str | None:
    return None if value is None or _finite(value) else "must be a finite number, or None"


def _optional_transforms(value: Any) -> str | None:
    """MONAI transforms (any callable) or None; a string is the usual slip, an expression without its ``$``."""
    if value is None or callable(value):
        return None
    hint = " (an expression starts with $)" if isinstance(value, str) else ""
    return f"must be MONAI transforms, e.g. \"$monai.transforms.FillHolesd('pred')\", or None{hint}"


def _optional_patch_size(value: Any) -> str | None:
    reason = None if value is None else _patch_size(value)
    return reason and f"{reason}, or None"


def _tra_preset_problem(value: Mapping, catalogue: str) -> str | None:
    """Why :func:`~jcsaug.policy.make_tra_policy` builds no policy from the preset mapping in ``catalogue``."""
    from jcsaug.policy.factory import make_tra_policy

    try:
        make_tra_policy(value, num_groups=1, catalogue=catalogue)
    except (KeyError, TypeError, ValueError) as err:
        return str(err.args[0]) if err.args else str(err)  # a KeyError's str() quotes its message
    return None


def _tra_preset(value: Any) -> str | None:
    """A TRA preset name, or a mapping series -> probability: whatever :func:`~jcsaug.policy.make_tra_policy` builds
    a policy from (as the run will) in one of the TRA catalogues (which one the run uses, ``tra_catalogue``, is
    checked with it: :func:`_relation_problems`; named here: SPEC's problem)."""
    from jcsaug.ops.tra import TRA_CATALOGUES
    from jcsaug.policy.presets import TRA_PRESETS

    if isinstance(value, Mapping):
        problems = {catalogue: _tra_preset_problem(value, catalogue) for catalogue in TRA_CATALOGUES.names()}
        return None if None in problems.values() else problems["spec"]
    reason = _registered(TRA_PRESETS)(value)
    return reason and f"{reason}, or a mapping series -> probability"


def _tea_preset(value: Any) -> str | None:
    """A TEA preset name, or one probability per TEA op: whatever :func:`~jcsaug.policy.make_tea_policy` builds a
    policy from (as the run will)."""
    from jcsaug.ops.tea import TEA_OPS
    from jcsaug.policy.factory import make_tea_policy
    from jcsaug.policy.presets import TEA_PRESETS

    if isinstance(value, (Sequence, np.ndarray)) and not isinstance(value, str):
        try:
            make_tea_policy(value)
        except (TypeError, ValueError) as err:
            return str(err)
        return None
    reason = _registered(TEA_PRESETS)(value)
    return reason and f"{reason}, or {len(TEA_OPS)} probabilities"


def _train_fraction(value: Any) -> str | None:
    """A training fraction of the paper's table (of any task: whether this task's prepared data has its split,
    ``training`` for 1.0 or ``training_50`` for 0.5, :func:`jcsaug.tasks.load_split`, is the data check's)."""
    from jcsaug.tasks.registry import TASKS

    fractions = sorted({1.0} | {float(f) for _, task in TASKS.items() for row in task.paper_settings.values()
                                for f in row})  # fmt: skip
    if _finite(value) and float(value) in fractions:
        return None
    return f"must be one of {', '.join(map(str, fractions))} (the training fractions of the paper's table)"


def _tra_context(value: Any) -> str | None:
    """``auto`` or voxels per side (:func:`jcsaug.ops.tra.resolve_tra_context`)."""
    from jcsaug.ops.tra import TRA_CONTEXT_AUTO, resolve_tra_context

    try:
        resolve_tra_context(value, (1, 1, 1))
    except (TypeError, ValueError):
        return f"must be {TRA_CONTEXT_AUTO!r}, a non-negative voxel count or three (one per axis)"
    return None


def _policy_file(value: Any) -> str | None:
    """``None`` or a path (whether the mode reads it, and then that it holds the policy: :func:`_relation_problems`;
    a path the mode ignores need not exist, as the evaluation configs pass the run's settings on)."""
    if value is None or (isinstance(value, (str, Path)) and str(value)):
        return None
    return "must be None or the path of a policies.json file"


def _validators() -> dict[str, Any]:
    """id -> rule (``value -> None`` or what the value must be); the ranges are those the updaters and the modes
    accept (:class:`~jcsaug.engine.base.PolicyUpdater`, :class:`~jcsaug.engine.TRAPolicyUpdater`,
    :class:`~jcsaug.engine.TEAPolicyUpdater`, :class:`~jcsaug.engine.AugmentationSetup`), so that a bad value fails
    here, named, instead of inside a config expression after the data is loaded."""
    from jcsaug.engine.base import POLICY_STEPS
    from jcsaug.engine.device_augmentation import AUGMENT_ON
    from jcsaug.engine.hypergradient import HYPERGRADIENTS
    from jcsaug.engine.losses import LOSSES
    from jcsaug.engine.modes import TEA_MODES, TRA_MODES
    from jcsaug.engine.tea_updater import TEA_ESTIMATORS, TEA_OP_SCORES
    from jcsaug.engine.tra_updater import TRA_DIRECTIONS, TRA_ESTIMATORS
    from jcsaug.ops.tra import TRA_CATALOGUES
    from jcsaug.policy.cascade import CF_EXPLORATIONS

    positive = ("max_epochs", "epoch_length", "tra_update_every", "tea_update_every", "num_tea_copies",
                "posthoc_iterations", "samples_per_case", "cases_per_batch", "train_cases_per_batch", "val_batch_size",
                "num_classes", "val_batches", "tea_patches")  # fmt: skip
    return {
        **dict.fromkeys(positive, _positive_int),
        **dict.fromkeys(
            ("num_workers", "stop_after_epochs", "seed", "tra_counterfactuals", "tea_background_patches"),
            _non_negative_int,
        ),
        "learning_rate": _positive_finite,  # the network's SGD: 0 would train nothing
        "planned_epochs": _optional_positive_int,
        # 0 is what the updaters accept (a budget replaces it); 0 where it is used: _relation_problems
        **dict.fromkeys(("tra_lr", "tea_lr", "posthoc_lr"), _at_least(0)),
        **dict.fromkeys(("tra_logit_budget", "tea_logit_budget"), _budget),
        "tea_poly_power": _at_least(0),
        "tra_poly_power": _at_least(0),
        "tra_start": _start_share,
        "tra_pull": _at_least(0),
        "tra_lookahead": _at_least(1),
        "val_average": _fraction(low_open=True),
        "cache_rate": _fraction(low_open=False),
        **dict.fromkeys(("resume", "overwrite", "train_on_val", "plots"), _flag),
        **dict.fromkeys(("tea_sliding_window", "tea_mask_out_of_view", "tea_volume_stats"), _flag),
        "tra_val_tea": _share_or_flag,
        "keep_largest_component": _component_classes,
        "segmentation_postprocessing": _optional_transforms,
        "tra_mode": _one_of(TRA_MODES),
        "tea_mode": _one_of(TEA_MODES),
        "tra_estimator": _one_of(TRA_ESTIMATORS),
        "tra_catalogue": _one_of(TRA_CATALOGUES),
        "tra_direction": _one_of(TRA_DIRECTIONS),
        "tra_step": _one_of(POLICY_STEPS),
        "tra_exploration": _one_of(CF_EXPLORATIONS),
        "tea_estimator": _one_of(TEA_ESTIMATORS),
        "tea_op_score": _one_of(TEA_OP_SCORES),
        "augment_on": _one_of(AUGMENT_ON),
        "hypergradient": _one_of(HYPERGRADIENTS),
        "train_loss": _registered(LOSSES),
        "val_loss": _val_loss,
        "network": _network,
        "tea_z": _tea_z,
        "tea_identity_weight": _identity_weight,
        "patch_size": _patch_size,
        "tea_patch_size": _optional_patch_size,
        "grad_clip_norm": _optional_positive,
        "tra_context": _tra_context,
        "roi_threshold": _optional_finite,
        "tra_meta_mode": _one_of(("eval", "train")),
        "tra_preset": _tra_preset,
        "tea_preset": _tea_preset,
        "train_fraction": _train_fraction,
        **dict.fromkeys(("tra_policy", "tea_policy"), _policy_file),
    }


def _policy_file_problems(
    which: str, mode: Any, settings: Mapping[str, Any], valid: Callable[[str], bool]
) -> list[str]:
    """What :func:`~jcsaug.engine.modes.policy_from_file` (the run's reader) refuses for the ``which``
    (``"tra"``/``"tea"``) policy file, checked only where both the mode and the file were given and are valid."""
    key = f"{which}_policy"
    if mode is None or not valid(key):
        return []
    path = settings[key]
    if not mode.from_file:
        if path is not None:
            warnings.warn(
                f"--{key} {path!r} is ignored: {which}_mode {mode.name!r} does not read a policy file "
                f"({which}_mode fixed does)",
                stacklevel=5,  # check_settings' caller
            )
        return []
    if path is None:  # AugmentationSetup says so when the run builds it (evaluate.yaml / inference.yaml never do)
        return []
    if not Path(path).is_file():
        return [f"--{key} {path!r}: no file {path} ({which}_mode {mode.name!r} reads the policy from it)"]
    from jcsaug.engine.modes import policy_from_file

    try:
        policy_from_file(path, which, mode.name)
    except ValueError as err:
        return [f"--{key} {path!r}: {err}"]
    return []


def _relation_problems(settings: Mapping[str, Any], valid: Callable[[str], bool]) -> list[str]:
    """Values each fine alone that do not go together; only settings given and valid alone (``valid(id)``) count.

    * a learning rate of 0 where it is used (a learned policy with no logit budget, ``learned-posthoc``'s
      ``posthoc_lr``) leaves the policy at its preset while the run reports it as learned: refused, since the modes
      that keep a policy as it is say so (``heuristic``, ``fixed``);
    * the paired TEA estimator scores each of its Z copies with another non-identity op (at most 83);
    * the paired TRA estimator needs at least one counterfactual copy; a natural ``tra_step`` (all but ``adam``) needs
      it (it steps on the op effects only that estimator measures);
    * the classes ``keep_largest_component`` names are foreground classes ``1..num_classes-1``;
    * a ``tea_identity_weight`` needs ``tea_z`` >= 2 (the identity and at least one op);
    * ``tea_background_patches`` pool patches into one score per op, which ``tea_op_score: ensemble`` does not;
    * a ``tra_preset`` mapping gives each series it names the probabilities of the run's ``tra_catalogue``
      (``spec`` when not given; ``split-signs`` has more ops in a series with signed ones);
    * a ``fixed`` mode's (``from_file``) ``tra_policy`` / ``tea_policy`` must exist and hold its policy, as
      :class:`~jcsaug.engine.AugmentationSetup` requires (no file at all: it says so itself when a training run
      builds it); a file given to another mode is ignored there: a warning.
    """
    from jcsaug.engine.base import POLICY_STEPS
    from jcsaug.engine.modes import get_tea_mode, get_tra_mode
    from jcsaug.ops.tea import TEA_OPS

    tra = get_tra_mode(settings["tra_mode"]) if valid("tra_mode") else None
    tea = get_tea_mode(settings["tea_mode"]) if valid("tea_mode") else None
    learned = {
        "tra_lr": (bool(tra and tra.learned), "tra_logit_budget", f"tra_mode {getattr(tra, 'name', '')!r}"),
        "tea_lr": (bool(tea and tea.joint), "tea_logit_budget", f"tea_mode {getattr(tea, 'name', '')!r}"),
        "posthoc_lr": (bool(tea and tea.posthoc), None, f"tea_mode {getattr(tea, 'name', '')!r}"),
    }
    problems = []
    for lr, (learns, budget, mode) in learned.items():
        # a budget not given is the updaters' default, None; one given but invalid is already reported
        if learns and valid(lr) and settings[lr] == 0 and (budget is None or settings.get(budget) is None):
            which = "TRA" if lr == "tra_lr" else "TEA"
            fix = f"set {lr} > 0" + (f" or a {budget}" if budget else "")
            problems.append(
                f"--{lr} {settings[lr]!r}: {mode} learns the {which} policy, but a learning rate of 0"
                + (f" with no {budget}" if budget else "")
                + f" never changes it; {fix} (to keep a policy as it is: {which.lower()}_mode heuristic or fixed)"
            )
    z, k = settings.get("num_tea_copies"), settings.get("tra_counterfactuals")
    tea_learned = bool(tea and (tea.joint or tea.posthoc))
    if tea_learned and settings.get("tea_estimator") == "paired" and valid("num_tea_copies") and z > len(TEA_OPS) - 1:
        problems.append(
            f"--num_tea_copies {z!r}: the paired TEA estimator (tea_estimator paired) scores each copy with another "
            f"non-identity op: at most {len(TEA_OPS) - 1}"
        )
    background = settings.get("tea_background_patches")
    if tea_learned and valid("tea_background_patches") and background and settings.get("tea_op_score") == "ensemble":
        problems.append(
            f"--tea_background_patches {background!r}: tea_op_score 'ensemble' scores each op on one patch; give 0 "
            "or another tea_op_score"
        )
    if tra and tra.learned and settings.get("tra_estimator") == "paired" and valid("tra_counterfactuals") and k == 0:
        problems.append(
            f"--tra_counterfactuals {k!r}: the paired TRA estimator (tra_estimator paired) of tra_mode {tra.name!r} "
            "needs at least 1 counterfactual copy per training patch"
        )
    paired_tra = tra and tra.learned and settings.get("tra_estimator") == "paired"
    if paired_tra and settings.get("tra_exploration") == "uniform" and valid("tra_counterfactuals") and k % 2:
        problems.append(
            f"--tra_counterfactuals {k!r}: tra_exploration 'uniform' makes the counterfactual copies in pairs: "
            "give an even number"
        )
    step = settings.get("tra_step", "adam")
    natural = valid("tra_step") and POLICY_STEPS.get(step).natural  # steps on the paired estimator's op effects
    if tra and tra.learned and natural and settings.get("tra_estimator") == "gumbel":
        problems.append(
            f"--tra_step {step!r}: steps on the op effects of the paired TRA estimator, but tra_estimator is "
            "'gumbel'; use tra_estimator paired, or tra_step adam"
        )
    weight = settings.get("tea_identity_weight")
    if weight is not None and valid("tea_identity_weight") and valid("tea_z") and settings["tea_z"] < 2:
        problems.append(
            f"--tea_z {settings['tea_z']!r}: with a tea_identity_weight ({weight!r}) the learned TTA holds the "
            "identity and at least one op: tea_z must be >= 2"
        )
    preset, catalogue = settings.get("tra_preset"), settings.get("tra_catalogue", "spec")
    catalogue_ok = "tra_catalogue" not in settings or valid("tra_catalogue")  # not given: the setup's default
    if isinstance(preset, Mapping) and valid("tra_preset") and catalogue_ok:
        reason = _tra_preset_problem(preset, catalogue)
        if reason:
            problems.append(f"--tra_preset {preset!r}: {reason} (in the tra_catalogue {catalogue!r})")
    for which, mode in (("tra", tra), ("tea", tea)):
        problems += _policy_file_problems(which, mode, settings, valid)
    if valid("keep_largest_component") and valid("num_classes"):  # 'task': the TaskSpec checks its own classes
        from jcsaug.evaluation.metrics import component_classes

        try:  # 'validation': chosen after training among the foreground classes (check_data: the split has cases)
            if not chooses_on_validation(settings["keep_largest_component"]):
                component_classes(settings["keep_largest_component"], settings["num_classes"], task_classes=())
        except ValueError as err:
            problems.append(f"--{err}")
    return problems


@_reported
def check_settings(argv: Sequence[str] | None = None, **settings: Any) -> None:
    """Check the values of a bundle's settings (id -> value; ids without a rule are not checked), the values that
    do not go together (e.g. ``tra_lr`` 0 for a learned TRA policy with no ``tra_logit_budget``) and, when the
    process is ``python -m monai.bundle run``, the override ids of its command line (:func:`check_override_ids`).
    A bundle passes every setting it has a rule for (tests/test_bundle_hardening.py checks it).

    Raises:
        PreflightError: one line per bad value, ``--id value: what it must be``.
    """
    check_override_ids(argv)
    rules = _validators()
    problems, bad = [], set()
    for key, value in settings.items():
        rule = rules.get(key)
        reason = rule(value) if rule is not None else None
        if reason:
            problems.append(f"--{key} {value!r}: {reason}")
            bad.add(key)
    problems += _relation_problems(settings, lambda key: key in settings and key not in bad)
    if problems:
        raise PreflightError("bad settings:\n  " + "\n  ".join(problems))


# ----------------------------------------------------------------------------------------------- override ids
def _command_line_ids(argv: Sequence[str]) -> tuple[list[str], list[str], Any] | None:
    """``(ids given as --id, config files, the --tracking value)`` of a ``monai.bundle run`` command line, else
    ``None``."""
    if len(argv) < 2 or not Path(argv[0]).parent.match("monai/bundle") or argv[1] not in ("run", "run_workflow"):
        return None
    ids, values = [], {}
    for i, token in enumerate(argv[2:], 2):
        if token.startswith("--") and len(token) > 2:
            key, eq, value = token[2:].partition("=")
            ids.append(key)
            values[key] = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
    config, tracking = values.get("config_file", ""), values.get("tracking")
    args_file = values.get("args_file")
    if args_file:
        from monai.bundle import ConfigParser

        extra = ConfigParser.load_config_file(args_file)
        ids += list(extra)
        config = config or extra.get("config_file", "")
        tracking = tracking or extra.get("tracking")
    if isinstance(config, str) and config.strip().startswith("["):
        config = ast.literal_eval(config.strip())
    files = [config] if isinstance(config, str) else list(config)
    return ids, [str(f) for f in files if f], tracking


def _tracking_ids(tracking: Any) -> set[str]:
    """The ids MONAI's experiment tracking (``--tracking mlflow``, or a settings file or mapping) adds to the config
    when missing, as ``ConfigWorkflow.patch_bundle_tracking`` does: the command line may set them
    (``--tracking_uri``, ``--experiment_name``, ``--run_name``, ...)."""
    if not tracking:
        return set()
    from monai.bundle import ConfigParser
    from monai.bundle.utils import DEFAULT_EXP_MGMT_SETTINGS

    if isinstance(tracking, str) and tracking in DEFAULT_EXP_MGMT_SETTINGS:
        settings = DEFAULT_EXP_MGMT_SETTINGS[tracking]
    elif isinstance(tracking, dict):
        settings = tracking
    else:  # a settings file, read as MONAI reads it (it has read it already: a missing one failed before this)
        settings = ConfigParser.load_config_files(tracking)
    return set(settings.get("configs", {})) - set(settings.get("handlers_id", {}))


def check_override_ids(argv: Sequence[str] | None = None) -> None:
    """Refuse override ids that the bundle does not have (``--max_epoch 3`` would silently add a new id).

    Compares the ``--id`` of a ``python -m monai.bundle run`` command line (and of its ``--args_file``) with the
    top-level ids of its config files (a ``#`` path is checked by its first part) and, with ``--tracking``, the ids
    that MONAI's tracking settings add. Anything else (a Python caller, ``torchrun``-less tests) is not checked.
    """
    found = _command_line_ids(list(sys.argv if argv is None else argv))
    if found is None:
        return
    ids, files, tracking = found
    if not files:
        return
    from monai.bundle import ConfigParser

    config = ConfigParser.load_config_files(files)
    known = set(config) | _RUN_ARGUMENTS | _tracking_ids(tracking)
    unknown = sorted({i for i in ids if _base_id(i) not in known})
    if unknown:
        lines = []
        for name in unknown:
            close = difflib.get_close_matches(_base_id(name), sorted(known), n=3, cutoff=0.6)
            hint = f" (did you mean {' or '.join('--' + c for c in close)}?)" if close else ""
            lines.append(f"--{name}{hint}")
        settings = sorted(k for k, v in config.items() if _is_setting(v) and not k.startswith("_"))
        raise PreflightError(
            f"unknown override id(s) {', '.join(lines)}: not an id of {', '.join(files)}. Its settings: "
            f"{', '.join(settings)} (and {len(config) - len(settings)} ids of components and expressions)"
        )


def _base_id(override: str) -> str:
    """The top-level id of an override (``network_def#channels`` -> ``network_def``; fire allows ``-`` for ``_``)."""
    return override.split("#")[0].replace("-", "_")


def _is_setting(value: Any) -> bool:
    """A plain value a user sets (a number, a word, a list of them), not a component or an expression."""
    if isinstance(value, str):
        return not value.startswith(("$", "@", "%"))
    if isinstance(value, list):
        return all(_is_setting(v) for v in value)
    return not isinstance(value, dict)


# ----------------------------------------------------------------------------------------------- output folder
def _artefacts(output_dir: Path) -> list[Path]:
    return sorted({p for pattern in RUN_ARTEFACTS for p in output_dir.glob(pattern)})


@_reported
def check_output_dir(
    output_dir: str | Path,
    resume: bool | str = False,
    overwrite: bool | str = False,
    max_epochs: int | None = None,
    epoch_length: int | None = None,
    settings: Mapping[str, Any] | None = None,
    inputs: Sequence[str | Path | None] = (),
) -> None:
    """A training run's ``output_dir`` must not hold another run, unless it is resumed or replaced.

    * nothing of a run in it (:data:`RUN_ARTEFACTS`; other files are left alone): fine;
    * ``resume``: ``resume.pt`` must be there, saved with the same ``max_epochs``/``epoch_length`` and run
      ``settings`` (e.g. seed, modes, update intervals; :func:`check_resume_matches`);
    * ``overwrite``: the previous run's files and folders (:data:`RUN_ARTEFACTS` only) are deleted, by rank 0 —
      unless one of them is among ``inputs``, files the new run reads (its ``tra_policy`` / ``tea_policy``): refused;
    * otherwise a :class:`PreflightError` saying which files are there and how to go on.
    """
    output_dir = Path(output_dir)
    resume, overwrite = as_flag(resume), as_flag(overwrite)
    if resume and overwrite:
        raise PreflightError("--resume true and --overwrite true contradict each other: choose one")
    if output_dir.exists() and not output_dir.is_dir():
        raise PreflightError(f"output_dir {output_dir} exists and is not a folder")
    found = _artefacts(output_dir) if output_dir.is_dir() else []
    if resume:
        path = output_dir / RESUME_FILE
        if not path.is_file():
            raise PreflightError(f"--resume true but {path} does not exist (no finished epoch to resume)")
        from jcsaug.engine.checkpoints import read_checkpoint

        try:
            check_resume_matches(read_checkpoint(path), path, max_epochs, epoch_length, settings=settings)
        except ValueError as err:
            raise PreflightError(str(err)) from None
        return
    if not found:
        return
    names = ", ".join(p.name for p in found[:6]) + (", ..." if len(found) > 6 else "")
    if not overwrite:
        raise PreflightError(
            f"{output_dir} holds another run ({names}): pass --resume true to continue it, --overwrite true to "
            "replace it (its checkpoints, policies, history, metrics and TensorBoard logs are deleted), or choose "
            "another --output_dir"
        )
    doomed = [p.resolve() for p in found]
    for given in inputs:
        path = None if given is None else Path(given).resolve()
        if path is not None and any(path == d or d in path.parents for d in doomed):
            raise PreflightError(
                f"--overwrite true would delete {given}, which this run reads (a policy file in the run folder it "
                f"replaces): copy it out of {output_dir} and give the copy"
            )
    if idist.get_rank() == 0:
        for path in found:
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        logger.info("--overwrite true: deleted the previous run's %s in %s", names, output_dir)


# ----------------------------------------------------------------------------------------------- data
def needs_validation(tra_mode: str, tea_mode: str) -> bool:
    """Whether these modes learn from the validation split (a learned TRA mode, a joint or post-hoc TEA mode)."""
    from jcsaug.engine.modes import get_tea_mode, get_tra_mode

    tea = get_tea_mode(tea_mode)
    return get_tra_mode(tra_mode).learned or tea.joint or tea.posthoc


def _header(path: Path) -> tuple[tuple[int, ...], np.ndarray] | None:
    """``(shape, affine)`` of a NIfTI file from its header only; ``None`` for other formats."""
    if not path.name.endswith((".nii", ".nii.gz")):
        return None
    import nibabel as nib

    image = nib.load(str(path))
    return tuple(int(s) for s in image.shape), np.asarray(image.affine, dtype=np.float64)


def _case_problems(
    entry: Any, keys: Sequence[str], required: Sequence[str], image_channels: int | None, spatial_dims: int
) -> tuple[str, list[str]]:
    if not isinstance(entry, Mapping):
        return repr(entry)[:80], [f"an entry of the datalist is a {type(entry).__name__}, not a dict of files"]
    name = str(entry.get(keys[0], entry))
    problems = [f"no {k!r} entry" for k in required if k not in entry]
    shapes, affines, channels = {}, {}, {}
    for key in keys:
        if key not in entry:
            continue
        path = Path(str(entry[key]))
        if not path.is_file():
            problems.append(f"{key} file {path} does not exist")
            continue
        try:
            header = _header(path)
        except Exception as err:  # noqa: BLE001 - nibabel raises many types for a broken header
            problems.append(f"cannot read the {key} header of {path}: {type(err).__name__}: {err}")
            continue
        if header is None:
            continue
        shape, affine = header
        extra = shape[spatial_dims:]
        channels[key] = int(np.prod(extra)) if extra else 1
        shapes[key], affines[key] = shape[:spatial_dims], affine
    if not problems and shapes and keys[0] in shapes:
        problems = pair_problems(shapes, affines, channels, keys[0], spatial_dims, image_channels)
    return name, problems


@_reported
def check_data(
    splits: Mapping[str, Sequence[Any]],
    tra_mode: str | None = None,
    tea_mode: str | None = None,
    keys: Sequence[str] = ("image", "label"),
    require: Sequence[str] | None = None,
    image_channels: int | None = 1,
    spatial_dims: int = 3,
    keep_largest_component: Any = False,
) -> None:
    """Check every case of every split before the first iteration.

    Args:
        splits: split name -> datalist entries (``{"image": path, "label": path, ...}``), e.g.
            ``{"training": ..., "validation": ..., "test": ...}``. Every split other than ``validation`` must
            have cases; ``validation`` may be empty (a warning if ``tra_mode``/``tea_mode`` learn from it).
        tra_mode, tea_mode: the run's modes (see :func:`needs_validation`).
        keys: the file keys of an entry; the first is the image.
        require: the keys every entry must have (default: all ``keys``).
        image_channels, spatial_dims: see :func:`jcsaug.data.checks.pair_problems` (NIfTI headers).
        keep_largest_component: the run's setting; ``"validation"`` chooses the post-processed classes on the
            validation cases after training, so then the validation split must have cases.

    Raises:
        PreflightError: every failing case of every split (up to 20 listed), each with what is wrong.
    """
    require = tuple(keys) if require is None else tuple(require)
    problems = []
    for split, entries in splits.items():
        entries = list(entries or [])
        if not entries:
            if split == "validation" and chooses_on_validation(keep_largest_component):
                problems.append(
                    "split 'validation' is empty: keep_largest_component 'validation' chooses the post-processed "
                    "classes on its cases (give the classes instead, e.g. [1], or true / false)"
                )
            elif split != "validation":
                problems.append(f"split {split!r} is empty: nothing to {'train on' if split == 'training' else 'use'}")
            elif tra_mode is not None and tea_mode is not None and needs_validation(tra_mode, tea_mode):
                warnings.warn(
                    f"the validation split is empty: every policy update of tra_mode {tra_mode!r} / tea_mode "
                    f"{tea_mode!r} is skipped and the policies keep their initial presets",
                    stacklevel=2,
                )
            continue
        for entry in entries:
            name, found = _case_problems(entry, keys, require, image_channels, spatial_dims)
            problems += [f"{split}: case {name}: {p}" for p in found]
    if problems:
        listed = problems[:_MAX_LISTED]
        more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        raise PreflightError(
            f"{len(problems)} problem(s) in the data, found before the run:\n  " + "\n  ".join(listed) + more
        )


@_reported
def check_evaluation_data(split: str, splits: Mapping[str, Sequence[Any]], **kwargs: Any) -> None:
    """evaluate.yaml's check: ``split`` (its ``evaluate_split``) names a split of ``splits`` that has cases, and
    every case of it passes :func:`check_data` (``kwargs`` go to it).

    Raises:
        PreflightError: an unknown or empty split, or what :func:`check_data` finds in its cases.
    """
    try:
        entries = evaluation_split(split, splits)
    except ValueError as err:
        raise PreflightError(str(err)) from None
    check_data({split: entries}, **kwargs)


# ----------------------------------------------------------------------------------------------- patch size
def _in_channels(net: nn.Module) -> int:
    channels = getattr(net, "in_channels", None)
    if isinstance(channels, int):
        return channels
    for p in net.parameters():
        if p.ndim >= 3:
            return int(p.shape[1])
    return 1


def _meta_copy(net: nn.Module) -> nn.Module:
    """A copy of ``net`` whose parameters and buffers live on the meta device (shapes only; the network itself is
    not touched: ``torch.func.functional_call`` can leave swapped tensors in modules reachable by two paths)."""
    memo: dict[int, Any] = {}
    for param in net.parameters():
        memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
    for buffer in net.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(net, memo)


def _meta_output_shape(net: nn.Module, size: Sequence[int], in_channels: int) -> tuple[int, ...]:
    from jcsaug.engine.losses import main_output

    meta = _meta_copy(net).eval()  # deep-supervision networks return their main head only
    with torch.no_grad():
        out = meta(torch.empty((1, in_channels, *size), device="meta"))
    return tuple(main_output(out).shape[2:])


@_reported
def check_patch_size(
    network: nn.Module,
    patch_size: int | Sequence[int],
    in_channels: int | None = None,
    sizes: Callable[[nn.Module, Sequence[int]], tuple[Sequence[int], Sequence[int]]] | None = None,
    name: str = "patch_size",
) -> None:
    """Refuse a patch size whose logits do not cover the patch (e.g. a U-Net's strides do not divide it).

    A forward pass on the meta device (shapes only, no memory, no compute) of a copy of the built ``network``
    (DDP-wrapped or not). ``sizes(network, patch) -> (input_size, output_size)`` says which input the patch means and
    which region its logits must cover (the network registry's :meth:`jcsaug.networks.NetworkSpec.sizes`: DeepMedic's
    logits cover its output region); ``None`` = input and output are the patch. The error names the setting
    (``name``: ``patch_size``, ``tea_patch_size``), the sizes and a size that fits.
    """
    net = getattr(network, "module", network)
    if not isinstance(net, nn.Module):
        raise PreflightError(f"network is {net!r}, not a network module")
    reason = _patch_size(patch_size)
    if reason:
        raise PreflightError(f"--{name} {patch_size!r}: {reason}")
    channels = _in_channels(net) if in_channels is None else int(in_channels)

    def fits(patch: Sequence[int]) -> tuple[bool, str]:
        input_size, output_size = (patch, patch) if sizes is None else sizes(net, patch)
        try:
            got = _meta_output_shape(net, input_size, channels)
        except Exception as err:  # noqa: BLE001 - any refusal of the network is the answer
            return False, f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"
        return got == tuple(int(o) for o in output_size), f"logits {list(got)} for a patch of {list(input_size)}"

    patch = [int(patch_size)] * 3 if isinstance(patch_size, numbers.Integral) else [int(p) for p in patch_size]
    ok, what = fits(patch)
    if ok:
        return
    hint = ""
    for k in (2, 4, 8, 16, 32, 64):
        candidate = [-(-p // k) * k for p in patch]
        if fits(candidate)[0]:
            hint = f"; e.g. {candidate} fits"
            break
    raise PreflightError(f"--{name} {patch_size!r} does not fit the {type(net).__name__} ({what}){hint}")
