"""One-step effect of single TRA ops (alone and in pairs) on the target-domain validation loss, paired per patch.

Command (from the repository root; about 20-80 s per checkpoint on one busy CPU core with the defaults)::

    python benchmarks/bench_op_effects.py --dataset-dir DIR --checkpoint RUN/checkpoint_epoch=20.pt
    # defaults: --ops <the ops that undo DIR's shift + rotate±[20,30) of the rotation series among them>
    #           --patches-per-group 48 --val-directions 2 --context none --seed 0 --device cpu
    python benchmarks/bench_op_effects.py --dataset-dir DIR --checkpoint A.pt B.pt --context drawn --out effects.md
    python benchmarks/bench_op_effects.py --dataset-dir DIR --checkpoint A.pt --ops rotate_frontal/rot90 noise/...

``DIR`` is a synthetic dataset of :func:`jcsaug.data.make_synthetic_dataset` (e.g. the one
``bench_learning_quality.py`` generates under its ``--out``): source patches come from its training split, the
validation loss from its validation split (the target domain). Every ``--checkpoint`` is a state saved by the
bundle (``network`` key); the network, the loading transforms, the crop, the class groups and the losses are the
bundle's (``--config``, default ``bundles/synthetic_lesion/configs/train.yaml``), built from the config itself.

For a state theta, a validation direction ``v`` = gradient of the bundle's validation loss (``val_loss``,
``batch-dice``) over ``val_batches`` batches of target patches (network in eval mode, as the TRA updater's
``meta_mode="eval"``), and a source patch x::

    s(T, x) = grad_theta l_train(T(x)) . v / ||v||         (l_train: the bundle's per-sample ``train_loss``)

A plain SGD step of size lr on T(x) changes the validation loss by ``-lr * ||v|| * s(T, x)`` to first order, so
s is the predicted *decrease* of the validation loss. The table reports, per transform T and class group,

    effect(T) = mean_x [ s(T, x) - s(identity, x) ] x 1000      (positive: T helps more than the plain patch)

with its standard error over patches (s averaged over the ``--val-directions`` directions first), t = effect /
s.e., ``v+`` = the directions whose mean effect is positive, n = patches. T is an op of ``--ops`` alone, each
pair of the shift-undoing ops among them (``A+B``) and, with three or more, all of them together; for each pair
the interaction ``s(A+B) - s(A) - s(B) + s(identity)``. The row ``s(identity)`` gives the absolute score of the
plain patches (same scale). Pairing: every patch gets the same draws of a series (rotation direction and angle,
gamma magnitude and sign, ...) under every transform containing it; ops are drawn and applied as the learner's
counterfactual copies are (``replace_series_op``, then ``apply_tra_batch``, image and label). Signed ops (e.g.
``gamma±[0.4,0.6)``) draw their sign, so their row is the average over both directions; their halves of the
``split-signs`` catalogue (``gamma+[0.4,0.6)``, ``gamma-[0.4,0.6)``, ``rot90+``, ``rot90-``) may be given in ``--ops``
too, each with its one sign.

``--context drawn``: the other series are drawn per patch from the TRA policy the state was trained with (the
checkpoint's learned policy when it holds one, else the config's ``tra_preset``; the tested series kept at the
identity), the same draw under every T, as the learner's copies keep the other series as drawn.

``--direction beyond-training`` scores against each ``v`` without its component along the gradient of the mean
training loss of all the plain source patches (the TRA updater's ``direction="beyond-training"``, which takes the
gradient of its training batch): the cosine of ``v`` with that gradient is printed per state.

``--ops all`` measures every op of the catalogue. ``--gradient-ratio`` adds, per class group and single op, the
mean over patches of ``|grad l_train(T(x))| / |grad l_train(x)|`` (how much larger the op makes a patch's training
gradient; one backward pass per patch and op) and Spearman's rank correlation of the effects with it: near +1, the
one-step estimate credits ops for the larger gradients of the harder patches they make rather than for what they
teach (the zoom shift of ``benchmarks/README.md``: in the lesion group rho is +0.8, the zoom ranks first and the
quarter turns, which the target does not call for, come next).

Printed: the meaning of a positive number, a progress line per state (validation loss, ||v||, seconds), then
the table (and the ratio table, best effect first); ``--out FILE.md`` writes them as Markdown too.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from monai.bundle import ConfigParser
from monai.data import load_decathlon_datalist
from scipy.stats import spearmanr
from synthetic_bundle import SYNTHETIC_TRAIN  # this folder's path to the synthetic bundle

from jcsaug.engine.hypergradient import (
    flat_dot,
    flat_norm,
    jvp_hypergradient,
    per_sample_gradient_stats,
    trainable_parameters,
    training_gradient,
)
from jcsaug.engine.losses import chunked_loss, get_loss
from jcsaug.engine.tra_updater import TRA_DIRECTIONS, without_component
from jcsaug.ops.catalogue import Series, find_op
from jcsaug.ops.tra import (
    TRA_CATALOGUES,
    TRA_SERIES,
    TRAParams,
    apply_tra_batch,
    replace_series_op,
    sample_tra_params,
    tra_catalogue,
    tra_catalogue_name,
)
from jcsaug.policy import make_tra_policy
from jcsaug.policy.categorical import CategoricalPolicy

SCALE = 1e3  #: the scores are printed x SCALE
IDENTITY = "identity"
ABSOLUTE = "s(identity)"

#: the ops ``--ops`` may name: SPEC's catalogue (same indices), then per series the signed halves of ``split-signs``
OP_SERIES: tuple[Series, ...] = tuple(
    Series(spec.name, spec.ops + tuple(op for op in split.ops if op.fixed_sign))
    for spec, split in zip(TRA_SERIES, tra_catalogue("split-signs"))
)
Op = tuple[int, int]  #: (series index, op index) in OP_SERIES
Patches = dict[int, tuple[torch.Tensor, torch.Tensor]]  #: class group -> (images [n, 1, ...], labels [n, 1, ...])
Direction = dict[str, torch.Tensor]


class Plan(NamedTuple):
    """What is measured: transforms (name -> ops applied together) and pairs (name of the interaction row ->
    (A+B, A, B) transform names)."""

    transforms: dict[str, tuple[Op, ...]]
    pairs: dict[str, tuple[str, str, str]]


# ----------------------------------------------------------------------------------------------- set-up
def parse_op(name: str) -> Op:
    """``"series/op"`` -> (series index, op index), checked against the TRA catalogue (:data:`OP_SERIES`)."""
    return find_op(OP_SERIES, name)


def undoing_ops(domain_shift: Mapping) -> list[str]:
    """The TRA ops that undo a dataset's shift (``dataset.json`` ``domain_shift.undone_by.tra``), as names."""
    return [f"{e['series']}/{e['op']}" for e in domain_shift["undone_by"]["tra"]]


