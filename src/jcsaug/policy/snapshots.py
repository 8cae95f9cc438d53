"""Policy snapshots sent with each index, so that what the DataLoader workers draw does not depend on their timing.

Transforms in the DataLoader workers (:class:`jcsaug.policy.TRACascaded`, :class:`jcsaug.policy.LearnableOneOfd`)
draw ops from a policy whose logits the main process updates in shared memory. Read live, the probabilities a
sample is drawn from depend on whether its worker makes it before or after the next policy update: on a quiet
machine the workers are ahead and a seeded run repeats, on a busy one it need not. The DataLoader asks its sampler
for a batch's indices at fixed points of the main loop (at its start, ``prefetch_factor x num_workers`` batches,
then one batch whenever it hands one to the loop), so :class:`PolicySnapshotSampler` copies the logits there and
sends the copy with each index, and :class:`PolicySnapshotDataset` makes the sample within
:func:`jcsaug.policy.sampling_from` that copy. The draws are then a function of the seed alone. With
``num_workers=0`` the indices are asked for when the batch is made, so nothing changes.

Not covered: a loader that asks for indices from a thread of its own, such as MONAI's ``ThreadDataLoader`` (its
buffer thread runs the sampler at that thread's pace, ahead of the loop by up to ``buffer_size + 1`` batches, so the
copy would be taken at a moment timing decides). Use :class:`jcsaug.policy.LockstepThreadDataLoader` in its place,
or draw the ops on the main process (:class:`jcsaug.policy.BatchTRACascaded` on each collated batch, the bundles'
``augment_on: device``).

Use both, with the same policies (they may wrap a :class:`jcsaug.engine.CounterfactualSampler` and
:class:`jcsaug.engine.CounterfactualDataset`, as the bundles do)::

    sampler = PolicySnapshotSampler(RandomSampler(dataset), [tra_policy])
    loader = DataLoader(PolicySnapshotDataset(dataset, [tra_policy]), sampler=sampler, batch_size=2, num_workers=2)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
from ignite.engine import Engine
from torch.utils.data import Dataset, Sampler

from jcsaug.policy.categorical import CategoricalPolicy, sampling_from
from jcsaug.utils import WrappedSamplerEpoch, wrapped_len


class SnapshotIndex(NamedTuple):
    """An index and the logits of the policies, in the sampler's order, when the DataLoader dispatched it."""

    index: Any
    logits: tuple[np.ndarray, ...]


def _as_policies(policies: CategoricalPolicy | Sequence[CategoricalPolicy], owner: str) -> list[CategoricalPolicy]:
    listed = [policies] if isinstance(policies, CategoricalPolicy) else list(policies)
    wrong = [type(p).__name__ for p in listed if not isinstance(p, CategoricalPolicy)]
    if not listed or wrong:
        raise TypeError(f"{owner}: policies must be CategoricalPolicy objects (at least one), got {wrong or 'none'}")
    return listed


class PolicySnapshotSampler(Sampler):
    """Yield a :class:`SnapshotIndex` for each index of ``sampler``: the index and a copy of ``policies``' logits
    taken when the DataLoader asks for it (at dispatch).

    A ``DistributedSampler`` wrapped here is out of MONAI's trainer's sight (it sets the epoch only of one it finds
    as the loader's ``sampler``): :meth:`attach` this sampler to the engine (e.g. in ``train_handlers``) or call
    :meth:`set_epoch` before each epoch, else every epoch repeats the same order (warned at the second).

    Args:
        sampler: the indices, e.g. ``RandomSampler(dataset)`` (as ``DataLoader(shuffle=True)`` draws them), a
            ``DistributedSampler`` or a :class:`jcsaug.engine.CounterfactualSampler`. ``set_epoch`` is passed on.
        policies: the policies the pipeline's transforms draw from (one or a list).
    """

    def __init__(self, sampler: Iterable, policies: CategoricalPolicy | Sequence[CategoricalPolicy]) -> None:
        self.sampler = sampler
        self.policies = _as_policies(policies, type(self).__name__)
        self.engine: Engine | None = None
        self._start_epoch = WrappedSamplerEpoch(type(self).__name__)

    def attach(self, engine: Engine) -> None:
        """Give the wrapped sampler the engine's epoch when its indices start, as MONAI's trainer gives it to a
        ``DistributedSampler`` it sees (and as :class:`jcsaug.engine.CounterfactualSampler` does)."""
        self.engine = engine

    def __iter__(self) -> Iterator[SnapshotIndex]:
        self._start_epoch(self.sampler, self.engine)
        for index in self.sampler:
            # per index, not per batch: a batch's indices are asked for in one go, so they get equal copies
            yield SnapshotIndex(index, tuple(policy.snapshot() for policy in self.policies))

    def __len__(self) -> int:
        return wrapped_len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        """Passed on to the wrapped sampler if it has one (a ``DistributedSampler`` shuffles by its epoch)."""
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


class PolicySnapshotDataset(Dataset):
    """``dataset`` whose items are asked for as :class:`SnapshotIndex` es (a :class:`PolicySnapshotSampler` over the
    same ``policies``): each is made within :func:`jcsaug.policy.sampling_from` the logits sent with it. A plain
    index (another sampler) is made with the live logits.

    MONAI's worker seeding (``set_rnd``) and :class:`jcsaug.engine.EpochReseeder` reach ``dataset``'s transforms
    through this wrapper as without it."""

    def __init__(self, dataset: Dataset, policies: CategoricalPolicy | Sequence[CategoricalPolicy]) -> None:
        self.dataset = dataset  # first: MONAI's set_rnd seeds the attributes in order, the policies hold no transform
        self.policies = _as_policies(policies, type(self).__name__)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, item: Any) -> Any:
        if not isinstance(item, SnapshotIndex):
            return self.dataset[item]
        if len(item.logits) != len(self.policies):
            raise ValueError(
                f"{type(self).__name__}: index {item.index!r} carries the logits of {len(item.logits)} policies, but "
                f"the dataset was given {len(self.policies)}: give the sampler and the dataset the same policies"
            )
        with sampling_from(dict(zip(self.policies, item.logits, strict=True))):
            return self.dataset[item.index]
