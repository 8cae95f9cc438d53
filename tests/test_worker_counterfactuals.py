"""The DataLoader workers make the paired TRA's counterfactual copies only for the batches a TRA update scores
(``CounterfactualSampler`` + ``CounterfactualDataset``), and the run is the same as with copies on every batch; they
draw from the policy as it was when each index was dispatched (``PolicySnapshotSampler`` + ``PolicySnapshotDataset``),
so the run is the same however late the workers make the batches."""

from __future__ import annotations

import multiprocessing
import warnings
from types import SimpleNamespace

import pytest
import torch
from ignite.engine import Events
from monai.data import DataLoader, Dataset
from monai.transforms import Compose
from monai.utils import set_determinism
from torch.utils.data import RandomSampler, SequentialSampler, get_worker_info

from helpers import SMALL_DATASET_KEPT
from jcsaug.engine import CounterfactualDataset, CounterfactualSampler
from jcsaug.policy import (
    PolicySnapshotDataset,
    PolicySnapshotSampler,
    TRACascaded,
    make_tra_policy,
    making_counterfactuals,
)


def _samples(n: int = 8) -> list[dict]:
    from helpers import lesion_batch

    batch = lesion_batch(n, seed=5)
    return [{k: v[i] for k, v in batch.items()} for i in range(n)]


class _LateAfterTheFirstBatch:
    """In a DataLoader worker, hold every sample after the worker's first ``batch_size`` until ``released`` is set
    (the main process sets it at the first policy update): the worker makes its later batches after that update,
    as a worker slowed by a busy machine would. In the main process, pass the sample on."""

    def __init__(self, released: multiprocessing.synchronize.Event, batch_size: int = 2) -> None:
        self.released, self.batch_size, self.made = released, batch_size, 0

    def __call__(self, data: dict) -> dict:
        if get_worker_info() is not None:
            self.made += 1
            if self.made > self.batch_size:
                assert self.released.wait(timeout=60), "the main process made no policy update"
        return data


def _worker_run(
    schedule: bool,
    start: float,
    num_workers: int,
    epoch_length: int | None = None,
    resume_at: int = 0,
    late_workers: bool = False,
) -> tuple[torch.Tensor, list[int], int, list]:
    """A paired-TRA run augmenting in the DataLoader (2 samples per batch, 4 batches of data, 2 epochs of
    ``epoch_length`` iterations, by default the data's; updates every 2nd iteration after a warm-up of ``start``;
    ``resume_at``: the engine starts from that many iterations done, as a resumed run; ``late_workers``: each worker
    makes its batches after its first only once the first update is done): the final logits, the iterations whose
    batch held copies, the updates made, and the batches' op records. The workers draw from the policy as it was
    when the loader dispatched each index (``PolicySnapshotSampler``), as the bundles' do."""
    from helpers import paired_tra_training

    set_determinism(seed=0)
    policy, engine, updater = paired_tra_training(start)
    cascade = TRACascaded("image", policy, label_keys="label", counterfactuals=2)
    released = multiprocessing.get_context().Event()
    transform = Compose([_LateAfterTheFirstBatch(released), cascade]) if late_workers else cascade
    dataset = Dataset(_samples(), transform=transform)
    if schedule:
        sampler = CounterfactualSampler(RandomSampler(dataset), batch_size=2, counterfactuals_for=updater)
        sampler.attach(engine)
        dataset = CounterfactualDataset(dataset)
    else:
        sampler = RandomSampler(dataset)  # as DataLoader(shuffle=True) draws the indices
    loader = DataLoader(PolicySnapshotDataset(dataset, policy), sampler=PolicySnapshotSampler(sampler, policy),
                        batch_size=2, num_workers=num_workers)  # fmt: skip
    with_copies, ops = [], []
    engine.add_event_handler(
        Events.ITERATION_STARTED, lambda e: "image_cf" in e.state.batch and with_copies.append(e.state.iteration)
    )
    engine.add_event_handler(Events.ITERATION_STARTED, lambda e: ops.append(e.state.batch["tra_ops"].clone()))
    updater.attach(engine)

    @engine.on(Events.ITERATION_COMPLETED)  # after the updater's handler
    def release_after_the_first_update(_: object) -> None:
        if updater.updates and not released.is_set():
            with torch.no_grad():  # and move the policy far, as a large step would: a late draw from it would differ
                policy.logits.add_(4.0 * (torch.arange(policy.logits.numel()) % 3).reshape(policy.logits.shape))
            released.set()

    if resume_at:
        engine.load_state_dict({"iteration": resume_at, "epoch_length": epoch_length, "max_epochs": 2})
    engine.run(loader, max_epochs=2, epoch_length=epoch_length)
    set_determinism(None)
    return policy.logits.detach().clone(), with_copies, updater.updates, ops


