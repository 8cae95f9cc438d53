"""Augmentation modes selectable without code (bundle overrides ``tra_mode`` / ``tea_mode``).

TRA modes: ``none`` (identity only), ``heuristic`` (fixed preset), ``randaugment-s/m/l`` (fixed),
``fixed`` (a learned ``policies.json`` reused unchanged: learn once, reuse), ``learned`` (one policy for all
patches) and ``class-specific`` (one policy per class group).
TEA modes: ``none`` (no TTA at test time), ``heuristic`` (nnU-Net mirroring), ``learned-posthoc`` (a TEA
policy learned on the frozen model after training) and ``joint`` (learned together with TRA during
training). Both are registries (``register_tra_mode`` / ``get_tra_mode`` / ``list_tra_modes``, the same for TEA).

A run's augmentation is built in three separate steps, each from the previous one's result:

1. :class:`AugmentationSetup` (the mode names) -> the TRA and TEA policies;
2. :meth:`AugmentationSetup.updaters` (model, optimiser, validation data) -> :class:`PolicyUpdaters`, the Ignite
   handlers that learn the policies together with what a checkpoint must hold;
3. after training, :meth:`AugmentationSetup.test_tea_policy` -> the TEA policy to test with (learned now on
   the frozen network in ``learned-posthoc`` mode), and :attr:`AugmentationSetup.test_methods`, the names of
   the test-time inferers to evaluate (:func:`jcsaug.inference.make_tta_inferers`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from ignite.engine import Engine
from monai.inferers import Inferer
from torch import nn

from jcsaug.engine.posthoc import learn_tea_posthoc
from jcsaug.engine.tea_updater import TEA_ESTIMATORS, TEA_OP_SCORES, TEAPolicyUpdater
from jcsaug.engine.tra_updater import TRA_ESTIMATORS, TRAPolicyUpdater
from jcsaug.inference.tta import IdentityWeight
from jcsaug.policy.categorical import CategoricalPolicy
from jcsaug.policy.factory import make_tea_policy, make_tra_policy
from jcsaug.policy.io import load_policies
from jcsaug.registry import Registry
from jcsaug.utils import as_share

__all__ = [
    "TEA_MODES",
    "TRA_MODES",
    "AugmentationSetup",
    "PolicyUpdaters",
    "TEAMode",
    "TRAMode",
    "get_tea_mode",
    "get_tra_mode",
    "initial_tea_policy",
    "list_tea_modes",
    "list_tra_modes",
    "register_tea_mode",
    "register_tra_mode",
]


@dataclass(frozen=True)
class TRAMode:
    """What a ``tra_mode`` name means.

    Args:
        name: the mode's name.
        preset: the fixed preset the mode always uses (a name, or a mapping: ``{}`` = identity only); ``None``
            = the run's ``tra_preset``.
        learned: the policy is learned during training (a :class:`TRAPolicyUpdater`).
        class_specific: one policy per class group (else one for all patches).
        from_file: the policy is the TRA policy of a ``policies.json`` (the setup's ``tra_policy_file``), used
            unchanged (any number of groups).
    """

    name: str
    preset: str | Mapping | None = None
    learned: bool = False
    class_specific: bool = False
    from_file: bool = False


@dataclass(frozen=True)
class TEAMode:
    """What a ``tea_mode`` name means.

    Args:
        name: the mode's name.
        test_method: the test-time method evaluated besides ``none`` (a :func:`jcsaug.inference.list_tta_inferers`
            name), or ``None``.
        joint: the TEA policy is learned during training (a :class:`TEAPolicyUpdater`), jointly with TRA.
        posthoc: the TEA policy is learned after training, on the frozen network.
        from_file: the policy is the TEA policy of a ``policies.json`` (the setup's ``tea_policy_file``), tested
            with unchanged (never learned).
    """

    name: str
    test_method: str | None = None
    joint: bool = False
    posthoc: bool = False
    from_file: bool = False


TRA_MODES: Registry[TRAMode] = Registry("tra_mode")
TEA_MODES: Registry[TEAMode] = Registry("tea_mode")


#: ``register_tra_mode(TRAMode(...))``, ``get_tra_mode(name)``, ``list_tra_modes()``; the same for TEA modes
register_tra_mode, get_tra_mode, list_tra_modes = TRA_MODES.register, TRA_MODES.get, TRA_MODES.names
register_tea_mode, get_tea_mode, list_tea_modes = TEA_MODES.register, TEA_MODES.get, TEA_MODES.names


for _tra in (
    TRAMode("none", preset={}),
    TRAMode("heuristic"),
    TRAMode("randaugment-s", preset="randaugment-s"),
    TRAMode("randaugment-m", preset="randaugment-m"),
    TRAMode("randaugment-l", preset="randaugment-l"),
    TRAMode("fixed", from_file=True),
    TRAMode("learned", learned=True),
    TRAMode("class-specific", learned=True, class_specific=True),
):
    register_tra_mode(_tra)
for _tea in (
    TEAMode("none"),
    TEAMode("heuristic", test_method="heuristic"),
    TEAMode("learned-posthoc", test_method="learned", posthoc=True),
    TEAMode("joint", test_method="learned", joint=True),
    TEAMode("fixed", test_method="learned", from_file=True),
):
    register_tea_mode(_tea)


def key_test_method(tea_mode: str, methods: Iterable[str]) -> str:
    """The test-time method a run of ``tea_mode`` is judged by among the evaluated ``methods`` (an evaluation's key
    metric): the mode's ``test_method`` (``none`` for ``tea_mode: none``), or ``none`` when that method is not
    evaluated (e.g. a run whose ``policies.json`` holds no TEA policy)."""
    method = get_tea_mode(tea_mode).test_method or "none"
    return method if method in list(methods) else "none"


def initial_tea_policy(tea_mode: str, tea_preset: str = "nnunet") -> CategoricalPolicy | None:
    """The TEA policy a run of ``tea_mode`` starts from when it learns its TEA during training (``joint``: the
    ``tea_preset``), else ``None``: what an evaluation built before the run writes its ``policies.json`` (MONAI FL's
    client) tests as ``learned`` until then (:class:`jcsaug.inference.TEAPolicyFile`)."""
    return make_tea_policy(tea_preset) if get_tea_mode(tea_mode).joint else None


class PolicyUpdaters(list):
    """The Ignite handlers that learn a run's policies (a list, possibly empty), and what checkpoints must hold.

    Built in one step by :meth:`AugmentationSetup.updaters`, so :meth:`checkpoint_items` is right whatever order
    the handlers are attached or resolved in.
    ``tea_tested``: without a TEA updater, whether the TEA policy is tested with as it is (read from a file), so
    checkpoints hold it.
    """

    def __init__(
        self,
        tra_policy: CategoricalPolicy,
        tea_policy: CategoricalPolicy,
        tra: TRAPolicyUpdater | None = None,
        tea: TEAPolicyUpdater | None = None,
        tea_tested: bool = True,
    ) -> None:
        super().__init__(u for u in (tra, tea) if u is not None)
        self.tra, self.tea = tra, tea
        self.tra_policy, self.tea_policy = tra_policy, tea_policy
        self.tea_tested = tea_tested

    def attach(self, engine: Engine) -> None:
        for updater in self:
            updater.attach(engine)

    def checkpoint_items(self) -> dict:
        """What a ``CheckpointSaver``/``ResumeCheckpoint`` must hold: each updater (its policy, optimiser and random
        stream), or the policy itself where nothing learns it. A TEA policy the run neither learns during training
        nor tests with as it is (``none``, ``heuristic``, ``learned-posthoc``: only its untrained preset exists
        while training) is left out, so that a checkpoint never offers a preset as a TEA policy to test with
        (:func:`jcsaug.inference.load_tea_policy`)."""
        items = {"tra_updater" if self.tra else "tra_policy": self.tra or self.tra_policy}
        if self.tea or self.tea_tested:
            items["tea_updater" if self.tea else "tea_policy"] = self.tea or self.tea_policy
        return items

    def counts(self) -> dict[str, dict]:
        """Per updater (``TRA``, ``TEA``): updates done, updates skipped, and how often each skip reason occurred."""
        return {
            u.name: {"updates": u.updates, "skipped": u.skipped, "skip_reasons": dict(u.skip_reasons)} for u in self
        }


def policy_from_file(path: str | Path | None, which: str, mode: str) -> CategoricalPolicy:
    """The ``which`` (``"tra"`` / ``"tea"``) policy of the ``policies.json`` at ``path``, never learned, for the
    mode ``mode`` (named in the errors: no ``path``, a file without that policy, or what :func:`load_policies`
    refuses). The one reader of a fixed mode's file, for :class:`AugmentationSetup` and the preflight checks."""
    mode = f"{which}_mode {mode!r}"
    if not path:
        raise ValueError(f"{mode} needs the policies.json to reuse: set {which}_policy (a file path)")
    policy = load_policies(path)[0 if which == "tra" else 1]
    if policy is None:
        raise ValueError(f"{path} holds no {which.upper()} policy ({mode})")
    policy.logits.requires_grad_(False)  # never learned
    return policy


class AugmentationSetup:
    """The policies of one run, from its mode names (step 1 of 3, see the module docstring).

    Args:
        tra_mode: one of :func:`list_tra_modes`.
        tea_mode: one of :func:`list_tea_modes`.
        tra_preset: initial TRA probabilities of the modes without a fixed preset.
        tra_catalogue: the TRA ops of a new policy, a name of :data:`jcsaug.ops.tra.TRA_CATALOGUES`: ``spec``
            (SPEC §2: a signed op draws its sign) or ``split-signs`` (its two signs are two ops, which the learned
            policy weighs apart). A ``fixed`` policy's file says its own.
        tea_preset: initial TEA probabilities.
        num_groups: class groups of a class-specific policy (2 = background/foreground).
        tra_policy_file: the ``policies.json`` whose TRA policy the ``fixed`` mode uses (any number of groups).
        tea_policy_file: the ``policies.json`` whose TEA policy ``tea_mode`` ``fixed`` tests with.
        tra_estimator: ``"gumbel"`` (the paper's) or ``"paired"`` (see :class:`TRAPolicyUpdater`).
        tra_counterfactuals: counterfactual copies per training patch for the ``"paired"`` estimator; read
            :attr:`counterfactuals` for the pipeline's ``TRACascaded``.
        tea_estimator: ``"gumbel"`` or ``"paired"`` (see :class:`TEAPolicyUpdater`).
        tea_op_score: a name of :data:`jcsaug.engine.tea_updater.TEA_OP_SCORES` (see :class:`TEAPolicyUpdater`'s
            ``op_score``).
        tea_z, tea_identity_weight: the learned TTA's size and identity weight (as the bundles' test inferers
            take them), which the TEA op score ``ensemble`` rates ops for (:class:`TEAPolicyUpdater`'s ``tta_z``,
            ``tta_identity_weight``).
        tea_mask_out_of_view: the TEA scores each copy on the voxels its op kept in view only, as the reference
            does (:class:`TEAPolicyUpdater`'s ``mask_out_of_view``); also for ``learned-posthoc``.
        tea_background_patches: background-centred patches pooled with each foreground-centred one in the TEA's op
            scores (:class:`TEAPolicyUpdater`'s ``background_patches``); also for ``learned-posthoc``.
    """

    def __init__(
        self,
        tra_mode: str = "class-specific",
        tea_mode: str = "joint",
        tra_preset: str | dict = "nnunet",
        tea_preset: str = "nnunet",
        num_groups: int = 2,
        tra_policy_file: str | Path | None = None,
        tra_estimator: str = "gumbel",
        tra_counterfactuals: int = 2,
        tea_estimator: str = "gumbel",
        tea_policy_file: str | Path | None = None,
        tea_op_score: str = "alone",
        tea_z: int = 8,
        tea_identity_weight: IdentityWeight = None,
        tra_catalogue: str = "spec",
        tea_mask_out_of_view: bool = False,
        tea_background_patches: int = 0,
    ) -> None:
        self.tra, self.tea = get_tra_mode(tra_mode), get_tea_mode(tea_mode)
        self.tra_mode, self.tea_mode = self.tra.name, self.tea.name
        # unknown names: an error listing the valid ones, before anything is built
        self.tra_estimator, self.tea_estimator = TRA_ESTIMATORS.key(tra_estimator), TEA_ESTIMATORS.key(tea_estimator)
        self.tea_op_score = TEA_OP_SCORES.key(tea_op_score)
        self.tea_z, self.tea_identity_weight = int(tea_z), tea_identity_weight
        self.tea_mask_out_of_view = bool(tea_mask_out_of_view)
        self.tea_background_patches = int(tea_background_patches)
        if self.tea_background_patches < 0:
            raise ValueError(f"tea_background_patches must be >= 0, got {tea_background_patches}")
        self.tra_counterfactuals = int(tra_counterfactuals)
        if self.tra_estimator == "paired" and self.tra.learned and self.tra_counterfactuals < 1:
            raise ValueError(f"tra_counterfactuals={tra_counterfactuals}: the paired TRA estimator needs at least 1")
        if self.tra.from_file:
            self.tra_policy = policy_from_file(tra_policy_file, "tra", self.tra_mode)
        else:
            preset = tra_preset if self.tra.preset is None else self.tra.preset
            self.tra_policy = make_tra_policy(
                preset, num_groups=num_groups if self.tra.class_specific else 1, catalogue=tra_catalogue
            )
        if self.tea.from_file:
            self.tea_policy = policy_from_file(tea_policy_file, "tea", self.tea_mode)
        else:
            self.tea_policy = make_tea_policy(tea_preset)
        #: copies of the policies as built, before any learning: what the run's changes are measured against
        self.initial_policies = (copy.deepcopy(self.tra_policy), copy.deepcopy(self.tea_policy))
        self._posthoc_learned = False

    @property
    def counterfactuals(self) -> int:
        """Counterfactual copies the training pipeline's ``TRACascaded`` must make (0 unless paired TRA learning)."""
        return self.tra_counterfactuals if self.learn_tra and self.tra_estimator == "paired" else 0

    @property
    def learn_tra(self) -> bool:
        return self.tra.learned

    @property
    def learn_tea(self) -> bool:
        """Whether the TEA policy is learned during training (joint mode)."""
        return self.tea.joint

    @property
    def tests_learned_tea(self) -> bool:
        """Whether the run is tested with a learned TEA policy (joint, post hoc, or one read from a file)."""
        return self.tea.joint or self.tea.posthoc or self.tea.from_file

    @property
    def test_methods(self) -> list[str]:
        """The test-time methods a run of this mode is evaluated with: ``none`` and the TEA mode's method."""
        return ["none"] + ([self.tea.test_method] if self.tea.test_method else [])

    def updaters(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        val_loader: Iterable | None,
        tra_lr: float = 1e-3,
        tea_lr: float = 5e-5,
        tra_update_every: int = 1,
        tea_update_every: int = 1,
        train_loss: str = "ce+dice",
        val_loss: str = "dice",
        num_copies: int = 10,
        hypergradient: str = "finite-difference",
        seed: int = 0,
        val_batches: int = 1,
        val_average: float = 1.0,
        tra_logit_budget: float | None = None,
        tea_logit_budget: float | None = None,
        tea_patches: int = 1,
        tra_lookahead: float = 1,
        tea_val_loader: Iterable | None = None,
        tea_poly_power: float = 0.9,
        tra_direction: str = "validation",
        tra_poly_power: float = 0.9,
        tra_start: float = 0.0,
        tra_val_tea: bool | float = True,
        tea_inferer: Inferer | None = None,
        tra_step: str = "adam",
        tra_meta_mode: str = "eval",
        planned_epochs: int | None = None,
        tra_pull: float = 0.0,
    ) -> PolicyUpdaters:
        """Step 2: the handlers that learn the policies of this mode (possibly none), with their checkpoint items.

        ``tra_logit_budget`` / ``tea_logit_budget`` (when not ``None``) replace ``tra_lr`` / ``tea_lr`` by a
        learning rate derived from the run's length (see :class:`~jcsaug.engine.base.PolicyUpdater`);
        ``tra_lookahead`` is the TRA updater's ``lookahead`` horizon (1: one step), ``tra_direction`` its
        ``direction`` (what the samples' gradients are scored against). ``tea_val_loader``: the
        validation patches the TEA updater scores its ops on (default ``val_loader``); patches larger than the
        training patches (whole volumes where they fit) score the ops closer to how they act at test time, on the
        whole image: an intensity op rescales by the image's range, a spatial op has fewer patch borders.
        ``tea_poly_power``: the TEA updater's ``poly_power`` (0: a constant gamma, so the last updates, made with the
        network the policy is tested with, move the logits as much as the first); ``tra_poly_power`` the TRA
        updater's (0.9: beta decays like the network's learning rate, as in the paper); ``tra_start`` its
        ``start`` (the share of the run before its first update: a warm-up). ``tra_val_tea`` (joint mode): the
        TRA's validation batch is transformed by ops of the current TEA policy, as in the paper (SPEC §5); ``False``
        scores the TRA on the validation batch as it is, a number in ``(0, 1)`` transforms that share of its samples
        on average (research, measured in ``benchmarks/README.md``).
        ``tea_inferer``: how the TEA updater predicts its copies (``None``: one pass of the network; the test's
        ``SlidingWindowInferer``: as the TTA predicts, for patches larger than the training patches).
        ``tra_step``: the TRA updater's ``step_rule``, a name of :data:`~jcsaug.engine.base.POLICY_STEPS` (``"adam"``;
        ``"natural"``: ops move in proportion to their effects; ``"natural-recent"``: the same with the effects of
        the last ~50 updates weighing most; ``"natural-unbiased"``, the synthetic bundle's default: the same without
        the drift that noisy effects give the rare ops; see :class:`~jcsaug.engine.base.PolicyUpdater`).
        ``tra_meta_mode``: the TRA updater's ``meta_mode`` (``"eval"``; ``"train"``: its extra passes in training
        mode, as the reference's code runs them: a U-Net's deep-supervision heads, BatchNorm's batch statistics).
        ``planned_epochs``: the epochs both updaters plan their learning rates over (None: the trainer's
        ``max_epochs``; see :class:`~jcsaug.engine.base.PolicyUpdater`). ``tra_pull``: the TRA updater's ``pull``
        (e-folds over the run by which its logits fade back to the preset; 0: none)."""
        tra = tea = None
        val_tea_share = as_share(tra_val_tea)
        if self.learn_tra:
            tra = TRAPolicyUpdater(
                self.tra_policy, model, val_loader, optimizer, lr=tra_lr, update_every=tra_update_every,
                train_loss=train_loss, val_loss=val_loss, hypergradient=hypergradient,
                tea_policy=self.tea_policy if self.learn_tea and val_tea_share > 0 else None,
                tea_share=val_tea_share or 1.0, seed=seed,
                estimator=self.tra_estimator,
                val_batches=val_batches, val_average=val_average, logit_budget=tra_logit_budget,
                lookahead=tra_lookahead, direction=tra_direction, poly_power=tra_poly_power,
                start=tra_start, step_rule=tra_step, meta_mode=tra_meta_mode, planned_epochs=planned_epochs,
                pull=tra_pull,
            )  # fmt: skip
        if self.learn_tea:
            tea = TEAPolicyUpdater(
                self.tea_policy, model, val_loader if tea_val_loader is None else tea_val_loader, lr=tea_lr,
                update_every=tea_update_every, num_copies=num_copies, seed=seed, estimator=self.tea_estimator,
                logit_budget=tea_logit_budget, patches=tea_patches, poly_power=tea_poly_power,
                op_score=self.tea_op_score, tta_z=self.tea_z, tta_identity_weight=self.tea_identity_weight,
                inferer=tea_inferer, mask_out_of_view=self.tea_mask_out_of_view,
                background_patches=self.tea_background_patches, planned_epochs=planned_epochs,
            )  # fmt: skip
        return PolicyUpdaters(self.tra_policy, self.tea_policy, tra, tea, tea_tested=self.tea.from_file)

    def test_tea_policy(
        self,
        network: nn.Module | None = None,
        val_loader: Iterable | None = None,
        posthoc_iterations: int = 100,
        posthoc_lr: float = 5e-3,
        num_copies: int = 10,
        seed: int = 0,
        inferer: Inferer | None = None,
    ) -> CategoricalPolicy | None:
        """Step 3: the TEA policy the run is tested with, or ``None`` if its TEA mode tests no learned policy.

        ``learned-posthoc`` learns it here, once, on the frozen trained ``network`` from ``val_loader``, its copies
        predicted by ``inferer`` (see :meth:`updaters`' ``tea_inferer``).
        """
        if self.tea.posthoc and not self._posthoc_learned:
            if network is None or val_loader is None:
                raise ValueError(f"tea_mode {self.tea_mode!r} needs the trained network and a validation loader")
            learn_tea_posthoc(
                network, val_loader, posthoc_iterations, posthoc_lr, num_copies, policy=self.tea_policy,
                seed=seed, estimator=self.tea_estimator, op_score=self.tea_op_score, tta_z=self.tea_z,
                tta_identity_weight=self.tea_identity_weight, inferer=inferer,
                mask_out_of_view=self.tea_mask_out_of_view, background_patches=self.tea_background_patches,
            )  # fmt: skip
            self._posthoc_learned = True
        return self.tea_policy if self.tests_learned_tea else None