def all_ops() -> list[str]:
    """Every non-identity op of the TRA catalogue, as names (``--ops all``)."""
    return [f"{series.name}/{op.name}" for series in TRA_SERIES for op in series.ops]


def default_ops(domain_shift: Mapping) -> list[str]:
    """The undoing ops, then ``rotate±[20,30)`` of every rotation series among them (a small-angle control)."""
    ops = undoing_ops(domain_shift)
    controls = [f"{e.split('/')[0]}/rotate±[20,30)" for e in ops if e.split("/")[0].startswith("rotate_")]
    return ops + [c for c in controls if c not in ops]


def plan_transforms(ops: Sequence[str], undoing: Sequence[str]) -> Plan:
    """Identity, every op alone, every pair of undoing ops (of different series) and, with three or more, all
    undoing ops together; an interaction row per pair."""
    transforms: dict[str, tuple[Op, ...]] = {IDENTITY: ()}
    for name in ops:
        transforms[name] = (parse_op(name),)
    paired = [name for name in ops if name in undoing]
    pairs = {}
    for a, b in itertools.combinations(paired, 2):
        if transforms[a][0][0] == transforms[b][0][0]:
            continue  # two ops of one series cannot be applied together
        transforms[f"{a}+{b}"] = transforms[a] + transforms[b]
        pairs[f"interaction {a} x {b}"] = (f"{a}+{b}", a, b)
    if len(paired) >= 3 and len({transforms[n][0][0] for n in paired}) == len(paired):
        transforms["+".join(paired)] = tuple(transforms[n][0] for n in paired)
    return Plan(transforms, pairs)


def bundle_config(config: Path, overrides: Mapping[str, object]) -> ConfigParser:
    """The bundle's config with ``overrides`` (ids -> values) set."""
    parser = ConfigParser()
    parser.read_config(str(config))
    for key, value in overrides.items():
        parser[key] = value
    return parser


