"""Issue 10's targets side by side: one table from the records ``bench_learning_quality.py`` writes.

Command (from the repository root)::

    python benchmarks/summarize_learning_quality.py OUT [OUT ...] [--output FILE]

Each ``OUT`` is a ``--out`` folder of ``bench_learning_quality.py`` (every ``learning_quality_*.json`` in it: one per
shift it reported) or one such file. The benchmark writes the record beside its Markdown report, with the seeds and
``--set`` settings it was called with; so report each shift over the seeds and settings to compare (e.g. ``--seeds
0 1 2 3 4 --reuse``, which reads the finished runs again), then summarize the folders. One row per record, in the
order given: the shift (a ``custom-`` one with its mapping), the settings, the seeds, the joint's lead over
``heuristic+mirror`` with TTA / without (the targets: +6 / +4; mean over seeds), the gain of the best oracle mode
reported (what knowing the answer is worth), the mean wall time of a joint run,
how many targets are met (``N/A``: the oracle gains nothing on that shift; "no oracle run": no oracle mode was
reported, so none could be found not to apply), and the missed ones with the figure measured (the joint's without
its mode's name).

With ``--paired``, a second table compares settings seed by seed: each record of a shift against the first record
of that shift given (e.g. ``OUT_defaults OUT_candidate``), the joint's test Dice differences on the seeds both hold,
with TTA and without, their means, how many seeds gained and a reading by the rule of benchmarks/README.md's paired
comparisons ("costs": mean <= -0.5 with at most one seed gaining, "gains": >= +0.5 with two or more, else "level");
then the mean over every paired run. A seed whose
``heuristic+mirror`` Dice differs between the two records by more than 0.1 is flagged (``*``): its runs were made
on machines (or code) that do not reproduce each other, so the pair compares more than the settings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

# this folder's benchmark (a sibling module, as Python puts a script's own folder on sys.path): the targets' bounds
# and the formatter that keeps a judged figure from rounding up to its bound
from bench_learning_quality import DICE_TARGET, DICE_TARGET_WITHOUT_TTA, MIN_ORACLE_GAIN, figure_against

JOINT = "class-specific+joint"


class RecordError(ValueError):
    """A record that cannot be read, named by its file."""


def record_files(paths: list[Path]) -> list[Path]:
    """The records under ``paths`` in the order given (a folder's sorted by name)."""
    files = []
    for path in paths:
        if path.is_dir():
            found = sorted(path.glob("learning_quality_*.json"))
            if not found:
                raise RecordError(f"{path}: no learning_quality_*.json in it (run bench_learning_quality.py with "
                                  "--out there first)")  # fmt: skip
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise RecordError(f"{path}: no such file or folder")
    return files


def load_record(path: Path) -> dict:
    """One record, checked for what the table reads."""
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise RecordError(f"{path}: not a readable JSON record ({error})") from error
    keys = ("shift", "seeds", "settings", "baseline", "dice", "seconds", "targets")
    missing = [k for k in keys if k not in record] if isinstance(record, dict) else list(keys)
    if missing:
        raise RecordError(f"{path}: not a bench_learning_quality.py record (missing {missing})")
    if record["baseline"] not in record["dice"]:
        raise RecordError(f"{path}: no Dice of the baseline {record['baseline']!r}")
    for mode, dice in record["dice"].items():
        if any(len(dice.get(key, ())) != len(record["seeds"]) for key in ("none", "tta")):
            raise RecordError(f"{path}: {mode}'s Dice (none, tta) is not one per seed of {record['seeds']}")
    return record


def seeds_text(seeds: list[int]) -> str:
    """``0–4`` for a run of three or more consecutive seeds, else the list."""
    if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}–{seeds[-1]}"
    return ", ".join(map(str, seeds))


def settings_text(record: dict) -> str:
    """The record's `--set` overrides, or ``defaults``."""
    return " ".join(record["settings"]) or "defaults"