@pytest.mark.parametrize(("start", "num_workers"), [(0.0, 0), (0.5, 0), (0.0, 2)])
def test_workers_make_copies_for_the_tra_updates_only_and_the_run_is_unchanged(start: float, num_workers: int) -> None:
    logits, with_copies, updates, ops = _worker_run(schedule=True, start=start, num_workers=num_workers)
    every_logits, every_batch, every_updates, every_ops = _worker_run(False, start, num_workers)
    assert every_batch == list(range(1, 9))
    assert with_copies == ([2, 4, 6, 8] if start == 0 else [6, 8])  # every 2nd iteration, after the warm-up's 4
    assert updates == every_updates == len(with_copies)  # none skipped: every update found its copies
    assert all(torch.equal(a, b) for a, b in zip(ops, every_ops, strict=True))  # the same samples drew the same ops
    assert torch.equal(logits, every_logits)  # the same draws, so the same policy trajectory


def test_late_workers_draw_what_prompt_ones_draw() -> None:
    """Each worker makes its batches after its first only once the main process has updated the policy (a busy
    machine's worst case): the samples draw the same ops, and the policy follows the same trajectory, as when the
    workers are ahead. Read live, those batches would be drawn from the updated policy."""
    logits, _, updates, ops = _worker_run(True, 0.0, 2)
    late_logits, _, late_updates, late_ops = _worker_run(True, 0.0, 2, late_workers=True)
    assert updates == late_updates == 4
    assert all(torch.equal(a, b) for a, b in zip(ops, late_ops, strict=True))
    assert torch.equal(logits, late_logits)


@pytest.mark.parametrize("resume_at", [0, 3])
def test_the_copies_follow_the_iterations_across_a_data_restart_mid_epoch_and_a_resume(resume_at: int) -> None:
    """Epochs of 3 iterations over 4 batches of data: Ignite keeps the data's iterator across the epoch boundary and
    restarts it within the second epoch; a resumed engine starts the data after 3 iterations done (odd, so a count
    from 0 would put the copies on the wrong batches and the updates would find none)."""
    logits, with_copies, updates, _ = _worker_run(True, 0.0, 0, epoch_length=3, resume_at=resume_at)
    every_logits, _, every_updates, _ = _worker_run(False, 0.0, 0, epoch_length=3, resume_at=resume_at)
    assert with_copies == ([2, 4, 6] if resume_at == 0 else [4, 6])
    assert updates == every_updates == len(with_copies) and torch.equal(logits, every_logits)


def test_the_sampler_counts_iterations_from_where_the_engine_is_when_the_data_starts() -> None:
    asked = []
    schedule = SimpleNamespace(updates_at=lambda engine, iteration: asked.append(iteration) or iteration % 3 == 0)
    sampler = CounterfactualSampler(SequentialSampler(range(7)), batch_size=2, counterfactuals_for=schedule)
    assert list(sampler) == [(i, True) for i in range(7)]  # not attached: copies everywhere, as without it
    sampler.attach(SimpleNamespace(state=SimpleNamespace(iteration=4)))  # e.g. resumed after 4 iterations
    tagged = list(sampler)
    assert [i for i, _ in tagged] == list(range(7)) and len(sampler) == 7
    assert sorted(set(asked)) == [5, 6, 7, 8]  # batches of 2: iterations 5..8
    assert [m for _, m in tagged] == [False, False, True, True, False, False, False]


