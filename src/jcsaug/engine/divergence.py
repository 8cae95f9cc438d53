"""Stop a diverged run: a non-finite training loss fails the run instead of finishing it as a good one.

Ignite's ``TerminateOnNan`` only *terminates* the engine, which then completes normally: ``COMPLETED`` handlers
save the final checkpoint (NaN weights), the bundle goes on to evaluate and exits 0. :class:`StopOnNonFiniteLoss`
keeps its check and turns the termination into a :class:`TrainingDiverged` error, so the run exits non-zero.
Together with the finiteness guard of the checkpoint writers (:func:`jcsaug.engine.checkpoints.nonfinite_entries`)
the files of the last finite epoch stay on disk.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ignite.engine import Engine, Events
from ignite.handlers import TerminateOnNan
from monai.handlers import from_engine

__all__ = ["StopOnNonFiniteLoss", "TrainingDiverged"]


class TrainingDiverged(RuntimeError):
    """The training loss (or the state to be saved) is no longer finite."""


class StopOnNonFiniteLoss(TerminateOnNan):
    """Ignite's ``TerminateOnNan`` that fails the run: raises :class:`TrainingDiverged` at the first iteration
    whose loss is NaN or infinite (attach it before the other iteration handlers, so none of them sees it).

    Args:
        output_transform: the loss from the engine's output; default: MONAI's ``from_engine(["loss"], first=True)``
            (the output of a ``SupervisedTrainer``, decollated or not).
    """

    def __init__(self, output_transform: Callable | None = None) -> None:
        super().__init__(output_transform or from_engine(["loss"], first=True))
        self.logger = logging.getLogger("jcsaug.engine")  # the app's logging (ignite's adds a second stream handler)

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.ITERATION_COMPLETED, self)

    def __call__(self, engine: Engine) -> None:
        already_terminating = engine.should_terminate
        super().__call__(engine)  # terminates the engine on a non-finite loss
        if engine.should_terminate and not already_terminating:
            engine.should_terminate = False
            loss = self._output_transform(engine.state.output)
            raise TrainingDiverged(
                f"training diverged: the loss is {loss} at epoch {engine.state.epoch}, iteration "
                f"{engine.state.iteration} (try a lower learning_rate); this state is not saved, the checkpoints of "
                "earlier epochs are kept"
            )
