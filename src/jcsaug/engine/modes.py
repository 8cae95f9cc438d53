"""Augmentation modes selectable without code (bundle overrides ``tra_mode`` / ``tea_mode``).

TRA modes: ``none`` (identity only), ``heuristic`` (fixed preset), ``randaugment-s/m/l`` (fixed),
``learned`` (one policy for all patches) and ``class-specific`` (one policy per class group).
TEA learning modes: ``none`` and ``joint`` (learned together with TRA during training).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from jcsaug.engine.tea_updater import TEAPolicyUpdater
from jcsaug.engine.tra_updater import TRAPolicyUpdater
from jcsaug.policy.factory import make_tea_policy, make_tra_policy

TRA_MODES = ("none", "heuristic", "randaugment-s", "randaugment-m", "randaugment-l", "learned", "class-specific")
TEA_MODES = ("none", "joint")


class AugmentationSetup:
    """The policies and policy handlers of one run, from its mode names.

    Args:
        tra_mode: one of :data:`TRA_MODES`.
        tea_mode: one of :data:`TEA_MODES`.
        tra_preset: initial TRA probabilities for ``heuristic``/``learned``/``class-specific``.
        tea_preset: initial TEA probabilities.
        num_groups: class groups of the ``class-specific`` policy (2 = background/foreground).
    """

    def __init__(
        self,
        tra_mode: str = "class-specific",
        tea_mode: str = "joint",
        tra_preset: str = "nnunet",
        tea_preset: str = "nnunet",
        num_groups: int = 2,
    ) -> None:
        if tra_mode not in TRA_MODES:
            raise ValueError(f"unknown tra_mode {tra_mode!r}; choose one of {list(TRA_MODES)}")
        if tea_mode not in TEA_MODES:
            raise ValueError(f"unknown tea_mode {tea_mode!r}; choose one of {list(TEA_MODES)}")
        self.tra_mode, self.tea_mode = tra_mode, tea_mode
        preset = {} if tra_mode == "none" else tra_mode if tra_mode.startswith("randaugment") else tra_preset
        self.tra_policy = make_tra_policy(preset, num_groups=num_groups if tra_mode == "class-specific" else 1)
        self.tea_policy = make_tea_policy(tea_preset)
        self.tra_updater: TRAPolicyUpdater | None = None
        self.tea_updater: TEAPolicyUpdater | None = None

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
    ) -> list:
        """The Ignite handlers that learn the policies of this mode (possibly none)."""
        if self.learn_tra:
            self.tra_updater = TRAPolicyUpdater(
                self.tra_policy, model, val_loader, optimizer, lr=tra_lr, update_every=tra_update_every,
                train_loss=train_loss, val_loss=val_loss, hypergradient=hypergradient,
                tea_policy=self.tea_policy if self.learn_tea else None, seed=seed,
            )  # fmt: skip
        if self.learn_tea:
            self.tea_updater = TEAPolicyUpdater(
                self.tea_policy, model, val_loader, lr=tea_lr, update_every=tea_update_every,
                num_copies=num_copies, seed=seed,
            )  # fmt: skip
        return [u for u in (self.tra_updater, self.tea_updater) if u is not None]

    def checkpoint_items(self) -> dict:
        """The updaters to put in a ``CheckpointSaver``/``CheckpointLoader`` ``save_dict`` (after :meth:`handlers`);
        without updaters the (fixed) policies themselves."""
        items: dict = {}
        items["tra_updater" if self.tra_updater else "tra_policy"] = self.tra_updater or self.tra_policy
        items["tea_updater" if self.tea_updater else "tea_policy"] = self.tea_updater or self.tea_policy
        return items
