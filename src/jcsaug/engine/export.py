"""Ignite handler: the policies' life in a run — history, TensorBoard scalars, ``policies.json``."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events

from jcsaug.policy.categorical import CategoricalPolicy
from jcsaug.policy.io import save_policies

logger = logging.getLogger("jcsaug.engine")


def _cut_torn_tail(fd: int, size: int, path: Path, chunk: int = 1 << 16) -> int:
    """Truncate a last line that lacks its newline (a write cut off by a crash); returns the new size."""
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return size
    end = size
    while end > 0:
        start = max(0, end - chunk)
        newline = os.pread(fd, end - start, start).rfind(b"\n")
        if newline >= 0:
            end = start + newline + 1
            break
        end = start
    os.ftruncate(fd, end)
    logger.warning("%s: dropped an incomplete last line (%d bytes, cut off by an interruption)", path, size - end)
    return end


def append_line(path: str | Path, line: str) -> None:
    """Append ``line`` + newline to ``path`` so that the file only ever holds whole lines.

    An incomplete last line left by an earlier interruption is cut first; the line goes out in ``os.write`` calls on
    an ``O_APPEND`` descriptor and is ``fsync``-ed; if writing fails (disk full, a signal) the file is truncated back
    to its previous size. (Rewriting the whole file atomically each epoch would cost O(epochs²) writes.)
    """
    path = Path(path)
    data = (line.rstrip("\n") + "\n").encode()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o666)
    try:
        size = _cut_torn_tail(fd, os.fstat(fd).st_size, path)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except BaseException:
            os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


def _probability_scalars(prefix: str, policy: CategoricalPolicy) -> dict[str, float]:
    tags = _op_tags(prefix, policy)
    out = {}
    for s, probs in enumerate(policy.probabilities()):
        for g in range(policy.num_groups):
            for j, p in enumerate(probs[g].tolist()):
                out[tags[g][policy.offsets[s] + j]] = p
    return out


def _op_tags(prefix: str, policy: CategoricalPolicy) -> list[list[str]]:
    """``[group][flat op index] -> tag`` (``prefix/[groupG/]series/op``), in the order of the policy's logits."""
    return [
        [
            f"{prefix}/{f'group{g}/' if policy.num_groups > 1 else ''}{policy.series_names[s]}/{op}"
            for s in range(policy.num_series)
            for op in policy.op_names[s]
        ]
        for g in range(policy.num_groups)
    ]


def _op_effect_entries(updater: object) -> dict[str, dict[str, float]]:
    """A paired-estimator updater's running op-effect estimates (:class:`~jcsaug.engine.paired.OpEffects`), by the
    op's tag: ``{"estimate": D, "measurements": n}`` for every op measured at least once (an identity never is)."""
    effects = getattr(updater, "effects", None)
    if effects is None:
        return {}
    tags = _op_tags(updater.name.lower(), updater.policy)
    return {
        tags[g][i]: {"estimate": float(effects.estimate[g, i]), "measurements": int(effects.count[g, i])}
        for g, i in (effects.count > 0).nonzero().tolist()
    }


