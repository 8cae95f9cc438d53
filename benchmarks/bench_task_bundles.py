"""Seconds per training iteration of a dataset bundle, per network: joint TRA+TEA learning with policy updates
every 10 iterations vs plain heuristic training, measured in the same run (ratios, on the CPU by default).

Command (from the repository root; about 15-20 min on 2 quiet cores with the defaults)::

    python benchmarks/bench_task_bundles.py
    # defaults: --bundle atlas_stroke --networks deepmedic unet3d transformer --blocks 4 --cases-per-batch 2
    #           --samples-per-case 2 --threads <torch default>
    python benchmarks/bench_task_bundles.py --dataset-dir data/atlas_stroke   # a prepared real dataset

Setting: the bundle's ``train.yaml`` as it is (DeepMedic: the paper's 37³ segments = 109³ input patches;
SGD; the bundle's data pipeline with class-balanced patch sampling and
the TRA cascade, DataLoader without workers), parsed twice per network with MONAI's ``ConfigParser``:

* ``heuristic``: ``tra_mode=heuristic``, ``tea_mode=none`` (the nnU-Net/DeepMedic preset, no learning);
* ``joint``: ``tra_mode=class-specific``, ``tea_mode=joint``, ``tra_update_every=tea_update_every=10``.

Without ``--dataset-dir`` the data are 64³ synthetic lesion volumes (``jcsaug.data.make_synthetic_dataset``,
binary, z-scored at load) with a datalist in the prepared format: larger than the patches, so that patch
centres, and hence the class groups a TRA update needs, vary (on volumes no larger than the patch every patch
is the whole volume and every TRA update is skipped). The run prints how many policy updates were done.
The U-Net and transformer use ``--patch`` (32³ by default on the CPU; ``--patch 64 64 64`` for the paper's).
The batch is ``--cases-per-batch`` x ``--samples-per-case`` patches (paper: n = m = 10; smaller by default so
the CPU run stays short) and the validation batch as many (m = n). Z = 10 TEA copies as the bundle.

Timing: the two trainers alternate in blocks of 10 iterations (one policy update per block for ``joint``);
``Engine.interrupt`` at the end of every block, then ``run()`` resumes. An iteration's time is the interval
between consecutive ``ITERATION_COMPLETED`` events after every other handler (so it includes loading the next
batch and the policy updates). The first block warms up; the table gives the median over the other blocks of
each block's mean seconds per iteration, and the ratio joint / heuristic (median of the per-block ratios).
The paper reports about +20 % training time with updates every 10 iterations.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from ignite.engine import Events
from monai.bundle import ConfigParser

from jcsaug.networks import get_network

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 10


def _synthetic_dataset(work: Path, task: str) -> Path:
    """64³ synthetic lesion volumes (``jcsaug.data.make_synthetic_dataset``) with a datalist in the prepared
    format of ``task``: volumes larger than the patches, so patch centres (and class groups) vary."""
    from jcsaug.data import make_synthetic_dataset

    path = make_synthetic_dataset(work / "data", num_train=8, num_val=4, num_test=1, shape=(64, 64, 64), progress=False)
    datalist = json.loads(path.read_text())
    datalist.update(name=task, normalisation={"scheme": "zscore"})
    path.write_text(json.dumps(datalist))
    return path.parent


def _trainer(bundle: str, overrides: dict):
    parser = ConfigParser()
    parser.read_config(str(ROOT / "bundles" / bundle / "configs" / "train.yaml"))
    parser.read_meta(str(ROOT / "bundles" / bundle / "configs" / "metadata.json"))  # names the bundle's task
    parser.update(overrides)
    for expression in parser.get("initialize", []):
        parser.get_parsed_content(f"initialize#{parser.get('initialize').index(expression)}")
    trainer = parser.get_parsed_content("trainer")
    trainer.policy_updaters = parser.get_parsed_content("policy_updaters")  # the same (cached) instances
    times: list[float] = []
    last = [None]

    def tick(engine):
        now = time.perf_counter()
        if last[0] is not None:
            times.append(now - last[0])
        last[0] = now
        if engine.state.iteration % BLOCK == 0:
            engine.interrupt()

    trainer.add_event_handler(Events.ITERATION_COMPLETED, tick)
    return trainer, times, last


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", default="atlas_stroke")
    p.add_argument("--networks", nargs="+", default=["deepmedic", "unet3d", "transformer"])
    p.add_argument("--dataset-dir", help="a folder prepared by `jcsaug prepare` (default: fake data)")
    p.add_argument("--blocks", type=int, default=4, help="blocks of 10 iterations per mode (first = warm-up)")
    p.add_argument("--cases-per-batch", type=int, default=2)
    p.add_argument("--samples-per-case", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--patch",
        type=int,
        nargs=3,
        default=[32, 32, 32],
        help="U-Net / transformer patch (default 32³ to keep the CPU run short; the paper's is 64³); "
        "DeepMedic keeps the paper's 37³ segments",
    )
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="bench_bundles_"))
    dataset = Path(args.dataset_dir) if args.dataset_dir else _synthetic_dataset(work, args.bundle)
    n = args.cases_per_batch * args.samples_per_case
    print(f"bundle {args.bundle}, batch n = m = {n}, Z = 10, blocks of {BLOCK} iterations x {args.blocks} "
          f"(first = warm-up), U-Net/transformer patch {args.patch}, DeepMedic 37³ segments, "
          f"{torch.get_num_threads()} threads, device cpu", flush=True)  # fmt: skip
    modes = {
        "heuristic": {"tra_mode": "heuristic", "tea_mode": "none"},
        "joint": {"tra_mode": "class-specific", "tea_mode": "joint", "tra_update_every": 10, "tea_update_every": 10},
    }
    rows = []
    for network in args.networks:
        common = {
            "dataset_dir": str(dataset), "network": network, "max_epochs": 1, "epoch_length": BLOCK * args.blocks,
            "num_workers": 0, "cases_per_batch": args.cases_per_batch, "samples_per_case": args.samples_per_case,
            "val_batch_size": n, "device": "$torch.device('cpu')",
        }  # fmt: skip
        if get_network(network).patch_sizes is None:  # logits cover the patch (not DeepMedic's segments)
            common["patch_size"] = list(args.patch)
        runs = {
            m: _trainer(args.bundle, {**common, **o, "output_dir": str(work / network / m)}) for m, o in modes.items()
        }
        per_block: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(args.blocks):
            for mode, (trainer, times, last) in runs.items():
                times.clear()
                last[0] = time.perf_counter()
                trainer.run()
                per_block[mode].append(sum(times) / len(times))
        heuristic, joint = per_block["heuristic"][1:], per_block["joint"][1:]
        ratio = statistics.median(j / h for j, h in zip(joint, heuristic))
        rows.append((network, statistics.median(heuristic), statistics.median(joint), ratio))
        counts = ", ".join(f"{u.name} {u.updates} done / {u.skipped} skipped" for u in runs["joint"][0].policy_updaters)
        print(f"  {network} joint policy updates: {counts}", flush=True)
        print(
            f"  {network}: heuristic {rows[-1][1]:.3f} s/it, joint {rows[-1][2]:.3f} s/it, ratio {ratio:.2f}",
            flush=True,
        )
    print("\n| network | heuristic s/it | joint (updates every 10) s/it | joint / heuristic |")
    print("|---|---|---|---|")
    for network, h, j, r in rows:
        print(f"| {network} | {h:.3f} | {j:.3f} | **{r:.2f}** |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
