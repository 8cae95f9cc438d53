"""Policy snapshots in lockstep with the training loop, for loaders that make batches on a thread of their own.

MONAI's ``ThreadDataLoader`` makes its batches on a buffer thread, ahead of the loop by up to ``buffer_size + 1``
batches at that thread's pace, so :class:`jcsaug.policy.PolicySnapshotSampler` would copy the logits at a moment
timing decides. Here the loop records a copy of the policies after each iteration (:class:`PolicyHistory`, an
Ignite handler or three calls in a plain loop), and :class:`LockstepThreadDataLoader` draws the batch the loop
consumes at iteration ``k`` from the copy after iteration ``k - lag``, waiting on its thread until the loop has got
there. What a sample draws is then a function of the seed and ``lag`` alone, not of either side's speed::

    history = PolicyHistory(tra_policy)
    history.attach(trainer)  # after each iteration's updates, before the next batch is fetched
    loader = LockstepThreadDataLoader(CacheDataset(files, transforms), history, batch_size=2, shuffle=True)
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from ignite.engine import Engine, Events
from monai.data import ThreadDataLoader
from monai.data.thread_buffer import buffer_iterator
from torch.utils.data import BatchSampler, Dataset, RandomSampler, SequentialSampler

from jcsaug.policy.categorical import CategoricalPolicy
from jcsaug.policy.snapshots import PolicySnapshotDataset, SnapshotIndex, _as_policies
from jcsaug.utils import wrapped_len

Logits = tuple[np.ndarray, ...]


class PolicyHistory:
    """Copies of the policies' logits after each iteration of a training loop (the last ``keep`` of them), read by
    :class:`LockstepThreadDataLoader` from its buffer thread.

    With an Ignite engine, :meth:`attach` does the bookkeeping. In a plain loop::

        history.start()
        history.publish(0)
        for iteration, batch in enumerate(loader, start=1):
            ...  # the training step and the policy updates
            history.publish(iteration)
        history.close()

    It has ``state_dict`` / ``load_state_dict``: saved in a checkpoint beside the policies, a resumed run draws the
    batches after the resume from the same copies as the uninterrupted run (without it, the first ``lag`` batches
    are drawn from the policies at the resume).

    Args:
        policies: the policies the pipeline's transforms draw from (one or a list).
        keep: how many iterations' copies are kept; at least the loader's ``lag``.
    """

    def __init__(self, policies: CategoricalPolicy | Sequence[CategoricalPolicy], keep: int = 64) -> None:
        if int(keep) < 1:
            raise ValueError(f"PolicyHistory: keep must be >= 1, got {keep}")
        self.policies = _as_policies(policies, type(self).__name__)
        self.keep = int(keep)
        self._copies: deque[tuple[int, Logits]] = deque(maxlen=self.keep)
        self._oldest: tuple[int, Logits] | None = None  # the run's first copy, for the first `lag` batches
        self._closed = False
        self._publisher: int | None = None  # the loop's thread: it must never wait for itself
        self._changed = threading.Condition()

    @property
    def latest(self) -> int | None:
        """The last iteration published, ``None`` before the first."""
        with self._changed:  # reentrant (the condition's default lock): the methods below read it holding it
            return self._copies[-1][0] if self._copies else None

    def attach(self, engine: Engine) -> None:
        """Start with each run, publish before each batch is fetched (after the previous iteration's handlers,
        the policy updaters among them), close when the run completes or is terminated."""
        engine.add_event_handler(Events.STARTED, lambda e: self.start(e.state.iteration))
        engine.add_event_handler(Events.GET_BATCH_STARTED, lambda e: self.publish(e.state.iteration))
        engine.add_event_handler(Events.COMPLETED, lambda _: self.close())
        engine.add_event_handler(Events.TERMINATE, lambda _: self.close())

    def start(self, iteration: int = 0) -> None:
        """A run starts (or resumes) at ``iteration``: copies from ``iteration`` on (a former run's) are dropped."""
        with self._changed:
            while self._copies and self._copies[-1][0] >= iteration:
                self._copies.pop()
            if self._oldest is not None and self._oldest[0] >= iteration:
                self._oldest = self._copies[0] if self._copies else None
            self._closed = False
            self._publisher = threading.get_ident()
            self._changed.notify_all()

    def publish(self, iteration: int) -> None:
        """Copy the policies' logits as they are after ``iteration`` iterations. Publishing the last iteration again
        keeps its first copy; an earlier one is refused (a new run calls :meth:`start` first)."""
        with self._changed:
            latest = self.latest
            if latest is not None and iteration <= latest:
                if iteration < latest:
                    raise ValueError(
                        f"PolicyHistory.publish: iteration {iteration} after iteration {latest}; a new run must "
                        "call start() first (attach() does)"
                    )
                return
            copy = (int(iteration), tuple(policy.snapshot() for policy in self.policies))
            self._copies.append(copy)
            if self._oldest is None:
                self._oldest = copy
            self._publisher = threading.get_ident()
            self._changed.notify_all()

    def close(self) -> None:
        """The run is over: a wait for a later iteration ends with the last copy (its batch is never consumed)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def wake(self) -> None:
        """Make every waiter look again at what it waits for (a loader stopping its buffer thread)."""
        with self._changed:
            self._changed.notify_all()

    def logits_after(self, iteration: int, stop: threading.Event | None = None) -> Logits:
        """The copy after ``iteration`` iterations; before the oldest, the oldest. Waits (on a thread other than the
        loop's) until the loop publishes it, or returns the last copy once the history is closed or ``stop`` set."""
        with self._changed:
            while self.latest is None or iteration > self.latest:
                if self._closed or (stop is not None and stop.is_set()):
                    if not self._copies:
                        raise RuntimeError("PolicyHistory: closed before any iteration was published")
                    return self._copies[-1][1]
                if threading.get_ident() == self._publisher:
                    raise RuntimeError(
                        f"PolicyHistory: a batch needs the policies after iteration {iteration}, but the last "
                        f"published is {self.latest} and the loop's own thread "
                        "would wait for them: raise the loader's lag"
                    )
                self._changed.wait()
            for published, logits in reversed(self._copies):
                if published <= iteration:
                    return logits
            assert self._oldest is not None
            if iteration < self._oldest[0]:
                return self._oldest[1]
            raise RuntimeError(
                f"PolicyHistory: the policies after iteration {iteration} are no longer kept (the oldest kept is "
                f"{self._copies[0][0]}): raise keep={self.keep} to at least the loader's lag"
            )

    def state_dict(self) -> dict[str, Any]:
        """The kept copies and the run's first (a few kB), as tensors that ``torch.load(..., weights_only=True)``
        reads: in a checkpoint with the policies, a resume draws as the uninterrupted run."""

        def saved(copy: tuple[int, Logits]) -> list:
            return [copy[0], [torch.from_numpy(x.copy()) for x in copy[1]]]

        with self._changed:
            first = None if self._oldest is None else saved(self._oldest)
            return {"copies": [saved(copy) for copy in self._copies], "first": first}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the copies of :meth:`state_dict`; a copy for other policies is refused by name."""
        shapes = [tuple(policy.logits.shape) for policy in self.policies]

        def loaded(copy: Sequence) -> tuple[int, Logits]:
            iteration, logits = int(copy[0]), tuple(torch.as_tensor(x).numpy().copy() for x in copy[1])
            if [tuple(x.shape) for x in logits] != shapes:
                raise ValueError(
                    f"PolicyHistory.load_state_dict: the copy after iteration {iteration} has logits of shapes "
                    f"{[tuple(x.shape) for x in logits]}, the policies {shapes}"
                )
            return iteration, logits

        try:
            copies = [loaded(copy) for copy in state["copies"]]
            first = None if state["first"] is None else loaded(state["first"])
        except (KeyError, TypeError, IndexError) as error:
            raise ValueError(f"PolicyHistory.load_state_dict: not a PolicyHistory state ({error!r})") from error
        with self._changed:
            self._copies = deque(copies, maxlen=self.keep)
            self._oldest = first
            self._changed.notify_all()


class _LockstepBatchSampler:
    """The loader's batches as lists of :class:`SnapshotIndex`: the ``n``-th batch of an iteration over the data
    is first consumed at iteration ``base + (n - 1) * repeats + 1``, ``base`` being the last iteration published
    when its first batch is asked for (the loop then waits for it), and carries the copy ``lag`` iterations
    before that."""

    def __init__(self, batch_sampler: Iterable[list], history: PolicyHistory, lag: int, repeats: int) -> None:
        self.batch_sampler = batch_sampler
        self.history = history
        self.lag = lag
        self.repeats = repeats
        self.stop = threading.Event()

    def __iter__(self) -> Iterator[list[SnapshotIndex]]:
        stop = self.stop
        base = self.history.latest  # the loop waits for this batch: nothing is published meanwhile
        if base is None:
            raise RuntimeError(
                "PolicyHistory: no iteration published before the first batch; attach the history to the engine "
                "(history.attach(trainer)) or, in a plain loop, call history.publish(0) before iterating"
            )
        for n, indices in enumerate(self.batch_sampler):
            logits = self.history.logits_after(base + n * self.repeats + 1 - self.lag, stop)
            yield [SnapshotIndex(index, logits) for index in indices]

    def __len__(self) -> int:
        return wrapped_len(self.batch_sampler)


class LockstepThreadDataLoader(ThreadDataLoader):
    """MONAI's ``ThreadDataLoader`` whose batches draw their ops from ``history``'s copy ``lag`` iterations before
    the one that consumes them, so a seeded run repeats however fast the loop and the buffer thread are.

    Each batch it makes must be consumed, in order (Ignite does; so does a ``for`` loop over it). The buffer
    thread waits when it gets ``lag`` batches ahead; a smaller lag is more up to date and overlaps less work.
    An error on the buffer thread is raised on the loop's (MONAI's prints it from the thread and ends the epoch early).
    Transforms on the buffer thread should draw from their own seeded state (MONAI's ``Randomizable`` ones and
    jcsaug's do), not from torch's global generator, which the loop's thread draws from at its own pace.

    >>> import torch
    >>> from ignite.engine import Engine
    >>> from monai.data import Dataset, MetaTensor
    >>> from monai.transforms import Flipd
    >>> from jcsaug.policy import CategoricalPolicy, LearnableOneOfd, LockstepThreadDataLoader, PolicyHistory
    >>> policy = CategoricalPolicy([2])  # identity or flip
    >>> flip = LearnableOneOfd([Flipd("image", spatial_axis=0)], policy, group_key=None)
    >>> data = Dataset([{"image": MetaTensor(torch.zeros(1, 4, 4, 4))}] * 8, flip)
    >>> history = PolicyHistory(policy)
    >>> loader = LockstepThreadDataLoader(data, history, batch_size=2)
    >>> trainer = Engine(lambda engine, batch: batch["learnable_ops"].shape)  # your step and updaters here
    >>> history.attach(trainer)
    >>> trainer.run(loader, max_epochs=1).output
    torch.Size([2, 1])

    Args:
        dataset: the samples, e.g. a ``CacheDataset`` whose transforms hold the learnable ones.
        history: the :class:`PolicyHistory` of the policies those transforms draw from, attached to the loop.
        lag: iterations between a batch's copy and the iteration that consumes it. Default: the batches the loader
            can hold ahead, ``buffer_size + 1`` (+ ``num_workers x prefetch_factor`` with workers); at least
            ``num_workers x prefetch_factor + 1`` with workers, as they ask for batches before handing one over.
        batch_size, shuffle, sampler, batch_sampler, drop_last, generator: as for ``DataLoader``. The loader's
            ``sampler`` is the one its batches are drawn from (``batch_sampler.sampler`` where that is given), so
            MONAI's trainer sets a ``DistributedSampler``'s epoch as it does for a ``DataLoader``; in a plain loop
            or a bare Ignite ``Engine``, call its ``set_epoch`` yourself, as with any ``DataLoader``.
        buffer_size, buffer_timeout, repeats, use_thread_workers, kwargs: as for ``ThreadDataLoader``.
    """

    def __init__(
        self,
        dataset: Dataset,
        history: PolicyHistory,
        lag: int | None = None,
        batch_size: int = 1,
        shuffle: bool = False,
        sampler: Iterable | None = None,
        batch_sampler: Iterable[list] | None = None,
        drop_last: bool = False,
        buffer_size: int = 1,
        buffer_timeout: float = 0.01,
        repeats: int = 1,
        use_thread_workers: bool = False,
        **kwargs: Any,
    ) -> None:
        if not isinstance(history, PolicyHistory):
            raise TypeError(f"LockstepThreadDataLoader: history must be a PolicyHistory, got {type(history).__name__}")
        workers = int(kwargs.get("num_workers", 0))
        prefetched = workers * (kwargs.get("prefetch_factor") or 2) if workers else 0
        lag = buffer_size + 1 + prefetched if lag is None else int(lag)
        if lag < prefetched + 1:
            raise ValueError(
                f"LockstepThreadDataLoader: lag={lag} with num_workers={workers} (prefetch {prefetched} batches) "
                f"would stop the loop; use lag >= {prefetched + 1}"
            )
        if lag > history.keep:
            raise ValueError(f"LockstepThreadDataLoader: lag={lag} but the history keeps {history.keep} iterations")
        if batch_sampler is None:
            if sampler is None:
                generator = kwargs.get("generator")
                sampler = RandomSampler(dataset, generator=generator) if shuffle else SequentialSampler(dataset)  # type: ignore[arg-type]
            batch_sampler = BatchSampler(sampler, batch_size, drop_last)  # type: ignore[arg-type]
        elif sampler is not None or shuffle or batch_size != 1 or drop_last:
            raise ValueError("LockstepThreadDataLoader: batch_sampler excludes sampler, shuffle, batch_size, drop_last")
        self.history = history
        self.lag = lag
        self.lockstep = _LockstepBatchSampler(batch_sampler, history, lag, int(repeats))
        super().__init__(
            PolicySnapshotDataset(dataset, history.policies),
            buffer_size=buffer_size,
            buffer_timeout=buffer_timeout,
            repeats=repeats,
            use_thread_workers=use_thread_workers,
            batch_sampler=self.lockstep,
            **kwargs,
        )
        # DataLoader refuses `sampler` beside `batch_sampler` and then names a default one; with a batch sampler it
        # never reads it. MONAI's Workflow reads it to set a DistributedSampler's epoch, so it names the real one.
        object.__setattr__(self, "sampler", getattr(batch_sampler, "sampler", self.sampler))

    def __iter__(self) -> Iterator[Any]:
        stop = self.lockstep.stop = threading.Event()  # this iteration's: read when its first batch is asked for
        failures: list[Exception] = []
        # MONAI's ThreadDataLoader.__iter__, with the buffer thread's error kept: there the loop sees a short epoch
        made = _keeping_error(super(ThreadDataLoader, self).__iter__(), failures)
        batches = buffer_iterator(made, self.buffer_size, self.buffer_timeout, self.repeats)
        try:
            # a loop, not `yield from`: closed (the run ended or raised), this frame releases the buffer thread
            # from its wait before MONAI's buffer joins it
            for batch in batches:  # noqa: UP028
                yield batch
        finally:
            stop.set()
            self.history.wake()
            batches.close()
        if failures:
            raise failures[0]


def _keeping_error(batches: Iterator[Any], failures: list[Exception]) -> Iterator[Any]:
    """``batches``, ended by an error on the buffer thread, which goes into ``failures`` for the loop's thread."""
    try:
        yield from batches
    except Exception as error:
        failures.append(error)
