"""Exact resume of a run: per-epoch reseeding, a resume checkpoint with everything, and a time box.

A resumed run equals an uninterrupted one (CPU, fixed seed) because every source of randomness is
either checkpointed (model, optimisers, LR schedule, policies, policy optimisers and their random
generators, the engine's counters) or a pure function of ``(seed, epoch)``: at the start of every
epoch :class:`EpochReseeder` reseeds torch/numpy/random, the datasets' random transforms, and starts
fresh data iterators (DataLoader workers are then seeded from the reseeded torch generator, so use
``persistent_workers=False``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import ignite.distributed as idist
from ignite.engine import Engine, Events
from monai.utils import set_determinism

from jcsaug.engine.checkpoints import load_checkpoint, save_checkpoint_atomic
from jcsaug.utils import as_flag

logger = logging.getLogger("jcsaug.engine")

RESUME_FILE = "resume.pt"


class EpochReseeder:
    """At every epoch start: reseed everything from ``(seed, epoch, rank)`` and restart the data streams.

    Args:
        seed: the run's seed.
        loader: the training data; a fresh iterator is started each epoch (``engine.set_data``).
        datasets: datasets whose ``transform`` random states are reset each epoch (transforms run in
            the main process with ``num_workers=0``; workers are seeded from torch's generator).
        updaters: policy updaters whose validation streams restart each epoch.
    """

    def __init__(
        self,
        seed: int,
        loader: Iterable | None = None,
        datasets: Sequence = (),
        updaters: Sequence = (),
    ) -> None:
        self.seed = int(seed)
        self.loader = loader
        self.datasets = list(datasets)
        self.updaters = list(updaters)

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.EPOCH_STARTED, self)

    def epoch_seed(self, epoch: int) -> int:
        return (self.seed + 1_000_003 * epoch + 7_919 * idist.get_rank()) % (2**31 - 1)

    def __call__(self, engine: Engine) -> None:
        seed = self.epoch_seed(engine.state.epoch)
        set_determinism(seed=seed)
        for i, dataset in enumerate(self.datasets):
            transform = getattr(dataset, "transform", None)
            if hasattr(transform, "set_random_state"):
                transform.set_random_state(seed=(seed + i + 1) % (2**31 - 1))
        for updater in self.updaters:
            stream = getattr(updater, "val_stream", None)
            if stream is not None:
                stream.restart()
        if self.loader is not None:
            engine.set_data(self.loader)


class ResumeCheckpoint:
    """Save everything a run needs to continue exactly, every epoch, and load it when ``resume`` is set.

    Args:
        output_dir: where ``resume.pt`` lives.
        objects: name -> object with ``state_dict``/``load_state_dict`` (network, optimiser, LR schedule,
            policy updaters...). The engine itself is added as ``"trainer"``.
        resume: load ``output_dir/resume.pt`` at the start of the run (an error if it is missing).
    """

    def __init__(self, output_dir: str | Path, objects: Mapping, resume: bool = False) -> None:
        self.path = Path(output_dir) / RESUME_FILE
        self.objects = dict(objects)
        self.resume = as_flag(resume)

    def attach(self, engine: Engine) -> None:
        self.objects["trainer"] = engine
        engine.add_event_handler(Events.STARTED, self.load)
        engine.add_event_handler(Events.EPOCH_COMPLETED, self.save)

    def save(self, engine: Engine | None = None) -> None:
        if idist.get_rank() == 0:
            save_checkpoint_atomic(self.path, self.objects)

    def load(self, engine: Engine | None = None) -> None:
        """Load every object from ``resume.pt``, all or none (clear errors naming the file)."""
        if not self.resume:
            return
        if not self.path.exists():
            raise FileNotFoundError(f"resume requested but {self.path} does not exist (no finished epoch to resume)")
        asked = (engine.state.max_epochs, engine.state.epoch_length) if engine is not None else (None, None)
        state = load_checkpoint(self.path, self.objects)
        check_resume_matches(state, self.path, *asked)
        logger.info("resumed from %s at iteration %s", self.path, state["trainer"].get("iteration"))


def check_resume_matches(state: Mapping, path: Path, max_epochs: int | None, epoch_length: int | None) -> None:
    """Refuse to resume a run with another ``max_epochs`` or ``epoch_length`` than it was saved with (a
    ``ValueError`` naming both).

    Resume continues a run exactly (same LR and policy-LR schedules, same data order): its length is part of the
    run, and ignite would silently keep the saved one. A longer run is a new run (another ``output_dir``).
    """
    trainer = state.get("trainer") if isinstance(state, Mapping) else None
    if not isinstance(trainer, Mapping):
        return
    saved = {"max_epochs": trainer.get("max_epochs"), "epoch_length": trainer.get("epoch_length")}
    asked = {"max_epochs": max_epochs, "epoch_length": epoch_length}
    differ = [k for k in saved if asked[k] is not None and saved[k] is not None and int(asked[k]) != int(saved[k])]
    if differ:
        got = ", ".join(f"--{k} {asked[k]}" for k in differ)
        was = ", ".join(f"{k} {saved[k]}" for k in differ)
        raise ValueError(
            f"cannot resume {path} with {got}: that run was saved with {was} (after {trainer.get('iteration')} "
            "iterations). "
            "Resume continues a run exactly, its LR schedule included, so it keeps its length: resume without "
            "these overrides, or start a longer run in another --output_dir (or with --overwrite true)"
        )


class StopAfterEpochs:
    """Terminate the run after ``epochs`` epochs (0 = never): a time box, and how resume is tested."""

    def __init__(self, epochs: int = 0) -> None:
        self.epochs = int(epochs)

    def attach(self, engine: Engine) -> None:
        if self.epochs > 0:
            engine.add_event_handler(Events.EPOCH_COMPLETED(once=self.epochs), lambda e: e.terminate())
