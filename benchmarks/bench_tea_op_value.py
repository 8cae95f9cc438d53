"""What each TEA op is worth at test time to a trained network, against the rank the learned TEA gave it.

For every trained run of the synthetic bundle given and every op of the TEA catalogue (SPEC §3), the mean Dice over
a split's volumes of

* **pair**: the identity's and the op's mapped-back logits averaged (``TEAInferer([identity, op])``), and
* **alone**: the op's copy alone (``TEAInferer([op])``: transform, segment, map back),

each minus the plain prediction's Dice, in points. Printed per run: the ops ranked by the pair's gain, each with its
rank in the run's learned TEA policy (``policies.json``, when it has one); the ops that undo the dataset's shift
(``dataset.json`` ``domain_shift``) with both gains and both ranks; Spearman's rank correlation between the learned
probabilities and the pair gains over the catalogue. With ``--patch-size``, also each op's effect on lesion-centred
patches of that size, as the TEA updater measures it (the soft Dice loss of the op's mapped-back prediction minus
the plain one's, x 100: negative helps), over every voxel and over the voxels the op kept in view only (the TEA's
``mask_out_of_view``, the reference's), and in view with the intensity ops reading the patch's volume's range and
mean instead of the patch's own (``tea_volume_stats``, as the ops act on the whole volume at test time), and that
score pooled with a background-centred patch of the same volume (one Dice over both: ``tea_background_patches`` 1),
and how well each ranks the ops as their pair gains do (Spearman). A Markdown table of the shift-undoing ops goes to
``--out``.

With ``--selections``, also what the learned policy's *choice* is worth: the split's Dice of TTA with the identity and
``--tea-z`` - 1 more ops, equal weights, the ops chosen five ways: the learned policy's top ops; every op measured on
the validation volumes with the final network (by alone gain, and by pair gain: an exhaustive, noise-free choice
from the data the TEA learns on; and by pair gain among the ops whose pair gain is positive only, so that when none
helps the TTA is the plain prediction); and by the split's own pair gains (a ceiling: chosen with the split's
labels); beside them the plain prediction's Dice (no TTA).

With ``--minus-split training``, also each op's alone gain on that split's volumes (``--max-volumes``: the first N
of each split) and ``--split``'s minus it: what the op does to the validation domain beyond what it does to the
training one, under the same network (``--ops``: only the named ops).

It answers whether a TEA op the learned policy leaves out (issue 10: ``gamma_compress_0.5`` on the default shift)
would have helped the trained network — a miss of the learner — or not — a target the trained network has no use
for. Every op is evaluated on the same volumes with the bundle's own sliding-window inferer, network and loading.

    python benchmarks/bench_tea_op_value.py --dataset-dir DATA --run-dir RUN [RUN ...]   # e.g. the runs and data
    # written by bench_learning_quality.py: OUT/data_default, OUT/runs/default/class-specific+joint/seed0 ...
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from bench_learning_quality import tea_ranks  # this folder's ranking of a run's TEA ops
from monai.bundle import ConfigParser
from monai.data import load_decathlon_datalist
from monai.transforms import RandCropByPosNegLabeld
from scipy.stats import spearmanr
from synthetic_bundle import SYNTHETIC_TRAIN  # this folder's path to the synthetic bundle
from tqdm.auto import tqdm

from jcsaug.data import VolumeStatsd, batch_volume_stats
from jcsaug.engine import latest_checkpoint, load_checkpoint
from jcsaug.engine.tea_updater import hard_dice_loss, soft_dice_loss
from jcsaug.evaluation.segmentation import case_dice
from jcsaug.inference import NoTTAInferer, TEAInferer
from jcsaug.ops.tea import TEA_OPS, apply_tea_ops, get_tea_op, in_view_masks

#: the datalist splits a run's volumes can be read from
SPLITS = ("test", "validation", "training")

#: the ways ``patch_effects`` scores an op on a patch (columns of the table, rows of the Spearman lines)
PATCH_SCORES = ("every voxel", "in view", "in view, volume stats", "pooled with a background patch",
                "with identity, hard")  # fmt: skip


def op_gains(network: torch.nn.Module, volumes: list[tuple[torch.Tensor, torch.Tensor]], sw, num_classes: int,
             device: torch.device, progress: bool = True,
             ops: list | None = None) -> dict[str, tuple[float, float]]:  # fmt: skip
    """``{op name: (pair gain, alone gain)}`` in Dice points over ``volumes`` (``[1, 1, ...]`` image and label), for
    ``ops`` (default: every op of the catalogue but the identity)."""
    plain_logits = [NoTTAInferer(sw)(image.to(device), network).float() for image, _ in volumes]
    plain = statistics.fmean(statistics.fmean(case_dice(p.cpu(), y, num_classes)) for p, (_, y) in
                             zip(plain_logits, volumes))  # fmt: skip
    gains = {}
    for op in tqdm(TEA_OPS[1:] if ops is None else ops, desc="TEA ops", disable=not progress):
        pair, alone = [], []
        for p, (image, label) in zip(plain_logits, volumes):
            mapped = TEAInferer([op], base_inferer=sw)(image.to(device), network).float()
            # TEAInferer([identity, op]) with equal weights averages the same two logits (average="logits")
            pair.append(statistics.fmean(case_dice(((p + mapped) / 2).cpu(), label, num_classes)))
            alone.append(statistics.fmean(case_dice(mapped.cpu(), label, num_classes)))
        gains[op.name] = (100 * (statistics.fmean(pair) - plain), 100 * (statistics.fmean(alone) - plain))
    return gains


def lesion_patches(volumes: list[tuple[torch.Tensor, torch.Tensor]], size: list[int], count: int, seed: int = 0,
                   background: bool = False) -> list[tuple[torch.Tensor, torch.Tensor, dict]]:  # fmt: skip
    """``count`` lesion-centred (``background``: background-centred) patches of ``size`` (MONAI's
    ``RandCropByPosNegLabeld``, seeded), in turn from each volume, ``[1, 1, ...]`` each, with their volume's
    intensity statistics (``VolumeStatsd``, ``[1]`` each)."""
    pos, neg = (0, 1) if background else (1, 0)
    crop = RandCropByPosNegLabeld(["image", "label"], "label", size, pos=pos, neg=neg, num_samples=1,
                                  allow_smaller=True)  # fmt: skip
    crop.set_random_state(seed)
    record = VolumeStatsd("image")
    patches = []
    for i in range(count):
        image, label = volumes[i % len(volumes)]
        out = crop(record({"image": image[0], "label": label[0]}))[0]
        stats = batch_volume_stats(out)  # one item: [1] each
        patches.append((torch.as_tensor(out["image"])[None], torch.as_tensor(out["label"])[None], stats))
    return patches


def _joined(patches: list[tuple[torch.Tensor, torch.Tensor, dict]], device: torch.device) -> tuple:
    """The patches as one batch: images, labels and volume statistics."""
    images = torch.cat([x for x, _, _ in patches]).to(device)
    labels = torch.cat([y for _, y, _ in patches]).to(device)
    return images, labels, {k: torch.cat([s[k] for _, _, s in patches]) for k in patches[0][2]}


def patch_effects(network: torch.nn.Module, patches: list[tuple[torch.Tensor, torch.Tensor, dict]],
                  device: torch.device, background: list | None = None) -> dict[str, tuple[float, ...]]:  # fmt: skip
    """``{op name: one effect per PATCH_SCORES}``, each the mean change of the soft Dice loss (x 100; < 0: the op
    helps) of the op's mapped-back prediction against the plain one on the same patch: what the TEA updater measures
    (``paired``), without and with its ``mask_out_of_view``, with it and the patches' volume statistics, and (given
    ``background``, one background-centred patch per patch) that score pooled over each patch and its background
    patch (one Dice over both, side by side, as the updater's ``background_patches`` pools them); the last, the
    change of the *hard* Dice loss of the TTA's pair (the op's mapped-back logits averaged with the plain ones) in
    view with the volume statistics against the plain prediction's on every voxel, as the updater with
    ``op_score="with-identity-hard"`` and ``mask_out_of_view`` scores them. Without ``background`` the fourth column
    is NaN."""
    images, labels, stats = _joined(patches, device)
    groups = [(images, labels, stats)] + ([_joined(background, device)] if background else [])
    plain_logits = network(images).float()
    plain = [torch.softmax(plain_logits, 1)] + [torch.softmax(network(x).float(), 1) for x, _, _ in groups[1:]]

    def scores(lesion_own, lesion, other, in_view):  # noqa: ANN001, ANN202 (the PATCH_SCORES losses of predictions)
        out = [soft_dice_loss(lesion_own, labels), soft_dice_loss(lesion_own, labels, in_view),
               soft_dice_loss(lesion, labels, in_view)]  # fmt: skip
        if other is not None:  # side by side: the voxel sums of one Dice run over the patch and its background patch
            both, both_labels = torch.cat([lesion, other], -1), torch.cat([labels, groups[1][1]], -1)
            out.append(soft_dice_loss(both, both_labels, torch.cat([in_view] * 2, -1)))
        else:
            out.append(torch.full_like(out[0], float("nan")))
        return out

    effects = {}
    for op in TEA_OPS[1:]:
        ops = [op] * len(images)
        in_view = in_view_masks([op], images.shape[2:], device)[0].expand(len(images), -1, -1, -1, -1)
        mapped = []
        for k, (x, _, group_stats) in enumerate(groups):
            for given in (None, group_stats) if k == 0 else (group_stats,):  # own statistics, then the volume's
                copies = torch.stack(apply_tea_ops(ops, x, "image", given))
                mapped.append(torch.stack(apply_tea_ops(ops, network(copies).float(), "invert")))  # logits
        pair = (plain_logits + mapped[1]) / 2  # the TTA's identity and op, logits averaged (volume statistics)
        mapped = [torch.softmax(m, 1) for m in mapped]
        with_op = scores(mapped[0], mapped[1], mapped[2] if background else None, in_view)
        without = scores(plain[0], plain[0], plain[1] if background else None, in_view)
        with_op.append(hard_dice_loss(pair, labels, in_view))
        without.append(hard_dice_loss(plain_logits, labels))  # the updater scores the untouched copy on every voxel
        effects[op.name] = tuple(100 * float((a - b).mean()) for a, b in zip(with_op, without))
    return effects


def selection_dice(network: torch.nn.Module, volumes: list[tuple[torch.Tensor, torch.Tensor]], sw,
                   num_classes: int, device: torch.device, names: list[str]) -> float:  # fmt: skip
    """Mean Dice (points) over ``volumes`` of TTA with the identity and the ops ``names``, equal weights."""
    inferer = TEAInferer([TEA_OPS[0], *map(get_tea_op, names)], base_inferer=sw)
    return 100 * statistics.fmean(statistics.fmean(case_dice(inferer(x.to(device), network).float().cpu(), y,
                                                             num_classes)) for x, y in volumes)  # fmt: skip


def top_ops(score: dict[str, float], count: int) -> list[str]:
    """The ``count`` names of highest score (ties: catalogue order)."""
    return sorted(score, key=lambda n: -score[n])[:count]


def learned_ranks(run_dir: Path) -> dict[str, tuple[int, float]]:
    """``{op name: (rank, probability)}`` of the run's learned TEA policy (``policies.json``), ranked as
    ``bench_learning_quality.py`` ranks them; empty when it has none."""
    path = run_dir / "policies.json"
    policies = json.loads(path.read_text()) if path.is_file() else {}
    if not policies.get("tea"):
        return {}
    ranks = tea_ranks(policies)
    return {o["name"]: (ranks[o["name"]], o["probability"]) for o in policies["tea"]["ops"]}


#: how ``--selections`` chooses the TTA's ops, in its table's column order
SELECTIONS = ("no TTA", "learned policy", "validation alone", "validation pair", "validation pair > 0",
              "split pair (ceiling)")  # fmt: skip


def selection_row(run_dir: Path, network: torch.nn.Module, gains: dict[str, tuple[float, float]],
                  ranks: dict[str, tuple[int, float]], validation: list, volumes: list, sw, num_classes: int,
                  device: torch.device, count: int) -> tuple[Path, list[float | None]]:  # fmt: skip
    """One run's ``--selections``: the split's TTA Dice with the top ``count`` ops of each of :data:`SELECTIONS`
    (``None`` for the learned policy when the run has none); printed as it goes."""
    with torch.no_grad():
        on_validation = gains if validation is volumes else op_gains(network, validation, sw, num_classes, device)
        chosen = {
            SELECTIONS[0]: [],  # the identity alone: the plain prediction
            SELECTIONS[1]: top_ops({n: -r for n, (r, _) in ranks.items() if n in gains}, count) if ranks else None,
            SELECTIONS[2]: top_ops({n: g[1] for n, g in on_validation.items()}, count),
            SELECTIONS[3]: top_ops({n: g[0] for n, g in on_validation.items()}, count),
            # only ops whose pair helps on the validation volumes: none helping falls back to the plain prediction
            SELECTIONS[4]: top_ops({n: g[0] for n, g in on_validation.items() if g[0] > 0}, count),
            SELECTIONS[5]: top_ops({n: g[0] for n, g in gains.items()}, count),
        }
        dice = [None if names is None else selection_dice(network, volumes, sw, num_classes, device, names)
                for names in chosen.values()]  # fmt: skip
    print(f"  ops chosen by validation pair > 0 ({len(chosen[SELECTIONS[4]])}): {', '.join(chosen[SELECTIONS[4]])}")
    print(f"  TTA Dice, identity + {count} ops chosen by: " + ", ".join(
        f"{k} {d:.2f}" for k, d in zip(SELECTIONS, dice) if d is not None))  # fmt: skip
    return run_dir, dice


def main(argv: list[str] | None = None) -> list[tuple]:
    """Run the benchmark; returns the rows of the shift-undoing ops' table (run, op, gains, rank, learned rank)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", nargs="+", type=Path, required=True, help="trained runs of the synthetic bundle")
    parser.add_argument("--dataset-dir", type=Path, required=True, help="the runs' dataset (make_synthetic_dataset)")
    parser.add_argument("--split", default="test", choices=SPLITS)
    parser.add_argument("--max-volumes", type=int, default=0, help="the first N volumes of each split (0: all)")
    parser.add_argument("--ops", nargs="+", default=None, metavar="NAME", help="only these TEA ops (default: all)")
    parser.add_argument("--minus-split", default=None, choices=SPLITS,
                        help="also each op's alone gain on this split, and --split's minus it")  # fmt: skip
    parser.add_argument("--top", type=int, default=12, help="ops printed per run, by pair gain")
    parser.add_argument("--patch-size", type=int, nargs=3, default=None, metavar=("X", "Y", "Z"),
                        help="also each op's effect on lesion-centred patches of this size (soft Dice loss, as the "
                        "TEA updater scores ops)")  # fmt: skip
    parser.add_argument("--patches", type=int, default=48, help="patches for --patch-size")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--selections", action="store_true",
                        help="also the Dice of TTA with the top ops as the policy, the validation split and this "
                        "split choose them")  # fmt: skip
    parser.add_argument("--tea-z", type=int, default=8, help="ops of the --selections TTA, the identity included")
    parser.add_argument("--out", type=Path, default=None, help="Markdown table of the shift-undoing ops")
    args = parser.parse_args(argv)
    if args.tea_z < 1:
        parser.error(f"--tea-z must be >= 1 (the identity included), got {args.tea_z}")
    if args.max_volumes < 0:
        parser.error(f"--max-volumes must be >= 0 (0: all), got {args.max_volumes}")
    try:
        ops = None if args.ops is None else [get_tea_op(name) for name in args.ops]
    except (KeyError, ValueError) as err:
        parser.error(f"--ops: {err}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    config = ConfigParser()
    config.read_config(str(SYNTHETIC_TRAIN))
    config["dataset_dir"] = str(args.dataset_dir)
    load = config.get_parsed_content("load")
    num_classes = config["num_classes"]
    sw = config.get_parsed_content("sw_inferer")
    datalist = args.dataset_dir / "dataset.json"

    def split_volumes(split: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cases = load_decathlon_datalist(datalist, data_list_key=split, base_dir=args.dataset_dir)
        cases = cases[: args.max_volumes] if args.max_volumes else cases
        return [(d["image"].unsqueeze(0), d["label"].unsqueeze(0)) for d in map(load, cases)]

    volumes = split_volumes(args.split)
    validation = split_volumes("validation") if args.selections and args.split != "validation" else volumes
    minus = split_volumes(args.minus_split) if args.minus_split else None
    undoing = json.loads(datalist.read_text())["domain_shift"]["undone_by"]["tea"]
    print(f"{len(volumes)} {args.split} volumes of {tuple(volumes[0][0].shape[2:])}; shift undone by TEA {undoing}")

    patches = lesion_patches(volumes, args.patch_size, args.patches) if args.patch_size else None
    background = lesion_patches(volumes, args.patch_size, args.patches, background=True) if patches else None
    rows, selections = [], []
    for run_dir in args.run_dir:
        network = config.get_parsed_content("network_def", instantiate=True, lazy=False).to(device)
        checkpoint = latest_checkpoint(run_dir)
        load_checkpoint(checkpoint, {"network": network}, map_location=device)
        network.eval()
        with torch.no_grad():
            gains = op_gains(network, volumes, sw, num_classes, device, ops=ops)
            gains_minus = op_gains(network, minus, sw, num_classes, device, ops=ops) if minus else {}
            on_patches = patch_effects(network, patches, device, background) if patches else {}
        ranks = learned_ranks(run_dir)
        by_pair = sorted(gains, key=lambda n: -gains[n][0])
        true_rank = {name: i + 1 for i, name in enumerate(by_pair)}
        print(f"\n{checkpoint}")
        patch_head = (
            f" {'patch loss':>10} {'in view':>8} {'vol stats':>9} {'pooled':>9} {'pair hard':>9}" if on_patches else ""
        )
        print(f"  {'op':<28} {'pair':>7} {'alone':>7}{patch_head} {'learned rank':>13}")

        for name in by_pair[: args.top]:
            learned = f"{ranks[name][0]:>13}" if ranks else f"{'-':>13}"
            patch = (
                f" {on_patches[name][0]:>+10.2f} {on_patches[name][1]:>+8.2f} {on_patches[name][2]:>+9.2f}"
                f" {on_patches[name][3]:>+9.2f} {on_patches[name][4]:>+9.2f}"
                if on_patches
                else ""
            )
            print(f"  {name:<28} {gains[name][0]:>+7.2f} {gains[name][1]:>+7.2f}{patch} {learned}")
        if ranks:
            names = list(gains)
            rho = spearmanr([ranks[n][1] for n in names], [gains[n][0] for n in names]).statistic
            print(f"  Spearman(learned probability, pair gain) over {len(names)} ops: {rho:+.2f}")
        if on_patches:  # how the updater's patch scores rank the ops, against their worth on whole volumes
            names = list(gains)
            for i, scored in enumerate(PATCH_SCORES):
                rho = spearmanr([-on_patches[n][i] for n in names], [gains[n][0] for n in names]).statistic
                print(f"  Spearman(patch loss {scored}, falling; pair gain) over {len(names)} ops: {rho:+.2f}")
        if gains_minus:  # what the op does on --split beyond what it does on --minus-split, same network
            print(f"  alone gain on {args.split} minus on {args.minus_split} ({len(minus)} volumes):")
            for name in by_pair[: args.top]:
                here, there = gains[name][1], gains_minus[name][1]
                print(f"    {name:<28} {here:>+7.2f} {there:>+7.2f} {here - there:>+7.2f}")
        for names in undoing:
            names = [n for n in names if n in gains]  # (--ops may leave some out)
            if not names:
                continue
            best = max(names, key=lambda n: gains[n][0])
            learned_rank = min(ranks[n][0] for n in names) if ranks else None
            patch = ""
            if on_patches:
                patch = (f", patch loss {on_patches[best][0]:+.2f} ({on_patches[best][1]:+.2f} in view, "
                         f"{on_patches[best][2]:+.2f} with volume stats, {on_patches[best][3]:+.2f} pooled with a "
                         f"background patch, {on_patches[best][4]:+.2f} hard, with the identity)")  # fmt: skip
            print(f"  shift-undoing {best}: pair {gains[best][0]:+.2f}, alone {gains[best][1]:+.2f}{patch}, rank by "
                  f"pair gain {true_rank[best]}, learned rank {learned_rank if ranks else '-'}")  # fmt: skip
            rows.append((run_dir, best, gains[best], true_rank[best], learned_rank))
        if args.selections:
            selections.append(selection_row(run_dir, network, gains, ranks, validation, volumes, sw, num_classes,
                                            device, args.tea_z - 1))  # fmt: skip

    if args.out:
        lines = ["| run | shift-undoing TEA op | pair gain | alone gain | rank by pair gain | learned rank |",
                 "|---|---|---|---|---|---|"]  # fmt: skip
        lines += [f"| {r} | `{n}` | {g[0]:+.2f} | {g[1]:+.2f} | {t} | {lr if lr is not None else '-'} |"
                  for r, n, g, t, lr in rows]  # fmt: skip
        if selections:
            lines += ["", f"| run | {' | '.join(SELECTIONS)} |", "|---|" + "---|" * len(SELECTIONS)]
            lines += [f"| {r} | " + " | ".join(f"{d:.2f}" if d is not None else "-" for d in dice) + " |"
                      for r, dice in selections]  # fmt: skip
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
        print(f"\nwritten: {args.out}")
    return rows


if __name__ == "__main__":
    main()
