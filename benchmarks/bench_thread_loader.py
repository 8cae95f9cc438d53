"""What lockstep costs a thread loader: MONAI's ``ThreadDataLoader`` against ``LockstepThreadDataLoader``.

Command (from the repository root; about 20 s on 2 quiet cores)::

    python benchmarks/bench_thread_loader.py
    # defaults: --lags 1 2 --iterations 12 --repeats 3 --patch 32 --volume 48 --cases-per-batch 2
    #           --samples-per-case 4 --threads 1 --seed 0

One process trains a small 3D U-Net (MONAI's ``UNet``, one SGD step per iteration, the policy's logits moved after
each iteration as an update would) on the synthetic bundle's worker pipeline (``ContextCropd(RandCropByPosNegLabeld)``,
``ClassGroupd``, ``TRACascaded``) from the same cases, in an Ignite loop, with each loader in turn, interleaved
repeat by repeat:

* **DataLoader**: MONAI's ``DataLoader(num_workers=0)``, the batch made when the loop asks for it (no overlap);
* **ThreadDataLoader**: MONAI's, ``buffer_size=1``, over ``PolicySnapshotSampler`` / ``PolicySnapshotDataset``:
  the batches made on a thread ahead of the loop, each drawn from the policy as the thread found it (timing decides);
* **lockstep, lag L**: ``LockstepThreadDataLoader(buffer_size=1, lag=L)``, each batch drawn from the policy after
  iteration ``k - L``, the thread waiting when it gets that far ahead (lag 2 is the default for ``buffer_size=1``).

Printed per loader: wall seconds per iteration (median of the repeats; the loader and the loop overlap, so CPU time
would count both), the ratio to ``ThreadDataLoader`` measured in the same run, and whether its repeats drew the same
ops (a lockstep loader's must: the script stops otherwise). For information: no target.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_worker_counterfactuals import add_pipeline_arguments, check_pipeline_arguments, make_cases, pipeline
from ignite.engine import Engine
from monai.data import DataLoader, Dataset, ThreadDataLoader
from monai.losses import DiceCELoss
from monai.networks.nets import UNet
from monai.utils import set_determinism
from torch.utils.data import RandomSampler

from jcsaug.policy import (
    CategoricalPolicy,
    LockstepThreadDataLoader,
    PolicyHistory,
    PolicySnapshotDataset,
    PolicySnapshotSampler,
)


def make_loader(kind: str, dataset: Dataset, policy: CategoricalPolicy, batch_size: int) -> tuple:
    """The arm's loader and, for a lockstep one, its history (to attach to the loop)."""
    if kind == "DataLoader":
        return DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=0), None
    if kind == "ThreadDataLoader":
        sampler = PolicySnapshotSampler(RandomSampler(dataset), policy)
        return ThreadDataLoader(PolicySnapshotDataset(dataset, policy), sampler=sampler, batch_size=batch_size), None
    history = PolicyHistory(policy)
    lag = int(kind.rsplit(" ", 1)[1])
    return LockstepThreadDataLoader(dataset, history, lag=lag, batch_size=batch_size, shuffle=True), history


def run_arm(kind: str, cases: list[dict], args: argparse.Namespace) -> tuple[float, list[torch.Tensor]]:
    """Wall seconds per iteration of ``args.iterations`` iterations after one warm-up iteration, and the batches'
    op records."""
    set_determinism(seed=args.seed)
    transform = pipeline(args.patch, args.samples_per_case, 0)
    (policy,) = {t.policy for t in transform.transforms if hasattr(t, "policy")}
    dataset = Dataset(cases, transform=transform)
    loader, history = make_loader(kind, dataset, policy, args.cases_per_batch)
    net = UNet(3, 1, 2, channels=(8, 16, 32), strides=(2, 2))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    loss = DiceCELoss(to_onehot_y=True, softmax=True)
    started: list[float] = []
    ops: list[torch.Tensor] = []
    nudge = 0.01 * torch.randn(policy.logits.shape, generator=torch.Generator().manual_seed(1))

    def step(engine: Engine, batch: dict) -> None:
        if engine.state.iteration == 2:
            started.append(time.perf_counter())  # after the warm-up iteration
        ops.append(batch["tra_ops"])
        optimizer.zero_grad()
        loss(net(batch["image"]), batch["label"]).backward()
        optimizer.step()
        with torch.no_grad():  # as a policy update would
            policy.logits.add_(nudge)

    trainer = Engine(step)
    if history is not None:
        history.attach(trainer)
    trainer.run(loader, max_epochs=1, epoch_length=args.iterations + 1)
    seconds = (time.perf_counter() - started[0]) / args.iterations
    set_determinism(None)
    return seconds, ops


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lags", type=int, nargs="+", default=[1, 2], help="the lockstep loaders' lags")
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    add_pipeline_arguments(parser)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if min(args.lags) < 1 or args.iterations < 1 or args.repeats < 1:
        parser.error("--lags, --iterations and --repeats must be >= 1")
    check_pipeline_arguments(parser, args)
    torch.set_num_threads(args.threads)
    cases = make_cases(args.volume, args.cases_per_batch * (args.iterations + 1), args.seed)
    kinds = ["DataLoader", "ThreadDataLoader", *(f"lockstep, lag {lag}" for lag in args.lags)]
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    repeatable: dict[str, bool] = {}
    first_ops: dict[str, list[torch.Tensor]] = {}
    for repeat in range(args.repeats):
        for kind in kinds if repeat % 2 == 0 else kinds[::-1]:
            seconds, ops = run_arm(kind, cases, args)
            times[kind].append(seconds)
            same = all(torch.equal(a, b) for a, b in zip(first_ops.setdefault(kind, ops), ops, strict=True))
            repeatable[kind] = repeatable.get(kind, True) and same
    for kind in kinds:
        if kind.startswith("lockstep") and not repeatable[kind]:
            raise RuntimeError(f"{kind}: the repeats drew different ops; a lockstep loader must repeat its draws")
    baseline = statistics.median(times["ThreadDataLoader"])
    print("loader              s / iteration  / ThreadDataLoader  same ops in every repeat")
    for kind in kinds:
        median = statistics.median(times[kind])
        print(f"{kind:<18}  {median:>13.3f}  {median / baseline:>16.2f}x  {'yes' if repeatable[kind] else 'no':>24}")
    print(
        f"Wall seconds per iteration (median of {args.repeats} repeats of {args.iterations} iterations after a "
        f"warm-up; {args.cases_per_batch} cases x {args.samples_per_case} patches of {args.patch}³ a batch, a U-Net "
        f"step each, {args.threads} torch thread(s)); ratios measured in this run."
    )


if __name__ == "__main__":
    main()
