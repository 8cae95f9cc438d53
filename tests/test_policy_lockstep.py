"""Lockstep snapshots (``PolicyHistory`` + ``LockstepThreadDataLoader``): a batch made on MONAI's buffer thread
draws from the policies ``lag`` iterations before the one consuming it, however fast the loop and the thread are."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from ignite.engine import Engine, Events
from ignite.handlers import Checkpoint, DiskSaver
from monai.data import CacheDataset, MetaTensor
from monai.engines import Workflow
from monai.losses import DiceCELoss
from monai.networks.nets import UNet
from monai.transforms import Compose, Flipd
from monai.utils import set_determinism
from torch.utils.data import BatchSampler, Dataset, DistributedSampler, SequentialSampler

from helpers import epoch_orders
from jcsaug.engine import TRAPolicyUpdater
from jcsaug.policy import (
    CategoricalPolicy,
    ClassGroupd,
    LearnableOneOfd,
    LockstepThreadDataLoader,
    PolicyHistory,
    TRACascaded,
    make_tra_policy,
)


class _SeenLogit(Dataset):
    """Items are the logit the policy's draws would see (the copy sent with the index)."""

    def __init__(self, policy: CategoricalPolicy, size: int = 8) -> None:
        self.policy, self.size = policy, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> float:
        return float(self.policy.sampling_logits()[0, 1])


class _Delayed(Dataset):
    """``dataset``'s items after a delay."""

    def __init__(self, dataset: Dataset, delay: float) -> None:
        self.dataset, self.delay = dataset, delay

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> object:
        time.sleep(self.delay)
        return self.dataset[index]


def _returns_within(seconds: float, work: Callable[[], object]) -> None:
    """Run ``work`` on a daemon thread: a hang fails the test instead of the suite; no thread is left behind."""
    before = set(threading.enumerate())
    failure: list[BaseException] = []

    def guarded() -> None:
        try:
            work()
        except BaseException as error:  # re-raised on the test's thread
            failure.append(error)

    runner = threading.Thread(target=guarded, daemon=True)
    runner.start()
    runner.join(timeout=seconds)
    assert not runner.is_alive(), "did not return: MONAI's buffer joined a thread still waiting for the policies"
    if failure:
        raise failure[0]
    assert set(threading.enumerate()) <= before, "a buffer thread was left running"


def _run(loader: LockstepThreadDataLoader, policy: CategoricalPolicy, step_delay: float, epochs: int = 2) -> list:
    """Ignite run over ``loader``; after iteration i the policy's logit is i. Returns each batch as consumed."""
    seen = []

    def step(engine: Engine, batch: torch.Tensor) -> None:
        time.sleep(step_delay)
        seen.append(batch.tolist())
        with torch.no_grad():
            policy.logits[0, 1] = float(engine.state.iteration)

    trainer = Engine(step)
    loader.history.attach(trainer)
    trainer.run(loader, max_epochs=epochs)
    return seen


@pytest.mark.parametrize("lag,buffer_size", [(None, 1), (3, 3), (1, 2)])
def test_each_batch_draws_from_the_policies_lag_iterations_before_it_whichever_side_is_slow(
    lag: int | None, buffer_size: int
) -> None:
    runs = []
    for step_delay, data_delay in [(0.03, 0.0), (0.0, 0.01)]:  # a slow loop (the thread waits), slow data
        policy = CategoricalPolicy([2])
        loader = LockstepThreadDataLoader(
            _Delayed(_SeenLogit(policy), data_delay),
            PolicyHistory(policy),
            lag=lag,
            batch_size=2,
            buffer_size=buffer_size,
        )
        runs.append(_run(loader, policy, step_delay))
    lag = buffer_size + 1 if lag is None else lag
    # 4 batches an epoch, 2 epochs: batch k (from 1) sees the logit after iteration max(k - lag, 0), which is that
    expected = [[float(max(k - lag, 0))] * 2 for k in range(1, 9)]
    assert runs[0] == expected
    assert runs[1] == expected