def test_a_wrapped_distributed_sampler_is_given_the_engines_epoch() -> None:
    """As MONAI's trainer sets the epoch of a DistributedSampler it sees in the DataLoader (its shuffle depends on it),
    the counterfactual sampler sets it on the sampler it wraps (multi_gpu_train.yaml)."""
    from torch.utils.data import DistributedSampler

    from helpers import epoch_orders

    at_1, at_2 = epoch_orders(DistributedSampler(range(16), num_replicas=2, rank=1, shuffle=True, seed=5), (1, 2))
    wrapped = CounterfactualSampler(DistributedSampler(range(16), num_replicas=2, rank=1, shuffle=True, seed=5), 2)
    engine = SimpleNamespace(state=SimpleNamespace(iteration=0, epoch=1))
    wrapped.attach(engine)
    assert [i for i, _ in wrapped] == at_1
    engine.state.epoch = 2
    assert [i for i, _ in wrapped] == at_2 != at_1


def test_unattached_a_wrapped_distributed_sampler_repeating_its_epoch_is_warned_of() -> None:
    from torch.utils.data import DistributedSampler

    wrapped = CounterfactualSampler(DistributedSampler(range(16), num_replicas=2, rank=1, shuffle=True, seed=5), 2)
    first = list(wrapped)
    with pytest.warns(
        RuntimeWarning, match=r"CounterfactualSampler: .* again at epoch 0.*attach the Counterfac"
    ) as seen:
        assert list(wrapped) == first
    assert seen[0].filename == __file__  # shown at the caller's line, not inside jcsaug or torch
    wrapped.sampler.set_epoch(1)  # an epoch given by hand: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(wrapped)


def test_the_dataset_makes_copies_as_tagged_and_passes_plain_indices_through() -> None:
    cascade = TRACascaded("image", make_tra_policy("uniform", num_groups=2), label_keys="label", counterfactuals=2)
    dataset = CounterfactualDataset(Dataset(_samples(2), transform=cascade))
    assert len(dataset) == 2
    assert "image_cf" in dataset[(0, True)] and "image_cf" not in dataset[(0, False)]
    assert "image_cf" in dataset[1]  # another sampler's plain index: copies made, as without the wrapper
    with making_counterfactuals(False):
        assert "image_cf" not in cascade(_samples(1)[0])
        assert "image_cf" in cascade(_samples(1)[0], make_counterfactuals=True)  # the caller's word wins
    assert "image_cf" in cascade(_samples(1)[0])  # restored after the block


def test_the_sampler_refuses_a_batch_size_below_one() -> None:
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        CounterfactualSampler(range(3), batch_size=0)


@pytest.mark.filterwarnings(SMALL_DATASET_KEPT)
@pytest.mark.parametrize("augment_on", ["worker", "device"])
def test_the_bundle_tags_its_training_batches_for_the_tra_update_in_worker_mode(tmp_path, augment_on: str) -> None:
    """The default bundle's loader draws its cases through the sampler, attached to the trainer: in the workers the
    copies are made for the TRA update's iterations only (every 2nd); on the device the workers make none."""
    from monai.bundle import ConfigParser

    from helpers import CONFIGS, small_dataset

    small_dataset(tmp_path)
    parser = ConfigParser()
    parser.read_config(str(CONFIGS / "train.yaml"))
    parser.update({"dataset_dir": str(tmp_path / "data"), "output_dir": str(tmp_path / "run"), "num_workers": 0,
                   "augment_on": augment_on})  # fmt: skip
    trainer = parser.get_parsed_content("trainer")
    loader, sampler = parser.get_parsed_content("train_loader"), parser.get_parsed_content("counterfactual_sampler")
    policy = parser.get_parsed_content("augmentation").tra_policy
    assert isinstance(loader.sampler, PolicySnapshotSampler) and loader.sampler.policies == [policy]
    assert loader.sampler.sampler is sampler and sampler.engine is trainer
    assert isinstance(loader.dataset, PolicySnapshotDataset) and loader.dataset.policies == [policy]
    assert isinstance(loader.dataset.dataset, CounterfactualDataset)
    updater = parser.get_parsed_content("policy_updaters").tra
    assert sampler.counterfactuals_for is (updater if augment_on == "worker" else None)
    trainer.state.iteration = 0  # as at the run's start
    batches = iter(loader)
    first, second = next(batches), next(batches)  # for iterations 1 and 2
    if augment_on == "worker":
        assert "image_cf" not in first and "image_cf" in second and second["image_cf"].shape[1] == 2
    else:
        assert "image_cf" not in first and "image_cf" not in second and "tra_ops" not in second