def build_network(parser: ConfigParser, checkpoint: Path, device: torch.device) -> torch.nn.Module:
    """The config's ``network_def`` (a fresh instance) with the checkpoint's ``network`` weights, in eval mode."""
    net = parser.get_parsed_content("network_def", lazy=False)
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)["network"]
    net.load_state_dict(state)
    return net.to(device).eval()


def load_split(parser: ConfigParser, dataset_dir: Path, split: str) -> list[dict]:
    """The cases of a split (``training`` / ``validation``) loaded with the bundle's ``load`` transforms."""
    files = load_decathlon_datalist(str(dataset_dir / "dataset.json"), data_list_key=split, base_dir=str(dataset_dir))
    load = parser.get_parsed_content("load", lazy=False)
    return [load(case) for case in files]


def make_crop(parser: ConfigParser, seed: int) -> Callable[[dict], list[dict]]:
    """A fresh instance of the bundle's ``crop`` (positive/negative crops of ``patch_size``), seeded."""
    crop = parser.get_parsed_content("crop", lazy=False)
    crop.set_random_state(seed)
    return crop


def group_names(dataset_dir: Path) -> dict[int, str]:
    """Class group -> name: background, and the dataset's foreground label names (ClassGroupd's default map)."""
    labels = json.loads((dataset_dir / "dataset.json").read_text()).get("labels", {})
    foreground = [name for key, name in sorted(labels.items()) if int(key) != 0]
    return {0: "background", 1: "+".join(foreground) or "foreground"}


# ----------------------------------------------------------------------------------------------- sampling
def sample_source_patches(
    cases: Sequence[dict], crop: Callable, grouper: Callable, n_per_group: int, seed: int, num_groups: int = 2
) -> Patches:
    """``n_per_group`` patches per class group (the bundle's ``class_group``), cropped from random cases."""
    rng = np.random.RandomState(seed)
    got: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {g: [] for g in range(num_groups)}
    while min(len(v) for v in got.values()) < n_per_group:
        for patch in crop(cases[rng.randint(len(cases))]):
            group = int(grouper(patch)["class_group"])
            if len(got[group]) < n_per_group:
                got[group].append((patch["image"], patch["label"]))
    return {g: (torch.stack([a for a, _ in v]), torch.stack([b for _, b in v])) for g, v in got.items()}


