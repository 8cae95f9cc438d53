"""Policy bookkeeping of a TRA update on whole tensors vs a per-series loop, as the number of series grows.

Command (from the repository root; seconds)::

    python benchmarks/bench_policy_bookkeeping.py
    # options: --batch 10 --groups 2 --series 15 60 240 --repeats 200 --threads 1 --seed 0

What an update spends besides its forward/backward passes on the policy side: the conditional Gumbel
re-sampling of the recorded choices (``CategoricalPolicy.series_weights``), the drawn-op mask
(``drawn_mask``), the class centring and sampling normalisation (``normalise_hypergradient``) and the
backward of the surrogate into the logits. For the 15 TRA series (sizes 6, 5, 5, 5, 2, 2, 2, 4, 4, 4, 4, 4,
7, 4, 4) and for policies with the same series repeated 4x and 16x, one process times (CPU clock, median
over ``--repeats``, the two variants interleaved):

* ``vectorised``: the library's calls (all series in one tensor operation);
* ``per-series loop``: the same weights computed series by series with ``conditional_gumbel_softmax`` (how
  ``series_weights`` worked before), as the baseline of the same run.

Printed: ms per update for each, their ratio, and how each grows from 15 series to the largest count.
Target: the vectorised bookkeeping a few ms, and not growing with the number of series (ratio of the
largest count to 15 series close to 1).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np
import torch

from jcsaug.engine.hypergradient import normalise_hypergradient
from jcsaug.ops.tra import TRA_SERIES
from jcsaug.policy.categorical import NOT_APPLIED, CategoricalPolicy
from jcsaug.policy.gumbel import conditional_gumbel_softmax, straight_through_weight


def loop_weights(policy: CategoricalPolicy, choices: torch.Tensor, groups: torch.Tensor, gen) -> torch.Tensor:
    """The per-series loop (the previous implementation of ``series_weights``): the baseline."""
    columns = []
    for s in range(policy.num_series):
        idx = choices[:, s]
        logits = policy.series_logits(s)[groups]
        w = straight_through_weight(conditional_gumbel_softmax(logits, idx.clamp(min=0), gen), idx.clamp(min=0))
        columns.append(torch.where(idx != NOT_APPLIED, w, torch.ones_like(w).detach()))
    return torch.stack(columns, dim=1)


def update(policy, choices, groups, g, gen, weights_fn) -> None:
    coefficients = normalise_hypergradient(g, groups, choices)
    weights = weights_fn(policy, choices, groups, gen)
    policy.drawn_mask(choices, groups)
    policy.logits.grad = None
    (coefficients.to(weights.dtype) * weights).sum().backward()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--series", type=int, nargs="+", default=[15, 60, 240], help="multiples of 15")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes15 = [s.size for s in TRA_SERIES]
    variants = {
        "vectorised": lambda p, c, g, gen: p.series_weights(c, g, gen),
        "per-series loop": loop_weights,
    }
    print(f"policy bookkeeping per TRA update | torch {torch.__version__}, {platform.machine()}, "
          f"{torch.get_num_threads()} thread(s) | batch {args.batch}, {args.groups} class groups | CPU clock, "
          f"median of {args.repeats}")  # fmt: skip
    rows = {}
    for count in args.series:
        sizes = sizes15 * (count // 15)
        policy = CategoricalPolicy(sizes, num_groups=args.groups)
        rng = np.random.RandomState(args.seed)
        groups = torch.tensor([i % args.groups for i in range(args.batch)])
        choices = torch.stack([torch.as_tensor(policy.sample_ops(int(g), rng)) for g in groups])
        g = torch.randn(args.batch, dtype=torch.float64)
        gen = torch.Generator().manual_seed(args.seed)
        times: dict[str, list[float]] = {k: [] for k in variants}
        names = list(variants)
        for r in range(args.repeats + 5):
            for name in names[r % 2 :] + names[: r % 2]:
                t0 = time.process_time()
                update(policy, choices, groups, g, gen, variants[name])
                if r >= 5:
                    times[name].append(time.process_time() - t0)
        rows[count] = {k: 1e3 * statistics.median(v) for k, v in times.items()}
        print(f"  {count:4d} series: vectorised {rows[count]['vectorised']:6.2f} ms, per-series loop "
              f"{rows[count]['per-series loop']:6.2f} ms, loop / vectorised "
              f"{rows[count]['per-series loop'] / rows[count]['vectorised']:5.2f}")  # fmt: skip
    first, last = args.series[0], args.series[-1]
    for name in variants:
        print(f"  {name}: {last} series / {first} series = {rows[last][name] / rows[first][name]:.2f}")


if __name__ == "__main__":
    main()
