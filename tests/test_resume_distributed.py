"""Exact resume of a distributed run: every rank continues its own policy-updater state (its random stream, seeded
seed + rank, and its running op effects), so an interrupted and resumed run draws the ops of an uninterrupted one on
every rank (2 gloo ranks on the CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ignite.engine import Engine, Events

from helpers import lesion_batch
from jcsaug.engine import ResumeCheckpoint, StopAfterEpochs, TEAPolicyUpdater, shutdown_distributed
from jcsaug.engine.checkpoints import read_checkpoint
from jcsaug.policy import make_tea_policy


def _job(net: torch.nn.Module, val: list, run_dir: Path, resume: bool = False, stop: int = 0) -> dict:
    """Two epochs of two paired TEA updates (no model step); the ops measured in each update, and the end state."""
    updater = TEAPolicyUpdater(make_tea_policy("nnunet"), net, val, lr=0.05, num_copies=4, seed=0, estimator="paired")
    engine = Engine(lambda e, b: None)
    ResumeCheckpoint(run_dir, {"tea_updater": updater}, resume=resume).attach(engine)
    StopAfterEpochs(stop).attach(engine)
    updater.attach(engine)
    ops, before = [], {}

    @engine.on(Events.ITERATION_STARTED)
    def count(e):
        before["count"] = updater.effects.count.clone()

    @engine.on(Events.ITERATION_COMPLETED)  # after the update: the ops it measured are those whose count grew
    def measured(e):
        ops.append([e.state.epoch, torch.nonzero(updater.effects.count - before["count"])[:, 1].tolist()])

    engine.run(range(2), max_epochs=2)
    return {"ops": ops, "estimate": updater.effects.estimate.tolist(), "logits": updater.policy.logits.tolist()}


def _rank(rank: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        net = torch.nn.Conv3d(1, 2, 1)  # not trained: every job scores with the same network
        val = [lesion_batch(2, seed=100 + rank)]  # each rank its own validation patches
        result = {"straight": _job(net, val, Path(out_dir, "straight"))}
        _job(net, val, Path(out_dir, "resumed"), stop=1)  # the time-boxed first job: epoch 1
        dist.barrier()  # rank 0 has written resume.pt
        result["resumed"] = _job(net, val, Path(out_dir, "resumed"), resume=True)  # epoch 2
    finally:
        # gloo's threads must stop before the interpreter does (else SIGABRT at exit, see jcsaug.engine.distributed)
        shutdown_distributed()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.usefixtures("hide_gpus")  # CPU ranks also where CUDA is available
def test_resumed_ranks_draw_the_ops_of_an_uninterrupted_run(tmp_path):
    torch.multiprocessing.start_processes(_rank, args=(str(tmp_path),), nprocs=2, start_method="spawn")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    second = []
    for rank, result in enumerate(results):
        straight, resumed = result["straight"], result["resumed"]
        assert [epoch for epoch, _ in resumed["ops"]] == [2, 2], rank  # the resumed job ran epoch 2 only
        assert resumed["ops"] == [op for op in straight["ops"] if op[0] == 2], rank
        assert all(len(ops) == 4 for _, ops in resumed["ops"]), rank  # Z = 4 ops measured per update
        assert resumed["estimate"] == straight["estimate"], rank  # this rank's own running op effects
        assert resumed["logits"] == straight["logits"], rank
        second.append(resumed["ops"])
    assert second[0] != second[1]  # the ranks draw their own ops (rank 1 did not continue rank 0's stream)
    saved = read_checkpoint(tmp_path / "resumed" / "resume.pt")["rank_states"]
    assert saved["world_size"] == 2 and set(saved["states"]["tea_updater"]) == {1}
