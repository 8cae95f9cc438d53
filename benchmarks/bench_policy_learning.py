"""Cost of learning the policies (SPEC §4-5, DESIGN "Cost of a policy update"), measured as ratios on the CPU.

Command (from the repository root; about 1-1.5 min on 2 quiet cores with the defaults, up to ~5 min on a
loaded machine)::

    python benchmarks/bench_policy_learning.py
    # defaults: --iterations 30 --batch 8 --patch 32 --copies 4 --threads <torch default> --clock wall --seed 0
    python benchmarks/bench_policy_learning.py --threads 1 --clock cpu   # on a shared, busy machine
    python benchmarks/bench_policy_learning.py --device cuda             # model, batches and updates on a GPU

Setting: the default bundle's network (MONAI ``UNet`` channels [16, 32, 64], strides [2, 2],
``num_res_units=1``, instance norm), SGD lr 0.01 momentum 0.99 Nesterov, ``DiceCELoss``; training batches
of ``--batch`` patches of ``--patch``³ and validation batches of as many patches (m = n); Z = ``--copies``
TEA copies of one patch. The batches are synthetic (noise plus bright spherical lesions, labels 0/1, half
of the patches centred on a lesion so both class groups occur, ``tra_ops`` drawn with
``make_tra_policy("nnunet", 2).sample_ops``) and precomputed in memory: no DataLoader, data loading is
excluded. Every configuration runs an Ignite ``Engine`` whose step is a plain supervised step (forward,
``DiceCELoss``, backward, SGD step) on the *same* batches:

* ``plain``: a fixed heuristic policy, no handler attached;
* ``joint N=1`` / ``joint N=10``: the handlers of ``AugmentationSetup("class-specific", "joint").updaters``
  (``TRAPolicyUpdater`` with the TEA policy + ``TEAPolicyUpdater``; the bundle's policy lrs, val loss
  ``dice``, finite-difference hypergradient), both updating every 1 / every 10 iterations.

Paired timing (robust to a machine whose load drifts): each engine is interrupted after every iteration
(``Engine.interrupt``) and resumed, so one *round* runs one iteration of every configuration and one of
each bare pass below, in an order rotated round by round. A *cycle* is 10 rounds (one N=10 update); all
models and SGD states are reset to the same start before each cycle (untimed); the first cycle warms up.
Per cycle, a configuration's (or pass's) time per iteration is the median over the cycle's rounds (for
N=10: the median of the 9 rounds without an update plus a tenth of the update round's excess over it);
ratios and bounds come from the same cycle; their medians over the cycles are printed (measured / bound =
median ratio / median bound), with the spread of the per-cycle measured / bound. A warning flags runs
too disturbed by the machine's load to trust (spread of measured/bound > 0.15, plain iteration / FB_train
outside [0.9, 1.25], or N=10 cheaper than plain): with several threads, other processes make OpenMP
oversubscribe and the times jump tenfold; ``--threads 1 --clock cpu`` is then the stable choice.
Both clocks are recorded: ``wall`` (``time.perf_counter``, the training time the targets are about; the
default for the verdicts) and ``cpu`` (this process's CPU time, summed over its threads).

1. seconds per iteration of each configuration and its ratio to ``plain``.
2. the ratio implied by the extra passes alone. Bare passes on their own model: ``F_train`` (no-grad
   forward + per-sample losses, training batch), ``FB_train`` (forward + DiceCE + backward, training
   batch), ``F_tea`` (one no-grad forward of Z+1 copies of one patch, as ``predict_by_shape`` batches
   them). With ``FB_val = FB_train`` (m = n):
   ``bound(1) = (FB_train + FB_val + 2 F_train + F_tea) / FB_train`` and
   ``bound(10) = (10 FB_train + FB_val + 2 F_train + F_tea) / (10 FB_train)``.
   Target: the measured ratio within 10 % of the bound (``measured / bound <= 1.10``).
3. where the time of one joint N=1 iteration goes: in a fresh process (the one of 4.), timers (the
   ``--clock``) patched around ``TRAPolicyUpdater._snapshot`` / ``_validation_gradient``,
   ``tra_updater.tea_transform_batch``, the ``tra_updater.HYPERGRADIENTS["finite-difference"]`` entry (the
   updater binds it when built), ``TEAPolicyUpdater.update``, ``tea_updater.predict_by_shape``,
   ``CategoricalPolicy.series_weights``, ``PolicyUpdater.step`` / ``_log_changes`` / ``_run_update`` and
   the trainer's step; one warm-up block of 10 iterations, then 10 timed iterations.
4. peak memory: ``plain`` and ``joint N=1`` each run in a fresh subprocess (this script with the hidden
   ``--config`` flag; same set-up; 2 blocks of 10 iterations). Peak = ``VmHWM`` of ``/proc/self/status``:
   ``ru_maxrss`` is printed too but is not used, because a child started by this (large) process inherits
   the parent's high-water mark across fork + exec. Target: joint / plain <= 1.3. The increase of the peak
   over the RSS after set-up (imports, model, data) is printed for information: it isolates what training
   itself allocates, the closer analogue of a GPU's peak allocated memory.

5. the cost of each estimator option per update (``--options``, on by default; ``--no-options`` skips it):
   every option is one ``TRAPolicyUpdater`` or ``TEAPolicyUpdater`` alone, updating every iteration on the same
   batches (training batches carry ``--cf-max`` counterfactual copies per patch, as ``TRACascaded`` makes them),
   its iterations interleaved round by round with a ``plain`` engine's; printed: ms per update (median iteration
   time minus plain's) and the ratio to the paper's TRA update (``gumbel``, one validation batch). Options: the
   paired TRA estimator with K = 1, 2, 4 copies, a validation pool of 6 batches, the batch soft Dice L_val, the
   look-ahead, the ``equal-norm`` hypergradient (one backward pass per sample), the ``beyond-training`` direction
   (one more forward-backward pass of the training batch; none beside the look-ahead, which computes that
   gradient already), the synthetic bundle's own TRA settings (read from its ``train.yaml``), the same settings
   with the other TRA catalogue (``spec`` / ``split-signs``: what choosing the sign costs; each catalogue's rows
   get batches whose ops and counterfactual records its own nnU-Net preset drew), the same settings with each other
   step rule (``tra_step``, :data:`~jcsaug.engine.POLICY_STEPS`: what the rule itself costs), and the TEA estimators
   (``gumbel``, ``paired``, ``paired`` on 4 patches).

The targets live here, never in timed tests. Compare numbers only from the same machine, same ``--threads``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import monai
import numpy as np
import torch
from ignite.engine import Engine, Events
from monai.inferers import SlidingWindowInferer
from monai.losses import DiceCELoss
from monai.networks.nets import UNet
from synthetic_bundle import synthetic_config  # this folder's path to the synthetic bundle

import jcsaug.engine.tea_updater as tea_mod
import jcsaug.engine.tra_updater as tra_mod
from jcsaug.engine import POLICY_STEPS, AugmentationSetup, TEAPolicyUpdater, TRAPolicyUpdater
from jcsaug.engine.base import PolicyUpdater
from jcsaug.engine.losses import get_loss
from jcsaug.policy import CategoricalPolicy, make_tea_policy, make_tra_policy

CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
clock = time.process_time  # set from --clock in main()
BLOCK = 10  # iterations per timed block (= the larger update period, so every N=10 block holds one update)
SYNTHETIC_CONFIG: dict = synthetic_config()
#: the synthetic bundle's fixed policy learning rates (``tra_lr``, ``tea_lr``: its runs derive theirs from a logit
#: budget, which needs a run length; the cost of an update does not depend on the rate)
TRA_LR, TEA_LR = (float(SYNTHETIC_CONFIG[key]) for key in ("tra_lr", "tea_lr"))
CONFIGS = {"plain": None, "joint N=1": 1, "joint N=10": 10}
TARGET_BOUND, TARGET_MEMORY = 1.10, 1.30


# ---------------------------------------------------------------------------------------------- data
def _patch(rng: np.random.RandomState, p: int, centred: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One ``[1, p, p, p]`` image and label: noise plus 1-3 bright spheres (one at the centre if ``centred``)."""
    grid = np.stack(np.meshgrid(*[np.arange(p)] * 3, indexing="ij"), -1).astype(np.float32)
    label = np.zeros((p, p, p), np.float32)
    centres = [np.full(3, p // 2)] if centred else []
    while len(centres) < rng.randint(1, 4) or not centres:
        c = rng.randint(p // 8, p - p // 8, size=3)
        if centred or np.abs(c - p // 2).max() > p // 4:  # background patches keep their centre voxel free
            centres.append(c)
    for c in centres:
        label[((grid - c) ** 2).sum(-1) <= rng.uniform(p / 10, p / 5) ** 2] = 1.0
    if not centred:
        label[p // 2, p // 2, p // 2] = 0.0
    image = rng.normal(0.0, 1.0, (p, p, p)).astype(np.float32) + 2.0 * label
    return torch.from_numpy(image)[None], torch.from_numpy(label)[None]


#: where the models, the batches and hence the policy updates' passes run (``--device``); policies stay on the CPU
DEVICE = torch.device("cpu")


def sync() -> None:
    """Wait for the device's queued work, so that the clocks see it (a no-op on the CPU)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def to_device(batches: list[dict]) -> list[dict]:
    return [{k: v.to(DEVICE) if k in ("image", "label") else v for k, v in b.items()} for b in batches]


def make_batches(num: int, batch: int, p: int, seed: int, policy: CategoricalPolicy | None) -> list[dict]:
    """``num`` dictionary batches; half the patches lesion-centred (class group 1), half not (group 0)."""
    rng = np.random.RandomState(seed)
    out = []
    for _ in range(num):
        groups = [i % 2 for i in range(batch)]
        pairs = [_patch(rng, p, bool(g)) for g in groups]
        b = {
            "image": torch.stack([x for x, _ in pairs]),
            "label": torch.stack([y for _, y in pairs]),
            "class_group": torch.tensor(groups, dtype=torch.long),
        }
        if policy is not None:
            b["tra_ops"] = torch.from_numpy(np.stack([policy.sample_ops(g, rng) for g in groups])).long()
        out.append(b)
    return out


# ---------------------------------------------------------------------------------------------- runs
class Run:
    """One configuration: its own model (same initial weights for all), SGD, engine and handlers."""

    def __init__(self, update_every: int | None, init_state: dict, val_batches: list[dict], copies: int, seed: int):
        self.model = make_model().to(DEVICE)
        self.model.load_state_dict(init_state)
        self.init_state = {k: v.clone() for k, v in init_state.items()}
        params = self.model.parameters()
        self.optimizer = torch.optim.SGD(params, lr=0.01, momentum=0.99, nesterov=True, weight_decay=3e-5)
        self.loss = DiceCELoss(to_onehot_y=True, softmax=True, include_background=False)
        self.engine = Engine(self._step)
        self.handlers: list = []
        self._interrupting = False
        if update_every is not None:
            setup = AugmentationSetup("class-specific", "joint")
            self.handlers = setup.updaters(
                self.model, self.optimizer, val_batches, tra_lr=TRA_LR, tea_lr=TEA_LR,
                tra_update_every=update_every, tea_update_every=update_every, train_loss="ce+dice",
                val_loss="dice", num_copies=copies, hypergradient="finite-difference", seed=seed,
            )  # fmt: skip
            for h in self.handlers:
                h.attach(self.engine)

    def _step(self, engine: Engine, batch: dict) -> float:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(self.model(batch["image"]), batch["label"])
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def reset(self) -> None:
        """Back to the common start: initial weights, no SGD momentum (untimed, between iterations)."""
        self.model.load_state_dict(self.init_state)
        self.optimizer.state.clear()

    def block(self, batches: list[dict]) -> tuple[float, float]:
        """Reset, then run one epoch over ``batches`` (a fresh engine run); returns (cpu, wall) seconds."""
        self.reset()
        sync()
        c0, w0 = time.process_time(), time.perf_counter()
        self.engine.run(batches, max_epochs=1)
        sync()
        return time.process_time() - c0, time.perf_counter() - w0

    def one(self, batches: list[dict]) -> tuple[float, float]:
        """Run exactly one more iteration (the engine is interrupted after each one and resumed here), with
        all its handlers; returns (cpu, wall) seconds. Do not mix with :meth:`block` on the same run."""
        if not self._interrupting:
            self.engine.add_event_handler(Events.ITERATION_COMPLETED, lambda e: e.interrupt())
            self._interrupting = True
        sync()
        c0, w0 = time.process_time(), time.perf_counter()
        self.engine.run(batches, max_epochs=10**6)
        sync()
        return time.process_time() - c0, time.perf_counter() - w0

    def finish(self, batches: list[dict]) -> None:
        """End an interrupted run cleanly (else Ignite logs an error when the paused run is collected)."""
        if self._interrupting:
            self.engine.terminate()
            self.engine.run(batches, max_epochs=10**6)

    def counts(self) -> str:
        return ", ".join(f"{h.name}: {h.updates} updates, {h.skipped} skipped" for h in self.handlers) or "-"


def make_model() -> UNet:
    return UNet(
        spatial_dims=3, in_channels=1, out_channels=2, channels=(16, 32, 64), strides=(2, 2),
        num_res_units=1, norm="instance",
    )  # fmt: skip


def setup(args: argparse.Namespace) -> tuple[dict, list[dict], list[dict]]:
    torch.manual_seed(args.seed)
    init_state = make_model().state_dict()
    policy = make_tra_policy("nnunet", 2)
    train = to_device(make_batches(BLOCK, args.batch, args.patch, args.seed, policy))
    val = to_device(make_batches(4, args.batch, args.patch, args.seed + 1, None))
    return init_state, train, val


# ---------------------------------------------------------------------------------------------- primitives
def make_primitives(init_state: dict, train: list[dict], val: list[dict], copies: int) -> dict[str, Callable]:
    """The bare passes, on their own model: F_train, FB_train (on one training batch) and F_tea(Z+1)."""
    model = make_model().to(DEVICE)
    model.load_state_dict(init_state)
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True, include_background=False)
    per_sample = get_loss("ce+dice")
    x, y = train[0]["image"], train[0]["label"]
    lesion = int(torch.nonzero(val[0]["class_group"])[0, 0])
    tea_in = val[0]["image"][lesion : lesion + 1].expand(copies + 1, -1, -1, -1, -1).contiguous()

    def f_train() -> None:  # the per-sample training losses at theta+ or theta- (eval mode, as meta_mode="eval")
        model.eval()
        with torch.no_grad():
            per_sample(model(x), y)

    def fb_train() -> None:
        model.train()
        model.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()

    def f_tea() -> None:
        model.eval()
        with torch.no_grad():
            torch.softmax(model(tea_in), dim=1)

    return {"FB_train": fb_train, "F_train": f_train, "F_tea": f_tea}


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    sync()
    c0, w0 = time.process_time(), time.perf_counter()
    fn()
    sync()
    return time.process_time() - c0, time.perf_counter() - w0


# ---------------------------------------------------------------------------------------------- breakdown
class Timers:
    """Patch timers (the ``--clock``) around named callables; ``restore`` undoes every patch."""

    def __init__(self) -> None:
        self.times: dict[str, float] = defaultdict(float)
        self._undo: list[Callable[[], None]] = []

    def _wrap(self, fn: Callable, label: Callable[[tuple], str] | str) -> Callable:
        @functools.wraps(fn)
        def timed(*a, **k):
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                self.times[label(a) if callable(label) else label] += clock() - t0

        return timed

    def attr(self, owner: object, name: str, label: Callable[[tuple], str] | str) -> None:
        old = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        setattr(owner, name, self._wrap(old, label))
        self._undo.append(lambda: setattr(owner, name, old))

    def item(self, registry, key: str, label: str) -> None:
        old = registry.get(key)
        registry.register(key, self._wrap(old, label), overwrite=True)
        self._undo.append(lambda: registry.register(key, old, overwrite=True))

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()


def install_timers() -> Timers:
    """Timers around the pieces of a joint update (before the updaters are built: they bind HYPERGRADIENTS[...])."""
    timers = Timers()
    timers.attr(tra_mod.TRAPolicyUpdater, "_snapshot", "snapshot")
    timers.attr(tra_mod.TRAPolicyUpdater, "_validation_gradient", "val_fb")
    timers.attr(tra_mod, "tea_transform_batch", "val_tea_ops")
    timers.item(tra_mod.HYPERGRADIENTS, "finite-difference", "theta_pm")
    timers.attr(tea_mod.TEAPolicyUpdater, "update", "tea_update")
    timers.attr(tea_mod, "predict_by_shape", "tea_forward")
    timers.attr(CategoricalPolicy, "series_weights", "series_weights")
    timers.attr(PolicyUpdater, "step", lambda a: f"{a[0].name}_adam")
    timers.attr(PolicyUpdater, "_log_changes", lambda a: f"{a[0].name}_log")
    timers.attr(PolicyUpdater, "_run_update", lambda a: f"{a[0].name}_total")
    return timers


def print_breakdown(t: dict[str, float], iterations: int, clock_name: str) -> None:
    it = t["iteration"]

    def line(name: str, key_or_value: str | float, indent: int = 2) -> float:
        v = t.get(key_or_value, 0.0) if isinstance(key_or_value, str) else key_or_value
        print(f"{' ' * indent}{name:<56} {v * 1e3:8.1f} ms {v / it:6.1%}")
        return v

    print(f"\n3. Where one joint N=1 iteration goes ({clock_name} time per iteration of {iterations}, timers):")
    line("iteration total", "iteration")
    line("trainer step: forward + DiceCE + backward + SGD", "step")
    line("snapshot theta (ITERATION_STARTED)", "snapshot")
    tra = line("TRA update (_run_update)", "TRA_total")
    parts = [
        line("validation forward+backward (_validation_gradient)", "val_fb", 4),
        line("theta± forwards (finite_difference_hypergradient)", "theta_pm", 4),
        line("conditional re-sampling (series_weights)", "series_weights", 4),
        line("Adam step incl. backward into the logits (step)", "TRA_adam", 4),
        line("probabilities before/after + _log_changes", "TRA_log", 4),
    ]
    line("of the validation pass: TEA ops on the val batch", "val_tea_ops", 6)
    line("rest (batch prep, norms, normalise, drawn_mask, clone)", tra - sum(parts), 4)
    line("TEA update (_run_update)", "TEA_total")
    tea = [line("forward of Z+1 copies (predict_by_shape)", "tea_forward", 4), line("Adam step", "TEA_adam", 4)]
    line("rest (patch search, ops, inverses, Dice, sampling)", t.get("tea_update", 0.0) - sum(tea), 4)
    line("probabilities before/after + _log_changes", "TEA_log", 4)
    accounted = sum(t.get(k, 0.0) for k in ("step", "snapshot", "TRA_total", "TEA_total"))
    line("engine / events (rest)", it - accounted)
    book = sum(t.get(k, 0.0) for k in ("series_weights", "TRA_adam", "TRA_log", "TEA_adam", "TEA_log"))
    print(f"  policy bookkeeping (re-sampling, Adam steps, logging; TRA + TEA): {book * 1e3:.1f} ms = {book / it:.1%}")


# ---------------------------------------------------------------------------------------------- 5. options
def synthetic_tra_settings(config: Path | None = None) -> tuple[dict, int, str, str]:
    """The synthetic bundle's TRA estimator settings as ``TRAPolicyUpdater`` arguments, read from its
    ``train.yaml`` (so that section 5's default row follows the bundle; ``config``: another file), its
    counterfactual copies K, its TRA catalogue (``tra_catalogue``: the policy's ops) and a label."""
    cfg = SYNTHETIC_CONFIG if config is None else synthetic_config(config)
    kwargs = {"estimator": cfg["tra_estimator"], "val_batches": int(cfg["val_batches"]), "val_loss": cfg["val_loss"],
              "lookahead": float(cfg["tra_lookahead"]), "direction": cfg["tra_direction"],
              "hypergradient": cfg["hypergradient"], "step_rule": cfg.get("tra_step", "adam")}  # fmt: skip
    copies = int(cfg["tra_counterfactuals"])
    catalogue = cfg.get("tra_catalogue", "spec")
    label = (f"{kwargs['estimator']} K={copies}, {kwargs['val_batches']} val batches, {kwargs['val_loss']} L_val, "
             f"look-ahead {cfg['tra_lookahead']}, {kwargs['direction']}, {catalogue} catalogue, "
             f"{kwargs['step_rule']} step")  # fmt: skip
    return kwargs, copies, catalogue, label


SYNTHETIC_TRA, SYNTHETIC_TRA_COPIES, SYNTHETIC_TRA_CATALOGUE, SYNTHETIC_TRA_NAME = synthetic_tra_settings()

#: option -> (updater class, its keyword arguments, counterfactual copies the training batches need)
# the synthetic bundle's tea_sliding_window predicts its 48³ volumes by 32³ windows (8 windows, 2.4x the voxels);
# here 24³ windows on the default 32³ patches (8 windows, 3.4x the voxels)
TEA_WINDOW = SlidingWindowInferer(24, sw_batch_size=8, overlap=0.25, mode="gaussian")
SYNTHETIC_ROW = f"TRA synthetic default ({SYNTHETIC_TRA_NAME})"
SYNTHETIC_6_ROW = "TRA synthetic default with 6 val batches (its setting before 2026-11-28)"
#: the bundle's settings with the other TRA catalogue: what the catalogue itself costs per update
OTHER_CATALOGUE = "spec" if SYNTHETIC_TRA_CATALOGUE == "split-signs" else "split-signs"
OTHER_CATALOGUE_ROW = f"TRA the synthetic settings in the {OTHER_CATALOGUE} catalogue"
#: the bundle's settings with each other step rule (``tra_step``): what the rule itself costs per update
OTHER_STEP_ROWS = {
    rule: f"TRA the synthetic settings with tra_step {rule}"
    for rule in POLICY_STEPS.names()
    if rule != SYNTHETIC_TRA["step_rule"]
}
OPTIONS: dict[str, tuple[type, dict, int]] = {
    "TRA gumbel (paper), 1 val batch": (TRAPolicyUpdater, {"estimator": "gumbel"}, 0),
    "TRA paired K=1": (TRAPolicyUpdater, {"estimator": "paired"}, 1),
    "TRA paired K=2": (TRAPolicyUpdater, {"estimator": "paired"}, 2),
    "TRA paired K=4": (TRAPolicyUpdater, {"estimator": "paired"}, 4),
    "TRA paired K=2, 6 val batches": (TRAPolicyUpdater, {"estimator": "paired", "val_batches": 6}, 2),
    "TRA paired K=2, batch-dice L_val": (TRAPolicyUpdater, {"estimator": "paired", "val_loss": "batch-dice"}, 2),
    "TRA paired K=2, look-ahead 16": (TRAPolicyUpdater, {"estimator": "paired", "lookahead": 16}, 2),
    "TRA paired K=2, equal-norm": (TRAPolicyUpdater, {"estimator": "paired", "hypergradient": "equal-norm"}, 2),
    "TRA paired K=2, beyond-training": (TRAPolicyUpdater, {"estimator": "paired", "direction": "beyond-training"}, 2),
    "TRA paired K=2, look-ahead 16, beyond-training": (
        TRAPolicyUpdater,
        {"estimator": "paired", "lookahead": 16, "direction": "beyond-training"},
        2,
    ),
    SYNTHETIC_ROW: (TRAPolicyUpdater, SYNTHETIC_TRA, SYNTHETIC_TRA_COPIES),
    SYNTHETIC_6_ROW: (
        TRAPolicyUpdater,
        {**SYNTHETIC_TRA, "val_batches": 6},
        SYNTHETIC_TRA_COPIES,
    ),
    OTHER_CATALOGUE_ROW: (TRAPolicyUpdater, SYNTHETIC_TRA, SYNTHETIC_TRA_COPIES),
    **{
        row: (TRAPolicyUpdater, {**SYNTHETIC_TRA, "step_rule": rule}, SYNTHETIC_TRA_COPIES)
        for rule, row in OTHER_STEP_ROWS.items()
    },
    "TEA gumbel (paper)": (TEAPolicyUpdater, {"estimator": "gumbel"}, 0),
    "TEA paired": (TEAPolicyUpdater, {"estimator": "paired"}, 0),
    "TEA paired, 4 patches": (TEAPolicyUpdater, {"estimator": "paired", "patches": 4}, 0),
    "TEA paired, ensemble score (z = 8)": (TEAPolicyUpdater, {"estimator": "paired", "op_score": "ensemble"}, 0),
    "TEA paired, scored in view": (TEAPolicyUpdater, {"estimator": "paired", "mask_out_of_view": True}, 0),
    "TEA paired, 1 background patch pooled in": (TEAPolicyUpdater, {"estimator": "paired", "background_patches": 1}, 0),
    "TEA paired, copies by a sliding window of 24³": (
        TEAPolicyUpdater,
        {"estimator": "paired", "inferer": TEA_WINDOW},
        0,
    ),
    "TEA paired, alone-hard score, copies by a sliding window of 24³": (
        TEAPolicyUpdater,
        {"estimator": "paired", "op_score": "alone-hard", "inferer": TEA_WINDOW},
        0,
    ),
}


#: option -> the TRA catalogue of its policy (others: ``spec``): the synthetic bundle's rows use the bundle's
OPTION_CATALOGUES = {
    SYNTHETIC_ROW: SYNTHETIC_TRA_CATALOGUE,
    SYNTHETIC_6_ROW: SYNTHETIC_TRA_CATALOGUE,
    OTHER_CATALOGUE_ROW: OTHER_CATALOGUE,
    **{row: SYNTHETIC_TRA_CATALOGUE for row in OTHER_STEP_ROWS.values()},
}


def with_counterfactuals(batches: list[dict], copies: int, seed: int, catalogue: str = "spec") -> list[dict]:
    """The batches with their ``tra_ops`` drawn anew by nnU-Net's preset in ``catalogue``, plus ``copies``
    counterfactual copies per patch (other patches of the same shape stand in for them: the cost does not depend on
    their content) and valid (series, op) records of that catalogue."""
    rng = np.random.RandomState(seed)
    policy = make_tra_policy("nnunet", 2, catalogue=catalogue)
    sizes = policy.series_sizes
    out = []
    for b in batches:
        n = b["image"].shape[0]
        groups = b["class_group"].tolist()
        b = {**b, "tra_ops": torch.from_numpy(np.stack([policy.sample_ops(g, rng) for g in groups])).long()}
        pick = torch.from_numpy(rng.randint(0, n, size=(n, copies)))
        series = rng.randint(0, len(sizes), size=(n, copies))
        ops = np.array([[rng.randint(1, sizes[s]) for s in row] for row in series])
        ops = np.where(b["tra_ops"].numpy()[np.arange(n)[:, None], series] != 0, 0, ops)
        out.append({**b, "image_cf": b["image"][pick], "label_cf": b["label"][pick],
                    "tra_cf_ops": torch.from_numpy(np.stack([series, ops], -1)).long()})  # fmt: skip
    return out


def option_costs(args: argparse.Namespace, init_state: dict, train: list[dict], val: list[dict]) -> None:
    """Section 5: ms per update of every option, interleaved round by round with a plain engine."""
    most = max(k for _, _, k in OPTIONS.values())
    batches = {c: with_counterfactuals(train, most, args.seed, c) for c in {"spec", *OPTION_CATALOGUES.values()}}
    catalogue_of = {name: OPTION_CATALOGUES.get(name, "spec") for name in ["plain", *OPTIONS]}
    runs = {"plain": Run(None, init_state, val, args.copies, args.seed)}
    for name, (cls, kwargs, copies) in OPTIONS.items():
        run = Run(None, init_state, val, args.copies, args.seed)
        if cls is TRAPolicyUpdater:
            policy = make_tra_policy("nnunet", 2, catalogue=catalogue_of[name])
            updater = cls(policy, run.model, val, run.optimizer, lr=TRA_LR, **kwargs)
        else:
            updater = cls(make_tea_policy("nnunet"), run.model, val, lr=TEA_LR, num_copies=args.copies, **kwargs)
        updater.attach(run.engine)
        run.handlers = [updater]
        run.copies = copies
        runs[name] = run
    data = {name: [{**b, "image_cf": b["image_cf"][:, : getattr(r, "copies", 0)],
                    "label_cf": b["label_cf"][:, : getattr(r, "copies", 0)],
                    "tra_cf_ops": b["tra_cf_ops"][:, : getattr(r, "copies", 0)]} for b in batches[catalogue_of[name]]]
            for name, r in runs.items()}  # fmt: skip
    times: dict[str, list[float]] = defaultdict(list)
    order = list(runs)
    k = 0 if args.clock == "cpu" else 1
    for r in range(BLOCK * (1 + max(1, math.ceil(args.iterations / BLOCK)))):
        shift = r % len(order)
        for name in order[shift:] + order[:shift]:
            t = runs[name].one(data[name])
            if r >= BLOCK:  # the first block warms up
                times[name].append(t[k])
    for name, run in runs.items():
        run.finish(data[name])
    plain = statistics.median(times["plain"])
    paper = statistics.median(times["TRA gumbel (paper), 1 val batch"]) - plain
    print(f"\n5. Cost of each estimator option per update ({args.clock} ms; median iteration minus plain's "
          f"{plain * 1e3:.1f} ms; updates every iteration):")  # fmt: skip
    width = max(map(len, OPTIONS))
    for name in OPTIONS:
        cost = statistics.median(times[name]) - plain
        print(f"  {name:<{width}} {cost * 1e3:8.1f} ms/update  {cost / paper:5.2f}x the paper's TRA update"
              f"   ({runs[name].counts()})")  # fmt: skip


# ---------------------------------------------------------------------------------------------- memory child
def rss_kib() -> tuple[int, int]:
    """(current RSS, peak RSS) of this process in KiB.

    The peak is ``VmHWM`` (Linux): ``ru_maxrss`` of a child process started by a large parent can carry
    the parent's peak across fork + exec, so it is read only where ``/proc`` is missing."""
    try:
        with open("/proc/self/status") as f:
            d = {k: int(v.split()[0]) for k, v in (ln.split(":", 1) for ln in f) if k in ("VmRSS", "VmHWM")}
        return d["VmRSS"], d["VmHWM"]
    except (OSError, KeyError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // (1024 if sys.platform == "darwin" else 1)
        return peak, peak


def child(args: argparse.Namespace) -> None:
    """Hidden ``--config`` mode: one configuration in a fresh process, one warm-up block + one block.

    Prints one JSON line: RSS after set-up, peak RSS (and ru_maxrss) at the end and, for joint runs,
    the breakdown timers of the second block."""
    init_state, train, val = setup(args)
    timers = install_timers() if CONFIGS[args.config] else None
    run = Run(CONFIGS[args.config], init_state, val, args.copies, args.seed)
    if timers is not None:
        timers.attr(run, "_step", "step")
        run.engine._process_function = run._step  # the engine holds the bound method it was built with
    setup_rss, _ = rss_kib()
    run.block(train)
    if timers is not None:
        timers.times.clear()
    t0 = clock()
    run.block(train)
    out: dict = {"config": args.config, "setup_kib": setup_rss, "peak_kib": rss_kib()[1]}
    out["ru_maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if timers is not None:
        out["breakdown"] = {**timers.times, "iteration": clock() - t0}
        out["breakdown"] = {k: v / BLOCK for k, v in out["breakdown"].items()}
        out["counts"] = run.counts()
    print(json.dumps(out))


def run_children(args: argparse.Namespace) -> dict[str, dict]:
    out = {}
    for name in ("plain", "joint N=1"):
        cmd = [sys.executable, os.path.abspath(__file__), "--config", name, "--batch", str(args.batch)]
        cmd += ["--patch", str(args.patch), "--copies", str(args.copies), "--seed", str(args.seed)]
        cmd += ["--clock", args.clock, "--device", str(DEVICE)]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise RuntimeError(f"subprocess for {name!r} failed:\n{res.stderr[-3000:]}")
        out[name] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


# ---------------------------------------------------------------------------------------------- main
def main() -> None:
    global clock, DEVICE  # noqa: PLW0603
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--iterations", type=int, default=30, help="timed iterations per configuration (blocks of 10)")
    parser.add_argument("--batch", type=int, default=8, help="patches per training / validation batch (n = m)")
    parser.add_argument("--patch", type=int, default=32, help="patch edge (cubic patches)")
    parser.add_argument("--copies", type=int, default=4, help="Z, TEA copies per TEA update")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall", help="clock of the verdicts (both printed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where models, batches and updates run: cpu, cuda, cuda:1...")
    parser.add_argument("--config", choices=list(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--options", action=argparse.BooleanOptionalAction, default=True,
                        help="section 5: the cost of each estimator option per update")  # fmt: skip
    args = parser.parse_args()
    DEVICE = torch.device(args.device)
    clock = CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*update skipped.*")  # skips are counted and printed
    if args.config:
        child(args)
        return

    cycles = max(1, math.ceil(args.iterations / BLOCK))
    print(
        f"policy-learning cost | torch {torch.__version__}, MONAI {monai.__version__}, "
        f"{platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads | batch {args.batch} x "
        f"{args.patch}³, Z = {args.copies} | {cycles} x {BLOCK} timed iterations per configuration | "
        f"verdicts on {args.clock} time | device {DEVICE}"
    )
    t_start = time.perf_counter()
    init_state, train, val = setup(args)
    runs = {name: Run(n, init_state, val, args.copies, args.seed) for name, n in CONFIGS.items()}
    prims = make_primitives(init_state, train, val, args.copies)

    # 1 + 2. one round = one iteration of every configuration + one of every bare pass, order rotated;
    # a cycle = BLOCK rounds (one N=10 update per cycle); runs reset to the common start before each cycle;
    # the first cycle warms up. Per cycle: s/it = cycle time / BLOCK, ratios and bounds from the same cycle.
    jobs: dict[str, Callable[[], tuple[float, float]]] = {n: functools.partial(r.one, train) for n, r in runs.items()}
    jobs |= {n: functools.partial(timed, f) for n, f in prims.items()}
    order = list(jobs)
    per_cycle: list[dict[str, list[tuple[float, float]]]] = []
    for c in range(cycles + 1):
        for run in runs.values():
            run.reset()
        times: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for r in range(BLOCK):
            shift = (c * BLOCK + r) % len(order)
            for name in order[shift:] + order[:shift]:
                times[name].append(jobs[name]())
        if c:
            per_cycle.append(times)
    for run in runs.values():
        run.finish(train)

    def metrics(i: int) -> dict[str, list[float]]:
        """Per-cycle values on clock ``i`` (0 = cpu, 1 = wall)."""
        out: dict[str, list[float]] = defaultdict(list)
        for times in per_cycle:
            # robust per-iteration estimates: the median over the cycle's rounds; for N=10 the median of
            # the 9 rounds without an update plus a tenth of the update round's excess over it
            mean = {n: statistics.median(t[i] for t in v) for n, v in times.items()}
            base = statistics.median(t[i] for t in times["joint N=10"][: BLOCK - 1])
            mean["joint N=10"] = base + (times["joint N=10"][BLOCK - 1][i] - base) / BLOCK
            fb, f, ft = mean["FB_train"], mean["F_train"], mean["F_tea"]
            for n in CONFIGS:
                out[f"s/it {n}"].append(mean[n])
                out[f"ratio {n}"].append(mean[n] / mean["plain"])
            for n, every in (("joint N=1", 1), ("joint N=10", 10)):
                bound = (every * fb + fb + 2 * f + ft) / (every * fb)  # FB_val = FB_train (m = n)
                out[f"bound {n}"].append(bound)
                out[f"q {n}"].append(mean[n] / mean["plain"] / bound)
            for n in prims:
                out[n].append(mean[n])
            out["plain/FB"].append(mean["plain"] / fb)
        return out

    met = [metrics(0), metrics(1)]
    med = [{k: statistics.median(v) for k, v in m.items()} for m in met]
    k = 0 if args.clock == "cpu" else 1

    print("\n1. Seconds per iteration and ratio to plain (medians; cpu = process CPU time, wall = elapsed):")
    print(f"  {'':<11} {'cpu s/it':>9} {'wall s/it':>10} {'ratio cpu':>10} {'ratio wall':>11}  policy updates (run)")
    for n in CONFIGS:
        print(
            f"  {n:<11} {med[0][f's/it {n}']:9.3f} {med[1][f's/it {n}']:10.3f} {med[0][f'ratio {n}']:10.2f} "
            f"{med[1][f'ratio {n}']:11.2f}  [{runs[n].counts()}]"
        )
    print("\n2. Passes alone (medians; cpu / wall ms):")
    for n, label in (("FB_train", "forward + backward, training batch"), ("F_train", "forward, training batch"),
                     ("F_tea", f"forward of Z+1 = {args.copies + 1} copies of one patch")):  # fmt: skip
        print(f"  {n:<9} {med[0][n] * 1e3:8.1f} {med[1][n] * 1e3:8.1f}   {label}")
    print(f"  plain iteration / FB_train: cpu {med[0]['plain/FB']:.2f}, wall {med[1]['plain/FB']:.2f}")
    print(f"  measured ratio vs the bound from the extra passes (target: measured / bound <= {TARGET_BOUND:.2f}):")
    for n in ("joint N=1", "joint N=10"):
        cells = []
        for i, cname in enumerate(("cpu", "wall")):
            q = met[i][f"q {n}"]
            cells.append(
                f"{cname}: {med[i][f'ratio {n}']:.2f} vs {med[i][f'bound {n}']:.2f}, "
                f"measured/bound {med[i][f'ratio {n}'] / med[i][f'bound {n}']:.2f} (cycles {min(q):.2f}-{max(q):.2f})"
            )
        verdict = "PASS" if med[k][f"ratio {n}"] / med[k][f"bound {n}"] <= TARGET_BOUND else "MISS"
        print(f"  {n:<11} {' | '.join(cells)}  {verdict} ({args.clock})")
    spread = max(max(met[k][f"q {n}"]) - min(met[k][f"q {n}"]) for n in ("joint N=1", "joint N=10"))
    if spread > 0.15 or not 0.9 <= med[k]["plain/FB"] <= 1.25 or med[k]["ratio joint N=10"] < 1.0:
        print(
            f"  WARNING: the {args.clock} times are disturbed (per-cycle measured/bound spread {spread:.2f}, "
            f"plain / FB_train {med[k]['plain/FB']:.2f}): the verdicts above are unreliable. Rerun on a quiet "
            "machine, or with --threads 1 --clock cpu (no OpenMP threads to oversubscribe)."
        )

    # 3 + 4. fresh processes: peak memory, and the breakdown of a joint N=1 iteration
    mem = run_children(args)
    print_breakdown(mem["joint N=1"]["breakdown"], BLOCK, args.clock)
    print(f"  updates in that process: {mem['joint N=1']['counts']}")
    p, j = mem["plain"], mem["joint N=1"]
    ratio = j["peak_kib"] / p["peak_kib"]
    print("\n4. Peak memory of a fresh process running one configuration (2 blocks; VmHWM):")
    for name, m in mem.items():
        print(
            f"  {name:<11} peak {m['peak_kib'] / 1024:7.1f} MiB | after set-up {m['setup_kib'] / 1024:7.1f} MiB | "
            f"training adds {(m['peak_kib'] - m['setup_kib']) / 1024:6.1f} MiB | "
            f"ru_maxrss {m['ru_maxrss_kib'] / 1024:7.1f} MiB"
        )
    verdict = "PASS" if ratio <= TARGET_MEMORY else "MISS"
    print(f"  joint N=1 / plain peak: {ratio:.2f} (target <= {TARGET_MEMORY})  {verdict}")
    inc_p, inc_j = p["peak_kib"] - p["setup_kib"], j["peak_kib"] - j["setup_kib"]
    if inc_p > 0:
        print(f"  for information: joint N=1 / plain of what training adds over set-up: {inc_j / inc_p:.2f}")
    if args.options:
        option_costs(args, init_state, train, val)
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
