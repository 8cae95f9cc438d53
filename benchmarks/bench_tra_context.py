"""What the TRA's context costs per training patch, and what it buys, on the CPU (a DataLoader worker's work).

Command (from the repository root; about 20 s on 2 cores)::

    python benchmarks/bench_tra_context.py
    # defaults: --sizes 32 64 --volume 2.5 --samples 20 --repeats 5 --threads 1 --seed 0

For each patch size, one process times, interleaved sample by sample, two worker pipelines on the same volume (a
float32 image ``volume`` times the patch size per axis, with a labelled blob so both class groups occur):

* **plain**: ``RandCropByPosNegLabeld`` -> ``ClassGroupd`` -> ``TRACascaded`` (the patch as cropped);
* **context**: ``ContextCropd(the same crop, tra_context(patch))`` -> ``ClassGroupd`` -> ``TRACascaded(context=)``
  (each patch cut with the context around it; the cascade resamples from it and returns the patch).

Both draw the same centres and ops (same seeds). Per-sample time = median over the repeats, averaged over the
samples; the ratio context / plain is the cost of the context (for information: no target). What it buys is printed
beside it: the share of the output patch's voxels that are padding rather than image (a key of ones in the volume,
resampled as a label, is 0 wherever the voxel came from outside the patch or the volume), over the same samples.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from monai.transforms import Compose, RandCropByPosNegLabeld

from jcsaug.data import ContextCropd
from jcsaug.ops import tra_context
from jcsaug.policy import ClassGroupd, TRACascaded, make_tra_policy

KEYS = ["image", "label", "inside"]
LABELS = ["label", "inside"]  # "inside": ones in the volume, resampled as a label, so 0 marks padding in view


def make_volume(size: int, factor: float) -> dict[str, torch.Tensor]:
    edge = int(round(size * factor))
    label = torch.zeros(1, edge, edge, edge)
    lo, hi = edge // 2 - size // 4, edge // 2 + size // 4
    label[0, lo:hi, lo:hi, lo:hi] = 1
    image = torch.rand(1, edge, edge, edge, generator=torch.Generator().manual_seed(0))
    return {"image": image, "label": label, "inside": torch.ones(1, edge, edge, edge)}


def pipelines(size: int, seed: int) -> dict[str, Compose]:
    policy = make_tra_policy("nnunet", num_groups=2)
    context = tra_context((size,) * 3)

    def crop() -> RandCropByPosNegLabeld:
        return RandCropByPosNegLabeld(KEYS, "label", spatial_size=(size,) * 3, num_samples=1)

    plain = Compose([crop(), ClassGroupd("label"), TRACascaded("image", policy, label_keys=LABELS)])
    enlarged = Compose([ContextCropd(crop(), context), ClassGroupd("label"),
                        TRACascaded("image", policy, label_keys=LABELS, context=context)])  # fmt: skip
    return {"plain": plain.set_random_state(seed), "context": enlarged.set_random_state(seed)}


def bench_size(size: int, factor: float, samples: int, repeats: int, seed: int) -> dict:
    volume = make_volume(size, factor)
    times: dict[str, list[list[float]]] = {name: [[] for _ in range(samples)] for name in ("plain", "context")}
    padding: dict[str, list[float]] = {"plain": [], "context": []}
    for repeat in range(repeats):
        pipes = pipelines(size, seed)  # the same draws on every repeat
        for i in range(samples):
            for name in ("plain", "context") if (i + repeat) % 2 == 0 else ("context", "plain"):
                start = time.process_time()
                (out,) = pipes[name](dict(volume))
                times[name][i].append(time.process_time() - start)
                if repeat == 0:
                    padding[name].append(float((torch.as_tensor(out["inside"]) == 0).float().mean()))
    per_sample = {k: statistics.mean(statistics.median(t) for t in v) * 1000 for k, v in times.items()}
    return {"size": size, "context": tra_context((size,) * 3)[0], **{f"{k}_ms": v for k, v in per_sample.items()},
            "ratio": per_sample["context"] / per_sample["plain"],
            **{f"{k}_padding": 100 * statistics.mean(v) for k, v in padding.items()}}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 64], help="patch edge lengths")
    parser.add_argument("--volume", type=float, default=2.5, help="volume edge / patch edge")
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.samples < 1 or args.repeats < 1 or args.volume < 1 or min(args.sizes) < 4:
        parser.error("--samples and --repeats >= 1, --volume >= 1, --sizes >= 4")
    torch.set_num_threads(args.threads)
    np.random.seed(args.seed)
    rows = [bench_size(s, args.volume, args.samples, args.repeats, args.seed) for s in args.sizes]
    print("size  context  plain ms  context ms  context/plain  padding in view: plain  context")
    for r in rows:
        print(f"{r['size']:>3}³  {r['context']:>7}  {r['plain_ms']:>8.2f}  {r['context_ms']:>10.2f}  "
              f"{r['ratio']:>12.2f}x  {r['plain_padding']:>21.1f} %  {r['context_padding']:>5.1f} %")  # fmt: skip
    print(
        f"Per-sample CPU time (median of {args.repeats} repeats, mean of {args.samples} samples) of a worker's crop "
        "+ class group + TRA cascade (nnU-Net preset), with the patch as cropped (plain) or cut with the TRA context "
        "(context). Padding in view: the share of the output patches' voxels that are padding, not image (with the "
        "context, what remains comes from beyond the volume's edge, or from rotations about two or three axes at once)."
    )


if __name__ == "__main__":
    main()
