"""Augmentation modes selectable without code (bundle overrides ``tra_mode`` / ``tea_mode``).

TRA modes: ``none`` (identity only), ``heuristic`` (fixed preset), ``randaugment-s/m/l`` (fixed),
``fixed`` (a learned ``policies.json`` reused unchanged: learn once, reuse), ``learned`` (one policy for all
patches) and ``class-specific`` (one policy per class group).
TEA modes: ``none`` (no TTA at test time), ``heuristic`` (nnU-Net mirroring), ``learned-posthoc`` (a TEA
policy learned on the frozen model after training) and ``joint`` (learned together with TRA during
training).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from monai.inferers import Inferer
from torch import nn

from jcsaug.engine.posthoc import learn_tea_posthoc
from jcsaug.engine.tea_updater import TEAPolicyUpdater
from jcsaug.engine.tra_updater import TRAPolicyUpdater
from jcsaug.policy.factory import make_tea_policy, make_tra_policy
from jcsaug.policy.io import load_policies, save_policies

TRA_MODES = (
    "none", "heuristic", "randaugment-s", "randaugment-m", "randaugment-l", "fixed", "learned", "class-specific"
)  # fmt: skip
TEA_MODES = ("none", "heuristic", "learned-posthoc", "joint")


class AugmentationSetup:
    """The policies and policy handlers of one run, from its mode names.

    Args:
        tra_mode: one of :data:`TRA_MODES`.
        tea_mode: one of :data:`TEA_MODES`.
        tra_preset: initial TRA probabilities for ``heuristic``/``learned``/``class-specific``.
        tea_preset: initial TEA probabilities.
        num_groups: class groups of the ``class-specific`` policy (2 = background/foreground).
        tra_policy_file: the ``policies.json`` whose TRA policy the ``fixed`` mode uses (any number of groups).
        tra_estimator: ``"gumbel"`` (the paper's) or ``"paired"`` (see :class:`TRAPolicyUpdater`).
        tra_counterfactuals: counterfactual copies per training patch for the ``"paired"`` estimator; read
            :attr:`counterfactuals` for the pipeline's ``TRACascaded``.
        tea_estimator: ``"gumbel"`` or ``"paired"`` (see :class:`TEAPolicyUpdater`).
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
    ) -> None:
        if tra_mode not in TRA_MODES:
            raise ValueError(f"unknown tra_mode {tra_mode!r}; choose one of {list(TRA_MODES)}")
        if tea_mode not in TEA_MODES:
            raise ValueError(f"unknown tea_mode {tea_mode!r}; choose one of {list(TEA_MODES)}")
        self.tra_mode, self.tea_mode = tra_mode, tea_mode
        self.tra_estimator, self.tea_estimator = tra_estimator, tea_estimator
        self.tra_counterfactuals = int(tra_counterfactuals)
        if tra_mode == "fixed":
            self.tra_policy = self._fixed_tra_policy(tra_policy_file)
        else:
            preset = {} if tra_mode == "none" else tra_mode if tra_mode.startswith("randaugment") else tra_preset
            self.tra_policy = make_tra_policy(preset, num_groups=num_groups if tra_mode == "class-specific" else 1)
        self.tea_policy = make_tea_policy(tea_preset)
        self.tra_updater: TRAPolicyUpdater | None = None
        self.tea_updater: TEAPolicyUpdater | None = None

    @staticmethod
    def _fixed_tra_policy(path: str | Path | None):
        if not path:
            raise ValueError("tra_mode 'fixed' needs the policies.json to reuse: set tra_policy (a file path)")
        tra, _ = load_policies(path)
        if tra is None:
            raise ValueError(f"{path} holds no TRA policy (tra_mode 'fixed')")
        tra.logits.requires_grad_(False)  # never learned
        return tra

    @property
    def counterfactuals(self) -> int:
        """Counterfactual copies the training pipeline's ``TRACascaded`` must make (0 unless paired TRA learning)."""
        return self.tra_counterfactuals if self.learn_tra and self.tra_estimator == "paired" else 0

    @property
    def learn_tra(self) -> bool:
        return self.tra_mode in ("learned", "class-specific")

    @property
    def learn_tea(self) -> bool:
        return self.tea_mode == "joint"

    def handlers(
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
    ) -> list:
        """The Ignite handlers that learn the policies of this mode (possibly none).

        ``tra_logit_budget`` / ``tea_logit_budget`` (when not ``None``) replace ``tra_lr`` / ``tea_lr`` by a
        learning rate derived from the run's length (see :class:`~jcsaug.engine.base.PolicyUpdater`)."""
        if self.learn_tra:
            self.tra_updater = TRAPolicyUpdater(
                self.tra_policy, model, val_loader, optimizer, lr=tra_lr, update_every=tra_update_every,
                train_loss=train_loss, val_loss=val_loss, hypergradient=hypergradient,
                tea_policy=self.tea_policy if self.learn_tea else None, seed=seed, estimator=self.tra_estimator,
                val_batches=val_batches, val_average=val_average, logit_budget=tra_logit_budget,
            )  # fmt: skip
        if self.learn_tea:
            self.tea_updater = TEAPolicyUpdater(
                self.tea_policy, model, val_loader, lr=tea_lr, update_every=tea_update_every,
                num_copies=num_copies, seed=seed, estimator=self.tea_estimator, logit_budget=tea_logit_budget,
                patches=tea_patches,
            )  # fmt: skip
        return [u for u in (self.tra_updater, self.tea_updater) if u is not None]

    def checkpoint_items(self) -> dict:
        """The updaters to put in a ``CheckpointSaver``/``CheckpointLoader`` ``save_dict`` (after :meth:`handlers`);
        without updaters the (fixed) policies themselves."""
        items: dict = {}
        items["tra_updater" if self.tra_updater else "tra_policy"] = self.tra_updater or self.tra_policy
        items["tea_updater" if self.tea_updater else "tea_policy"] = self.tea_updater or self.tea_policy
        return items

    def test_inferers(
        self,
        base_inferer: Inferer | None = None,
        z: int = 8,
        network: nn.Module | None = None,
        val_loader: Iterable | None = None,
        posthoc_iterations: int = 100,
        posthoc_lr: float = 5e-3,
        num_copies: int = 10,
        seed: int = 0,
        output_dir: str | Path | None = None,
    ) -> dict[str, Inferer]:
        """Inferers to evaluate after training: ``{"none": plain}`` plus ``{tea_mode: inferer}``.

        ``heuristic`` is nnU-Net mirroring; ``joint`` uses the top-``z`` ops of the TEA policy learned
        during training; ``learned-posthoc`` first learns the TEA policy on the frozen ``network`` from
        ``val_loader`` (and, given ``output_dir``, adds it to ``output_dir/policies.json``).
        """
        from jcsaug.inference.tta import MirrorTTAInferer, NoTTAInferer, TEAInferer

        inferers: dict[str, Inferer] = {"none": NoTTAInferer(base_inferer)}
        if self.tea_mode == "heuristic":
            inferers["heuristic"] = MirrorTTAInferer(base_inferer)
        elif self.tea_mode in ("learned-posthoc", "joint"):
            if self.tea_mode == "learned-posthoc":
                if network is None or val_loader is None:
                    raise ValueError("tea_mode 'learned-posthoc' needs the trained network and a validation loader")
                learn_tea_posthoc(
                    network, val_loader, posthoc_iterations, posthoc_lr, num_copies, policy=self.tea_policy,
                    seed=seed, estimator=self.tea_estimator,
                )  # fmt: skip
                if output_dir is not None:
                    save_policies(Path(output_dir) / "policies.json", self.tra_policy, self.tea_policy)
            inferers[self.tea_mode] = TEAInferer.from_policy(self.tea_policy, z=z, base_inferer=base_inferer)
        return inferers
