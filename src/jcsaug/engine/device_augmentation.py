"""Ignite handler: augment each training batch on the device, after collation and before the iteration."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Protocol

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


def _takes(fn: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read: let the call decide
        return True


class UpdateSchedule(Protocol):
    """What :class:`DeviceAugmentation` asks of ``counterfactuals_for`` (a :class:`jcsaug.engine.TRAPolicyUpdater`)."""

    def updates_at(self, engine: Engine, iteration: int) -> bool: ...


class DeviceAugmentation:
    """Replace ``engine.state.batch`` by ``transform(batch)`` as soon as the batch is fetched.

    It runs at ``GET_BATCH_COMPLETED``, before ``ITERATION_STARTED``, so the trainer's step and every handler
    (the TRA updater reads the op record and the augmented tensors from ``engine.state.batch``) see the
    augmented batch. Use it with a batch transform such as :class:`jcsaug.policy.BatchTRACascaded` (its
    ``device`` argument moves the tensors there first); the DataLoader's pipeline then stops at
    ``ClassGroupd``.

    ``transform`` is also exposed as :attr:`transform`, so :class:`jcsaug.engine.EpochReseeder` reseeds it
    when given this handler among its ``datasets``.

    Args:
        transform: the batch transform.
        counterfactuals_for: the TRA updater that scores the transform's counterfactual copies (the paired
            estimator; ``BatchTRACascaded(counterfactuals=K)``): the copies are then made only for the batches of
            the iterations it updates at (``updates_at``), and drawn but not made for the others (those between
            its updates, and a warm-up's), so the random stream, and hence the run, is the same as with copies on
            every batch. The transform must take ``make_counterfactuals`` (as ``BatchTRACascaded`` does).
            ``None`` (default): ``transform(batch)`` on every batch.
    """

    def __init__(self, transform: Callable[..., Mapping], counterfactuals_for: UpdateSchedule | None = None) -> None:
        if counterfactuals_for is not None and not _takes(transform, "make_counterfactuals"):
            raise TypeError(
                f"DeviceAugmentation(counterfactuals_for=...) needs a transform that takes make_counterfactuals "
                f"(BatchTRACascaded), got {type(transform).__name__}"
            )
        self.transform = transform
        self.counterfactuals_for = counterfactuals_for

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.GET_BATCH_COMPLETED, self)

    def __call__(self, engine: Engine) -> None:
        batch = as_batch(engine.state.batch)
        if self.counterfactuals_for is None:
            engine.state.batch = self.transform(batch)
            return
        # GET_BATCH_COMPLETED comes before Ignite counts the iteration this batch is for
        wanted = self.counterfactuals_for.updates_at(engine, engine.state.iteration + 1)
        engine.state.batch = self.transform(batch, make_counterfactuals=wanted)
