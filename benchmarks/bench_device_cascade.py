"""The batched TRA cascade on a device vs the per-sample worker path on the CPU vs MONAI's own transforms.

Command (from the repository root)::

    python benchmarks/bench_device_cascade.py --device cuda     # the issue's target: a GPU
    python benchmarks/bench_device_cascade.py --device cpu      # what a machine without one can measure
    # options: --batch 8 --size 128 --repeats 5 --warmup 1 --threads <torch default> --seed 0

One process, one batch of ``--batch`` x 1 x ``--size``³ float32 patches (half lesion-centred, so both class
groups occur) and their labels; three ways to apply nnU-Net-like augmentation, interleaved repeat by repeat
(order rotated), wall-clock time per batch (``torch.cuda.synchronize`` around each timed call on a GPU),
median over the repeats:

* ``batched``: ``BatchTRACascaded`` (nnunet preset, 2 class groups) on the collated batch on ``--device``:
  one ``grid_sample`` per key for all samples' affines, index ops, vectorised intensity ops;
* ``per-sample CPU``: ``ClassGroupd`` + ``TRACascaded`` on each CPU sample, as a DataLoader worker runs it;
* ``MONAI``: MONAI's dictionary transforms (``RandAffined`` for rotation + scaling with nnU-Net's
  probabilities, ``RandGaussianNoised``, ``RandGaussianSmoothd``, ``RandScaleIntensityd``,
  ``RandAdjustContrastd``, ``RandSimulateLowResolutiond``, ``RandFlipd`` x3) on each sample's tensors on
  ``--device``.

Printed: seconds per batch and the ratios per-sample CPU / batched (target on a GPU: >= 10) and MONAI on the
device / batched. The target is about a GPU; on the CPU the script still runs and prints the ratios.

With ``--counterfactuals K`` (default: the synthetic bundle's ``tra_counterfactuals``; 0 skips it) two more rows,
the batched cascade with the paired TRA estimator's K copies per sample made (``batched + K copies``) and drawn only
(``batched, copies drawn only``: what :class:`jcsaug.engine.DeviceAugmentation` with ``counterfactuals_for`` does on
the iterations without a TRA update), and what that schedule saves per iteration with a TRA update every
``--update-every`` iterations (default: the bundle's ``tra_update_every``): copies on every batch against copies on
the update iterations only; and the per-sample CPU path with the same copies (``per-sample CPU + K copies``: the
DataLoader workers make them for every batch). On the CPU use a patch of the bundle's size: ``--device cpu --size
32``.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time

import monai
import numpy as np
import torch
from bench_tra_cascade import KEYS, monai_nnunet_intensity_and_flips  # this folder's nnU-Net pipeline in MONAI
from monai.data import MetaTensor, list_data_collate
from monai.transforms import Compose, RandAffined
from synthetic_bundle import bundle_default  # this folder's path to the synthetic bundle

from jcsaug.policy import BatchTRACascaded, ClassGroupd, TRACascaded, make_tra_policy

TARGET_GPU = 10.0
#: the synthetic bundle's counterfactual copies per sample and TRA update interval (the defaults of the copies' rows)
SYNTHETIC_COPIES = int(bundle_default("tra_counterfactuals"))
SYNTHETIC_UPDATE_EVERY = int(bundle_default("tra_update_every"))


def make_samples(n: int, size: int, seed: int) -> list[dict]:
    rng = np.random.RandomState(seed)
    grid = np.stack(np.meshgrid(*[np.arange(size, dtype=np.float32)] * 3, indexing="ij"))
    out = []
    for i in range(n):
        centre = np.full(3, size / 2) if i % 2 == 0 else rng.uniform(0.1 * size, 0.3 * size, 3)
        label = (((grid - centre[:, None, None, None]) ** 2).sum(0) <= (0.15 * size) ** 2).astype(np.float32)
        image = rng.normal(0.0, 0.3, label.shape).astype(np.float32) + 2.0 * label
        sample = {
            "image": MetaTensor(torch.from_numpy(image)[None]),
            "label": MetaTensor(torch.from_numpy(label)[None]),
        }
        out.append(ClassGroupd("label")(sample))
    return out


def monai_nnunet() -> Compose:
    """nnU-Net's augmentation in MONAI, with rotation + scaling as one ``RandAffined`` (p = 1 - 0.8²)."""
    angle = math.radians(30.0)
    affine = RandAffined(KEYS, prob=0.36, rotate_range=(angle,) * 3, scale_range=(0.3,) * 3,
                         mode=("bilinear", "nearest"), padding_mode="zeros")  # fmt: skip
    return Compose([affine, *monai_nnunet_intensity_and_flips()])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--counterfactuals", type=int, default=SYNTHETIC_COPIES, help="K copies per sample (0: none)")
    parser.add_argument("--update-every", type=int, default=SYNTHETIC_UPDATE_EVERY, help="iterations per TRA update")
    args = parser.parse_args(argv)
    if args.counterfactuals < 0 or args.update_every < 1:
        parser.error(f"--counterfactuals must be >= 0 and --update-every >= 1, got {args.counterfactuals} and "
                     f"{args.update_every}")  # fmt: skip
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    samples = make_samples(args.batch, args.size, args.seed)
    on_device = [{k: v.to(device) if k in KEYS else v for k, v in s.items()} for s in samples]
    policy = make_tra_policy("nnunet", num_groups=2)
    batched = BatchTRACascaded("image", policy, label_keys="label", device=device).set_random_state(args.seed)
    per_sample = TRACascaded("image", policy, label_keys="label").set_random_state(args.seed)
    monai_pipe = monai_nnunet().set_random_state(args.seed)
    collated = list_data_collate(on_device)

    runners = {
        "batched": lambda: batched(collated),
        "per-sample CPU": lambda: [per_sample(dict(s)) for s in samples],
        "MONAI": lambda: [monai_pipe(dict(s)) for s in on_device],
    }
    copies = args.counterfactuals
    if copies:
        with_copies = BatchTRACascaded("image", policy, label_keys="label", device=device, counterfactuals=copies)
        with_copies.set_random_state(args.seed)
        runners[f"batched + {copies} copies"] = lambda: with_copies(collated)
        runners["batched, copies drawn only"] = lambda: with_copies(collated, make_counterfactuals=False)
        per_sample_copies = TRACascaded("image", policy, label_keys="label", counterfactuals=copies)
        per_sample_copies.set_random_state(args.seed)
        runners[f"per-sample CPU + {copies} copies"] = lambda: [per_sample_copies(dict(s)) for s in samples]
    times: dict[str, list[float]] = {k: [] for k in runners}
    names = list(runners)
    for r in range(args.warmup + args.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            sync()
            t0 = time.perf_counter()
            runners[name]()
            sync()
            if r >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    s = {k: statistics.median(v) for k, v in times.items()}
    print(f"batched TRA cascade | torch {torch.__version__}, MONAI {monai.__version__}, {platform.machine()}, "
          f"{torch.get_num_threads()} threads | device {device} "
          f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}) | batch {args.batch} x 1 x "
          f"{args.size}³ | {args.repeats} repeats (median), wall clock")  # fmt: skip
    for name in names:
        print(f"  {name:<26} {s[name]:8.4f} s per batch")
    speedup = s["per-sample CPU"] / s["batched"]
    verdict = ("PASS" if speedup >= TARGET_GPU else "MISS") if device.type == "cuda" else "(target is for a GPU)"
    print(f"  per-sample CPU / batched on {device}: {speedup:.2f}  target >= {TARGET_GPU:g} {verdict}")
    print(f"  MONAI on {device} / batched on {device}: {s['MONAI'] / s['batched']:.2f}")
    if copies:
        made, drawn, n = s[f"batched + {copies} copies"], s["batched, copies drawn only"], args.update_every
        scheduled = (made + (n - 1) * drawn) / n
        print(f"  {copies} counterfactual copies, a TRA update every {n} iterations: copies on every batch "
              f"{made:.4f} s per iteration, on the update iterations only {scheduled:.4f} s "
              f"({made / scheduled:.2f}x faster, {made - scheduled:.4f} s saved per iteration)")  # fmt: skip
        worker = s[f"per-sample CPU + {copies} copies"] - s["per-sample CPU"]
        print(f"  the same copies in the DataLoader workers (per-sample CPU, made for every batch): {worker:.4f} s "
              f"per batch, {worker * (n - 1) / n:.4f} s of it on iterations without a TRA update")  # fmt: skip


if __name__ == "__main__":
    main()