class PolicyExporter:
    """Write the policies of a run (rank 0 only).

    * every epoch: one line of probabilities appended to ``output_dir/policy_history.jsonl`` (whole lines only,
      :func:`append_line`); with ``updaters`` whose estimator measures op effects (``paired``), the line also
      holds ``op_effects``: each measured op's running effect estimate and how often it was measured so far (the
      numbers its logit's steps are made of: a negative effect lowers the validation loss, and its logit rises
      while its effect is below its series' probability-weighted mean), by the same names as the probabilities;
    * when ``tensorboard_dir`` is given and tensorboard is installed: a scalar per op probability after every
      policy update (every iteration that changed a policy), at that iteration's step, whether the exporter is
      attached before or after the policy updaters;
    * at the end of training (and on every epoch, so a crash leaves a recent one): ``policies.json``,
      written atomically, readable by ``jcsaug policy show PATH``.
    """

    def __init__(
        self,
        output_dir: str | Path,
        tra_policy: CategoricalPolicy | None = None,
        tea_policy: CategoricalPolicy | None = None,
        tensorboard_dir: str | Path | None = None,
        updaters: Iterable | None = None,
    ) -> None:
        self.output_dir = Path(output_dir)
        self.tra_policy, self.tea_policy = tra_policy, tea_policy
        #: the policy updaters whose op-effect estimates go into the history (e.g. a bundle's ``policy_updaters``)
        self.updaters = list(updaters or [])
        self.tensorboard_dir = tensorboard_dir
        self._writer = None

    def attach(self, engine: Engine) -> None:
        if idist.get_rank() != 0:
            return
        engine.add_event_handler(Events.STARTED, self._open)
        engine.add_event_handler(Events.EPOCH_COMPLETED, self._epoch)
        engine.add_event_handler(Events.COMPLETED, self._completed)

    @property
    def policies_path(self) -> Path:
        return self.output_dir / "policies.json"

    def _open(self, engine: Engine) -> None:
        # Ignite runs an event's handlers in the order they were added: added now, when the run starts, the scalars
        # handler comes after every handler attached before the run (the policy updaters, whatever the order of a
        # bundle's train_handlers), so it sees the policy as the iteration's update left it
        if not engine.has_event_handler(self._iteration, Events.ITERATION_COMPLETED):
            engine.add_event_handler(Events.ITERATION_COMPLETED, self._iteration)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if self.tensorboard_dir is not None and self._writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                logger.warning("tensorboard is not installed: no policy scalars (pip install jcsaug[tensorboard])")
            else:
                self._writer = SummaryWriter(log_dir=str(self.tensorboard_dir))
                self._written_logits = self._logits()  # the start: written at the first update that changes it
                for tag, value in self._scalars().items():
                    self._writer.add_scalar(tag, value, engine.state.iteration)

    def _scalars(self) -> dict[str, float]:
        scalars = {}
        if self.tra_policy is not None:
            scalars.update(_probability_scalars("tra", self.tra_policy))
        if self.tea_policy is not None:
            scalars.update(_probability_scalars("tea", self.tea_policy))
        return scalars

    def _logits(self) -> list:
        return [p.logits.detach().clone() for p in (self.tra_policy, self.tea_policy) if p is not None]

    def _iteration(self, engine: Engine) -> None:
        """TensorBoard scalars after every iteration that changed a policy (a policy update)."""
        if self._writer is None:
            return
        logits = self._logits()
        last = getattr(self, "_written_logits", None)
        if last is not None and all(torch.equal(a, b) for a, b in zip(logits, last)):
            return
        self._written_logits = logits
        for tag, value in self._scalars().items():
            self._writer.add_scalar(tag, value, engine.state.iteration)

    def _epoch(self, engine: Engine) -> None:
        self._iteration(engine)  # an update that ran after the scalars handler (an updater attached during the run)
        scalars = self._scalars()
        record = {"epoch": engine.state.epoch, "iteration": engine.state.iteration, "probabilities": scalars}
        effects = {tag: entry for updater in self.updaters for tag, entry in _op_effect_entries(updater).items()}
        if effects:
            record["op_effects"] = effects
        append_line(self.output_dir / "policy_history.jsonl", json.dumps(record))
        if self._writer is not None:
            self._writer.flush()
        self.write_policies(engine)

    def _completed(self, engine: Engine) -> None:
        self._iteration(engine)  # the last update, also when the run was stopped mid-epoch
        if self._writer is not None:
            self._writer.flush()
        self.write_policies(engine)

    def write_policies(self, engine: Engine | None = None, tea_policy: CategoricalPolicy | None = None) -> Path:
        """Write ``policies.json`` now; ``tea_policy`` replaces the exporter's own (e.g. one learned post hoc)."""
        return save_policies(self.policies_path, self.tra_policy, tea_policy or self.tea_policy)
