"""Benchmark of the TRA cascade (SPEC §2) against plain MONAI and TorchIO, on the CPU.

Command (from the repository root; about 1.5 min on 2 cores)::

    python benchmarks/bench_tra_cascade.py
    # defaults: --sizes 64 128 --samples 30 10 --repeats 6 --warmup 3 --threads 1 --clock cpu
    #           --malloc default --seed 0
    python benchmarks/bench_tra_cascade.py --malloc keep   # steadier: large buffers reused, no page faults

For single-channel float32 patches of 64³ and 128³ (MetaTensors with an identity affine, as
``LoadImaged`` gives them, and a float label with a few foreground blobs, so both class groups occur),
one process measures, after a warm-up, the per-sample time of three pipelines interleaved sample by
sample (call order rotated), the whole set repeated ``--repeats`` times: per-sample time = median over
the repeats, averaged over the samples. The default clock is this process's CPU time
(``time.process_time``), which other processes' load on a shared machine does not inflate and which
equals latency with one thread; ``--clock wall`` uses ``time.perf_counter``. With glibc's default
``malloc``, 64³-128³ temporaries are mmapped and page-faulted anew on every call (system time, varying
with the machine's memory state, as in a DataLoader worker); ``--malloc keep`` reuses them instead and
measures the compute alone, with much less spread.

(a) ``Compose([ClassGroupd("label"), TRACascaded("image", make_tra_policy("nnunet", 2), label_keys="label")])``
    divided by a plain MONAI ``Compose`` of nnU-Net's default augmentation with nnU-Net's probabilities
    (RandRotated, RandZoomd, RandGaussianNoised, RandGaussianSmoothd, RandScaleIntensityd,
    RandAdjustContrastd, RandSimulateLowResolutiond, RandFlipd x3; image bilinear, label nearest).
    Target <= 1.0.
(b) the policy machinery's own overhead: the cascade divided by ``apply_tra`` alone on the *same* ops,
    pre-drawn with ``policy.sample_ops`` + ``sample_tra_params`` from the same ``RandomState`` sequence
    as the cascade's (checked: same choices, bit-identical outputs). Target <= 1.05.
(peers) the same run also times nnU-Net's augmentation in TorchIO (an optional dependency: the extra
    ``bench``) and prints the cascade / the fastest peer pipeline (MONAI or TorchIO). Target <= 0.9.
(p1) one resampling at p = 1 (scaling and rotations about all three axes, image bilinear + label
    nearest): jcsaug's cascade with a policy that always draws them, MONAI's ``RandAffined(prob=1)`` and
    TorchIO's ``RandomAffine(p=1)`` (SimpleITK given ``--threads`` threads). Target: jcsaug <= TorchIO.
(c) resamplings of the image per sample in the cascade: calls of ``jcsaug.ops.resample.resample`` from
    ``jcsaug.ops.tra`` with mode "bilinear" (max and mean). Target: max <= 1. For information, the MONAI pipeline's
    image resamplings (``grid_sample`` / ``interpolate`` calls with a non-nearest mode made by
    RandRotated / RandZoomd) and all its ``grid_sample`` + ``interpolate`` calls are printed too.

Counting runs in a separate, untimed pass with the same seeds (the wrappers never touch timed runs).
The targets live here, never in timed tests.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import platform
import statistics
import time
from collections import Counter
from collections.abc import Callable

import monai
import numpy as np
import torch
from monai.data import MetaTensor
from monai.transforms import (
    Compose,
    RandAdjustContrastd,
    RandAffined,
    RandFlipd,
    RandGaussianNoised,
    RandGaussianSmoothd,
    RandRotated,
    RandScaleIntensityd,
    RandSimulateLowResolutiond,
    RandZoomd,
)
from monai.transforms.transform import apply_transform

import jcsaug.ops.tra as tra_mod
from jcsaug.ops.tra import TRAParams, apply_tra, sample_tra_params
from jcsaug.policy.cascade import TRACascaded
from jcsaug.policy.factory import make_tra_policy
from jcsaug.policy.transforms import DEFAULT_GROUP_KEY, ClassGroupd

#: per-call timers: CPU time of this process (immune to other processes' load), or wall-clock time
CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.process_time, "wall": time.perf_counter}
TARGET_A = 1.0
TARGET_B = 1.05
TARGET_C = 1
TARGET_PEER = 0.9  # nnunet-preset cascade / fastest peer pipeline (MONAI, TorchIO)
TARGET_P1 = 1.0  # one resampling at p = 1: jcsaug / TorchIO
KEYS = ("image", "label")


def keep_freed_memory() -> str:
    """Make glibc malloc reuse large freed buffers instead of unmapping them (and page-faulting them back).

    By default glibc serves allocations above a dynamic threshold (at most 32 MiB) with ``mmap`` and returns
    them on ``free``: a 64³-128³ pipeline then page-faults its large temporaries on every call, which
    costs a lot of system CPU time and varies with the machine's memory state.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return "unavailable (not glibc)"
    m_trim_threshold, m_mmap_threshold = -1, -3
    ok = libc.mallopt(m_mmap_threshold, 1 << 30) == 1 and libc.mallopt(m_trim_threshold, 1 << 30) == 1
    return "keep (mmap/trim thresholds 1 GiB)" if ok else "mallopt refused"