def sample_validation_batches(
    cases: Sequence[dict], crop: Callable, batches: int, cases_per_batch: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``batches`` batches of target patches: ``cases_per_batch`` distinct cases each, all their crops."""
    rng = np.random.RandomState(seed)
    out = []
    for _ in range(batches):
        idx = rng.choice(len(cases), min(cases_per_batch, len(cases)), replace=False)
        patches = [p for i in idx for p in crop(cases[i])]
        out.append((torch.stack([p["image"] for p in patches]), torch.stack([p["label"] for p in patches])))
    return out


def direction_batches(
    parser: ConfigParser, cases: Sequence[dict], directions: int, seed: int
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per direction, the config's ``val_batches`` batches of ``val_batch_size // samples_per_case`` target cases
    (as the bundle's validation loader), drawn in turn from one crop and one generator seeded ``seed``."""
    per_direction = int(parser["val_batches"])
    cases_per_batch = max(1, int(parser["val_batch_size"]) // int(parser["samples_per_case"]))
    batches = sample_validation_batches(
        cases, make_crop(parser, seed), per_direction * directions, cases_per_batch, seed
    )
    return [batches[k * per_direction : (k + 1) * per_direction] for k in range(directions)]


def patch_seeds(n: int, group: int) -> np.ndarray:
    """One seed per patch of a group; series s of patch i is drawn from ``RandomState([seed_i, s])``."""
    return np.arange(n) + 1000 * (group + 1)


def draw_params(seeds: Sequence[int], ops: Sequence[Op], base: Sequence[TRAParams]) -> list[TRAParams]:
    """Per patch, its base params with every op of ``ops`` switched in (``replace_series_op``), the draws of
    series s of patch i from ``RandomState([seeds[i], s])`` whatever else is applied."""
    out = []
    for seed, params in zip(seeds, base):
        for series, op in ops:
            params = replace_series_op(params, series, op, np.random.RandomState([int(seed), series]), OP_SERIES)
        out.append(params)
    return out


def draw_context(
    seeds: Sequence[int], group: int, policy: CategoricalPolicy | None, keep_identity: Sequence[int]
) -> list[TRAParams]:
    """Per patch, the ops of the other series: identity (``policy`` None) or drawn from ``policy`` for the group,
    the series of ``keep_identity`` put back to the identity."""
    if policy is None:
        return [TRAParams() for _ in seeds]
    out = []
    catalogue = tra_catalogue(tra_catalogue_name(policy.op_names))
    for seed in seeds:
        rng = np.random.RandomState([int(seed), 99])
        params = sample_tra_params(policy.sample_ops(group, rng), rng, catalogue)
        for series in keep_identity:
            params = replace_series_op(params, series, 0, rng)
        out.append(params)
    return out


def training_policy(parser: ConfigParser, checkpoint: Path, num_groups: int) -> CategoricalPolicy:
    """The TRA policy a state was trained with: the checkpoint's learned one (of the catalogue its size is), else the
    config's ``tra_preset``."""
    preset = parser.get_parsed_content("tra_preset")
    stored = torch.load(checkpoint, map_location="cpu", weights_only=False).get("tra_updater")
    if stored is None:
        return make_tra_policy(preset, num_groups=num_groups)
    for name in TRA_CATALOGUES:
        policy = make_tra_policy(preset, num_groups=num_groups, catalogue=name)
        if policy.logits.shape == stored["policy"]["logits"].shape:
            policy.load_state_dict(stored["policy"])
            return policy
    shape = tuple(stored["policy"]["logits"].shape)
    raise ValueError(f"{checkpoint}: its TRA policy has logits of shape {shape}, which no TRA catalogue has")


# ----------------------------------------------------------------------------------------------- applying
def apply_params(
    images: torch.Tensor, labels: torch.Tensor, params: Sequence[TRAParams]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The library's batched TRA application (image and label) of per-patch params."""
    out_i, out_l = apply_tra_batch({"image": images}, {"label": labels}, params)
    return out_i["image"], out_l["label"]


def validation_directions(
    model: torch.nn.Module, batches_per_direction: Sequence[Sequence[tuple]], val_loss: Callable
) -> list[Direction]:
    """Per direction, ``v`` = gradient of the mean validation loss over its batches (one chunk each)."""
    params = trainable_parameters(model)
    device = next(model.parameters()).device
    out = []
    for batches in batches_per_direction:
        total = None
        for x, y in batches:
            loss = val_loss([(model(x.to(device)), y.to(device))]) / len(batches)
            grads = torch.autograd.grad(loss, list(params.values()))
            total = list(grads) if total is None else [a + b for a, b in zip(total, grads)]
        out.append(dict(zip(params, total)))
    return out


def source_gradient(model: torch.nn.Module, patches: Patches, train_loss: Callable) -> Direction:
    """The gradient of the mean training loss over every group's plain source patches."""
    device = next(model.parameters()).device
    images = torch.cat([x for x, _ in patches.values()]).to(device)
    labels = torch.cat([y for _, y in patches.values()]).to(device)
    return training_gradient(model, images, labels, train_loss)


def directional_scores(
    model: torch.nn.Module,
    directions: Sequence[Direction],
    images: torch.Tensor,
    labels: torch.Tensor,
    train_loss: Callable,
    batch: int,
) -> np.ndarray:
    """``[n, K]``: s = grad l_train(x_i) . v_k / ||v_k||, by the library's exact JVP (``jvp_hypergradient``
    returns ``-lr/n grad l_i . v``; with lr = n it is ``-grad l_i . v``)."""
    theta = {n: p.detach() for n, p in model.named_parameters()}
    cols = []
    for v in directions:
        norm = flat_norm(v)
        parts = [
            -jvp_hypergradient(
                model,
                theta,
                v,
                images[i : i + batch],
                labels[i : i + batch],
                train_loss,
                lr=float(len(images[i : i + batch])),
            )  # fmt: skip
            for i in range(0, len(images), batch)
        ]
        cols.append((torch.cat(parts) / norm).cpu())
    return torch.stack(cols, 1).numpy()


# ----------------------------------------------------------------------------------------------- core
def gradient_norms(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor,
                   train_loss: Callable) -> np.ndarray:  # fmt: skip
    """``[n]``: the norm of each patch's own training-loss gradient ``|grad l_train(x_i)|`` (one backward pass per
    patch, :func:`~jcsaug.engine.hypergradient.per_sample_gradient_stats`: a JVP gives a gradient's projections,
    not its length)."""
    theta = {n: p.detach() for n, p in trainable_parameters(model).items()}
    zeros = {n: torch.zeros_like(p) for n, p in theta.items()}
    return per_sample_gradient_stats(model, theta, zeros, images, labels, train_loss)[1].cpu().numpy()


def score_transforms(
    model: torch.nn.Module,
    patches: Patches,
    plan: Plan,
    directions: Sequence[Direction],
    train_loss: Callable,
    contexts: Mapping[int, Sequence[TRAParams]] | None = None,
    batch: int = 16,
    norms: dict[int, dict[str, np.ndarray]] | None = None,
) -> dict[int, dict[str, np.ndarray]]:
    """Per class group and transform, the scores ``[n, K]`` (x SCALE) of its patches under the same draws; with a
    ``norms`` dict, also each patch's training-gradient norm (:func:`gradient_norms`) of every single-op transform
    and the identity, stored there the same way (``[n]``)."""
    device = next(model.parameters()).device
    out = {}
    for group, (images, labels) in patches.items():
        seeds = patch_seeds(len(images), group)
        base = contexts[group] if contexts is not None else [TRAParams() for _ in seeds]
        images, labels = images.to(device), labels.to(device)
        out[group] = {}
        for name, ops in plan.transforms.items():
            x, y = apply_params(images, labels, draw_params(seeds, ops, base))
            out[group][name] = directional_scores(model, directions, x, y, train_loss, batch) * SCALE
            if norms is not None and len(ops) <= 1:
                norms.setdefault(group, {})[name] = gradient_norms(model, x, y, train_loss)
    return out


def gradient_ratio_rows(scores: Mapping[int, Mapping[str, np.ndarray]], norms: Mapping[int, Mapping[str, np.ndarray]],
                        state: str, names: Mapping) -> list[dict]:  # fmt: skip
    """Per class group and single op: its effect and ``ratio``, the mean over patches of ``|grad l(T(x))| /
    |grad l(x)|`` (how much larger the op makes the patch's training gradient); per group also Spearman's rank
    correlation ``rho`` of the effect with the ratio over the ops (+1: the larger the gradient an op makes, the
    more credit the one-step estimate gives it, whatever the invariance it teaches; NaN for fewer than 3 ops)."""
    rows = []
    for group, by_name in norms.items():
        base, plain = scores[group][IDENTITY], by_name[IDENTITY]
        group_rows = [{"state": state, "group": names[group], "transform": name,
                       "effect": float((scores[group][name] - base).mean()), "ratio": float(np.mean(n / plain))}
                      for name, n in by_name.items() if name != IDENTITY]  # fmt: skip
        rho = float("nan")
        if len(group_rows) > 2:
            rho = float(spearmanr([r["effect"] for r in group_rows], [r["ratio"] for r in group_rows]).statistic)
        for r in group_rows:
            r["rho"] = rho
        rows += sorted(group_rows, key=lambda r: -r["effect"])
    return rows


def format_ratio_table(rows: Sequence[dict], undoing: Sequence[str], markdown: bool = False) -> str:
    """The ``--gradient-ratio`` rows, best effect first per state and group, with the rank of every op and the
    correlation line of each group."""
    lines = []
    for (state, group), block in itertools.groupby(rows, key=lambda r: (r["state"], r["group"])):
        block = list(block)
        head = f"{state} {group}: Spearman(effect, gradient ratio) over {len(block)} ops = {block[0]['rho']:+.2f}"
        if markdown:
            lines += ["", head, "", "| rank | op | effect | gradient ratio |", "|---|---|---|---|"]
            lines += [f"| {i} | `{r['transform']}`{' (undoes the shift)' if r['transform'] in undoing else ''} | "
                      f"{r['effect']:+.1f} | {r['ratio']:.2f} |" for i, r in enumerate(block, 1)]  # fmt: skip
        else:
            lines += ["", head, f"  {'rank':>4s} {'op':42s} {'effect':>9s} {'ratio':>6s}"]
            lines += [f"  {i:4d} {r['transform']:42s} {r['effect']:+9.1f} {r['ratio']:6.2f}"
                      f"{'  <- undoes the shift' if r['transform'] in undoing else ''}"
                      for i, r in enumerate(block, 1)]  # fmt: skip
    return "\n".join(lines)


def mean_se(values: np.ndarray) -> tuple[float, float]:
    """Mean and standard error of the mean (0 for fewer than two values)."""
    se = float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) > 1 else 0.0
    return float(values.mean()), se


def row(state: str, group: str, transform: str, diff: np.ndarray) -> dict:
    """A table row from per-patch, per-direction differences ``[n, K]``."""
    effect, se = mean_se(diff.mean(1))
    t = effect / se if se > 0 else 0.0
    return {"state": state, "group": group, "transform": transform, "effect": effect, "se": se, "t": t,
            "v_pos": int((diff.mean(0) > 0).sum()), "n_v": diff.shape[1], "n": diff.shape[0]}  # fmt: skip


def summarise(scores: Mapping[int, Mapping[str, np.ndarray]], plan: Plan, state: str, names: Mapping) -> list[dict]:
    """Rows per group: ``s(identity)`` (absolute), the effect of every transform (identity: exactly 0), and the
    interaction of every pair."""
    rows = []
    for group, s in scores.items():
        base = s[IDENTITY]
        rows.append(row(state, names[group], ABSOLUTE, base))
        rows += [row(state, names[group], name, s[name] - base) for name in plan.transforms]
        for name, (ab, a, b) in plan.pairs.items():
            rows.append(row(state, names[group], name, s[ab] - s[a] - s[b] + base))
    return rows


# ----------------------------------------------------------------------------------------------- output
def format_table(rows: Sequence[dict]) -> str:
    """The plain-text table."""
    width = max([len(r["transform"]) for r in rows] + [10])
    state_w = max([len(r["state"]) for r in rows] + [5])
    lines = [f"{'state':{state_w}s} {'group':10s} {'transform':{width}s} {'effect ±s.e.':>20s} {'t':>6s} "
             f"{'v+':>5s} {'n':>4s}"]  # fmt: skip
    for r in rows:
        lines.append(f"{r['state']:{state_w}s} {r['group']:10s} {r['transform']:{width}s} {r['effect']:+10.3f} "
                     f"±{r['se']:8.3f} {r['t']:6.1f} {r['v_pos']:>2d}/{r['n_v']:<2d} {r['n']:4d}")  # fmt: skip
    return "\n".join(lines)


def format_markdown(rows: Sequence[dict], header: str) -> str:
    """The table as Markdown under ``header``."""
    lines = [header, "", "| state | group | transform | effect ± s.e. | t | v+ | n |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['state']} | {r['group']} | `{r['transform']}` | {r['effect']:+.1f} ± {r['se']:.1f} | "
                     f"{r['t']:.1f} | {r['v_pos']}/{r['n_v']} | {r['n']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def state_name(checkpoint: Path) -> str:
    """A short label of a checkpoint: its run folder (two levels) and file stem."""
    return "/".join([*checkpoint.resolve().parent.parts[-2:], checkpoint.stem])


# ----------------------------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset-dir", type=Path, required=True, help="a make_synthetic_dataset folder")
    parser.add_argument("--checkpoint", type=Path, nargs="+", required=True, help="bundle checkpoints (states)")
    parser.add_argument("--ops", nargs="+", default=None, metavar="SERIES/OP",
                        help="TRA ops or 'all' (default: the shift's undoing ops + rotate±[20,30))")  # fmt: skip
    parser.add_argument("--gradient-ratio", action="store_true",
                        help="also each op's training-gradient ratio, correlated with the effect")  # fmt: skip
    parser.add_argument("--direction", choices=TRA_DIRECTIONS.names(), default="validation",
                        help="score against v, or v less its component along the plain patches' gradient")  # fmt: skip
    parser.add_argument("--patches-per-group", type=int, default=48)
    parser.add_argument("--val-directions", type=int, default=2, help="validation directions v (averaged over)")
    parser.add_argument("--context", choices=["none", "drawn"], default="none",
                        help="the other series: identity, or drawn from the state's training policy")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--batch", type=int, default=16, help="patches per JVP")
    parser.add_argument("--patch-size", type=int, nargs=3, default=None, help="crop size (default: the config's)")
    parser.add_argument("--config", type=Path, default=SYNTHETIC_TRAIN, help="the bundle's train.yaml")
    parser.add_argument("--out", type=Path, default=None, help="also write the table as Markdown here")
    return parser.parse_args(argv)


def measure_state(
    args: argparse.Namespace, parser: ConfigParser, checkpoint: Path, patches: Patches, val: list[dict], plan: Plan
) -> tuple[list[dict], str]:
    """The rows of one state and its progress line."""
    start = time.perf_counter()
    device = torch.device(args.device)
    model = build_network(parser, checkpoint, device)
    batches = direction_batches(parser, val, args.val_directions, args.seed + 1)
    val_loss = chunked_loss(parser["val_loss"])  # the TRA updater's L_val
    directions = validation_directions(model, batches, val_loss)
    cosines = ""
    if args.direction == "beyond-training":
        source = source_gradient(model, patches, get_loss(parser["train_loss"]))
        cosines = ", cos(v, source gradient) = " + ", ".join(
            f"{float(flat_dot(v, source) / (flat_norm(v) * flat_norm(source))):+.3f}" for v in directions
        )
        directions = [without_component(v, source) for v in directions]
    with torch.no_grad():
        loss = np.mean([float(val_loss([(model(x.to(device)), y.to(device))])) for b in batches for x, y in b])
    contexts = None
    if args.context == "drawn":
        policy = training_policy(parser, checkpoint, len(patches))
        keep = sorted({s for ops in plan.transforms.values() for s, _ in ops})
        contexts = {g: draw_context(patch_seeds(len(p[0]), g), g, policy, keep) for g, p in patches.items()}
    grad_norms = {} if args.gradient_ratio else None
    scores = score_transforms(model, patches, plan, directions, get_loss(parser["train_loss"]), contexts, args.batch,
                              grad_norms)  # fmt: skip
    name = state_name(checkpoint)
    norms = ", ".join(f"{float(flat_norm(v)):.3f}" for v in directions)
    line = (f"{name}: validation {parser['val_loss']} loss {loss:.3f}, ||v|| = {norms}{cosines}, "
            f"{time.perf_counter() - start:.0f} s")  # fmt: skip
    groups = group_names(args.dataset_dir)
    ratios = gradient_ratio_rows(scores, grad_norms, name, groups) if grad_norms is not None else []
    return summarise(scores, plan, name, groups), line, ratios


def main(argv: Sequence[str] | None = None) -> list[dict]:
    """Run the benchmark; returns the table's rows (with ``--gradient-ratio``, then the ratio rows, which hold a
    ``ratio`` key)."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shift = json.loads((args.dataset_dir / "dataset.json").read_text())["domain_shift"]
    undoing = undoing_ops(shift)
    plan = plan_transforms(all_ops() if args.ops == ["all"] else args.ops or default_ops(shift), undoing)
    overrides = {"patch_size": list(args.patch_size)} if args.patch_size else {}
    parser = bundle_config(args.config, overrides)
    train = load_split(parser, args.dataset_dir, "training")
    val = load_split(parser, args.dataset_dir, "validation")
    grouper = parser.get_parsed_content("class_group", lazy=False)
    patches = sample_source_patches(train, make_crop(parser, args.seed), grouper, args.patches_per_group, args.seed)
    print(f"shift {shift['name']!r}, undone by {undoing}; transforms: {list(plan.transforms)}")
    print(f"effect = mean over source patches of [s(T, x) - s(identity, x)], s = grad l_train(T(x)) . v / ||v|| "
          f"x {SCALE:g}: positive = one SGD step on T(x) is predicted to lower the target validation loss more "
          f"than one on the plain patch x. {args.patches_per_group} patches per group, {args.val_directions} "
          f"directions v, context {args.context}.", flush=True)  # fmt: skip
    rows, ratios = [], []
    for checkpoint in args.checkpoint:
        state_rows, line, state_ratios = measure_state(args, parser, checkpoint, patches, val, plan)
        rows += state_rows
        ratios += state_ratios
        print(line, flush=True)
    print()
    print(format_table(rows))
    if ratios:
        print(format_ratio_table(ratios, undoing))
    if args.out:
        header = (f"## One-step effect of TRA ops, dataset `{args.dataset_dir}` (shift `{shift['name']}`), "
                  f"context {args.context}, seed {args.seed}")  # fmt: skip
        text = format_markdown(rows, header)
        if ratios:
            text += "\n### Training-gradient ratio of each op\n"
            text += format_ratio_table(ratios, undoing, markdown=True) + "\n"
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"\nwritten {args.out}")
    return rows + ratios


if __name__ == "__main__":
    main()
