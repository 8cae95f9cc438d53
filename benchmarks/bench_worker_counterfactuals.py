"""What the workers save by making the paired TRA's counterfactual copies only for the batches a TRA update scores.

Command (from the repository root; about 30 s on 2 cores)::

    python benchmarks/bench_worker_counterfactuals.py
    # defaults: --counterfactuals 2 4 --update-every 2 10 --patch 32 --volume 48 --cases-per-batch 2
    #           --samples-per-case 4 --batches 20 --repeats 3 --threads 1 --seed 0

One process runs, on the CPU and interleaved repeat by repeat, the worker pipeline of the synthetic bundle (load
from a cache, ``ContextCropd(RandCropByPosNegLabeld)``, ``ClassGroupd``, ``TRACascaded(counterfactuals=K,
context=)``, collation) through a ``DataLoader`` (``num_workers=0``: the work a worker does) in two arms:

* **every batch**: ``DataLoader(shuffle=True)``, the copies made for every sample (as before the sampler);
* **update batches**: ``CounterfactualSampler`` + ``CounterfactualDataset`` with a TRA update every
  ``update_every``-th iteration (the synthetic bundle: 2; the dataset bundles' paper setting: 1, nothing to save;
  10 is their documented cheaper setting), the copies drawn for every sample and made for those batches only.

Both draw the same cases, centres and ops (same seeds; checked). Printed per (K, N): CPU time per batch (median of
the repeats), the ratio update batches / every batch, and the batch's bytes (the tensors the workers hand to the
main process) in each arm. For information: no target.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch
from monai.data import DataLoader, Dataset
from monai.transforms import Compose, RandCropByPosNegLabeld
from monai.utils import set_determinism
from torch.utils.data import RandomSampler

from jcsaug.data import ContextCropd
from jcsaug.engine import CounterfactualDataset, CounterfactualSampler
from jcsaug.ops import tra_context
from jcsaug.policy import ClassGroupd, TRACascaded, make_tra_policy


def make_cases(volume: int, cases: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``cases`` float32 images of ``volume``³ voxels with a labelled blob each (both class groups occur)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(cases):
        label = torch.zeros(1, volume, volume, volume, dtype=torch.uint8)
        lo = int(rng.integers(volume // 4, volume // 2))
        label[0, lo : lo + volume // 4, lo : lo + volume // 4, lo : lo + volume // 4] = 1
        image = torch.as_tensor(rng.normal(size=(1, volume, volume, volume)).astype(np.float32)) + label
        out.append({"image": image, "label": label})
    return out


def pipeline(patch: int, samples: int, counterfactuals: int) -> Compose:
    context = tra_context((patch,) * 3)
    crop = RandCropByPosNegLabeld(["image", "label"], "label", spatial_size=(patch,) * 3, num_samples=samples)
    cascade = TRACascaded("image", make_tra_policy("nnunet", num_groups=2), label_keys="label",
                          counterfactuals=counterfactuals, context=context)  # fmt: skip
    return Compose([ContextCropd(crop, context), ClassGroupd("label"), cascade])


def add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    """The worker pipeline's sizes (``make_cases`` and ``pipeline``), shared with ``bench_thread_loader.py``."""
    parser.add_argument("--patch", type=int, default=32)
    parser.add_argument("--volume", type=int, default=48, help="case edge length (the synthetic cases: 48)")
    parser.add_argument("--cases-per-batch", type=int, default=2)
    parser.add_argument("--samples-per-case", type=int, default=4)


def check_pipeline_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.volume < args.patch or args.cases_per_batch < 1 or args.samples_per_case < 1:
        parser.error("--volume must be >= --patch; --cases-per-batch and --samples-per-case >= 1")


