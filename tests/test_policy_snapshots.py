"""Policy snapshots: the workers draw from the logits sent with each index (``PolicySnapshotSampler`` +
``PolicySnapshotDataset``, ``sampling_from``), not from the live ones. The run-level check, workers made late on
purpose, is ``test_worker_counterfactuals.py::test_late_workers_draw_what_prompt_ones_draw``."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from monai.engines import Workflow
from monai.transforms import Flipd
from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler

from helpers import epoch_orders
from jcsaug.policy import (
    CategoricalPolicy,
    LearnableOneOfd,
    PolicySnapshotDataset,
    PolicySnapshotSampler,
    SnapshotIndex,
    sampling_from,
)


def _sure(policy: CategoricalPolicy, op: int) -> np.ndarray:
    """A snapshot of ``policy`` with all probability on ``op`` in every series."""
    policy.set_probabilities([np.eye(n)[min(op, n - 1)] for n in policy.series_sizes], floor=1e-12)
    return policy.snapshot()


def test_within_sampling_from_a_policy_draws_from_its_snapshot_and_others_from_their_live_logits() -> None:
    policy, other = CategoricalPolicy([3, 2], num_groups=2), CategoricalPolicy([2])
    first = _sure(policy, 1)
    _sure(policy, 0)  # the live logits move on after the snapshot
    _sure(other, 1)
    rng = np.random.RandomState(0)
    with sampling_from({policy: first}):
        assert policy.sample_ops(1, rng).tolist() == [1, 1]  # the snapshot's
        assert other.sample_ops(0, rng).tolist() == [1]  # not in the block's mapping: live
        assert torch.equal(policy.sampling_logits(), torch.from_numpy(first))
    assert policy.sample_ops(1, rng).tolist() == [0, 0]  # live again after the block
    with pytest.raises(ValueError, match=r"snapshot of shape \(2, 2\) for a policy with logits \(2, 5\)"):
        with sampling_from({policy: np.zeros((2, 2), np.float32)}):
            pass


def test_a_learnable_chooser_draws_from_the_snapshot_too() -> None:
    policy = CategoricalPolicy([2])
    snapshot = _sure(policy, 1)
    _sure(policy, 0)
    chooser = LearnableOneOfd([Flipd("image", spatial_axis=0)], policy, group_key=None).set_random_state(0)
    sample = {"image": torch.arange(3.0).reshape(1, 3, 1, 1)}
    assert chooser(sample)["learnable_ops"].tolist() == [0]
    with sampling_from({policy: snapshot}):
        assert chooser(sample)["learnable_ops"].tolist() == [1]


def test_the_sampler_sends_a_copy_of_the_logits_when_each_index_is_asked_for() -> None:
    policy = CategoricalPolicy([2, 3])
    sampler = PolicySnapshotSampler(SequentialSampler(range(3)), policy)
    assert len(sampler) == 3 and sampler.policies == [policy]
    indices = iter(sampler)
    first = next(indices)
    _sure(policy, 1)  # an update between two dispatches
    second = next(indices)
    assert isinstance(first, SnapshotIndex) and (first.index, second.index) == (0, 1)
    assert np.array_equal(first.logits[0], np.zeros((1, 5), np.float32))  # as it was when asked for
    assert np.array_equal(second.logits[0], policy.snapshot())
    with torch.no_grad():
        policy.logits.zero_()
    assert not np.array_equal(second.logits[0], policy.snapshot())  # a copy, not a view of the live logits
    # numpy, sent by value: a tensor would go to the worker as a shared-memory handle per index
    assert type(pickle.loads(pickle.dumps(second)).logits[0]) is np.ndarray


def test_the_sampler_passes_the_epoch_on_to_a_distributed_sampler() -> None:
    at_3, at_0 = epoch_orders(DistributedSampler(range(16), num_replicas=2, rank=0, shuffle=True, seed=3), (3, 0))
    sampler = PolicySnapshotSampler(DistributedSampler(range(16), num_replicas=2, rank=0, shuffle=True, seed=3),
                                    [CategoricalPolicy([2])])  # fmt: skip
    sampler.set_epoch(3)
    assert [i.index for i in sampler] == at_3 != at_0
    PolicySnapshotSampler(range(2), CategoricalPolicy([2])).set_epoch(1)  # no set_epoch to pass on: nothing


def _epochs_under_monais_trainer(attach: bool, epochs: int = 3) -> tuple[list[list[int]], DistributedSampler]:
    """The indices each epoch of MONAI's Workflow consumed through a DataLoader over the snapshot wrappers."""
    shards = DistributedSampler(range(8), num_replicas=2, rank=1, shuffle=True, seed=3)
    policy = CategoricalPolicy([2])
    sampler = PolicySnapshotSampler(shards, policy)
    loader = DataLoader(PolicySnapshotDataset(list(range(8)), policy), sampler=sampler, batch_size=2)
    seen: list[int] = []
    trainer = Workflow(
        device=torch.device("cpu"),
        max_epochs=epochs,
        data_loader=loader,
        iteration_update=lambda engine, batch: seen.extend(batch.tolist()),
        decollate=False,
        handlers=[sampler] if attach else None,
    )
    trainer.run()
    return [seen[4 * e : 4 * e + 4] for e in range(epochs)], shards


