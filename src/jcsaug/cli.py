"""The ``jcsaug`` command line: catalogues, policies, datasets (synthetic and prepared) and reports.

Each sub-command is a function registered in :data:`COMMANDS` with its argument builder.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from jcsaug.registry import Registry

Builder = Callable[[argparse.ArgumentParser], None]
Runner = Callable[[argparse.Namespace], int]

#: sub-command name -> (argument builder, runner)
COMMANDS: Registry[tuple[Builder, Runner]] = Registry("command")


def command(name: str, build: Builder):
    """Register the decorated runner as the sub-command ``name`` with its argument builder."""

    def register(run: Runner) -> Runner:
        COMMANDS.register(name, (build, run))
        return run

    return register


# ----------------------------------------------------------------------------- ops
def _build_ops(p: argparse.ArgumentParser) -> None:
    which = p.add_mutually_exclusive_group()
    which.add_argument("--tra", action="store_true", help="the 15 training-time series (SPEC §2)")
    which.add_argument("--tea", action="store_true", help="the 84 test-time operations (SPEC §3)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--catalogue",
        default="spec",
        help="TRA catalogue for --tra: spec (signed ops draw their sign; default) or split-signs",
    )
    sub = p.add_subparsers(dest="ops_command")
    from jcsaug.viz import build_gallery_parser

    build_gallery_parser(sub.add_parser("gallery", help="picture of the 84 TEA ops and TRA draws on one slice"))


@command("ops", _build_ops)
def _run_ops(args: argparse.Namespace) -> int:
    """List the TRA series and the TEA ops (or picture them: gallery)."""
    if args.ops_command == "gallery":
        from jcsaug.viz import run_gallery

        return run_gallery(args)
    if not (args.tra or args.tea):
        print("jcsaug ops: give --tra or --tea (or the 'gallery' sub-command)", file=sys.stderr)
        return 2
    if args.tra:
        from jcsaug.ops.tra import tra_catalogue, tra_catalogue_json

        try:
            catalogue = tra_catalogue_json(tra_catalogue(args.catalogue))
        except KeyError as err:  # the registry's message: the name and the valid ones (as `policy show` prints it)
            print(f"jcsaug ops: {err.args[0]}", file=sys.stderr)
            return 2
        if args.json:
            print(json.dumps(catalogue, indent=1))
            return 0
        print(f"{'series':>6}  {'series name':<20} {'op':>3}  {'name':<28} magnitude")
        for s in catalogue:
            for op in s["ops"]:
                lo, hi = op["magnitude"]
                sign = "±" if op["signed"] else op.get("sign", "")
                mag = "" if op["kind"] == "identity" else f"{sign}[{lo:g}, {hi:g})"
                print(f"{s['id']:>6}  {s['series']:<20} {op['index']:>3}  {op['name']:<28} {mag}")
        return 0
    from jcsaug.ops.tea import tea_catalogue_json

    catalogue = tea_catalogue_json()
    if args.json:
        print(json.dumps(catalogue, indent=1))
        return 0
    print(f"{'id':>3}  {'kind':<16} {'name':<32} magnitude")
    for op in catalogue:
        print(f"{op['id']:>3}  {op['kind']:<16} {op['name']:<32} {op['magnitude']:g}")
    return 0


# ----------------------------------------------------------------------------- policy
def _build_policy(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="policy_command", required=True)
    show = sub.add_parser("show", help="print a policy's probabilities by class group, series and op")
    show.add_argument("path", nargs="?", help="a policies.json written by a run")
    show.add_argument("--preset", help="show an initial TRA preset instead (e.g. nnunet, deepmedic, uniform)")
    show.add_argument("--groups", type=int, default=2, help="class groups for --preset (default 2)")
    show.add_argument("--catalogue", default="spec", help="TRA catalogue for --preset: spec (default) or split-signs")
    show.add_argument("--json", action="store_true", help="machine-readable output")
    from jcsaug.viz import build_policy_plot_parser

    build_policy_plot_parser(sub.add_parser("plot", help="picture of a policies.json (and its history)"))


def _print_policies(data: dict) -> None:
    for g in data.get("tra", {}).get("groups", []):
        print(f"TRA policy, class group {g['group']}")
        for s in g["series"]:
            ops = "  ".join(f"{op['name']}={op['probability']:.3f}" for op in s["ops"])
            print(f"  {s['series']:<20} {ops}")
    if "tea" in data:
        top = sorted(data["tea"]["ops"], key=lambda op: -op["probability"])
        print("TEA policy (ops by probability)")
        for op in top:
            print(f"  {op['id']:>3} {op['name']:<32} {op['probability']:.4f}")


@command("policy", _build_policy)
def _run_policy(args: argparse.Namespace) -> int:
    """Show or plot a policy: a run's policies.json or an initial preset."""
    if args.policy_command == "plot":
        from jcsaug.viz import run_policy_plot

        return run_policy_plot(args)
    from jcsaug.policy.factory import make_tra_policy
    from jcsaug.policy.io import load_policies, policies_to_dict

    if (args.path is None) == (args.preset is None):
        print("jcsaug policy show: give either a policies.json PATH or --preset NAME", file=sys.stderr)
        return 2
    try:
        if args.preset:
            data = policies_to_dict(tra=make_tra_policy(args.preset, num_groups=args.groups, catalogue=args.catalogue))
        else:
            data = policies_to_dict(*load_policies(args.path))
    except (KeyError, ValueError) as err:
        print(f"jcsaug policy show: {err.args[0] if err.args else err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(data, indent=1, allow_nan=False))  # strict JSON (load_policies refuses NaN logits)
    else:
        _print_policies(data)
    return 0


# ----------------------------------------------------------------------------- synthetic data
def _build_synthetic(p: argparse.ArgumentParser) -> None:
    from jcsaug.data.synthetic import SHIFT_KEYS, TARGET_SHIFTS

    p.add_argument("out_dir", help="directory to write the NIfTI volumes and dataset.json into")
    p.add_argument("--seed", type=int, default=0, help="seed of the volumes (default 0: the bundle's)")
    p.add_argument("--num-train", type=int, default=16, help="source-domain training cases (default 16)")
    p.add_argument("--num-val", type=int, default=4, help="target-domain validation cases (default 4)")
    p.add_argument("--num-test", type=int, default=6, help="target-domain test cases (default 6)")
    p.add_argument("--shape", type=int, nargs=3, default=(48, 48, 48), help="volume shape (default 48 48 48)")
    names, keys = ", ".join(TARGET_SHIFTS), ", ".join(SHIFT_KEYS)
    p.add_argument(
        "--shift",
        default="default",
        help=f"the validation and test domain: a name ({names}; default: default) or a JSON object of its aspects, "
        f'e.g. \'{{"long_axis": 1, "gamma": [1.3, 1.45]}}\' (keys: {keys}; jcsaug.data.synthetic.'
        "resolve_target_shift)",
    )
    p.add_argument("--overwrite", action="store_true", help="regenerate even if dataset.json exists")


@command("make-synthetic", _build_synthetic)
def _run_synthetic(args: argparse.Namespace) -> int:
    """Generate the synthetic lesion dataset (source-domain training, shifted validation and test)."""
    from jcsaug.data.synthetic import make_synthetic_dataset, parse_target_shift

    path = make_synthetic_dataset(
        args.out_dir, num_train=args.num_train, num_val=args.num_val, num_test=args.num_test,
        shape=tuple(args.shape), seed=args.seed, overwrite=args.overwrite, target_shift=parse_target_shift(args.shift),
    )  # fmt: skip
    print(path)
    return 0


# ----------------------------------------------------------------------------- prepare
def _positive_int(text: str) -> int:
    """argparse type of counts: an integer >= 1 (a negative --max-cases silently dropped subjects)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {value}")
    return value


def _build_prepare(p: argparse.ArgumentParser) -> None:
    from jcsaug.tasks import list_tasks

    p.add_argument("task", choices=list_tasks(), help="the dataset task (one bundle per task)")
    p.add_argument("raw_dir", help="the dataset as published (layout: see the bundle's docs/README.md)")
    p.add_argument("--out", required=True, dest="out_dir", help="prepared dataset folder (dataset.json, images/)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random splits (default 0)")
    p.add_argument("--num-workers", type=int, default=0, help="processes for the cases (default: this one)")
    p.add_argument("--skip-unlabelled", action="store_true", help="leave out images without a label file")
    p.add_argument("--max-cases", type=_positive_int, help="use a seeded subset of this many subjects (ATLAS: 220)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


@command("prepare", _build_prepare)
def _run_prepare(args: argparse.Namespace) -> int:
    """Turn a paper dataset as published into its bundle's layout (resampled NIfTI and a MONAI datalist)."""
    import logging

    from jcsaug.tasks import PrepareError, prepare_task

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        path = prepare_task(
            args.task, args.raw_dir, args.out_dir, seed=args.seed, num_workers=args.num_workers,
            skip_unlabelled=args.skip_unlabelled, max_cases=args.max_cases, progress=not args.quiet,
        )  # fmt: skip
    except PrepareError as err:
        print(f"jcsaug prepare: error: {err}", file=sys.stderr)
        return 1
    print(path)
    return 0


# ----------------------------------------------------------------------------- report
def _build_report(p: argparse.ArgumentParser) -> None:
    from jcsaug.evaluation.report import build_report_parser

    build_report_parser(p)


@command("report", _build_report)
def _run_report(args: argparse.Namespace) -> int:
    """Compare runs as the paper does: mean metrics, average rank, Wilcoxon tests against a baseline."""
    from jcsaug.evaluation.report import run_report

    return run_report(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jcsaug", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (build, run) in COMMANDS.items():
        summary = run.__doc__.strip().splitlines()[0] if run.__doc__ else None
        build(sub.add_parser(name, help=summary, description=summary))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one sub-command; bad input (``ValueError``, ``OSError``, ``KeyError``) is one line on stderr, exit 2."""
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS.get(args.command)[1](args)
    except BrokenPipeError:  # e.g. `jcsaug ops --tea | head`
        sys.stderr.close()
        return 0
    except (ValueError, OSError, KeyError) as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
        print(f"jcsaug {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
