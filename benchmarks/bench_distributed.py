"""Distributed policy learning on CPU (gloo): seconds per iteration with 1 and 2 processes at the same
global batch, and the share of a policy update spent in the all-reduce of the policy gradients.

The synthetic bundle's network (MONAI UNet 16/32/64), 32³ patches, a global batch of 8 training patches
(8 on one process, 4 per rank on two), 8 validation patches, joint TRA + TEA updates every iteration,
DDP over gloo; each process uses one intra-op thread (2 processes = the machine's 2 cores).

    python benchmarks/bench_distributed.py --iterations 12
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ignite.distributed as idist
import numpy as np
import torch
from ignite.engine import Engine, Events
from monai.losses import DiceCELoss
from monai.networks.nets import UNet
from torch.nn.parallel import DistributedDataParallel

from jcsaug.engine import AugmentationSetup
from jcsaug.engine import base as engine_base

GLOBAL_BATCH = 8


def _batch(n: int, size: int, seed: int, policy) -> dict:
    rng = np.random.RandomState(seed)
    img = torch.as_tensor(rng.randn(n, 1, size, size, size).astype(np.float32))
    lab = torch.zeros(n, 1, size, size, size)
    c = size // 2
    for i in range(n):
        lo, hi = (c - 4, c + 4) if i % 2 == 0 else (2, 10)
        lab[i, 0, lo:hi, lo:hi, lo:hi] = 1
        img[i, 0, lo:hi, lo:hi, lo:hi] += 2
    groups = torch.tensor([1 - i % 2 for i in range(n)])
    ops = torch.as_tensor(np.stack([policy.sample_ops(int(g), rng) for g in groups]))
    return {"image": img, "label": lab, "class_group": groups, "tra_ops": ops}


def _run(local_rank: int, iterations: int, size: int, out: str) -> None:
    torch.set_num_threads(1)
    world, rank = idist.get_world_size(), idist.get_rank()
    torch.manual_seed(0)
    net = UNet(3, 1, 2, channels=(16, 32, 64), strides=(2, 2), num_res_units=1)
    model = DistributedDataParallel(net) if world > 1 else net
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.99, nesterov=True)
    setup = AugmentationSetup("class-specific", "joint")
    per_rank = GLOBAL_BATCH // world
    data = [_batch(per_rank, size, 1000 * rank + i, setup.tra_policy) for i in range(iterations + 2)]
    val = [_batch(per_rank, size, 10_000 + 1000 * rank + i, setup.tra_policy) for i in range(2)]
    updaters = setup.updaters(model, opt, val, num_copies=4)
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True)

    def step(engine, batch):
        model.train()
        opt.zero_grad()
        loss = loss_fn(model(batch["image"]), batch["label"])
        loss.backward()
        opt.step()

    trainer = Engine(step)
    reduce_time, update_time, iter_time = [0.0], [0.0], []
    real_reduce, real_run = engine_base.PolicyUpdater._all_reduce, engine_base.PolicyUpdater._run_update

    def timed_reduce(self, grad, drawn):
        t = time.perf_counter()
        try:
            return real_reduce(self, grad, drawn)
        finally:
            reduce_time[0] += time.perf_counter() - t

    def timed_run(self, engine):
        t = time.perf_counter()
        try:
            return real_run(self, engine)
        finally:
            update_time[0] += time.perf_counter() - t

    engine_base.PolicyUpdater._all_reduce = timed_reduce
    engine_base.PolicyUpdater._run_update = timed_run
    for u in updaters:  # attached after the timers are installed (attach binds _run_update)
        u.attach(trainer)
    start = [0.0]

    @trainer.on(Events.ITERATION_STARTED)
    def _start(engine):
        idist.barrier()
        start[0] = time.perf_counter()

    @trainer.on(Events.ITERATION_COMPLETED)
    def _stop(engine):
        idist.barrier()
        if engine.state.iteration > 2:  # warm-up
            iter_time.append(time.perf_counter() - start[0])
        else:
            reduce_time[0] = update_time[0] = 0.0

    trainer.run(data, max_epochs=1)
    if rank == 0:
        Path(out).write_text(json.dumps({"iter": iter_time, "reduce": reduce_time[0], "update": update_time[0]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--patch", type=int, default=32)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in (1, 2):
            out = str(Path(tmp) / f"{nproc}.json")
            if nproc == 1:
                _run(0, args.iterations, args.patch, out)
            else:
                with idist.Parallel(backend="gloo", nproc_per_node=nproc) as parallel:
                    parallel.run(_run, args.iterations, args.patch, out)
            results[nproc] = json.loads(Path(out).read_text())
    base = statistics.median(results[1]["iter"])
    print(f"torch {torch.__version__}, global batch {GLOBAL_BATCH} x {args.patch}³, joint TRA+TEA every iteration, "
          f"{args.iterations} timed iterations, 1 thread per process, python {sys.version.split()[0]}")  # fmt: skip
    print(f"{'processes':>9} {'s/iteration':>12} {'vs 1 proc':>10} {'all-reduce / policy updates':>28}")
    for nproc, r in results.items():
        t = statistics.median(r["iter"])
        share = f"{r['reduce'] / r['update']:.2%}" if nproc > 1 else "- (no all-reduce)"
        print(f"{nproc:>9} {t:>12.3f} {t / base:>10.2f} {share:>28}")


if __name__ == "__main__":
    main()
