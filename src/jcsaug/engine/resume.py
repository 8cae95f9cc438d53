"""Exact resume of a run: per-epoch reseeding, a resume checkpoint with everything, and a time box.

A resumed run equals an uninterrupted one (CPU, fixed seed) because every source of randomness is
either checkpointed (model, optimisers, LR schedule, policies, policy optimisers and their random
generators, the engine's counters) or a pure function of ``(seed, epoch)``: at the start of every
epoch :class:`EpochReseeder` reseeds torch/numpy/random, the datasets' random transforms, and starts
fresh data iterators (DataLoader workers are then seeded from the reseeded torch generator, so use
``persistent_workers=False``).

Distributed runs: what differs between ranks (each policy updater's random stream, seeded ``seed + rank``, and
its running estimates made from the rank's own batches) is saved for every rank, and each rank resumes its own;
the rest (network, optimisers, policies, counters) is identical on every rank and saved once.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import ignite.distributed as idist
from ignite.engine import Engine, Events
from monai.utils import set_determinism

from jcsaug.engine.checkpoints import load_checkpoint, save_checkpoint_atomic
from jcsaug.engine.distributed import gather_on_rank0
from jcsaug.utils import as_flag

logger = logging.getLogger("jcsaug.engine")

RESUME_FILE = "resume.pt"
#: entry of ``resume.pt``: ``{"world_size": N, "states": {name: {rank: state}}}``, the per-rank states of ranks
#: 1..N-1 (rank 0's are the objects' own entries, so a file stays loadable as a single-process one)
RANK_STATES = "rank_states"
#: entry of ``resume.pt``: the run's settings given to :class:`ResumeCheckpoint` (``settings``)
RUN_SETTINGS = "run_settings"


class EpochReseeder:
    """At every epoch start: reseed everything from ``(seed, epoch, rank)`` and restart the data streams.

    Args:
        seed: the run's seed.
        loader: the training data; a fresh iterator is started each epoch (``engine.set_data``).
        datasets: datasets whose ``transform`` random states are reset each epoch (transforms run in
            the main process with ``num_workers=0``; workers are seeded from torch's generator).
        updaters: policy updaters whose validation streams restart each epoch; the datasets of their own loaders
            (``val_stream.loader.dataset``, e.g. the TEA's random crops) are reset too, after ``datasets`` (so
            those keep their seeds) and each once.
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

    def reseeded_datasets(self) -> list:
        """``datasets``, then those of the updaters' loaders not among them (each dataset once, by identity)."""
        found = list(self.datasets)
        for updater in self.updaters:
            # an updater's own loader (the TEA's validation crops) draws from the dataset's transform too: left out,
            # its crops would continue from where the interrupted run's process left them, not from the epoch seed
            loader = getattr(getattr(updater, "val_stream", None), "loader", None)
            dataset = getattr(loader, "dataset", None)
            if dataset is not None and not any(dataset is d for d in found):
                found.append(dataset)
        return found

    def __call__(self, engine: Engine) -> None:
        seed = self.epoch_seed(engine.state.epoch)
        set_determinism(seed=seed)
        for i, dataset in enumerate(self.reseeded_datasets()):
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
        settings: option name -> plain value of the run's settings that a resume must keep (e.g. ``seed``): saved,
            and a resume with other values is refused (:func:`check_resume_matches`).

    Distributed runs: attach it on every rank. Rank 0 writes the file; saving gathers, from every rank, the states
    of the objects whose state is per rank (``rank_local_state``: the policy updaters, whose random streams and
    running estimates differ between ranks), and every rank loads its own. A run saved with per-rank states resumes
    only with the same number of processes.
    """

    def __init__(
        self, output_dir: str | Path, objects: Mapping, resume: bool = False, settings: Mapping[str, Any] | None = None
    ) -> None:
        self.path = Path(output_dir) / RESUME_FILE
        self.objects = dict(objects)
        self.resume = as_flag(resume)
        self.settings = dict(settings or {})

    def attach(self, engine: Engine) -> None:
        self.objects["trainer"] = engine
        engine.add_event_handler(Events.STARTED, self.load)
        engine.add_event_handler(Events.EPOCH_COMPLETED, self.save)

    def _rank_local(self) -> dict[str, Any]:
        return {name: obj for name, obj in self.objects.items() if getattr(obj, "rank_local_state", False)}

    def save(self, engine: Engine | None = None) -> None:
        """Write ``resume.pt`` (rank 0); in a distributed run with per-rank states, a collective of every rank."""
        world, rank = idist.get_world_size(), idist.get_rank()
        local = self._rank_local()
        gathered = None
        if world > 1 and local:  # rank 0's states are saved as its objects' own entries: it sends none
            gathered = gather_on_rank0(None if rank == 0 else {name: obj.state_dict() for name, obj in local.items()})
        if rank != 0:
            return
        per_rank = {name: {r: gathered[r][name] for r in range(1, world)} for name in local} if gathered else {}
        extra: dict[str, Any] = {RANK_STATES: {"world_size": world, "states": per_rank}}
        if self.settings:
            extra[RUN_SETTINGS] = self.settings
        save_checkpoint_atomic(self.path, {**self.objects, **extra})

    def load(self, engine: Engine | None = None) -> None:
        """Load every object from ``resume.pt``, all or none (clear errors naming the file), then check the run
        matches the saved one (:func:`check_resume_matches`) and give each rank its own per-rank states."""
        if not self.resume:
            return
        if not self.path.exists():
            raise FileNotFoundError(f"resume requested but {self.path} does not exist (no finished epoch to resume)")
        asked = (engine.state.max_epochs, engine.state.epoch_length) if engine is not None else (None, None)
        local = self._rank_local()
        updaters = {name: o.resume_settings() for name, o in self.objects.items() if hasattr(o, "resume_settings")}
        state = load_checkpoint(self.path, self.objects)
        world = idist.get_world_size()
        check_resume_matches(
            state, self.path, *asked, settings=self.settings, updaters=updaters, world_size=world if local else None
        )
        self._load_rank_states(state, local, world)
        logger.info("resumed from %s at iteration %s", self.path, state["trainer"].get("iteration"))

    def _load_rank_states(self, state: Mapping, local: Mapping[str, Any], world: int) -> None:
        rank = idist.get_rank()
        if world == 1 or not local:
            return
        saved = state.get(RANK_STATES)
        if not isinstance(saved, Mapping) or not isinstance(saved.get("states"), Mapping):
            if rank == 0:
                warnings.warn(
                    f"{self.path} holds no per-rank states (saved by an older jcsaug): every rank continues from rank "
                    "0's policy-updater random streams and running estimates, so the ranks draw the same ops (the "
                    "resume is not exact)",
                    stacklevel=2,
                )
            return
        if rank == 0:  # rank 0's states are the objects' own entries, loaded already
            return
        for name, obj in local.items():
            try:
                obj.load_state_dict(saved["states"][name][rank])
            except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as err:
                raise ValueError(
                    f"checkpoint {self.path}: no usable state of {name!r} for rank {rank} ({type(err).__name__}: {err})"
                ) from err


def _differences(
    state: Mapping,
    max_epochs: int | None,
    epoch_length: int | None,
    settings: Mapping[str, Any] | None,
    updaters: Mapping[str, Mapping[str, Any]] | None,
    world_size: int | None,
) -> list[tuple[str, str, str]]:
    """``(kind, asked, saved)`` for each setting the run asks otherwise than ``state`` was saved with."""
    found: list[tuple[str, str, str]] = []
    trainer = state.get("trainer")
    if isinstance(trainer, Mapping):
        for key, asked in (("max_epochs", max_epochs), ("epoch_length", epoch_length)):
            saved = trainer.get(key)
            if asked is not None and saved is not None and int(asked) != int(saved):
                found.append(("length", f"--{key} {asked}", f"{key} {saved}"))
    saved_settings = state.get(RUN_SETTINGS)
    if isinstance(saved_settings, Mapping):
        saved_settings = {**RUN_SETTINGS_BEFORE_SAVED, **saved_settings}
    found += _setting_differences(settings or {}, saved_settings, "--", "")
    for name, asked_settings in (updaters or {}).items():
        entry = state.get(name)
        saved = entry.get("settings") if isinstance(entry, Mapping) else None
        if isinstance(saved, Mapping):
            saved = {**UPDATER_SETTINGS_BEFORE_SAVED, **saved}
        found += _setting_differences(asked_settings, saved, f"{name}.", f"{name}.")
    ranks = state.get(RANK_STATES)
    saved_world = ranks.get("world_size") if isinstance(ranks, Mapping) else None
    if world_size is not None and saved_world is not None and int(world_size) != int(saved_world):
        found.append(("processes", _processes(world_size), _processes(saved_world)))
    return found


#: a policy updater's setting -> the value every run had before the setting was saved in ``resume.pt`` (a file
#: without it ran with that value, so a resume asking another is refused rather than silently changing the run).
#: Until 2026-12-01 the start, step rule and the TEA's scoring settings were saved only when not the default; the
#: TRA's ``pull`` is saved only when not 0.
UPDATER_SETTINGS_BEFORE_SAVED: dict[str, Any] = {
    "direction": "validation", "start": 0.0, "step_rule": "adam", "pull": 0.0,
    "background_patches": 0, "op_score": "alone", "mask_out_of_view": False, "inferer": None,
}  # fmt: skip

#: the same for a run's settings (``ResumeCheckpoint(settings=)``): runs before the TRA context cropped no context,
#: runs before the task's ROI drew patch centres from the whole volume, runs before the TEA read its volumes'
#: statistics used each patch's own
RUN_SETTINGS_BEFORE_SAVED: dict[str, Any] = {
    "tra_context": [0, 0, 0], "roi_threshold": None, "tea_volume_stats": False, "planned_epochs": None,
}  # fmt: skip


def _setting_differences(
    asked: Mapping[str, Any], saved: Any, asked_prefix: str, saved_prefix: str
) -> list[tuple[str, str, str]]:
    """The settings of ``asked`` that ``saved`` holds with another value; none when ``saved`` is no mapping (a file
    from before these settings were saved: nothing to compare)."""
    if not isinstance(saved, Mapping):
        return []
    return [("setting", f"{asked_prefix}{key} {value}", f"{saved_prefix}{key} {saved[key]}")
            for key, value in asked.items() if key in saved and value != saved[key]]  # fmt: skip


def _processes(count: int) -> str:
    return f"{count} process" if int(count) == 1 else f"{count} processes"


def check_resume_matches(
    state: Mapping,
    path: Path,
    max_epochs: int | None,
    epoch_length: int | None,
    settings: Mapping[str, Any] | None = None,
    updaters: Mapping[str, Mapping[str, Any]] | None = None,
    world_size: int | None = None,
) -> None:
    """Refuse to resume a run with other settings than it was saved with (a ``ValueError`` naming each, asked and
    saved).

    Resume continues a run exactly (same LR and policy-LR schedules, same data order, same random streams), so the
    run keeps what shapes its trajectory: ``max_epochs`` and ``epoch_length`` (its length: ignite would silently
    keep the saved one; a longer run is a new run, in another ``output_dir``); ``settings``, option name -> value
    (saved by :class:`ResumeCheckpoint` with its ``settings``); ``updaters``, checkpoint entry -> the policy
    updater's :meth:`~jcsaug.engine.base.PolicyUpdater.resume_settings` (seed, update interval, learning rate...);
    and ``world_size``, the number of processes, when the file holds per-rank states. ``None`` (or a setting the
    file does not hold, e.g. one saved by an older version) is not checked, except the updater settings of
    :data:`UPDATER_SETTINGS_BEFORE_SAVED`, whose value before they were saved is known.
    """
    if not isinstance(state, Mapping):
        return
    found = _differences(state, max_epochs, epoch_length, settings, updaters, world_size)
    if not found:
        return
    trainer = state.get("trainer")
    iterations = trainer.get("iteration") if isinstance(trainer, Mapping) else None
    got = ", ".join(asked for _, asked, _ in found)
    was = ", ".join(saved for _, _, saved in found)
    was += "" if iterations is None else f" (after {iterations} iterations)"
    if {kind for kind, _, _ in found} == {"length"}:
        advice = (
            "Resume continues a run exactly, its LR schedule included, so it keeps its length: resume without "
            "these overrides, or start a longer run in another --output_dir (or with --overwrite true)"
        )
    else:
        advice = (
            "Resume continues a run exactly (its length, seeds, policy-update settings and each process's random "
            "streams included): resume with the settings and number of processes it was saved with, or start a new "
            "run in another --output_dir (or with --overwrite true)"
        )
    raise ValueError(f"cannot resume {path} with {got}: that run was saved with {was}. {advice}")


class StopAfterEpochs:
    """Terminate the run after ``epochs`` epochs of this job (0 = never): a time box, and how resume is tested.

    The epochs are counted from the one the job starts at, so a resumed job (same command plus ``--resume true``)
    runs ``epochs`` more, not up to the absolute epoch ``epochs``. The start is taken at the first epoch start, after
    every ``STARTED`` handler (:class:`ResumeCheckpoint` loads the saved epoch then), whatever their order.
    """

    def __init__(self, epochs: int = 0) -> None:
        self.epochs = int(epochs)
        self._first_epoch: int | None = None  # the first epoch this job runs

    def attach(self, engine: Engine) -> None:
        if self.epochs > 0:
            engine.add_event_handler(Events.STARTED, self._reset)
            engine.add_event_handler(Events.EPOCH_STARTED, self._start)
            engine.add_event_handler(Events.EPOCH_COMPLETED, self._stop)

    def _reset(self, engine: Engine) -> None:
        self._first_epoch = None

    def _start(self, engine: Engine) -> None:
        if self._first_epoch is None:
            self._first_epoch = engine.state.epoch

    def _stop(self, engine: Engine) -> None:
        if self._first_epoch is not None and engine.state.epoch - self._first_epoch + 1 >= self.epochs:
            engine.terminate()