# --------------------------------------------------------------------------- data
def make_patch(size: int, rng: np.random.RandomState, centre_fg: bool) -> dict[str, MetaTensor]:
    """A patch as LoadImaged would give it: [1, X, Y, Z] float32 MetaTensors, identity affine.

    The label holds three spherical blobs (values 1 and 2); with ``centre_fg`` the first blob covers the
    patch centre (class group 1), otherwise the centre is kept background (class group 0).
    """
    grid = np.stack(np.meshgrid(*[np.arange(size, dtype=np.float32)] * 3, indexing="ij"))
    label = np.zeros((size,) * 3, dtype=np.float32)
    image = rng.normal(0.0, 0.3, size=(size,) * 3).astype(np.float32)
    centre = np.full(3, size // 2, dtype=np.float32)
    for b in range(3):
        radius = size * rng.uniform(0.08, 0.15)
        if b == 0 and centre_fg:
            c = centre
        else:  # away from the centre so it stays background
            while True:
                c = rng.uniform(0.2 * size, 0.8 * size, 3).astype(np.float32)
                if np.linalg.norm(c - centre) > radius + 2:
                    break
        inside = ((grid - c[:, None, None, None]) ** 2).sum(0) <= radius**2
        value = 1 + b % 2
        label[inside] = value
        image[inside] += 1.0 + value
    if not centre_fg:
        label[(size // 2,) * 3] = 0.0
    affine = torch.eye(4, dtype=torch.float64)

    def meta(name: str) -> dict:
        return {"filename_or_obj": f"{name}.nii.gz", "spatial_shape": np.array([size] * 3), "original_channel_dim": -1}

    return {
        "image": MetaTensor(torch.from_numpy(image)[None], affine=affine.clone(), meta=meta("img")),
        "label": MetaTensor(torch.from_numpy(label)[None], affine=affine.clone(), meta=meta("seg")),
    }


# --------------------------------------------------------------------------- pipelines
def make_cascade() -> tuple[Compose, TRACascaded]:
    tra = TRACascaded("image", make_tra_policy("nnunet", num_groups=2), label_keys="label")
    return Compose([ClassGroupd("label"), tra]), tra


def make_monai_nnunet() -> Compose:
    """nnU-Net's default training augmentation (probabilities per sample) as plain MONAI transforms."""
    angle = math.radians(30.0)
    return Compose(
        [
            RandRotated(
                KEYS, range_x=angle, range_y=angle, range_z=angle, prob=0.2,
                mode=("bilinear", "nearest"), padding_mode="zeros",
            ),
            RandZoomd(KEYS, prob=0.2, min_zoom=0.7, max_zoom=1.4, mode=("trilinear", "nearest"), keep_size=True),
            *monai_nnunet_intensity_and_flips(),
        ]
    )  # fmt: skip


def monai_nnunet_intensity_and_flips() -> list:
    """nnU-Net's intensity augmentation and mirroring with its probabilities, as MONAI dictionary transforms."""
    return [
        RandGaussianNoised("image", prob=0.1, mean=0.0, std=0.1),
        RandGaussianSmoothd("image", sigma_x=(0.5, 1.0), sigma_y=(0.5, 1.0), sigma_z=(0.5, 1.0), prob=0.2),
        RandScaleIntensityd("image", factors=0.25, prob=0.15),
        RandAdjustContrastd("image", prob=0.3, gamma=(0.7, 1.5), retain_stats=True),  # nnU-Net keeps mean and std
        RandSimulateLowResolutiond("image", prob=0.25, zoom_range=(0.5, 1.0)),
        RandFlipd(KEYS, prob=0.5, spatial_axis=0),
        RandFlipd(KEYS, prob=0.5, spatial_axis=1),
        RandFlipd(KEYS, prob=0.5, spatial_axis=2),
    ]


def make_torchio_nnunet():
    """The same nnU-Net augmentation in TorchIO (optional benchmark dependency: ``pip install jcsaug[bench]``)."""
    try:
        import torchio as tio
    except ImportError:
        return None
    return tio.Compose(
        [
            tio.RandomAffine(scales=(0.7, 1.4), degrees=30, p=0.36),  # nnU-Net: rotation p .2 and scaling p .2
            tio.RandomNoise(std=(0.0, 0.1), p=0.1),
            tio.RandomBlur(std=(0.5, 1.0), p=0.2),
            tio.RandomGamma(log_gamma=(math.log(0.7), math.log(1.5)), p=0.3),
            tio.RandomAnisotropy(axes=(0, 1, 2), downsampling=(1.0, 2.0), p=0.25),
            tio.RandomFlip(axes=(0, 1, 2), flip_probability=0.5),
        ]
    )


def resampling_policy():
    """A TRA policy that always scales and rotates about all three axes (small rotations), nothing else."""
    policy = make_tra_policy("nnunet", num_groups=2)
    probs = []
    for s, n in enumerate(policy.series_sizes):
        p = np.zeros(n)
        if s == 0:
            p[1:] = 1.0  # any scaling bin
        elif s in (1, 2, 3):
            p[1:4] = 1.0  # the small-rotation bins (no 90-degree turn)
        else:
            p[0] = 1.0
        probs.append(p)
    policy.set_probabilities(probs, floor=0.0)
    return policy


def make_resampling_pipelines() -> dict[str, Callable]:
    """One resampling at p = 1 (scaling and rotations about three axes, image bilinear + label nearest)."""
    tra = TRACascaded("image", resampling_policy(), label_keys="label")
    pipes: dict[str, Callable] = {"p1 jcsaug": Compose([ClassGroupd("label"), tra])}
    angle = math.radians(30.0)
    pipes["p1 MONAI"] = RandAffined(
        KEYS, prob=1.0, rotate_range=(angle,) * 3, scale_range=(0.5,) * 3, mode=("bilinear", "nearest"),
        padding_mode="zeros",
    )  # fmt: skip
    try:
        import torchio as tio

        pipes["p1 TorchIO"] = tio.RandomAffine(scales=0.5, degrees=30, p=1.0)
    except ImportError:
        pass
    return pipes


def as_subject(sample: dict):
    import torchio as tio

    return tio.Subject(image=tio.ScalarImage(tensor=sample["image"].as_tensor()),
                       label=tio.LabelMap(tensor=sample["label"].as_tensor()))  # fmt: skip


def predraw(tra: TRACascaded, samples: list[dict], seed: int) -> list[tuple[int, np.ndarray, TRAParams]]:
    """The cascade's draws, replayed: ``sample_ops`` then ``sample_tra_params`` on one RandomState."""
    rng = np.random.RandomState(seed)
    group_of = ClassGroupd("label")
    out = []
    for s in samples:
        group = int(group_of(s)[DEFAULT_GROUP_KEY])
        choices = tra.policy.sample_ops(group, rng)
        out.append((group, choices, sample_tra_params(choices, rng)))
    return out


# --------------------------------------------------------------------------- counting
def _mode(args: tuple, kwargs: dict, position: int, default: str) -> str:
    return str(kwargs.get("mode", args[position] if len(args) > position else default))


class CallCounter:
    """Counts ``grid_sample`` / ``interpolate`` and the cascade's ``resample`` calls while installed."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()
        self.tag = ""
        self._depth: Counter = Counter()
        self._saved: list[tuple[object, str, Callable]] = []

    def _wrap(self, owner: object, name: str, key: Callable[[tuple, dict], str]) -> None:
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            # a MetaTensor argument re-enters through __torch_function__ (which looks the public name up
            # again, i.e. finds this wrapper): count the outermost call only
            if not self._depth[name]:
                self.calls[(self.tag, name, key(args, kwargs))] += 1
            self._depth[name] += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth[name] -= 1

        self._saved.append((owner, name, original))
        setattr(owner, name, wrapper)

    def __enter__(self) -> CallCounter:
        F = torch.nn.functional
        self._wrap(F, "grid_sample", lambda a, k: _mode(a, k, 2, "bilinear"))
        self._wrap(F, "interpolate", lambda a, k: _mode(a, k, 3, "nearest"))
        self._wrap(tra_mod, "resample", lambda a, k: _mode(a, k, 2, "?"))  # the cascade's one call per key
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    def take(self) -> Counter:
        out, self.calls = self.calls, Counter()
        return out


def count_resamplings(cascade, tra, monai_pipe, samples, seed_tra, seed_monai, drawn) -> dict:
    """Untimed pass with the timed runs' seeds: resampling counts, and a check that (b) compares like with like."""
    cascade_img, cascade_all, monai_img, monai_all = [], [], [], []
    tra.set_random_state(seed_tra)
    monai_pipe.set_random_state(seed_monai)
    with CallCounter() as counter:
        for s, (_, choices, params) in zip(samples, drawn):
            out = cascade(dict(s))
            c = counter.take()
            cascade_img.append(c[("", "resample", "bilinear")])
            cascade_all.append(sum(n for (_, name, _), n in c.items() if name != "resample"))
            if not np.array_equal(out["tra_ops"].numpy(), choices):
                raise RuntimeError("pre-drawn choices differ from the cascade's: (b) would compare different ops")
            ref_img, ref_lab = apply_tra({"image": s["image"]}, {"label": s["label"]}, params)
            counter.take()
            if not (torch.equal(out["image"].as_tensor(), ref_img["image"])
                    and torch.equal(out["label"].as_tensor(), ref_lab["label"])):  # fmt: skip
                raise RuntimeError("apply_tra on the pre-drawn params differs from the cascade's output")

            d = dict(s)
            for t in monai_pipe.transforms:  # what Compose.__call__ does (no lazy resampling), tagged per transform
                counter.tag = type(t).__name__
                d = apply_transform(t, d)
            counter.tag = ""
            c = counter.take()
            monai_img.append(
                sum(n for (tag, _, mode), n in c.items() if tag in ("RandRotated", "RandZoomd") and mode != "nearest")
            )
            monai_all.append(sum(c.values()))
    return {
        "cascade_img": cascade_img,
        "cascade_all": cascade_all,
        "monai_img": monai_img,
        "monai_all": monai_all,
    }


# --------------------------------------------------------------------------- timing
def bench_size(size: int, n: int, repeats: int, warmup: int, seed: int, clock: Callable[[], float]) -> dict:
    rng = np.random.RandomState(seed + size)
    samples = [make_patch(size, rng, centre_fg=i % 2 == 0) for i in range(n)]
    checksum = [float(s["image"].sum()) + float(s["label"].sum()) for s in samples]
    cascade, tra = make_cascade()
    monai_pipe = make_monai_nnunet()
    seed_tra, seed_monai = seed + 11, seed + 23
    drawn = predraw(tra, samples, seed_tra)

    def run_cascade(i: int) -> None:
        cascade(dict(samples[i]))

    def run_monai(i: int) -> None:
        monai_pipe(dict(samples[i]))

    def run_direct(i: int) -> None:
        s = samples[i]
        apply_tra({"image": s["image"]}, {"label": s["label"]}, drawn[i][2])

    runners: dict[str, Callable[[int], None]] = {"cascade": run_cascade, "monai": run_monai, "direct": run_direct}
    torchio_pipe = make_torchio_nnunet()
    if torchio_pipe is not None:
        runners["torchio"] = lambda i: torchio_pipe(as_subject(samples[i]))
    resampling = make_resampling_pipelines()
    for name, pipe in resampling.items():
        if "TorchIO" in name:
            runners[name] = lambda i, pipe=pipe: pipe(as_subject(samples[i]))
        else:
            runners[name] = lambda i, pipe=pipe: pipe(dict(samples[i]))
    seeded = [tra, monai_pipe] + [p for n, p in resampling.items() if "TorchIO" not in n]
    names = list(runners)

    # warm-up: every pipeline on the first samples (allocator, MONAI/torch lazy imports and caches)
    tra.set_random_state(seed_tra)
    monai_pipe.set_random_state(seed_monai)
    for k, pipe in enumerate(seeded[2:]):
        pipe.set_random_state(seed + 31 + k)
    for i in range(min(warmup, n)):
        for name in names:
            runners[name](i)

    # times[name][i] = the repeats' times of sample i
    times: dict[str, list[list[float]]] = {name: [[] for _ in range(n)] for name in names}
    for r in range(repeats):
        # same seeds every repeat: the cascade replays exactly the pre-drawn ops of `drawn`
        tra.set_random_state(seed_tra)
        monai_pipe.set_random_state(seed_monai)
        for i in range(n):
            k = (i + r) % len(names)
            for name in names[k:] + names[:k]:  # rotate the order sample by sample
                t0 = clock()
                runners[name](i)
                times[name][i].append(clock() - t0)
    # per-sample time = median over the repeats (robust to bursts of load), averaged over the samples
    ms = {name: 1e3 * float(np.mean([statistics.median(ts) for ts in v])) for name, v in times.items()}

    counts = count_resamplings(cascade, tra, monai_pipe, samples, seed_tra, seed_monai, drawn)
    if [float(s["image"].sum()) + float(s["label"].sum()) for s in samples] != checksum:
        raise RuntimeError("a pipeline modified its input in place")
    groups = Counter(g for g, _, _ in drawn)
    peers = {k: ms[k] for k in ("monai", "torchio") if k in ms}
    return {
        "size": size,
        "n": n,
        "groups": (groups[0], groups[1]),
        "ms": ms,
        "ratio_a": ms["cascade"] / ms["monai"],
        "ratio_b": ms["cascade"] / ms["direct"],
        "ratio_peer": ms["cascade"] / min(peers.values()),
        "fastest_peer": min(peers, key=peers.get),
        "ratio_p1": ms["p1 jcsaug"] / ms["p1 TorchIO"] if "p1 TorchIO" in ms else float("nan"),
        "ratio_p1_monai": ms["p1 jcsaug"] / ms["p1 MONAI"],
        **counts,
    }


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def print_table(rows: list[dict]) -> None:
    header = [
        "size", "n", "grp0/1", "cascade ms", "MONAI ms", "(a) c/M", "target", "",
        "direct ms", "(b) c/d", "target", "", "(c) max", "mean", "target", "", "MONAI img mean/max", "all F c/M",
    ]  # fmt: skip
    table = [header]
    for r in rows:
        img = r["cascade_img"]
        # verdicts on the printed (3-decimal) ratios, so that the table reads consistently
        a_ok, b_ok = round(r["ratio_a"], 3) <= TARGET_A, round(r["ratio_b"], 3) <= TARGET_B
        c_ok = max(img) <= TARGET_C
        table.append(
            [
                f"{r['size']}³", str(r["n"]), "{}/{}".format(*r["groups"]),
                f"{r['ms']['cascade']:.2f}", f"{r['ms']['monai']:.2f}", f"{r['ratio_a']:.3f}",
                f"<={TARGET_A:.2f}", _verdict(a_ok),
                f"{r['ms']['direct']:.2f}", f"{r['ratio_b']:.3f}", f"<={TARGET_B:.2f}", _verdict(b_ok),
                str(max(img)), f"{np.mean(img):.2f}", f"max<={TARGET_C}", _verdict(c_ok),
                f"{np.mean(r['monai_img']):.2f}/{max(r['monai_img'])}",
                f"{np.mean(r['cascade_all']):.2f}/{np.mean(r['monai_all']):.2f}",
            ]
        )  # fmt: skip
    _print(table)
    print("\nPeers in the same run (nnU-Net augmentation; one resampling at p = 1: scaling + rotations about 3 axes):")
    table = [["size", "cascade ms", "MONAI ms", "TorchIO ms", "c/fastest", "target", "",
              "p1 jcsaug ms", "p1 MONAI ms", "p1 TorchIO ms", "p1 j/T", "target", "", "p1 j/M"]]  # fmt: skip
    for r in rows:
        ms = r["ms"]
        p1_ok = round(r["ratio_p1"], 3) <= TARGET_P1 if math.isfinite(r["ratio_p1"]) else False
        table.append(
            [
                f"{r['size']}³", f"{ms['cascade']:.2f}", f"{ms['monai']:.2f}", f"{ms.get('torchio', float('nan')):.2f}",
                f"{r['ratio_peer']:.3f} ({r['fastest_peer']})", f"<={TARGET_PEER:.2f}",
                _verdict(round(r["ratio_peer"], 3) <= TARGET_PEER),
                f"{ms['p1 jcsaug']:.2f}", f"{ms['p1 MONAI']:.2f}", f"{ms.get('p1 TorchIO', float('nan')):.2f}",
                f"{r['ratio_p1']:.3f}", f"<={TARGET_P1:.2f}", _verdict(p1_ok), f"{r['ratio_p1_monai']:.3f}",
            ]
        )  # fmt: skip
    _print(table)


def _print(table: list[list[str]]) -> None:
    widths = [max(len(row[j]) for row in table) for j in range(len(table[0]))]
    for k, row in enumerate(table):
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
        if k == 0:
            print("-" * (sum(widths) + 2 * (len(widths) - 1)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128], help="patch edge lengths")
    parser.add_argument(
        "--samples", type=int, nargs="+", default=None,
        help="samples per size (one value, or one per size); default 30 for <=64³, 10 for larger",
    )  # fmt: skip
    parser.add_argument(
        "--repeats", type=int, default=6,
        help="timed passes over the samples (median per sample; a multiple of 3 balances the call order)",
    )  # fmt: skip
    parser.add_argument("--warmup", type=int, default=3, help="warm-up samples per pipeline and size")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument(
        "--clock", choices=sorted(CLOCKS), default="cpu",
        help="cpu: CPU time of this process (time.process_time; robust to other load on a shared machine, "
        "equal to latency with --threads 1); wall: time.perf_counter",
    )  # fmt: skip
    parser.add_argument(
        "--malloc", choices=["default", "keep"], default="default",
        help="default: glibc's behaviour, as in a DataLoader worker; keep: reuse large freed buffers "
        "(no page faults on every call: steadier numbers, the compute cost alone)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if args.samples is None:
        samples = [30 if s <= 64 else 10 for s in args.sizes]
    elif len(args.samples) == 1:
        samples = args.samples * len(args.sizes)
    elif len(args.samples) == len(args.sizes):
        samples = args.samples
    else:
        parser.error("--samples takes one value or one per size")

    malloc = keep_freed_memory() if args.malloc == "keep" else "glibc default"
    torch.set_num_threads(args.threads)
    try:  # TorchIO resamples with SimpleITK: give it the same number of threads
        import SimpleITK as sitk

        sitk.ProcessObject.SetGlobalDefaultNumberOfThreads(args.threads)
    except ImportError:
        print("note: TorchIO not installed (pip install 'jcsaug[bench]'): its columns are nan")
    torch.manual_seed(args.seed)
    print(
        f"torch {torch.__version__}, MONAI {monai.__version__}, {platform.processor() or platform.machine()}, "
        f"threads={torch.get_num_threads()}, clock={args.clock}, seed={args.seed}, repeats={args.repeats}, "
        f"warm-up={args.warmup}, malloc={malloc}"
    )
    if args.clock == "cpu" and args.threads > 1:
        print("note: with --threads > 1 the cpu clock sums the threads' CPU time (work, not latency)")
    start = time.perf_counter()
    clock = CLOCKS[args.clock]
    rows = [bench_size(size, n, args.repeats, args.warmup, args.seed, clock) for size, n in zip(args.sizes, samples)]
    print()
    print_table(rows)
    print(
        "\nms = per-sample time (median over repeats, mean over samples). (a) cascade / plain-MONAI nnU-Net "
        "Compose; (b) cascade / apply_tra alone on the same pre-drawn ops.\n(c) resample calls on the "
        "image per cascade sample. 'MONAI img' = image grid_sample/interpolate calls (non-nearest mode) in "
        "RandRotated + RandZoomd;\n'all F c/M' = all grid_sample + interpolate calls per sample (image and "
        f"label, low-res included), cascade / MONAI.  Total {time.perf_counter() - start:.0f} s."
    )


if __name__ == "__main__":
    main()
