"""Gradient-norm clipping of the model's training step, as an Ignite handler for MONAI's ``SupervisedTrainer``.

Why by hand: neither MONAI's trainers nor Ignite's handlers clip gradients; MONAI's ``SupervisedTrainer`` fires
``IterationEvents.BACKWARD_COMPLETED`` between the backward pass and the optimiser step, where this handler calls
``torch.nn.utils.clip_grad_norm_`` (nnU-Net and the paper's U-Net clip the norm at 12).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from ignite.engine import Engine
from monai.engines.utils import IterationEvents

__all__ = ["GradientClipping"]


class GradientClipping:
    """Clip the global gradient norm of the trainer's network to ``max_norm`` before each optimiser step.

    Args:
        max_norm: the largest L2 norm of all gradients together; ``None`` clips nothing (a bundle whose network
            does not clip keeps the handler in its list).
        parameters: ``() -> parameters`` to clip (default: the trainer's ``network``'s).

    With mixed precision (the trainer's ``scaler``) the gradients are unscaled first, as PyTorch's AMP recipe does.
    The norm before clipping is kept in ``engine.state.grad_norm``.

    Example:
        >>> GradientClipping(12.0).attach(trainer)  # doctest: +SKIP
    """

    def __init__(
        self, max_norm: float | None, parameters: Callable[[], Iterable[torch.nn.Parameter]] | None = None
    ) -> None:
        if max_norm is not None and (isinstance(max_norm, bool) or not math.isfinite(max_norm) or max_norm <= 0):
            raise ValueError(f"max_norm must be a finite number > 0 or None, got {max_norm!r}")
        self.max_norm = None if max_norm is None else float(max_norm)
        self.parameters = parameters

    def attach(self, engine: Engine) -> None:
        if self.max_norm is None:
            return
        try:
            engine.add_event_handler(IterationEvents.BACKWARD_COMPLETED, self)
        except ValueError as err:  # Ignite: not an event of this engine
            raise TypeError(
                f"GradientClipping needs an engine that fires IterationEvents.BACKWARD_COMPLETED between backward and "
                f"the optimiser step (MONAI's SupervisedTrainer), got {type(engine).__name__}"
            ) from err

    def __call__(self, engine: Engine) -> None:
        scaler = getattr(engine, "scaler", None)
        if getattr(engine, "amp", False) and scaler is not None:
            scaler.unscale_(engine.optimizer)
        params = self.parameters() if self.parameters is not None else engine.network.parameters()
        engine.state.grad_norm = float(torch.nn.utils.clip_grad_norm_(list(params), self.max_norm))
