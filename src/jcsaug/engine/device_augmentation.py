"""Ignite handler: augment each training batch on the device, after collation and before the iteration."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from ignite.engine import Engine, Events

from jcsaug.engine.base import as_batch

AUGMENT_ON = ("auto", "worker", "device")


def resolve_augment_on(setting: str, device: torch.device | str) -> str:
    """Where a bundle runs its TRA cascade: ``"worker"`` (per sample, in the DataLoader workers) or ``"device"``
    (per batch, on the training device); ``"auto"`` picks ``"device"`` when that device is a GPU."""
    if setting not in AUGMENT_ON:
        raise ValueError(f"augment_on must be one of {AUGMENT_ON}, got {setting!r}")
    if setting == "auto":
        return "device" if torch.device(device).type == "cuda" else "worker"
    return setting


class DeviceAugmentation:
    """Replace ``engine.state.batch`` by ``transform(batch)`` as soon as the batch is fetched.

    It runs at ``GET_BATCH_COMPLETED``, before ``ITERATION_STARTED``, so the trainer's step and every handler
    (the TRA updater reads the op record and the augmented tensors from ``engine.state.batch``) see the
    augmented batch. Use it with a batch transform such as :class:`jcsaug.policy.BatchTRACascaded` (its
    ``device`` argument moves the tensors there first); the DataLoader's pipeline then stops at
    ``ClassGroupd``.

    ``transform`` is also exposed as :attr:`transform`, so :class:`jcsaug.engine.EpochReseeder` reseeds it
    when given this handler among its ``datasets``.
    """

    def __init__(self, transform: Callable[[Mapping], Mapping]) -> None:
        self.transform = transform

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.GET_BATCH_COMPLETED, self)

    def __call__(self, engine: Engine) -> None:
        engine.state.batch = self.transform(as_batch(engine.state.batch))