def markdown_row(cells: list[str]) -> str:
    """One row of a Markdown table; a "|" inside a cell (a setting's value) is escaped, not a column."""
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def lead(record: dict, mode: str, key: str) -> float | None:
    """The mean over seeds of ``mode``'s test Dice (``none`` or ``tta``) less the baseline's, seed by seed."""
    if mode not in record["dice"]:
        return None
    base = record["dice"][record["baseline"]][key]
    return statistics.mean(a - b for a, b in zip(record["dice"][mode][key], base))


def row(record: dict) -> str:
    """The record's row of the table."""
    tta, none = lead(record, JOINT, "tta"), lead(record, JOINT, "none")
    dice = "–" if tta is None else (f"{figure_against(tta, DICE_TARGET, 1, '+')} / "
                                    f"{figure_against(none, DICE_TARGET_WITHOUT_TTA, 1, '+')}")  # fmt: skip
    seconds = f"{statistics.mean(record['seconds'][JOINT]):.0f}" if JOINT in record["seconds"] else "–"
    verdicts = [t["verdict"] for t in record["targets"]]
    judged = [v for v in verdicts if v != "N/A"]
    met = f"{judged.count('PASS')} of {len(judged)}" if judged else "–"
    if len(judged) < len(verdicts):
        met += f" ({len(verdicts) - len(judged)} N/A)"
    if record.get("oracle_gain") is None and verdicts:
        met += " (no oracle run)"  # so no target could be found not to apply
    missed = [(t.get("label") or t["target"]).removeprefix(f"{JOINT}: ") for t in record["targets"]
              if t["verdict"] == "MISS"]  # fmt: skip
    shift = record["shift"]
    if shift.startswith("custom-") and record.get("target_domain"):  # a hash: show the mapping it stands for
        shift += f" `{json.dumps(record['target_domain'])}`"
    gain = record.get("oracle_gain")
    oracle = "–" if gain is None else figure_against(gain, MIN_ORACLE_GAIN, 1, "+")  # under 1 the targets are N/A
    cells = [shift, settings_text(record), seeds_text(record["seeds"]), dice, oracle, seconds,
             met, "; ".join(missed) or "–"]  # fmt: skip
    return markdown_row(cells)


