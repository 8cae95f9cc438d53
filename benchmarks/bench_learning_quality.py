"""Learning quality: does the learned augmentation beat the heuristic one, and does it find what undoes the shift?

Command (from the repository root; one default-bundle run is about 2 min (heuristic) to 7 min (learned) on 2
quiet CPU cores, about 1 min on a GPU, and the defaults make 3 modes x 3 seeds = 9 runs)::

    python benchmarks/bench_learning_quality.py
    # defaults: --modes heuristic+mirror class-specific+joint oracle+mirror --seeds 0 1 2 --shift default
    #           --device cpu --jobs 1 --out benchmarks/results/learning_quality
    python benchmarks/bench_learning_quality.py --device cuda --jobs 4
    python benchmarks/bench_learning_quality.py --shift rotate-longitudinal   # a shift the defaults were not tuned on
    python benchmarks/bench_learning_quality.py --shift blur                  # another: a blur, no geometric change
    python benchmarks/bench_learning_quality.py --shift gamma --modes heuristic+mirror class-specific+joint \
        oracle-partial+mirror                                                 # the default's gamma alone
    python benchmarks/bench_learning_quality.py --modes heuristic+mirror paper --set max_epochs=80
    python benchmarks/bench_learning_quality.py --shift '{"long_axis": 1, "mirror_axis0": true, "blur": [0.8, 1.0]}'

``--shift`` is a name of ``jcsaug.data.synthetic.TARGET_SHIFTS`` or a JSON object of its keys (``long_axis`` 0-2,
``mirror_axis0``, ``gamma`` and ``blur`` ranges ``[lo, hi]`` or null; a missing key: the source domain's value, no
change in that aspect), a shift nobody tuned on. Its dataset is ``--out/data_NAME``, its runs ``--out/runs/NAME``,
its report ``learning_quality_NAME.md`` (:func:`shift_name`: a mapping equal to a named shift is that shift,
another ``custom-`` and a hash of the mapping), whose header gives the mapping and its description. Every run is the
default bundle (``bundles/synthetic_lesion/configs/train.yaml``) launched as a user would (``python -m monai.bundle
run``) on the synthetic dataset of ``--shift`` (generated once under ``--out``), with the mode's overrides,
``seed`` and ``--set`` overrides. The modes (:data:`MODES`; add ``--modes`` names of it):

* ``heuristic+mirror``: nnU-Net's heuristic TRA, nnU-Net's 8-flip mirroring TTA (the baseline);
* ``class-specific+joint``: the bundle's defaults: class-specific TRA and TEA learned jointly;
* ``oracle+mirror``: heuristic TRA with the ops that undo the shift set by hand (each such series: identity
  0.5, the op 0.5; random-sign "partial" ops keep the preset, but in the ``split-signs`` catalogue the half that
  reproduces the shift is exact and set), *read from the dataset's own metadata*
  (``dataset.json`` ``domain_shift.undone_by``), and mirroring TTA: what knowing the answer is worth at training
  time (the TRA's ceiling);
* ``oracle-partial+mirror``: the oracle with the random-sign "partial" ops set as well (a shift whose only aspect
  is a gamma leaves ``oracle+mirror`` the heuristic itself);
* ``heuristic+oracle-tea``: heuristic TRA tested with the TEA ops that undo the shift (identity and each such op at
  equal weight, ``tea_mode fixed`` with that policy and ``tea_z`` = their number): what knowing the answer is worth
  at test time; the shares and the joint and TEA targets refer to the largest oracle gain, the TRA-only targets to
  the TRA oracles' (``oracle+mirror``, ``oracle-partial+mirror``);
* ``heuristic+learned-tea``: heuristic TRA, the TEA learned during training (``tea_mode joint``; no TRA is learned):
  does the TEA find the shift-undoing ops where they are worth most, on a network that never learned to undo the
  shift? Set beside ``heuristic+oracle-tea``;
* ``oracle-background+mirror``, ``oracle-lesion+mirror``: the oracle in one class group only (background- or
  lesion-centred patches; the other group keeps the heuristic), as a fixed TRA policy: whether a class-specific
  policy needs the shift-undoing ops in both groups;
* ``oracle-flip-off-background+mirror``, ``oracle-flip-off+mirror``: the oracle with the shift's mirror flips off
  (identity 1) in background-centred patches / in both groups, as a fixed TRA policy: what the flip that undoes the
  shift's mirroring is worth (the heuristic and the oracle draw it at 0.5);
* ``paper``: class-specific + joint with the paper's estimators (Gumbel straight-through, policy-sampled TEA
  copies) and the bundle's former fixed learning rates;
* ``learned+joint``: one TRA policy for all patches (not class-specific) + joint TEA;
* ``class-specific+mirror``: class-specific TRA learned alone (TEA: mirroring TTA, not learned), which shows what
  the TRA finds when no learned TEA undoes the shift on the validation batch.

A run's ``metrics.json`` holds the test Dice without TTA (``none``) and with its TEA, so a ``class-specific+joint``
run also gives *learned TRA without TTA* and a ``heuristic+mirror`` run *heuristic TRA without TTA*. Printed:
test Dice per seed, mean ± sd, the differences against ``heuristic+mirror`` and the share of the oracle's gain;
the final probability of every TRA op that undoes the shift in each class group; the rank of the TEA ops that
undo it; the wall time of each run. Targets (issue 10): joint - heuristic+mirror >= 6 Dice points; learned TRA
without TTA - heuristic without TTA >= 4; each undoing TRA op >= 0.3 in both class groups (a random-sign op: in a
``split-signs`` run its half that reproduces the shift; none with ``spec``, where half its draws go the other way);
each aspect of the shift undone by one of the TEA policy's top ``--tea-z`` ops; printed ``N/A`` (with no shares)
when the oracle gains under :data:`MIN_ORACLE_GAIN` on the shift (knowing the answer is worth nothing there, as on
``--shift blur``). A Markdown table goes to ``--out`` (``learning_quality_NAME.md``), its figures and verdicts as data
beside it (``learning_quality_NAME.json``; ``benchmarks/summarize_learning_quality.py`` sets several shifts' side by
side).

With ``--validation`` every run is also evaluated by the bundle's ``evaluate.yaml`` on its validation split (the 4
volumes the learned policies were scored on; ``metrics_evaluate_validation.json``) and on its test split
(``metrics_evaluate.json``, for nnU-Net's mirroring on the same network; about 30 s per run, kept in the run's
folder), and the report sets each mode's Dice there beside the test's, and the lead of its TTA over mirroring on the
same networks on both: a learned policy that gains more on the cases it learned from than on the test cases fits
them.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

from synthetic_bundle import ROOT, SYNTHETIC_CONFIGS, bundle_default  # this folder's path to the synthetic bundle

#: mode name -> bundle overrides (``oracle`` is filled in from the dataset's metadata)
MODES: dict[str, dict[str, str]] = {
    "heuristic+mirror": {"tra_mode": "heuristic", "tea_mode": "heuristic"},
    "class-specific+joint": {"tra_mode": "class-specific", "tea_mode": "joint"},
    "oracle+mirror": {"tra_mode": "heuristic", "tea_mode": "heuristic"},
    # the oracle with the random-sign ("partial") undoing ops set too
    "oracle-partial+mirror": {"tra_mode": "heuristic", "tea_mode": "heuristic"},
    # the heuristic TRA tested with the TEA ops that undo the shift (a fixed TEA policy file)
    "heuristic+oracle-tea": {"tra_mode": "heuristic", "tea_mode": "fixed"},
    # the heuristic TRA, the TEA learned during its training (the TEA's estimator where its ops are worth most)
    "heuristic+learned-tea": {"tra_mode": "heuristic", "tea_mode": "joint"},
    # the oracle in one class group only (the other keeps the heuristic): a fixed two-group TRA policy file
    "oracle-background+mirror": {"tra_mode": "fixed", "tea_mode": "heuristic"},
    "oracle-lesion+mirror": {"tra_mode": "fixed", "tea_mode": "heuristic"},
    # the oracle with the shift's mirror flips off in background-centred patches / in both groups
    "oracle-flip-off-background+mirror": {"tra_mode": "fixed", "tea_mode": "heuristic"},
    "oracle-flip-off+mirror": {"tra_mode": "fixed", "tea_mode": "heuristic"},
    # the paper's estimators (the synthetic bundle's docs give the same line), at fixed rates
    "paper": {
        "tra_mode": "class-specific", "tea_mode": "joint", "tra_estimator": "gumbel", "tea_estimator": "gumbel",
        "tra_step": "adam", "tra_lookahead": "1", "tra_direction": "validation", "tra_catalogue": "spec",
        "val_batches": "1", "num_tea_copies": "10", "tea_patch_size": "None", "tra_poly_power": "0.9",
        "tea_poly_power": "0.9", "tra_logit_budget": "None", "tea_logit_budget": "None", "tra_lr": "0.02",
        "tea_lr": "0.01", "tea_mask_out_of_view": "true", "tea_volume_stats": "true",
    },
    "learned+joint": {"tra_mode": "learned", "tea_mode": "joint"},
    "class-specific+mirror": {"tra_mode": "class-specific", "tea_mode": "heuristic"},
}  # fmt: skip
BASELINE = "heuristic+mirror"
#: issue 10's targets: the joint's gain over the baseline with TTA and the learned TRA's without (test Dice points),
#: and the probability of each TRA op that undoes the shift, in every class group
DICE_TARGET, DICE_TARGET_WITHOUT_TTA, TRA_TARGET = 6, 4, 0.3


def op_names_in(op_names: list[str], op: str) -> list[str]:
    """The names a series' ``op_names`` give SPEC's op ``op``: itself, or in the ``split-signs`` catalogue its
    ``+`` and ``-`` halves (:func:`jcsaug.ops.catalogue.half_names`)."""
    from jcsaug.ops.catalogue import half_names

    if op in op_names:
        return [op]
    halves = list(half_names(op))
    if not all(h in op_names for h in halves):
        raise KeyError(f"no op {op!r} (or its signed halves) among {op_names}")
    return halves


def exact_op_names(op_names: list[str], entry: dict) -> list[str] | None:
    """The names a series' ``op_names`` give a shift-undoing TRA op (an entry of ``undone_by["tra"]``) when their
    draws all reproduce the shift: the op itself; for a random-sign ("partial") op, in the ``split-signs`` catalogue
    the half its ``sign`` names; ``None`` where its sign is drawn (``spec``, or a dataset written before the sign
    was recorded)."""
    names = op_names_in(op_names, entry["op"])
    if not entry.get("partial"):
        return names
    if len(names) == 2 and entry.get("sign") in ("+", "-"):
        return [names["+-".index(entry["sign"])]]  # op_names_in gives the halves in (+, -) order
    return None


def oracle_preset(undone_by: dict, partial: bool = False, catalogue: str = "spec") -> dict:
    """The nnU-Net preset with every series holding a shift-undoing op set to identity 0.5, that op 0.5
    (:func:`exact_op_names`; in the ``split-signs`` catalogue a random-sign op's half that reproduces the shift);
    the random-sign ("partial") ops whose sign the catalogue draws only with ``partial`` (half their draws go
    against the shift; in ``split-signs`` their two halves 0.25 each: the same draws)."""
    from jcsaug.ops.tra import tra_catalogue

    preset: dict = {"base": "nnunet"}
    by_name = {s.name: s for s in tra_catalogue(catalogue)}
    for entry in undone_by["tra"]:
        series = by_name[entry["series"]]
        names = exact_op_names(series.op_names, entry)
        if names is None and not partial:
            continue
        names = names or op_names_in(series.op_names, entry["op"])
        probs = [0.0] * series.size
        probs[0] = 0.5
        for name in names:
            probs[series.index_of(name)] = 0.5 / len(names)
        preset[entry["series"]] = probs
    return preset


#: the oracles of the TRA (set by hand at training time): their gain is what the TRA-only targets refer to
TRA_ORACLE_MODES = ("oracle+mirror", "oracle-partial+mirror")
#: every oracle whose gain over the heuristic is the ceiling the shares and targets refer to (the largest one run)
ORACLE_GAIN_MODES = (*TRA_ORACLE_MODES, "heuristic+oracle-tea")


def oracle_tea_policy_file(out: Path, undone_by: dict) -> tuple[Path, int]:
    """A ``policies.json`` whose TEA policy puts equal weight on the identity and every TEA op that undoes an aspect
    of the shift (all else ~0), for ``tea_mode fixed``; returns it and the number of those ops (the run's ``tea_z``).
    What knowing the answer is worth at test time."""
    from jcsaug.policy import make_tea_policy
    from jcsaug.policy.io import save_policies

    policy = make_tea_policy("nnunet")
    names = ["identity"] + [name for aspect in undone_by["tea"] for name in aspect]
    chosen = [policy.op_names[0].index(name) for name in dict.fromkeys(names)]
    probs = [0.0] * policy.series_sizes[0]
    for i in chosen:
        probs[i] = 1.0 / len(chosen)
    policy.set_probabilities([probs])
    return save_policies(out / "oracle_tea_policies.json", None, policy), len(chosen)


#: the per-group oracle modes -> the class group (0 background-, 1 lesion-centred patches) that gets the oracle
ORACLE_GROUP_MODES = {"oracle-background+mirror": 0, "oracle-lesion+mirror": 1}


def oracle_group_policy_file(out: Path, undone_by: dict, group: int, catalogue: str = "spec") -> Path:
    """A ``policies.json`` whose TRA policy is the oracle (:func:`oracle_preset`) in class group ``group`` and the
    nnU-Net preset in the other, for ``tra_mode fixed``: does that group need the shift-undoing ops?"""
    import torch

    from jcsaug.policy import make_tra_policy
    from jcsaug.policy.io import save_policies

    policy = make_tra_policy("nnunet", num_groups=2, catalogue=catalogue)
    oracle = make_tra_policy(oracle_preset(undone_by, catalogue=catalogue), num_groups=2, catalogue=catalogue)
    with torch.no_grad():
        policy.logits[group] = oracle.logits[group]
    return save_policies(out / f"oracle_group{group}_policies.json", policy)


#: the flip-off oracle modes -> the class groups in which the shift's mirror flips are off (identity 1)
ORACLE_FLIP_OFF_MODES = {"oracle-flip-off-background+mirror": (0,), "oracle-flip-off+mirror": (0, 1)}


def oracle_flip_off_policy_file(out: Path, undone_by: dict, groups: tuple[int, ...], catalogue: str = "spec") -> Path:
    """A ``policies.json`` whose TRA policy is the oracle (:func:`oracle_preset`, both groups) with every
    shift-undoing ``mirror_*`` flip off (identity 1) in ``groups``, for ``tra_mode fixed``: is the flip that undoes
    the shift's mirroring worth any Dice there? (The heuristic already draws it at 0.5.)"""
    from jcsaug.policy import make_tra_policy
    from jcsaug.policy.io import save_policies

    mirrors = [e["series"] for e in undone_by["tra"] if e["series"].startswith("mirror_")]
    if not mirrors:
        raise ValueError("the flip-off oracle modes need a shift with a mirror aspect (domain_shift.undone_by.tra)")
    policy = make_tra_policy(oracle_preset(undone_by, catalogue=catalogue), num_groups=2, catalogue=catalogue)
    probs = [p.detach().clone() for p in policy.probabilities()]
    for series in mirrors:
        s = policy.series_names.index(series)
        for group in groups:
            probs[s][group] = 0.0
            probs[s][group, 0] = 1.0
    policy.set_probabilities(probs)
    name = "_".join(map(str, groups))
    return save_policies(out / f"oracle_flip_off_group{name}_policies.json", policy)


def parse_shift(text: str) -> str | dict:
    """``--shift``: a name of ``TARGET_SHIFTS`` or a JSON object of a target domain, checked
    (``jcsaug.data.synthetic.parse_target_shift``; an error names the bad key and value)."""
    from jcsaug.data.synthetic import parse_target_shift

    try:
        return parse_target_shift(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def shift_name(shift: str | Mapping) -> str:
    """The shift's name in folder and file names: its ``TARGET_SHIFTS`` name (also for an equal mapping), else
    ``custom-`` and the first 8 hex digits of the SHA-1 of the canonical JSON of the normalised mapping's aspects that
    differ from the source domain (stable: key order, lists or tuples, a range bound written ``1`` or ``1.0``, a key
    given at its source value, and keys added to ``SHIFT_KEYS`` later do not change it)."""
    from jcsaug.data.synthetic import CUSTOM_SHIFT, changed_aspects, resolve_target_shift

    name = resolve_target_shift(shift)[0]
    if name != CUSTOM_SHIFT:
        return name
    canonical = json.dumps(changed_aspects(shift), sort_keys=True, separators=(",", ":"))
    return f"{CUSTOM_SHIFT}-{hashlib.sha1(canonical.encode()).hexdigest()[:8]}"


def default_validation_volumes() -> int:
    """How many validation volumes the synthetic dataset has unless asked otherwise (``make_synthetic_dataset``'s
    ``num_val``)."""
    from jcsaug.data import make_synthetic_dataset

    return inspect.signature(make_synthetic_dataset).parameters["num_val"].default


def prepare_dataset(out: Path, shift: str | Mapping, num_val: int) -> tuple[Path, dict]:
    """The synthetic dataset of ``shift`` with ``num_val`` validation volumes under ``out/data_<shift_name>`` (made
    once) and its ``domain_shift``. The cases are seeded by split and index, so the first validation volumes and the
    test volumes are the same arrays whatever the count. A dataset already in ``out`` with another count is refused
    (an ``--out`` holds one dataset per shift)."""
    from jcsaug.data import make_synthetic_dataset

    data = out / f"data_{shift_name(shift)}"
    existing = data / "dataset.json"
    if existing.is_file():  # refused before make_synthetic_dataset would return it unchanged with a warning
        found = len(json.loads(existing.read_text())["validation"])
        if found != num_val:
            raise SystemExit(f"{data} holds a dataset with {found} validation volumes, not the {num_val} asked for "
                             "(--num-val): give another --out")  # fmt: skip
    json_path = make_synthetic_dataset(data, seed=0, num_val=num_val, target_shift=shift, progress=False)
    return data, json.loads(Path(json_path).read_text())["domain_shift"]


def run_settings(mode: str, seed: int, data: Path, overrides: dict, device: str) -> dict:
    """What decides a run's results (written beside it as ``bench_settings.json``; ``--reuse`` compares them)."""
    return {"mode": mode, "seed": seed, "dataset": data.name, "device": device,
            "overrides": {k: str(v) for k, v in sorted(overrides.items())}}  # fmt: skip


def reusable(run_dir: Path, settings: dict) -> bool:
    """Whether ``run_dir`` holds a finished run made with ``settings``. A run from before the settings were written
    down is reused with a warning (its settings cannot be checked); one made with other settings is not."""
    if not (run_dir / "metrics.json").is_file():
        return False
    path = run_dir / "bench_settings.json"
    if not path.is_file():
        print(f"  warning: {run_dir} has no bench_settings.json: reused without checking its settings", flush=True)
        return True
    stored = json.loads(path.read_text())
    if stored != settings:
        changed = sorted(k for k in {**stored, **settings} if stored.get(k) != settings.get(k))
        print(f"  {run_dir}: made with other settings ({', '.join(changed)}): run again", flush=True)
        return False
    return True


def run_bundle(
    configs: list[str], data: Path, run_dir: Path, device: str, overrides: Mapping, threads: int, log: Path
) -> int:
    """``python -m monai.bundle run`` of the synthetic bundle's ``configs`` (merged in that order) on ``data`` with
    ``output_dir`` ``run_dir``, as a user would launch it, on ``threads`` CPU threads, its output in ``log``; returns
    its exit status."""
    files = [str(SYNTHETIC_CONFIGS / c) for c in configs]
    meta, logging_conf = (str(SYNTHETIC_CONFIGS / name) for name in ("metadata.json", "logging.conf"))
    args = [sys.executable, "-m", "monai.bundle", "run", "--config_file", files[0] if len(files) == 1 else str(files),
            "--meta_file", meta, "--logging_file", logging_conf,
            "--dataset_dir", str(data), "--output_dir", str(run_dir)]  # fmt: skip
    if device != "auto":
        args += ["--device", f"$torch.device('{device}')"]
    for key, value in overrides.items():
        args += [f"--{key}", str(value)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    with open(log, "w") as out:
        return subprocess.run(args, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env).returncode


def run_one(
    mode: str, seed: int, data: Path, run_dir: Path, overrides: dict, device: str, reuse: bool, threads: int
) -> dict:
    """One bundle run (skipped when ``reuse`` and ``run_dir`` holds a finished run with the same settings, else
    replacing whatever ``run_dir`` holds) on ``threads`` CPU threads; returns its parsed results."""
    metrics = run_dir / "metrics.json"
    settings = run_settings(mode, seed, data, overrides, device)
    if not (reuse and reusable(run_dir, settings)):
        # the folder is the benchmark's: a run left there is replaced
        extra = {"seed": seed, "overwrite": "true", **overrides}
        run_dir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        returncode = run_bundle(["train.yaml"], data, run_dir, device, extra, threads, run_dir / "bench.log")
        if returncode != 0:
            raise RuntimeError(f"{mode} seed {seed} failed (exit {returncode}); see {run_dir / 'bench.log'}")
        (run_dir / "bench_seconds.txt").write_text(f"{time.perf_counter() - start:.1f}\n")
        (run_dir / "bench_settings.json").write_text(json.dumps(settings, indent=1) + "\n")
    seconds = float((run_dir / "bench_seconds.txt").read_text()) if (run_dir / "bench_seconds.txt").is_file() else 0.0
    m = json.loads(metrics.read_text())
    return {
        **_dice_pair(m, _tta_name(m)),
        "policies": json.loads((run_dir / "policies.json").read_text()),
        "seconds": seconds,
    }


def _tta_name(metrics: Mapping) -> str | None:
    """The TTA method of a run's ``metrics.json`` (its one test-time method besides ``none``), or ``None``."""
    tta = [k for k in metrics if k != "none" and isinstance(metrics[k], dict) and "mean_dice" in metrics[k]]
    return tta[0] if tta else None


def _dice_pair(metrics: Mapping, tta_name: str | None) -> dict:
    """``{"none", "tta"}`` test-time Dice (in points) of a metrics file; ``tta_name`` the TTA method to read."""
    return {
        "none": 100 * metrics["none"]["mean_dice"],
        "tta": 100 * metrics[tta_name]["mean_dice"] if tta_name else None,
    }


def evaluate_split(run_dir: Path, data: Path, overrides: dict, device: str, threads: int, split: str) -> dict:
    """A finished run evaluated on ``split`` (``test`` or ``validation``) by the bundle's ``evaluate.yaml``, which
    reports no TTA, nnU-Net's mirroring and the run's learned TEA alike: its metrics (kept in the run's folder, and
    made again only when older than the run's ``metrics.json``)."""
    from jcsaug.evaluation.splits import evaluation_file_names

    path = run_dir / evaluation_file_names(split)[0]
    if not (path.is_file() and path.stat().st_mtime >= (run_dir / "metrics.json").stat().st_mtime):
        log = run_dir / f"bench_evaluate_{split}.log"
        extra = {**overrides, "evaluate_split": split}
        returncode = run_bundle(["train.yaml", "evaluate.yaml"], data, run_dir, device, extra, threads, log)
        if returncode != 0:
            raise RuntimeError(f"evaluating {run_dir} on the {split} split failed (exit {returncode}); see {log}")
    return json.loads(path.read_text())


def evaluate_validation(run_dir: Path, data: Path, overrides: dict, device: str, threads: int) -> dict:
    """A finished run's Dice (in points) on its validation split, ``none`` and ``tta`` (the TTA method the run itself
    was tested with), and the lead of that TTA over nnU-Net's mirroring on the same network, ``lead_validation`` and
    ``lead_test`` (0 for a run tested with mirroring)."""
    tta = _tta_name(json.loads((run_dir / "metrics.json").read_text()))
    validation = evaluate_split(run_dir, data, overrides, device, threads, "validation")
    test = evaluate_split(run_dir, data, overrides, device, threads, "test")

    def lead(metrics: Mapping) -> float:
        return 100 * (metrics[tta]["mean_dice"] - metrics["heuristic"]["mean_dice"]) if tta else 0.0

    return {**_dice_pair(validation, tta), "lead_validation": lead(validation), "lead_test": lead(test)}


def validation_lines(modes: list[str], results: dict, validation: dict, seeds: list[int], cases: int) -> list[str]:
    """The report's table of each mode's Dice on the validation split beside the test split's (means over seeds):
    the change against the baseline, and the lead of the mode's TTA over mirroring on the same networks, on both."""

    def mean(mode: str, table: dict, key: str, base: bool = False) -> float:
        rows = [table[(mode, s)][key] - (table[(BASELINE, s)][key] if base else 0.0) for s in seeds]
        return statistics.mean(rows)

    lines = [f"Validation split ({cases} cases, the ones the learned policies were scored on) beside the test split, "
             "means over seeds (`--validation`): a learned policy that gains more on the validation cases than on "
             "the test cases fits them.", "",
             "| mode | validation none / TTA | test none / TTA | Δ vs baseline, validation TTA / none "
             "| Δ vs baseline, test TTA / none | its TTA − mirroring on the same networks, validation / test |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for mode in modes:
        v = {k: mean(mode, validation, k) for k in ("none", "tta")}
        t = {k: mean(mode, results, k) for k in ("none", "tta")}
        dv = {k: mean(mode, validation, k, base=True) for k in ("none", "tta")}
        dt = {k: mean(mode, results, k, base=True) for k in ("none", "tta")}
        lead = f"{mean(mode, validation, 'lead_validation'):+.1f} / {mean(mode, validation, 'lead_test'):+.1f}"
        cells = [f"{v['none']:.1f} / {v['tta']:.1f}", f"{t['none']:.1f} / {t['tta']:.1f}",
                 f"{dv['tta']:+.1f} / {dv['none']:+.1f}", f"{dt['tta']:+.1f} / {dt['none']:+.1f}", lead]  # fmt: skip
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return lines


def threads_per_run(jobs: int, threads: int = 0) -> int:
    """CPU threads for each of ``jobs`` parallel runs: ``threads`` when given, else the cores shared out."""
    return threads or max(1, (os.cpu_count() or 1) // max(1, jobs))


def _series_ops(group: dict, series: str) -> list[dict]:
    """The ``ops`` entries (name, probability, ...) of TRA ``series`` in one class group of a ``policies.json``."""
    return next(s for s in group["series"] if s["series"] == series)["ops"]


def tra_series_op_names(policies: dict, series: str) -> list[str]:
    """The op names of a run's TRA ``series`` (its catalogue's: ``spec`` or ``split-signs``)."""
    return [o["name"] for o in _series_ops(policies["tra"]["groups"][0], series)]


def tra_op_probabilities(policies: dict, series: str, op: str) -> list[list[float]]:
    """Per class group, the final probabilities of the names the run's catalogue gives the op (:func:`op_names_in`:
    the op itself, or its ``+`` and ``-`` halves)."""
    out = []
    for group in policies["tra"]["groups"]:
        by_name = {o["name"]: o["probability"] for o in _series_ops(group, series)}
        out.append([by_name[name] for name in op_names_in(list(by_name), op)])
    return out


def tra_probability(policies: dict, series: str, op: str) -> list[float]:
    """The op's final probability in every class group (``split-signs``: the sum of its two halves)."""
    return [sum(probs) for probs in tra_op_probabilities(policies, series, op)]


def tra_halves(policies: dict, series: str, op: str) -> list[tuple[float, float]] | None:
    """``(+, -)`` final probabilities of a signed op's halves per class group in a ``split-signs`` run, else None."""
    groups = tra_op_probabilities(policies, series, op)
    return [(plus, minus) for plus, minus in groups] if all(len(probs) == 2 for probs in groups) else None


def tea_ranks(policies: dict) -> dict[str, int]:
    ops = sorted(policies["tea"]["ops"], key=lambda o: -o["probability"])
    return {o["name"]: rank + 1 for rank, o in enumerate(ops)}


def mean_sd(values: list[float]) -> str:
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.1f} ± {sd:.1f}"


#: below this gain of the oracle over the heuristic (test Dice points, with TTA) knowing the answer is worth nothing
#: on the shift: the shares of it and the targets (set on a shift the augmentation can undo) do not apply
MIN_ORACLE_GAIN = 1.0


def figure_against(value: float, bound: float, decimals: int = 2, sign: str = "") -> str:
    """A judged figure to ``decimals`` (``sign`` "+" prints its sign), or truncated to one decimal more where rounding
    would carry a miss up to ``bound``: 0.299 reads "0.299", not a "0.30" beside a MISS of ">= 0.3"; a gain of 5.96
    "+5.96", not "+6.0" beside a MISS of ">= 6"."""
    text = f"{value:{sign}.{decimals}f}"
    if value < bound <= float(text):
        text = f"{value:{sign}.{decimals + 1}f}"  # 5.9599999 (a mean of float differences) reads "5.96"
        if bound <= float(text):  # still at the bound (5.9996): truncated
            scale = 10 ** (decimals + 1)
            text = f"{math.floor(value * scale) / scale:{sign}.{decimals + 1}f}"
    return text


def oracle_gain_of(gains: dict[str, list[float]]) -> float | None:
    """The ceiling: the largest mean gain (TTA Dice points over the baseline, per seed) of the oracle modes run;
    ``None`` when none was run."""
    return max((statistics.mean(g) for g in gains.values()), default=None)


def verdict(ok: bool, oracle_gain: float | None = None) -> str:
    """``PASS`` / ``MISS``; ``N/A`` when the oracle was run and gained under :data:`MIN_ORACLE_GAIN`."""
    if oracle_gain is not None and oracle_gain < MIN_ORACLE_GAIN:
        return "N/A"
    return "PASS" if ok else "MISS"


def oracle_share(delta: float, oracle_gain: float | None) -> str:
    """``delta`` as a share of the oracle's gain; ``-`` without an oracle or when its gain is under the minimum."""
    return "-" if oracle_gain is None or oracle_gain < MIN_ORACLE_GAIN else f"{100 * delta / oracle_gain:.0f} %"


class Target(NamedTuple):
    """One target of the report: its text, whether it is met, the oracle gain it is judged against (``N/A`` below
    :data:`MIN_ORACLE_GAIN`) and a short label with the figure measured (for ``summarize_learning_quality.py``)."""

    text: str
    met: bool
    oracle_gain: float | None
    label: str = ""


def target_lines(checks: list[Target], oracle_gain: float | None, tra_gain: float | None) -> list[str]:
    """The report's targets: a note when an oracle gains under :data:`MIN_ORACLE_GAIN`, then ``PASS`` / ``MISS`` /
    ``N/A`` per :class:`Target`."""
    lines = []
    if oracle_gain is not None and oracle_gain < MIN_ORACLE_GAIN:
        lines += [f"The oracle gains {figure_against(oracle_gain, MIN_ORACLE_GAIN, 1, '+')} Dice points on this shift "
                  f"(< {MIN_ORACLE_GAIN:g}): setting the "
                  "ops that undo it by hand is worth nothing here, so the targets do not apply; read whether the "
                  "learned runs stay level with the heuristic.", ""]  # fmt: skip
    elif tra_gain is not None and tra_gain < MIN_ORACLE_GAIN:
        lines += [f"The TRA's oracle gains {figure_against(tra_gain, MIN_ORACLE_GAIN, 1, '+')} Dice points "
                  f"(< {MIN_ORACLE_GAIN:g}; the best oracle "
                  f"{oracle_gain:+.1f}): no TRA set by hand undoes this shift, so the TRA-only targets do not apply.",
                  ""]  # fmt: skip
    return lines + [f"- {verdict(t.met, t.oracle_gain)} {t.text}" for t in checks]


def undoing_op_report(
    modes: list[str],
    results: dict[tuple[str, int], dict],
    seeds: list[int],
    undone_by: dict,
    tea_z: int,
    tra_gain: float | None,
    oracle_gain: float | None,
) -> tuple[list[str], list[Target]]:
    """The report's lines on the shift-undoing ops, and their targets (:class:`Target`, with the figure judged):
    per mode that learns a TRA, each undoing TRA op's final probability per class group and seed; per mode that
    learns its TEA during training (``tea_mode joint``, with a learned or a heuristic TRA), the rank of the best
    TEA op of each aspect of the shift per seed."""
    from jcsaug.engine.modes import get_tea_mode, get_tra_mode  # what each bundle mode learns, from its registry

    lines: list[str] = []
    checks: list[Target] = []
    for mode in modes:
        for entry in undone_by["tra"] if get_tra_mode(MODES[mode]["tra_mode"]).learned else []:
            probs = [tra_probability(results[(mode, s)]["policies"], entry["series"], entry["op"]) for s in seeds]
            text = "; ".join(", ".join(f"{p:.2f}" for p in groups) for groups in probs)
            lines.append(f"- {mode}: TRA `{entry['series']}/{entry['op']}`: {text}")
            halves = [tra_halves(results[(mode, s)]["policies"], entry["series"], entry["op"]) for s in seeds]
            if all(h is not None for h in halves):  # split-signs: which sign the policy chose
                lines[-1] += " (+ / - halves: " + "; ".join(
                    ", ".join(f"{a:.2f} / {b:.2f}" for a, b in groups) for groups in halves) + ")"  # fmt: skip
            exact = {tuple(names) for s in seeds if (names := exact_op_names(
                tra_series_op_names(results[(mode, s)]["policies"], entry["series"]), entry)) is not None}  # fmt: skip
            if len(exact) != 1:  # a random-sign op: half its draws undo the shift (reported, no target)
                lines[-1] += " (partial: its sign is drawn; no target)"
                continue
            op = entry["op"]
            if entry.get("partial"):  # split-signs: the half that reproduces the shift is the op judged
                ((op,),) = exact
                probs = [tra_probability(results[(mode, s)]["policies"], entry["series"], op) for s in seeds]
                text = "; ".join(", ".join(f"{p:.2f}" for p in groups) for groups in probs)
                lines.append(f"- {mode}: TRA `{entry['series']}/{op}` (the half that reproduces the shift): {text}")
            means = [statistics.mean(p[g] for p in probs) for g in range(len(probs[0]))]
            figure = " / ".join(figure_against(m, TRA_TARGET) for m in means)
            judged = f"{mode}: TRA {entry['series']}/{op}"
            checks.append(Target(f"{judged} >= {TRA_TARGET} in every group (mean over seeds: {figure})",
                                 min(means) >= TRA_TARGET,
                                 tra_gain, f"{judged} {figure}"))  # fmt: skip
        if get_tea_mode(MODES[mode]["tea_mode"]).joint:
            for aspect in undone_by["tea"]:
                ranks = [min(tea_ranks(results[(mode, s)]["policies"])[name] for name in aspect) for s in seeds]
                lines.append(f"- {mode}: TEA {' / '.join(aspect)}: rank {', '.join(map(str, ranks))}")
                median = statistics.median(ranks)
                checks.append(Target(f"{mode}: TEA {aspect[0]} (or equivalent) in the top {tea_z} (median seed: "
                                     f"rank {median:g})", median <= tea_z, oracle_gain,
                                     f"{mode}: TEA {aspect[0]} rank {median:g}"))  # fmt: skip
    return lines, checks


def quality_record(
    name: str,
    aspects: Mapping,
    args: argparse.Namespace,
    modes: list[str],
    results: dict[tuple[str, int], dict],
    checks: list[Target],
    oracle_gain: float | None,
    num_val: int,
) -> dict:
    """The report's figures as data (``learning_quality_NAME.json``, read by ``summarize_learning_quality.py``):
    the shift, the settings, test Dice per mode and seed (none / TTA), the oracle's gain and each target's verdict."""
    return {
        "shift": name,
        "target_domain": dict(aspects),
        "validation_volumes": num_val,
        "seeds": list(args.seeds),
        "device": args.device,
        "settings": list(args.set),
        "baseline": BASELINE,
        "dice": {m: {k: [results[(m, s)][k] for s in args.seeds] for k in ("none", "tta")} for m in modes},
        "seconds": {m: [results[(m, s)]["seconds"] for s in args.seeds] for m in modes},
        "oracle_gain": oracle_gain,
        "targets": [{"target": t.text, "label": t.label, "verdict": verdict(t.met, t.oracle_gain)} for t in checks],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--modes", nargs="+", default=[BASELINE, "class-specific+joint", "oracle+mirror"], choices=sorted(MODES)
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--shift", default="default", type=parse_shift,
                        help="target shift of the synthetic dataset: a name of TARGET_SHIFTS or a JSON object of its "
                        "keys, e.g. '{\"long_axis\": 1, \"mirror_axis0\": true, \"blur\": [0.8, 1.0]}'")  # fmt: skip
    parser.add_argument("--device", default="cpu", help="cpu, cuda, or auto (the bundle's own choice)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time")
    parser.add_argument("--set", nargs="*", default=[], metavar="ID=VALUE", help="bundle overrides for every run")
    parser.add_argument("--tea-z", type=int, default=None,
                        help="top TEA ops used at test time, passed to the bundle as tea_z and used by the rank "
                        "targets (default: --set tea_z=..., else the bundle's tea_z)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "learning_quality")
    parser.add_argument("--reuse", action="store_true", help="keep runs whose metrics.json exists")
    parser.add_argument("--num-val", type=int, default=None,
                        help="validation volumes of the synthetic dataset, the volumes the policies learn from "
                        "(default: make_synthetic_dataset's, 4); the test volumes stay the same arrays; an --out of "
                        "its own")  # fmt: skip
    parser.add_argument(
        "--validation",
        action="store_true",
        help="also evaluate every run on the validation split; report its Dice beside the test's",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads per run (default: the cores shared out over --jobs; oversubscribed torch threads "
        "spin and slow every run down several times)",
    )
    args = parser.parse_args()  # fmt: skip
    args.out = args.out.resolve()  # the runs start in the repository root: a relative path would land there

    from jcsaug.data.synthetic import changed_aspects, describe_shift
    from jcsaug.utils import atomic_write_text

    name = shift_name(args.shift)
    aspects = changed_aspects(args.shift)
    about = f"`{json.dumps(aspects)}`: {describe_shift(args.shift)}"
    if args.num_val is not None and args.num_val < 1:
        parser.error(f"--num-val must be >= 1, got {args.num_val}")
    num_val = default_validation_volumes() if args.num_val is None else args.num_val
    data, shift = prepare_dataset(args.out, args.shift, num_val=num_val)
    undone_by = shift["undone_by"]
    common = dict(item.split("=", 1) for item in args.set)
    if args.tea_z is not None and "tea_z" in common and int(common["tea_z"]) != args.tea_z:
        parser.error(f"--tea-z {args.tea_z} and --set tea_z={common['tea_z']} disagree")
    tea_z = args.tea_z if args.tea_z is not None else int(common.get("tea_z", bundle_default("tea_z")))
    if args.tea_z is not None:
        common["tea_z"] = str(args.tea_z)  # the runs test with the z the rank targets are judged by
    modes = [BASELINE] + [m for m in args.modes if m != BASELINE]
    policy_dir = args.out / "runs" / name  # the oracle policy files of this shift (another shift's are its own)
    policy_dir.mkdir(parents=True, exist_ok=True)
    jobs = []
    catalogue = common.get("tra_catalogue", bundle_default("tra_catalogue"))
    for mode in modes:
        overrides = {**MODES[mode], **common}
        if mode in TRA_ORACLE_MODES:
            partial = mode == "oracle-partial+mirror"
            overrides["tra_preset"] = json.dumps(oracle_preset(undone_by, partial=partial, catalogue=catalogue))
        if mode == "heuristic+oracle-tea":
            overrides["tea_policy"], overrides["tea_z"] = oracle_tea_policy_file(policy_dir, undone_by)
        if mode in ORACLE_GROUP_MODES:
            overrides["tra_policy"] = oracle_group_policy_file(
                policy_dir, undone_by, ORACLE_GROUP_MODES[mode], catalogue
            )
        if mode in ORACLE_FLIP_OFF_MODES:
            overrides["tra_policy"] = oracle_flip_off_policy_file(
                policy_dir, undone_by, ORACLE_FLIP_OFF_MODES[mode], catalogue
            )
        for seed in args.seeds:
            jobs.append((mode, seed, data, args.out / "runs" / name / mode / f"seed{seed}", overrides))
    print(f"shift {name!r} ({about}): undone by TRA {undone_by['tra']} / TEA {undone_by['tea']}; {len(jobs)} runs")
    results: dict[tuple[str, int], dict] = {}
    threads = threads_per_run(args.jobs, args.threads)
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {
            pool.submit(run_one, m, s, d, r, o, args.device, args.reuse, threads): (m, s) for m, s, d, r, o in jobs
        }
        for future, key in futures.items():
            results[key] = future.result()
            print(f"  {key[0]} seed {key[1]}: Dice none {results[key]['none']:.1f} / TTA {results[key]['tta']:.1f}"
                  f" ({results[key]['seconds']:.0f} s)", flush=True)  # fmt: skip
    validation: dict[tuple[str, int], dict] = {}
    if args.validation:
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = {pool.submit(evaluate_validation, r, d, o, args.device, threads): (m, s)
                       for m, s, d, r, o in jobs}  # fmt: skip
            for future, key in futures.items():
                validation[key] = future.result()

    settings = f", settings {' '.join(args.set)}" if args.set else ""
    lines = [f"## Learning quality, shift `{name}`, seeds {args.seeds}, device {args.device}{settings}", "",
             f"Target domain {about}. Validation volumes: {num_val}.", "",
             "| mode | " + " | ".join(f"seed {s} none / TTA" for s in args.seeds)
             + " | mean none | mean TTA | Δ TTA vs baseline | share of oracle gain | s / run |",
             "|---" * (len(args.seeds) + 6) + "|"]  # fmt: skip
    base = {s: results[(BASELINE, s)] for s in args.seeds}
    # per mode, per seed: the gain over the baseline with TTA, and without
    summary = {m: tuple([results[(m, s)][k] - base[s][k] for s in args.seeds] for k in ("tta", "none")) for m in modes}
    oracle_gain = oracle_gain_of({m: summary[m][0] for m in modes if m in ORACLE_GAIN_MODES})
    # (target, met, the oracle gain it is judged against): the TRA-only targets against the TRA's oracles
    tra_gain = oracle_gain_of({m: summary[m][0] for m in modes if m in TRA_ORACLE_MODES})
    tra_gain = oracle_gain if tra_gain is None else tra_gain
    for mode in modes:
        rows = [results[(mode, s)] for s in args.seeds]
        delta = summary[mode][0]
        share = oracle_share(statistics.mean(delta), oracle_gain) if mode != BASELINE else "-"
        cells = " | ".join(f"{r['none']:.1f} / {r['tta']:.1f}" for r in rows)
        means = f"{mean_sd([r['none'] for r in rows])} | {mean_sd([r['tta'] for r in rows])}"
        seconds = statistics.mean(r["seconds"] for r in rows)
        lines.append(f"| {mode} | {cells} | {means} | {mean_sd(delta)} | {share} | {seconds:.0f} |")
    lines += ["", "Final probabilities of the TRA ops that undo the shift (per class group, per seed), and the ranks "
              "of the TEA ops that undo it (best of the equivalent ops, per seed):", ""]  # fmt: skip
    undoing_lines, checks = undoing_op_report(modes, results, args.seeds, undone_by, tea_z, tra_gain, oracle_gain)
    lines += undoing_lines
    lines += ["", "Targets:", ""]
    if "class-specific+joint" in summary:
        delta, delta_none = summary["class-specific+joint"]
        gain, gain_none = statistics.mean(delta), statistics.mean(delta_none)
        text, text_none = (figure_against(gain, DICE_TARGET, 1, "+"),
                           figure_against(gain_none, DICE_TARGET_WITHOUT_TTA, 1, "+"))  # fmt: skip
        checks = [Target(f"joint - heuristic+mirror >= {DICE_TARGET} Dice points (mean {text})", gain >= DICE_TARGET,
                         oracle_gain, f"joint - heuristic+mirror {text}"),
                  Target(f"learned TRA without TTA - heuristic without TTA >= {DICE_TARGET_WITHOUT_TTA} (mean "
                         f"{text_none})", gain_none >= DICE_TARGET_WITHOUT_TTA, tra_gain,
                         f"learned TRA without TTA {text_none}")] + checks  # fmt: skip
    lines += target_lines(checks, oracle_gain, tra_gain)
    if validation:
        cases = len(json.loads((data / "dataset.json").read_text())["validation"])
        lines += ["", *validation_lines(modes, results, validation, args.seeds, cases)]
    report = "\n".join(lines) + "\n"
    print("\n" + report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"learning_quality_{name}.md").write_text(report)
    record = quality_record(name, aspects, args, modes, results, checks, oracle_gain, num_val)
    atomic_write_text(args.out / f"learning_quality_{name}.json", json.dumps(record, indent=1) + "\n")
    print(f"written: {args.out / f'learning_quality_{name}.md'} (and its .json, read by summarize_learning_quality.py)")


if __name__ == "__main__":
    main()
