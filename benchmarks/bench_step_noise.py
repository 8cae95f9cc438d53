"""What noise alone does to a learned TRA policy: the paired estimator's step rules fed op effects of known mean.

Command (from the repository root; about 10 s per step rule on one core)::

    python benchmarks/bench_step_noise.py
    # options: --rules adam natural natural-recent natural-unbiased --signals 0 0.3 0.6 --seeds 8
    #          --updates 250 --samples 8 --counterfactuals 2 --budget 6 --preset nnunet --catalogue split-signs

A run of the synthetic bundle measures each op's effect with noise as large as, or larger than, the effect itself
(``benchmarks/README.md``). This benchmark replaces the network by effects of known mean: each measurement is
``mean + N(0, 1)``, where the mean is 0 for every op except a *helpful* op (``--helpful``, mean ``-signal``: it
lowers the validation loss) and a *harmful* one (``--harmful``, ``+signal``); with ``--signals 0`` nothing helps or
hurts. Everything else is the library's: the TRA policy (``--preset``, ``--catalogue``, two class groups), the running
op effects and the natural or softmax gradient (:class:`jcsaug.engine.paired.OpEffects`), the step rule's masked Adam
(:data:`jcsaug.engine.base.POLICY_STEPS`, with the paired estimators' frequency scaling) at a constant learning rate
``--budget / --updates``. Per update, ``--samples`` patches (half per class group) draw their ops from the policy
and each makes ``--counterfactuals`` copies as ``TRACascaded(exploration="drawn")`` does: a uniformly drawn
(series, op); where the sample drew a non-identity op in that series the copy scores the sample's op, else the
drawn op.

Printed per step rule, mean ± sd over ``--seeds``: the expected number of series per sample that apply a
non-identity op (group mean; the preset's at the start) and the final probabilities of the helpful and the harmful
op (group means). With ``--signals 0`` a rule without bias keeps the preset's count; one that grows it adds
augmentation for no reason (a rare op's probability rises in expectation under logit noise: ``exp`` is convex).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np
import torch

from jcsaug.engine.base import POLICY_STEPS
from jcsaug.engine.paired import OpEffects
from jcsaug.ops.catalogue import find_op as catalogue_op
from jcsaug.ops.tra import tra_catalogue
from jcsaug.policy import make_tra_policy
from jcsaug.policy.categorical import CategoricalPolicy


def find_op(catalogue: str, name: str) -> tuple[int, int]:
    """``"series/op"`` of the TRA catalogue -> (series index, op index); a command-line error names the valid
    series or ops."""
    try:
        return catalogue_op(tra_catalogue(catalogue), name)
    except KeyError as err:
        raise SystemExit(f"--helpful / --harmful: {err.args[0]}") from None


def non_identity_series(policy: CategoricalPolicy) -> float:
    """Expected number of series per sample that apply a non-identity op, averaged over the class groups."""
    return float(sum((1 - p[:, 0]).mean() for p in policy.probabilities()))


def simulate(
    rule: str,
    seed: int,
    signal: float,
    helpful: tuple[int, int],
    harmful: tuple[int, int],
    updates: int = 250,
    samples: int = 8,
    counterfactuals: int = 2,
    budget: float = 6.0,
    preset: str = "nnunet",
    catalogue: str = "split-signs",
) -> dict[str, float]:
    """One simulated run; returns the start and end non-identity counts and the two ops' final probabilities."""
    rng = np.random.RandomState(seed)
    policy = make_tra_policy(preset, num_groups=2, catalogue=catalogue)
    step_rule = POLICY_STEPS.get(rule)
    optimizer = step_rule.optimizer(policy, budget / updates, frequency_scaling=True)
    effects = OpEffects(policy, smoothing=0.1, natural=step_rule.natural)
    explorable = [(s, j) for s, size in enumerate(policy.series_sizes) for j in range(1, size)]
    means = {helpful: -signal, harmful: signal}
    start = non_identity_series(policy)
    for _ in range(updates):
        groups, series, ops, measured = [], [], [], []
        for i in range(samples):
            group = i % 2
            own = policy.sample_ops(group, rng)  # the sample's ops, drawn as the DataLoader workers draw them
            # the copies as TRACascaded.randomize_counterfactuals draws them (by hand: that method also builds the
            # copies' op parameters from a sample's, which a simulation without images has none of)
            for _ in range(counterfactuals):
                s, j = explorable[rng.randint(len(explorable))]
                op = int(own[s]) if own[s] != 0 else j  # the sample's own op is scored, else the drawn one explored
                groups.append(group)
                series.append(s)
                ops.append(op)
                measured.append(means.get((s, op), 0.0) + rng.randn())
        sums, counts = effects.accumulate(torch.tensor(groups), torch.tensor(series), torch.tensor(ops),
                                          torch.tensor(measured))  # fmt: skip
        grad, mask = effects.gradient(sums, counts)
        policy.logits.grad = grad.to(policy.logits.dtype)
        optimizer.step(mask=mask)
    end = policy.probabilities()
    return {
        "start": start,
        "end": non_identity_series(policy),
        "helpful": float(end[helpful[0]][:, helpful[1]].mean()),
        "harmful": float(end[harmful[0]][:, harmful[1]].mean()),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rules", nargs="+", default=["adam", "natural", "natural-recent", "natural-unbiased"],
                        choices=POLICY_STEPS.names())  # fmt: skip
    parser.add_argument("--signals", nargs="+", type=float, default=[0.0, 0.3, 0.6],
                        help="mean effect of the helpful / harmful op, in units of the noise's sd")  # fmt: skip
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--updates", type=int, default=250, help="TRA updates (the synthetic bundle's: 250)")
    parser.add_argument("--samples", type=int, default=8, help="training patches per update")
    parser.add_argument("--counterfactuals", type=int, default=2, help="copies per patch (tra_counterfactuals)")
    parser.add_argument("--budget", type=float, default=6.0, help="tra_logit_budget (constant learning rate)")
    parser.add_argument("--preset", default="nnunet")
    parser.add_argument("--catalogue", default="split-signs")
    parser.add_argument("--helpful", default="rotate_frontal/rot90+")
    parser.add_argument("--harmful", default="rotate_sagittal/rot90+")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    probe = make_tra_policy(args.preset, num_groups=2, catalogue=args.catalogue)
    helpful, harmful = find_op(args.catalogue, args.helpful), find_op(args.catalogue, args.harmful)
    start = non_identity_series(probe)
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}; {args.updates} updates of "
          f"{args.samples} patches x {args.counterfactuals} copies, logit budget {args.budget:g}, {args.seeds} seeds; "
          f"preset {args.preset} ({args.catalogue}): {start:.2f} non-identity series per sample")  # fmt: skip
    print(f"# helpful op {args.helpful} (mean effect -signal), harmful op {args.harmful} (+signal); noise sd 1\n")
    print("| step rule | signal | non-identity series per sample, end | helpful op, end | harmful op, end | s/run |")
    print("|---|---|---|---|---|---|")
    rows = []
    for rule in args.rules:
        for signal in args.signals:
            tic = time.perf_counter()
            runs = [simulate(rule, seed, signal, helpful, harmful, args.updates, args.samples, args.counterfactuals,
                             args.budget, args.preset, args.catalogue) for seed in range(args.seeds)]  # fmt: skip
            seconds = (time.perf_counter() - tic) / args.seeds

            def cell(key: str, runs: list[dict] = runs) -> str:
                values = [r[key] for r in runs]
                sd = statistics.stdev(values) if len(values) > 1 else 0.0
                return f"{statistics.fmean(values):.3f} ± {sd:.3f}"

            row = {"rule": rule, "signal": signal, **{k: statistics.fmean(r[k] for r in runs) for k in runs[0]}}
            rows.append(row)
            helpful_cell = cell("helpful") if signal else "–"
            harmful_cell = cell("harmful") if signal else "–"
            print(f"| {rule} | {signal:g} | {cell('end')} | {helpful_cell} | {harmful_cell} | {seconds:.1f} |",
                  flush=True)  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
