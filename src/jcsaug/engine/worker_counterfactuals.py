"""The paired TRA's counterfactual copies made in the DataLoader workers only for the batches a TRA update scores.

:class:`jcsaug.policy.TRACascaded` runs per sample in the workers, which do not know which iteration a sample is
for; the sampler, in the main process, can know it. :class:`CounterfactualSampler` tags each index with whether
its batch is one a TRA update will score, and :class:`CounterfactualDataset` makes the sample within
:func:`jcsaug.policy.making_counterfactuals` of that tag. The copies of other batches are drawn but not made, so
the random stream, and hence the run, is the same as with copies on every batch; only the work and the batch's
bytes are saved (with an update every 2nd iteration, half of the copies). The device path does the same in
:class:`jcsaug.engine.DeviceAugmentation`.

Use both, and attach the sampler to the trainer (it reads the iteration the epoch's data starts at)::

    sampler = CounterfactualSampler(RandomSampler(dataset), batch_size=2, counterfactuals_for=tra_updater)
    loader = DataLoader(CounterfactualDataset(dataset), sampler=sampler, batch_size=2, num_workers=2)
    sampler.attach(trainer)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from ignite.engine import Engine
from torch.utils.data import Dataset, Sampler

from jcsaug.engine.device_augmentation import UpdateSchedule
from jcsaug.policy.cascade import making_counterfactuals
from jcsaug.utils import WrappedSamplerEpoch, wrapped_len


class CounterfactualSampler(Sampler):
    """Yield ``(index, make_counterfactuals)`` for each index of ``sampler``: whether the batch holding it is for an
    iteration at which ``counterfactuals_for`` updates (:meth:`jcsaug.engine.TRAPolicyUpdater.updates_at`).

    The k-th index of an epoch's data goes into batch ``k // batch_size``, which Ignite consumes at the iteration
    after the one the engine had done when the data's iterator started (an epoch's start, or a restart mid-epoch);
    prefetching workers do not change that order. Until :meth:`attach` ed, or with ``counterfactuals_for=None``,
    every index is tagged ``True`` (copies on every batch, as without this sampler).

    A wrapped sampler with ``set_epoch`` (``DistributedSampler``) is given the engine's epoch when its indices
    start, as MONAI's trainer gives it to a ``DistributedSampler`` it finds in the DataLoader.

    Args:
        sampler: the indices, e.g. ``RandomSampler(dataset)`` (as ``DataLoader(shuffle=True)`` draws them) or a
            ``DistributedSampler``.
        batch_size: the DataLoader's batch size.
        counterfactuals_for: the TRA updater whose update iterations need the copies.
    """

    def __init__(
        self, sampler: Iterable[int], batch_size: int, counterfactuals_for: UpdateSchedule | None = None
    ) -> None:
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.sampler = sampler
        self.batch_size = int(batch_size)
        self.counterfactuals_for = counterfactuals_for
        self.engine: Engine | None = None
        self._start_epoch = WrappedSamplerEpoch(type(self).__name__)

    def attach(self, engine: Engine) -> None:
        self.engine = engine

    def __iter__(self) -> Iterator[tuple[Any, bool]]:
        schedule, engine = self.counterfactuals_for, self.engine
        self._start_epoch(self.sampler, engine)  # a DistributedSampler shuffles by its epoch
        if schedule is None or engine is None:
            for index in self.sampler:
                yield index, True
            return
        # read when the first index is asked for: when Ignite starts the data's iterator
        first = engine.state.iteration + 1
        for k, index in enumerate(self.sampler):
            yield index, schedule.updates_at(engine, first + k // self.batch_size)

    def __len__(self) -> int:
        return wrapped_len(self.sampler)


class CounterfactualDataset(Dataset):
    """``dataset`` whose items are asked for as ``(index, make_counterfactuals)`` (a :class:`CounterfactualSampler`):
    each is made within :func:`jcsaug.policy.making_counterfactuals`, so the pipeline's ``TRACascaded`` makes its
    copies only where asked. A plain index (another sampler) is passed through with the copies made.

    MONAI's worker seeding (``set_rnd``) and :class:`jcsaug.engine.EpochReseeder` reach ``dataset``'s transforms
    through this wrapper as without it."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, item: Any) -> Any:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], bool):
            index, make = item
            with making_counterfactuals(make):
                return self.dataset[index]
        return self.dataset[item]