def loader(cases: list[dict], args: argparse.Namespace, k: int, update_every: int | None) -> DataLoader:
    """The arm's DataLoader over the same cases; ``update_every`` None: copies on every batch."""
    dataset = Dataset(cases, transform=pipeline(args.patch, args.samples_per_case, k))
    if update_every is None:
        return DataLoader(dataset, batch_size=args.cases_per_batch, shuffle=True, num_workers=0)
    schedule = SimpleNamespace(updates_at=lambda engine, iteration: iteration % update_every == 0)
    sampler = CounterfactualSampler(RandomSampler(dataset), args.cases_per_batch, counterfactuals_for=schedule)
    sampler.attach(SimpleNamespace(state=SimpleNamespace(iteration=0)))  # an engine at the run's start
    return DataLoader(CounterfactualDataset(dataset), sampler=sampler, batch_size=args.cases_per_batch, num_workers=0)


def run_arm(cases: list[dict], args: argparse.Namespace, k: int, update_every: int | None) -> tuple[float, float, list]:
    """CPU seconds for ``args.batches`` batches, mean MB per batch, and the batches' op records."""
    set_determinism(seed=args.seed)
    batches = iter(loader(cases, args, k, update_every))
    seconds, megabytes, ops = 0.0, [], []
    for _ in range(args.batches):
        start = time.process_time()
        batch = next(batches)
        seconds += time.process_time() - start
        megabytes.append(sum(v.nbytes for v in batch.values() if isinstance(v, torch.Tensor)) / 2**20)
        ops.append(batch["tra_ops"])
    set_determinism(None)
    return seconds, statistics.mean(megabytes), ops


def bench(args: argparse.Namespace, k: int, update_every: int) -> dict:
    cases = make_cases(args.volume, max(args.cases_per_batch * args.batches, 2), args.seed)
    times: dict[str, list[float]] = {"every": [], "update": []}
    size: dict[str, float] = {}
    records: dict[str, list] = {}
    for repeat in range(args.repeats):
        for arm in ("every", "update") if repeat % 2 == 0 else ("update", "every"):
            seconds, mb, ops = run_arm(cases, args, k, None if arm == "every" else update_every)
            times[arm].append(seconds / args.batches * 1000)
            size[arm], records[arm] = mb, ops
    if not all(torch.equal(a, b) for a, b in zip(records["every"], records["update"], strict=True)):
        raise RuntimeError("the two arms drew different ops: the sampler changed the random stream")
    every, update = (statistics.median(times[a]) for a in ("every", "update"))
    return {"k": k, "update_every": update_every, "every_ms": every, "update_ms": update, "ratio": update / every,
            "every_mb": size["every"], "update_mb": size["update"]}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counterfactuals", type=int, nargs="+", default=[2, 4], help="K, copies per sample")
    parser.add_argument("--update-every", type=int, nargs="+", default=[2, 10], help="N, iterations per TRA update")
    add_pipeline_arguments(parser)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if min(args.counterfactuals) < 1 or min(args.update_every) < 1 or args.batches < 1 or args.repeats < 1:
        parser.error("--counterfactuals, --update-every, --batches and --repeats must be >= 1")
    check_pipeline_arguments(parser, args)
    torch.set_num_threads(args.threads)
    rows = [bench(args, k, n) for k in args.counterfactuals for n in args.update_every]
    print("K  update every  every batch ms  update batches ms  ratio  batch MB: every  update batches (mean)")
    for r in rows:
        print(f"{r['k']:>1}  {r['update_every']:>12}  {r['every_ms']:>14.1f}  {r['update_ms']:>17.1f}  "
              f"{r['ratio']:>4.2f}x  {r['every_mb']:>15.2f}  {r['update_mb']:>21.2f}")  # fmt: skip
    print(
        f"CPU time per batch ({args.cases_per_batch} cases x {args.samples_per_case} patches of {args.patch}³, "
        f"median of {args.repeats} repeats of {args.batches} batches) of the workers' pipeline with the paired TRA's K "
        "counterfactual copies made for every batch, or only for the batches of the TRA update's iterations "
        "(CounterfactualSampler); the same cases, centres and ops in both (checked)."
    )


if __name__ == "__main__":
    main()