def test_attached_to_monais_trainer_the_sampler_gives_a_distributed_sampler_each_epoch() -> None:
    consumed, shards = _epochs_under_monais_trainer(attach=True)
    expected = epoch_orders(shards, (1, 2, 3))
    assert consumed == expected
    assert expected[0] != expected[1] != expected[2]


def test_unattached_a_distributed_sampler_repeating_its_epoch_is_warned_of() -> None:
    """MONAI's trainer sees the wrapper, not the DistributedSampler: the order repeats, which is said by name."""
    with pytest.warns(RuntimeWarning, match=r"iterated again at epoch 0.*attach the PolicySnapshotSampler") as seen:
        consumed, _ = _epochs_under_monais_trainer(attach=False)
    assert {w.filename for w in seen} == {__file__}  # at the trainer.run() line, not inside MONAI, Ignite or torch
    assert consumed[0] == consumed[1] == consumed[2]


def test_the_samplers_length_is_the_wrapped_ones_and_a_stream_without_one_is_named() -> None:
    assert len(PolicySnapshotSampler(range(5), CategoricalPolicy([2]))) == 5
    with pytest.raises(TypeError, match="generator has no len()"):
        len(PolicySnapshotSampler((i for i in range(5)), CategoricalPolicy([2])))


def test_the_dataset_makes_each_item_from_its_snapshot_and_plain_indices_from_the_live_logits() -> None:
    policy = CategoricalPolicy([3])
    chooser = LearnableOneOfd([Flipd("image", 0), Flipd("image", 1)], policy, group_key=None).set_random_state(0)

    class Samples(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> dict:
            return chooser({"image": torch.zeros(1, 2, 2, 1)})

    dataset = PolicySnapshotDataset(Samples(), [policy])
    snapshot = _sure(policy, 2)
    _sure(policy, 1)
    assert len(dataset) == 4
    assert dataset[SnapshotIndex(0, (snapshot,))]["learnable_ops"].tolist() == [2]
    assert dataset[0]["learnable_ops"].tolist() == [1]  # another sampler's plain index: live
    with pytest.raises(ValueError, match="index 3 carries the logits of 2 policies, but the dataset was given 1"):
        dataset[SnapshotIndex(3, (snapshot, snapshot))]


def test_both_refuse_what_is_not_a_policy() -> None:
    with pytest.raises(TypeError, match=r"PolicySnapshotSampler: policies must be CategoricalPolicy .*\['Tensor'\]"):
        PolicySnapshotSampler(range(2), [torch.zeros(2)])
    with pytest.raises(TypeError, match="PolicySnapshotDataset: policies must be CategoricalPolicy .*none"):
        PolicySnapshotDataset([], [])