def summary_table(records: list[dict]) -> str:
    """The Markdown table, one row per record."""
    lines = [
        f"| shift | settings | seeds | joint − heuristic+mirror, TTA / none (≥ +{DICE_TARGET} / "
        f"+{DICE_TARGET_WITHOUT_TTA}) | the oracle's gain, TTA | s / joint run | targets met | missed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    return "\n".join(lines + [row(r) for r in records]) + "\n"


REPRODUCED = 0.1  # Dice points: a baseline run that differs more between two records was not reproduced
#: the per-shift rule the paired comparisons of benchmarks/README.md were read by (written before their runs): a
#: mean difference at least this far from 0 ...
PAIRED_MARGIN = 0.5
#: ... with at least this many seeds gaining for "gains", fewer for "costs"
PAIRED_SEEDS = 2


def paired_reading(deltas: list[float]) -> str:
    """``costs`` if the mean difference is <= -PAIRED_MARGIN with fewer than PAIRED_SEEDS seeds gaining, ``gains``
    if it is >= +PAIRED_MARGIN with at least PAIRED_SEEDS gaining, else ``level``."""
    mean, gaining = statistics.mean(deltas), sum(v > 0 for v in deltas)
    if mean <= -PAIRED_MARGIN and gaining < PAIRED_SEEDS:
        return "costs"
    if mean >= PAIRED_MARGIN and gaining >= PAIRED_SEEDS:
        return "gains"
    return "level"


def paired_differences(record: dict, reference: dict) -> dict | None:
    """The joint's Dice in ``record`` less that in ``reference``, seed by seed on the seeds both hold (``None``
    where either has no joint run or they share no seed), and the seeds whose baseline was not reproduced."""
    if JOINT not in record["dice"] or JOINT not in reference["dice"]:
        return None
    position = {seed: i for i, seed in enumerate(reference["seeds"])}
    seeds = [seed for seed in record["seeds"] if seed in position]
    if not seeds:
        return None
    mine = {seed: i for i, seed in enumerate(record["seeds"])}

    def delta(mode: str, key: str, seed: int) -> float:  # a mode both records hold
        return record["dice"][mode][key][mine[seed]] - reference["dice"][mode][key][position[seed]]

    base = record["baseline"]  # load_record checked that a record holds its baseline's Dice
    unreproduced = [seed for seed in seeds if base == reference["baseline"]
                    and any(abs(delta(base, key, seed)) > REPRODUCED for key in ("none", "tta"))]  # fmt: skip
    return {
        "seeds": seeds,
        "tta": [delta(JOINT, "tta", seed) for seed in seeds],
        "none": [delta(JOINT, "none", seed) for seed in seeds],
        "unreproduced": unreproduced,
    }


def paired_table(records: list[dict]) -> str:
    """Each shift's later records against its first, seed by seed; then the mean over every paired run."""
    lines = [
        "| shift | settings | against | seeds | Δ TTA per seed | Δ none per seed | mean Δ, TTA / none | seeds gaining, "
        "TTA / none | reading, TTA / none |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    first: dict[str, dict] = {}
    every_tta: list[float] = []
    every_none: list[float] = []
    any_unreproduced = False
    for record in records:
        reference = first.setdefault(record["shift"], record)
        if reference is record:
            continue
        paired = paired_differences(record, reference)
        if paired is None:
            continue
        tta, none, seeds = paired["tta"], paired["none"], paired["seeds"]
        every_tta += tta
        every_none += none
        any_unreproduced |= bool(paired["unreproduced"])
        flagged = [f"{v:+.1f}" + ("*" if seed in paired["unreproduced"] else "") for seed, v in zip(seeds, tta)]
        cells = [
            record["shift"], settings_text(record), settings_text(reference), seeds_text(seeds), ", ".join(flagged),
            ", ".join(f"{v:+.1f}" for v in none), f"{statistics.mean(tta):+.2f} / {statistics.mean(none):+.2f}",
            f"{sum(v > 0 for v in tta)} / {sum(v > 0 for v in none)} of {len(seeds)}",
            f"{paired_reading(tta)} / {paired_reading(none)}",
        ]  # fmt: skip
        lines.append(markdown_row(cells))
    if not every_tta:
        return "No paired runs: give two records of one shift with a joint run on a seed they share.\n"
    lines.append(
        f"\nOver {len(every_tta)} paired runs: mean Δ {statistics.mean(every_tta):+.2f} with TTA, "
        f"{statistics.mean(every_none):+.2f} without ({sum(v > 0 for v in every_tta)} / "
        f"{sum(v > 0 for v in every_none)} gaining)."
    )
    lines.append(
        f"Reading: `costs` where the mean Δ is ≤ −{PAIRED_MARGIN} with fewer than {PAIRED_SEEDS} seeds gaining, "
        f"`gains` where it is ≥ +{PAIRED_MARGIN} with at least {PAIRED_SEEDS} gaining, else `level`."
    )
    if any_unreproduced:
        lines.append(f"`*`: the seed's {JOINT} pair compares runs whose baseline differs by more than {REPRODUCED}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, metavar="OUT", help="--out folders or record files")
    parser.add_argument("--output", type=Path, default=None, help="also write the table to this file")
    parser.add_argument("--paired", action="store_true",
                        help="also compare each shift's records with its first one, seed by seed")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        records = [load_record(path) for path in record_files(args.paths)]
    except RecordError as error:
        parser.error(str(error))
    table = summary_table(records)
    if args.paired:
        table += "\n" + paired_table(records)
    print(table, end="")
    if args.output is not None:
        args.output.write_text(table)
        print(f"written: {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