def test_a_repeated_batch_counts_from_the_first_iteration_consuming_it() -> None:
    policy = CategoricalPolicy([2])
    loader = LockstepThreadDataLoader(_SeenLogit(policy), PolicyHistory(policy), lag=2, batch_size=2, repeats=2)
    # Ignite's epoch is len(loader) = 4 iterations, two per batch: batch n is first consumed at iteration 2n - 1
    seen = _run(loader, policy, 0.01, epochs=4)
    assert seen == [[float(max(2 * ((i + 1) // 2) - 1 - 2, 0))] * 2 for i in range(1, 17)]


def test_with_workers_the_default_lag_covers_their_prefetch_and_a_smaller_one_is_refused() -> None:
    policy = CategoricalPolicy([2])
    loader = LockstepThreadDataLoader(_SeenLogit(policy), PolicyHistory(policy), batch_size=2, num_workers=2)
    assert loader.lag == 1 + 1 + 2 * 2
    assert _run(loader, policy, 0.0) == [[float(max(k - 6, 0))] * 2 for k in range(1, 9)]
    with pytest.raises(ValueError, match=r"lag=4 with num_workers=2 \(prefetch 4 batches\).*lag >= 5"):
        LockstepThreadDataLoader(_SeenLogit(policy), PolicyHistory(policy), lag=4, batch_size=2, num_workers=2)
    with pytest.raises(ValueError, match="lag=9 but the history keeps 8 iterations"):
        LockstepThreadDataLoader(_SeenLogit(policy), PolicyHistory(policy, keep=8), lag=9)


def _learnable_ops(step_delay: float, data_delay: float) -> list[list[int]]:
    """The ops a seeded ``LearnableOneOfd`` draws per batch over 3 epochs, its policy moving every iteration."""
    set_determinism(seed=0)
    policy = CategoricalPolicy([2])
    chooser = LearnableOneOfd([Flipd("image", spatial_axis=0)], policy, group_key=None)
    items = [{"image": MetaTensor(torch.zeros(1, 2, 2, 2))} for _ in range(12)]
    data = _Delayed(CacheDataset(items, chooser, progress=False), data_delay)
    loader = LockstepThreadDataLoader(data, PolicyHistory(policy), batch_size=3, shuffle=True)
    ops = []

    def step(engine: Engine, batch: dict) -> None:
        time.sleep(step_delay)
        ops.append(batch["learnable_ops"].flatten().tolist())
        sure = engine.state.iteration % 2  # all on the flip after odd iterations, on the identity after even ones
        policy.set_probabilities([np.array([1.0 - sure, sure])], floor=1e-6)

    trainer = Engine(step)
    loader.history.attach(trainer)
    trainer.run(loader, max_epochs=3)
    set_determinism(None)
    return ops


def test_a_learnable_transform_draws_the_same_ops_whether_the_loop_or_the_data_is_slow() -> None:
    """The determinism the class exists for: MONAI's seeding, a learnable chooser, a policy moving every iteration."""
    slow_loop, slow_data = _learnable_ops(0.02, 0.0), _learnable_ops(0.0, 0.005)
    assert slow_loop == slow_data
    # batches 3.. draw from the policy after iteration k - 2
    assert [set(ops) for ops in slow_loop[2:]] == [{(k - 2) % 2} for k in range(3, 13)]


def _learned_tra(step_delay: float, data_delay: float) -> torch.Tensor:
    """The TRA policy's logits after a tiny seeded Ignite run: a TRA update every iteration, the cascade on the
    loader's buffer thread."""
    set_determinism(seed=0)
    tra = make_tra_policy("nnunet", num_groups=2)
    volumes = [torch.rand(1, 16, 16, 16) for _ in range(13)]
    items = [{"image": MetaTensor(v), "label": MetaTensor((v > 0.7).float())} for v in volumes]
    pipeline = Compose([ClassGroupd("label"), TRACascaded("image", tra, label_keys="label")])
    data = _Delayed(CacheDataset(items[:12], pipeline, progress=False), data_delay)
    # 4 patches a batch: the estimator compares the patches of a class group within a batch
    loader = LockstepThreadDataLoader(data, PolicyHistory(tra), batch_size=4, shuffle=True)
    net = UNet(3, 1, 2, channels=(4, 8), strides=(2,))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    loss = DiceCELoss(to_onehot_y=True, softmax=True)

    def step(engine: Engine, batch: dict) -> None:
        time.sleep(step_delay)
        optimizer.zero_grad()
        loss(net(batch["image"]), batch["label"]).backward()
        optimizer.step()

    trainer = Engine(step)
    validation = [{"image": items[12]["image"][None], "label": items[12]["label"][None]}]
    TRAPolicyUpdater(tra, net, validation, optimizer, lr=0.1, update_every=1).attach(trainer)
    loader.history.attach(trainer)
    trainer.run(loader, max_epochs=2)
    set_determinism(None)
    return tra.logits.detach().clone()


@pytest.mark.filterwarnings("ignore:TRA update skipped")  # a batch with one class group: expected in so few patches
def test_the_tra_policys_trajectory_repeats_whether_the_loop_or_the_data_is_slow() -> None:
    # an iteration takes ~0.1 s here: with the slow loop the buffer thread is ahead, with slow data behind
    slow_loop, slow_data = _learned_tra(0.3, 0.0), _learned_tra(0.0, 0.1)
    assert not torch.equal(slow_loop, make_tra_policy("nnunet", num_groups=2).logits)  # the updates moved it
    assert torch.equal(slow_loop, slow_data)


def test_a_run_that_raises_releases_the_waiting_buffer_thread_and_a_new_run_starts_afresh() -> None:
    policy = CategoricalPolicy([2])
    loader = LockstepThreadDataLoader(_SeenLogit(policy, size=40), PolicyHistory(policy), batch_size=2, buffer_size=4)

    def step(engine: Engine, batch: torch.Tensor) -> None:
        time.sleep(0.05)  # the buffer thread gets ahead and waits for the policies
        if engine.state.iteration == 3:
            raise KeyboardInterrupt

    def run() -> None:
        trainer = Engine(step)
        loader.history.attach(trainer)
        with pytest.raises(KeyboardInterrupt):
            trainer.run(loader, max_epochs=1)

    _returns_within(60, run)
    # the next run starts at iteration 0 again: the former run's copies are dropped
    with torch.no_grad():
        policy.logits[0, 1] = 7.0
    again = Engine(lambda engine, batch: None)
    seen = []
    again.add_event_handler(Events.ITERATION_COMPLETED, lambda engine: seen.append(engine.state.batch.tolist()))
    loader.history.attach(again)
    again.run(loader, max_epochs=1, epoch_length=3)
    assert seen == [[7.0, 7.0]] * 3


def test_a_plain_loop_publishes_by_hand_and_may_stop_early() -> None:
    policy = CategoricalPolicy([2])
    history = PolicyHistory(policy)
    loader = LockstepThreadDataLoader(_SeenLogit(policy, size=20), history, lag=1, batch_size=2, buffer_size=2)
    seen = []

    def loop() -> None:
        history.start()
        history.publish(0)
        for iteration, batch in enumerate(loader, start=1):
            seen.append(batch[0].item())
            with torch.no_grad():
                policy.logits[0, 1] = float(iteration)
            history.publish(iteration)
            if iteration == 4:
                break  # the loader's iterator is closed with the buffer thread waiting for iteration 4's copy
        history.close()

    _returns_within(60, loop)
    assert seen == [0.0, 1.0, 2.0, 3.0]  # lag 1: each batch sees the policies right before its iteration


def test_without_a_published_iteration_the_loader_raises_on_the_loops_thread() -> None:
    policy = CategoricalPolicy([2])
    loader = LockstepThreadDataLoader(_SeenLogit(policy), PolicyHistory(policy), batch_size=2)
    with pytest.raises(RuntimeError, match=r"no iteration published.*history.attach\(trainer\)"):
        next(iter(loader))


class _Broken(_SeenLogit):
    def __getitem__(self, index: int) -> float:
        if index == 5:
            raise KeyError("image: missing in item 5")
        return super().__getitem__(index)


def test_an_error_on_the_buffer_thread_is_raised_on_the_loops_thread() -> None:
    """MONAI's ThreadDataLoader would print it from its thread and end the epoch early; this one raises the error."""
    policy = CategoricalPolicy([2])
    loader = LockstepThreadDataLoader(_Broken(policy), PolicyHistory(policy), batch_size=2)
    with pytest.raises(KeyError, match="image: missing in item 5"):
        _returns_within(60, lambda: _run(loader, policy, 0.0))


class _Index(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        return index


@pytest.mark.parametrize("as_batch_sampler", [False, True])
def test_monais_trainer_sets_the_epoch_of_a_distributed_sampler_given_to_the_loader(as_batch_sampler: bool) -> None:
    """MONAI's Workflow sets the epoch of a DistributedSampler it finds as the loader's ``sampler``: each epoch is
    shuffled anew, as with a DataLoader (the sampler wrapped out of sight, every epoch repeated epoch 0's order)."""
    shards = DistributedSampler(_Index(), num_replicas=2, rank=1, shuffle=True, seed=3)
    policy = CategoricalPolicy([2])
    history = PolicyHistory(policy)
    given = (
        {"batch_sampler": BatchSampler(shards, 2, False)} if as_batch_sampler else {"sampler": shards, "batch_size": 2}
    )
    loader = LockstepThreadDataLoader(_Index(), history, **given)
    assert loader.sampler is shards
    seen: list[int] = []
    trainer = Workflow(
        device=torch.device("cpu"),
        max_epochs=3,
        data_loader=loader,
        iteration_update=lambda engine, batch: seen.extend(batch.tolist()),
        decollate=False,
    )
    history.attach(trainer)
    trainer.run()
    expected = epoch_orders(shards, (1, 2, 3))
    assert [seen[:4], seen[4:8], seen[8:]] == expected
    assert expected[0] != expected[1] != expected[2]


def _seen_in_a_plain_loop(policy: CategoricalPolicy, history: PolicyHistory, first: int, last: int) -> list[float]:
    """Iterations first+1 .. last of a plain loop (the logit is the iteration after each), as a resumed run does."""
    indices = SequentialSampler(range(2 * first, 2 * last))
    loader = LockstepThreadDataLoader(_SeenLogit(policy, size=40), history, lag=3, sampler=indices, batch_size=2)
    history.start(first)
    history.publish(first)
    seen = []
    for iteration, batch in enumerate(loader, start=first + 1):
        seen.append(batch[0].item())
        with torch.no_grad():
            policy.logits[0, 1] = float(iteration)
        history.publish(iteration)
    history.close()
    return seen


def test_a_resume_with_the_history_from_the_checkpoint_draws_as_the_uninterrupted_run(tmp_path: Path) -> None:
    policy = CategoricalPolicy([2])
    uninterrupted = _seen_in_a_plain_loop(policy, PolicyHistory(policy), 0, 8)
    assert uninterrupted == [0.0, 0.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0]

    policy = CategoricalPolicy([2])
    history = PolicyHistory(policy)
    first_half = _seen_in_a_plain_loop(policy, history, 0, 4)
    path = tmp_path / "checkpoint.pt"
    torch.save({"policy": policy.state_dict(), "history": history.state_dict()}, path)
    checkpoint = torch.load(path, weights_only=True)  # torch's default since 2.6: tensors, lists and ints only
    resumed_policy = CategoricalPolicy([2])
    resumed_policy.load_state_dict(checkpoint["policy"])
    resumed_history = PolicyHistory(resumed_policy)
    resumed_history.load_state_dict(checkpoint["history"])
    assert first_half + _seen_in_a_plain_loop(resumed_policy, resumed_history, 4, 8) == uninterrupted
    # without the history, the first lag batches after the resume see the policies at the resume
    fresh = PolicyHistory(resumed_policy)
    with torch.no_grad():
        resumed_policy.logits[0, 1] = 4.0
    assert _seen_in_a_plain_loop(resumed_policy, fresh, 4, 8)[:3] == [4.0, 4.0, 4.0]


def _ignite_epochs(folder: Path, epochs: int, state: dict | None = None) -> list[float]:
    """Epochs of 4 iterations (the logit is the iteration after each), saving the trainer, the policy and its
    history with Ignite's ``Checkpoint`` in ``folder`` at each epoch's end; ``state`` (a loaded one) resumes."""
    policy = CategoricalPolicy([2])
    history = PolicyHistory(policy)
    loader = LockstepThreadDataLoader(_SeenLogit(policy), history, lag=3, batch_size=2)
    seen = []

    def step(engine: Engine, batch: torch.Tensor) -> None:
        seen.append(batch[0].item())
        with torch.no_grad():
            policy.logits[0, 1] = float(engine.state.iteration)

    trainer = Engine(step)
    history.attach(trainer)
    objects = {"trainer": trainer, "policy": policy, "history": history}
    if state is not None:
        Checkpoint.load_objects(objects, state)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, Checkpoint(objects, DiskSaver(folder, require_empty=False)))
    trainer.run(loader, max_epochs=epochs)
    return seen


def test_ignites_checkpoint_saves_the_history_and_a_resume_draws_as_the_uninterrupted_run(tmp_path: Path) -> None:
    uninterrupted = _ignite_epochs(tmp_path / "whole", epochs=2)
    assert uninterrupted == [0.0, 0.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    first_epoch = _ignite_epochs(tmp_path / "first", epochs=1)
    (saved,) = (tmp_path / "first").glob("checkpoint_*.pt")
    state = torch.load(saved, weights_only=True)  # torch's default since 2.6: tensors, lists and numbers only
    # batches 5 and 6 draw from the policy after iterations 2 and 3, which only the saved history holds
    assert first_epoch + _ignite_epochs(tmp_path / "second", epochs=2, state=state) == uninterrupted


def test_the_history_refuses_what_would_mislead_by_name() -> None:
    policy = CategoricalPolicy([2, 3], num_groups=2)
    history = PolicyHistory(policy, keep=2)
    history.start()
    for iteration in range(4):
        history.publish(iteration)
    history.publish(3)  # again: kept as first published
    with pytest.raises(ValueError, match="iteration 2 after iteration 3.*start"):
        history.publish(2)
    with pytest.raises(RuntimeError, match=r"after iteration 1 are no longer kept \(the oldest kept is 2\).*keep=2"):
        history.logits_after(1)
    assert history.logits_after(-5)[0].shape == (2, 5)  # before the run's first: its first copy
    with pytest.raises(RuntimeError, match="after iteration 4, but the last published is 3.*raise the loader's lag"):
        history.logits_after(4)  # the loop's own thread would wait for itself
    other = PolicyHistory(CategoricalPolicy([2]))
    with pytest.raises(ValueError, match=r"the copy after iteration 2 has logits of shapes \[\(2, 5\)\]"):
        other.load_state_dict(history.state_dict())
    with pytest.raises(ValueError, match="not a PolicyHistory state"):
        other.load_state_dict({"copies": []})
    with pytest.raises(TypeError, match="history must be a PolicyHistory"):
        LockstepThreadDataLoader(_SeenLogit(CategoricalPolicy([2])), policy)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="keep must be >= 1"):
        PolicyHistory(policy, keep=0)
