"""Paper-style comparison of methods (SPEC §6): mean metrics, average rank and, given a baseline, paired Wilcoxon
tests against it and ΔDSC.

Input: the ``per_case.csv`` of one or more run directories (written by
:func:`jcsaug.evaluation.evaluate_cases`), or per-case CSV files themselves: ``evaluate.yaml`` writes
``per_case_evaluate.csv`` (``per_case_evaluate_validation.csv`` for the validation split) beside the training run's
``per_case.csv``, so a re-evaluation (another post-processing, another split) is compared by giving
``RUN/per_case_evaluate.csv``. Conventions:

- **Method names**: with one input a method is named by the CSV's ``method`` column (``none``);
  with several, ``<source>/<method>``. A run directory's source name is its name (``tra_heuristic/none``); a CSV's is
  its folder's name, with what follows ``per_case_`` in the file's name after a colon (``run:evaluate/none`` for
  ``run/per_case_evaluate.csv``; ``run/per_case.csv`` is ``run``). Sources that share a name are named by their paths.
- **Per-case value** of a metric: the mean over the selected foreground classes of the defined values
  (undefined = NaN, see :mod:`jcsaug.evaluation.metrics`); undefined if no class is defined. Classes: ``--classes``,
  else with ``--task`` the task's headline subset (its first ``report_classes``: KiTS tumour), else all.
- **A class absent from a case's label** (BTCV's gallbladder in 2 of 30 cases): scored by default as the metrics
  score it (Dice 1 when the prediction has none either, 0 when it has some); ``--absent-classes ignore`` leaves it
  out of that case's mean whatever the prediction, as MONAI's ``DiceMetric(ignore_empty=True)`` does (read from the
  CSV's ``status`` column).
- **Pairing**: every method must have been evaluated on the same case ids (compared exactly, against the baseline,
  or the first method without one), else :class:`ReportError` names the missing cases. Cases are the evaluated
  images' paths; ``--pair-by name`` pairs them by the images' file names instead (runs evaluated on copies of one
  dataset at different places: another machine, a moved folder), refused unless those are unique within each run.
  The error of unpaired cases suggests it when the file names would pair them.
- **Mean**: over the cases with a defined value; the number of undefined cases is reported.
- **Rank** per metric: 1 = best mean (higher is better for Dice, sensitivity, precision; lower for HD95),
  ties get the average rank (``scipy.stats.rankdata``), an undefined mean ranks last; the **average rank**
  is the mean of these ranks over the metrics.
- **p-value** (only with a baseline): two-sided paired Wilcoxon signed-rank test (``scipy.stats.wilcoxon``, default zero
  handling: zero differences dropped) of each method against the baseline on the per-case values; pairs
  with an undefined value are dropped. It is 1.0 when all differences are zero, and NaN ("n/a") for the
  baseline itself or without any pair.
- **ΔDSC** (only with a baseline): mean Dice minus the baseline's, in Dice points (×100) as in the paper's tables.
- **Post-processing**: read from the metrics file beside each CSV where there is one (``metrics.json`` beside
  ``per_case.csv``, ``metrics_evaluate.json`` beside ``per_case_evaluate.csv``: its ``segmentation_postprocessing``,
  ``largest_component_classes``); methods post-processed differently get a note under the table naming each one's.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy.stats import rankdata, wilcoxon

from jcsaug.evaluation.metrics import HIGHER_IS_BETTER, METRICS, nanmean
from jcsaug.utils import atomic_write_text

PER_CASE_CSV = "per_case.csv"
#: the metrics file written beside it (read for how each method's predictions were post-processed); beside another
#: per-case CSV, ``per_case<suffix>.csv``, it is ``metrics<suffix>.json`` (``evaluate.yaml``'s ``_evaluate``)
METRICS_JSON = "metrics.json"
#: how the methods' cases are paired (``--pair-by``): by their images' paths, or by the paths' file names
PAIR_BY = ("path", "name")
#: how a class absent from a case's label counts (``--absent-classes``): as the metrics score it, or left out
ABSENT_CLASSES = ("score", "ignore")
#: the ``status`` values of a class absent from the label (:data:`jcsaug.evaluation.metrics.STATUSES`)
ABSENT_STATUSES = ("both_empty", "label_empty")
LABELS = {"dice": "DSC", "sensitivity": "Sens.", "precision": "Prec.", "hd95": "HD95"}


class ReportError(ValueError):
    """Invalid input to the report (missing CSV, unknown baseline, unpaired cases ...)."""


@dataclass
class Report:
    """The comparison table; every mapping is keyed by method name, then (where nested) by metric.

    Without a baseline (``baseline is None``) ``p_values``, ``n_pairs`` and ``dice_improvement`` are empty."""

    baseline: str | None
    metrics: tuple[str, ...]
    methods: list[str]
    cases: list[str]
    means: dict[str, dict[str, float]]
    ranks: dict[str, dict[str, float]]
    average_rank: dict[str, float]
    p_values: dict[str, dict[str, float]]
    n_pairs: dict[str, dict[str, int]]
    n_undefined: dict[str, dict[str, int]]
    dice_improvement: dict[str, float]
    classes: list[int] | None = None
    values: dict[str, dict[str, list[float]]] = field(default_factory=dict, repr=False)
    classes_name: str | None = None  # what ``classes`` are, e.g. "tumour" (from a task's report_classes)
    absent_classes: str = "score"  # how a class absent from a case's label counts (ABSENT_CLASSES)
    pair_by: str = "path"  # how the methods' cases were paired (PAIR_BY): their paths or their file names
    #: how each method's predictions were post-processed, where its run's ``metrics.json`` says (methods_postprocessing)
    postprocessing: dict[str, str] = field(default_factory=dict)

    def rows(self) -> list[dict]:
        """One flat dictionary per method (the CSV rows)."""
        rows = []
        tested = self.baseline is not None
        for m in self.methods:
            row: dict = {"method": m, **({"is_baseline": m == self.baseline} if tested else {})}
            row["n_cases"] = len(self.cases)
            for metric in self.metrics:
                row[f"{metric}_mean"] = self.means[m][metric]
                row[f"{metric}_rank"] = self.ranks[m][metric]
                if tested:
                    row[f"{metric}_p"] = self.p_values[m][metric]
                    row[f"{metric}_n_pairs"] = self.n_pairs[m][metric]
                row[f"{metric}_n_undefined"] = self.n_undefined[m][metric]
            row["average_rank"] = self.average_rank[m]
            if tested:
                row["dice_improvement"] = self.dice_improvement[m]
            rows.append(row)
        return rows

    def to_csv(self, path: str | Path | None = None) -> str:
        """The table as CSV (full precision, undefined = ``nan``); written atomically to ``path`` if given."""
        rows = self.rows()
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        if path is not None:
            atomic_write_text(path, buffer.getvalue())
        return buffer.getvalue()

    def to_markdown(self) -> str:
        """The paper-style Markdown table (percentages for Dice/sensitivity/precision, mm for HD95); the ΔDSC and
        p-value columns only with a baseline."""
        tested = self.baseline is not None
        head = ["Method", *(_column(m) for m in self.metrics), "Avg. rank"]
        if tested:
            head += ["ΔDSC", *(f"p {LABELS[m]}" for m in self.metrics)]
        best = {k: min(self.ranks[m][k] for m in self.methods) for k in self.metrics}  # bold, ties included
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
        for m in self.methods:
            cells = [f"{m} (baseline)" if m == self.baseline else m]
            for metric in self.metrics:
                text = _format_value(metric, self.means[m][metric])
                cells.append(f"**{text}**" if self.ranks[m][metric] == best[metric] and text != "n/a" else text)
            cells.append(f"{self.average_rank[m]:.2f}")
            if tested:
                cells.append(f"{self.dice_improvement[m]:+.1f}")
                cells += [_format_p(self.p_values[m][metric]) for metric in self.metrics]
            lines.append("| " + " | ".join(cells) + " |")
        classes = "all foreground classes" if self.classes is None else f"classes {self.classes}"
        if self.classes_name:
            classes += f" ({self.classes_name})"
        absent = " (a class absent from a case's label left out)" if self.absent_classes == "ignore" else ""
        paired = " (paired by the images' file names)" if self.pair_by == "name" else ""
        note = (
            f"{len(self.cases)} paired cases{paired}, per-case values averaged over {classes}{absent}. Ranks: 1 = "
            "best mean per metric, ties averaged."
        )
        if tested:
            note += (
                " p: two-sided paired Wilcoxon signed-rank test against the baseline (undefined pairs dropped; 1 "
                "when all differences are zero). ΔDSC: Dice points vs the baseline."
            )
        else:
            note += " No baseline: no p-values (give --baseline for paired Wilcoxon tests and ΔDSC)."
        lines += ["", note]
        undefined = [
            f"{m}: {metric} {self.n_undefined[m][metric]}"
            for m in self.methods
            for metric in self.metrics
            if self.n_undefined[m][metric]
        ]
        if undefined:
            lines.append("Cases with an undefined value (left out of means and tests): " + "; ".join(undefined) + ".")
        if len(set(self.postprocessing.values())) > 1:
            listed = "; ".join(f"{m}: {how}" for m, how in self.postprocessing.items())
            lines.append(f"The methods' predictions were post-processed differently: {listed}.")
        return "\n".join(lines) + "\n"


def _column(metric: str) -> str:
    return f"{LABELS[metric]} (mm)" if metric == "hd95" else f"{LABELS[metric]} (%)"


def _format_value(metric: str, value: float) -> str:
    if not math.isfinite(value):
        return "n/a"
    return f"{value:.2f}" if metric == "hd95" else f"{100 * value:.1f}"


def _format_p(p: float) -> str:
    if not math.isfinite(p):
        return "—"
    return "<0.001" if p < 1e-3 else f"{p:.3f}"


def _float(text: str | None) -> float:
    try:
        return float(text) if text not in (None, "", "None", "null") else math.nan
    except ValueError as error:
        raise ReportError(f"not a number: {text!r}") from error


def read_per_case(
    path: str | Path,
    metrics: Sequence[str] = METRICS,
    classes: Sequence[int] | None = None,
    absent_classes: str = "score",
) -> dict[str, dict[str, dict[str, float]]]:
    """``{method: {metric: {case: value}}}`` from a ``per_case.csv``, values averaged over the classes
    (``absent_classes="ignore"``: over those present in the case's label; a case without any is undefined)."""
    path = Path(path)
    if absent_classes not in ABSENT_CLASSES:
        raise ReportError(f"absent_classes {absent_classes!r}: must be one of {list(ABSENT_CLASSES)}")
    ignore_absent = absent_classes == "ignore"
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = {"method", "case", "class", *metrics, *(("status",) if ignore_absent else ())} - set(
            reader.fieldnames or []
        )
        if missing:
            raise ReportError(f"{path}: missing column(s) {sorted(missing)}")
        collected: dict[str, dict[str, dict[str, list[float]]]] = {}
        seen: dict[str, set[int]] = {}
        for row in reader:
            c = int(row["class"])
            seen.setdefault(row["method"], set()).add(c)
            if classes is not None and c not in classes:
                continue
            per_metric = collected.setdefault(row["method"], {m: {} for m in metrics})
            absent = ignore_absent and row["status"] in ABSENT_STATUSES
            for m in metrics:
                per_metric[m].setdefault(row["case"], []).append(math.nan if absent else _float(row[m]))
    if not seen:
        raise ReportError(f"{path}: no rows")
    if classes is not None:
        for method, present in seen.items():
            if set(classes) - present:
                raise ReportError(f"{path}: method {method!r} has no class {sorted(set(classes) - present)}")
    return {
        method: {m: {case: nanmean(v) for case, v in per_metric[m].items()} for m in metrics}
        for method, per_metric in collected.items()
    }


def _csv_suffix(csv_path: Path) -> str | None:
    """What follows ``per_case`` in a per-case CSV's name (``""``, ``"_evaluate"``); None for a CSV named otherwise."""
    stem = Path(PER_CASE_CSV).stem
    return csv_path.stem[len(stem) :] if csv_path.stem.startswith(stem) else None


def per_case_source(source: str | Path) -> tuple[Path, Path | None]:
    """``(per-case CSV, metrics JSON beside it)`` of a report's input: a run directory (its ``per_case.csv`` and
    ``metrics.json``) or a per-case CSV file (``per_case_evaluate.csv`` and ``metrics_evaluate.json``; None for a CSV
    named otherwise). The JSON need not exist; the CSV must."""
    source = Path(source)
    if source.is_dir():
        csv_path = source / PER_CASE_CSV
        if not csv_path.is_file():
            raise ReportError(f"{source}: no {PER_CASE_CSV} (is it a run directory that was evaluated?)")
        return csv_path, source / METRICS_JSON
    if source.suffix != ".csv":
        what = "not a per-case CSV" if source.exists() else f"no {PER_CASE_CSV} (no such run directory)"
        raise ReportError(f"{source}: {what}; give a run directory or a per-case CSV such as per_case_evaluate.csv")
    if not source.is_file():
        raise ReportError(f"{source}: no such file")
    suffix = _csv_suffix(source)
    return source, None if suffix is None else source.with_name(f"{Path(METRICS_JSON).stem}{suffix}.json")


def _source_names(csv_paths: Sequence[Path]) -> list[str]:
    """Each input's name in its methods' names, from the per-case CSV it gave (:func:`per_case_source`): the CSV's
    folder's name (a run directory's ``per_case.csv``: the run's), with the file's own suffix after a colon for
    another CSV (``run:evaluate``); their folders' paths where two would share a name."""

    def named(csv_path: Path, whole_path: bool) -> str:
        name = csv_path.parent.as_posix() if whole_path else csv_path.parent.name
        suffix = _csv_suffix(csv_path)
        return name if suffix == "" else f"{name}:{csv_path.stem if suffix is None else suffix.lstrip('_')}"

    names = [named(p, False) for p in csv_paths]
    if len(set(names)) < len(names):
        names = [named(p, True) for p in csv_paths]
    return names


def _paired_p(method: Sequence[float], baseline: Sequence[float]) -> tuple[float, int]:
    pairs = [(a, b) for a, b in zip(method, baseline) if math.isfinite(a) and math.isfinite(b)]
    if not pairs:
        return math.nan, 0
    x, y = np.array(pairs).T
    if np.all(x == y):
        return 1.0, len(pairs)
    return float(wilcoxon(x, y, alternative="two-sided").pvalue), len(pairs)


def build_report(
    run_dirs: Sequence[str | Path],
    baseline: str | None = None,
    metrics: Sequence[str] = METRICS,
    classes: Sequence[int] | None = None,
    absent_classes: str = "score",
    pair_by: str = "path",
) -> Report:
    """Compare the methods of ``run_dirs`` (each holding a ``per_case.csv``, or a per-case CSV itself): means and
    ranks, and with a ``baseline`` paired Wilcoxon tests against it and ΔDSC.

    Args:
        run_dirs: run directories or per-case CSV files (``RUN/per_case_evaluate.csv``); see the module docstring
            for how methods are named.
        baseline: the method name the others are tested against; ``None``: no tests.
        metrics: metrics of the table, a subset of ``("dice", "sensitivity", "precision", "hd95")``.
        classes: foreground classes to average over (e.g. ``[2]`` for KiTS tumour); None = all.
        absent_classes: ``"score"``: a class absent from a case's label counts as the metrics score it (Dice 1 or
            0); ``"ignore"``: it is left out of that case's mean (MONAI's ``DiceMetric(ignore_empty=True)``).
        pair_by: ``"path"``: cases are paired by their images' paths; ``"name"``: by the paths' file names (runs
            evaluated on copies of one dataset), which must be unique within each run.
    """
    if pair_by not in PAIR_BY:
        raise ReportError(f"pair_by {pair_by!r}: must be one of {list(PAIR_BY)}")
    metrics = tuple(metrics)
    unknown = [m for m in metrics if m not in METRICS]
    if unknown or not metrics:
        raise ReportError(f"unknown metric(s) {unknown}; choose from {list(METRICS)}")
    if not run_dirs:
        raise ReportError("no run directories given")
    read_metrics = tuple(dict.fromkeys(("dice", *metrics)))  # Dice is always needed for ΔDSC
    values: dict[str, dict[str, dict[str, float]]] = {}
    sources = [per_case_source(d) for d in run_dirs]  # (per-case CSV, metrics JSON) of each input
    given_as: dict[Path, str | Path] = {}  # each CSV read, by its resolved path -> the input that named it
    for run_dir, (csv_path, _) in zip(run_dirs, sources):
        key = csv_path.resolve()
        if key in given_as:
            raise ReportError(f"{run_dir}: the same per-case CSV as {given_as[key]}, given twice")
        given_as[key] = run_dir
    names = _source_names([csv_path for csv_path, _ in sources])
    postprocessing: dict[str, str] = {}
    for (csv_path, metrics_path), run_name in zip(sources, names):
        recorded = methods_postprocessing(metrics_path)
        for method, per_metric in read_per_case(csv_path, read_metrics, classes, absent_classes).items():
            name = method if len(run_dirs) == 1 else f"{run_name}/{method}"
            values[name] = per_metric
            if method in recorded:
                postprocessing[name] = recorded[method]
    methods = list(values)
    if baseline is not None and baseline not in values:
        raise ReportError(f"unknown baseline {baseline!r}; methods are {methods}")
    reference = methods[0] if baseline is None else baseline

    if pair_by == "name":
        values = _by_file_name(values)
    cases = sorted(values[reference]["dice"])
    for method in methods:
        own = set(values[method]["dice"])
        lacking, extra = sorted(set(cases) - own), sorted(own - set(cases))
        if lacking or extra:
            raise ReportError(
                f"method {method!r} is not evaluated on the same cases as {'the baseline ' if baseline else ''}"
                f"{reference!r}: "
                f"missing {lacking[:5]}{' ...' if len(lacking) > 5 else ''}, "
                f"extra {extra[:5]}{' ...' if len(extra) > 5 else ''}"
                + (_pair_by_name_hint(values) if pair_by == "path" else "")
            )
    table = {m: {k: [values[m][k][case] for case in cases] for k in read_metrics} for m in methods}

    means = {m: {k: nanmean(table[m][k]) for k in read_metrics} for m in methods}
    ranks: dict[str, dict[str, float]] = {m: {} for m in methods}
    for k in metrics:
        sign = -1.0 if HIGHER_IS_BETTER[k] else 1.0
        keys = [sign * means[m][k] if math.isfinite(means[m][k]) else math.inf for m in methods]
        for m, r in zip(methods, rankdata(keys, method="average")):
            ranks[m][k] = float(r)
    tested = [] if baseline is None else methods
    p_values: dict[str, dict[str, float]] = {m: {} for m in tested}
    n_pairs: dict[str, dict[str, int]] = {m: {} for m in tested}
    for m in tested:
        for k in metrics:
            if m == baseline:
                p_values[m][k], n_pairs[m][k] = math.nan, len(cases)
            else:
                p_values[m][k], n_pairs[m][k] = _paired_p(table[m][k], table[baseline][k])
    return Report(
        baseline=baseline,
        metrics=metrics,
        methods=methods,
        cases=cases,
        means={m: {k: means[m][k] for k in metrics} for m in methods},
        ranks=ranks,
        average_rank={m: float(np.mean([ranks[m][k] for k in metrics])) for m in methods},
        p_values=p_values,
        n_pairs=n_pairs,
        n_undefined={m: {k: sum(1 for v in table[m][k] if not math.isfinite(v)) for k in metrics} for m in methods},
        dice_improvement={}
        if baseline is None
        else {m: 100.0 * (means[m]["dice"] - means[baseline]["dice"]) for m in methods},
        classes=None if classes is None else [int(c) for c in classes],
        values=table,
        absent_classes=absent_classes,
        pair_by=pair_by,
        postprocessing=postprocessing,
    )


def methods_postprocessing(metrics_path: Path | None) -> dict[str, str]:
    """``{method: how its predictions were post-processed}`` from a run's metrics file (``metrics.json``,
    ``metrics_evaluate.json``: its ``segmentation_postprocessing``, then ``largest_component_classes``; ``"none"``),
    ``{}`` where none is given or it is missing or unreadable (a report needs only the CSV); a method whose entry
    records neither is left out."""
    try:
        recorded = json.loads(metrics_path.read_text()) if metrics_path is not None else {}
    except (OSError, ValueError):
        return {}
    described = {}
    for method, entry in recorded.items() if isinstance(recorded, dict) else ():
        if not isinstance(entry, dict) or not {"segmentation_postprocessing", "largest_component_classes"} & set(entry):
            continue
        transforms = entry.get("segmentation_postprocessing")  # not recorded before it existed: none
        steps = [str(transforms)] if transforms else []
        if entry.get("largest_component_classes"):
            steps.append(f"largest component of classes {entry['largest_component_classes']}")
        described[method] = " then ".join(steps) or "none"
    return described


def _by_file_name(values: dict[str, dict[str, dict[str, float]]]) -> dict[str, dict[str, dict[str, float]]]:
    """The methods' per-case values keyed by their cases' file names, refused when two cases of a method share one."""
    renamed = {}
    for method, per_metric in values.items():
        counts = Counter(Path(case).name for case in per_metric["dice"])
        shared = sorted(name for name, count in counts.items() if count > 1)
        if shared:
            raise ReportError(f"method {method!r}: cases {shared[:5]} share a file name; they cannot be paired by name")
        renamed[method] = {k: {Path(c).name: v for c, v in per_case.items()} for k, per_case in per_metric.items()}
    return renamed


def _pair_by_name_hint(values: dict[str, dict[str, dict[str, float]]]) -> str:
    """A hint for unpaired cases whose file names would pair them (runs evaluated on copies of one dataset)."""
    try:
        names = [set(per_metric["dice"]) for per_metric in _by_file_name(values).values()]
    except ReportError:
        return ""
    if all(n == names[0] for n in names):
        return (". Their file names pair them: if the runs were evaluated on copies of one dataset, or given its "
                "folder once as a relative and once as an absolute path (--dataset_dir), "
                "give --pair-by name")  # fmt: skip
    return ""


def build_report_parser(p: argparse.ArgumentParser) -> None:
    """Arguments of ``jcsaug report RUN [RUN ...] [--baseline NAME]``."""
    p.description = (
        "Compare evaluated runs (their per_case.csv, or evaluate.yaml's per_case_evaluate.csv): mean metrics and "
        "average rank; with --baseline also paired Wilcoxon tests against it and the Dice improvement."
    )
    p.add_argument(
        "run_dirs",
        nargs="+",
        type=Path,
        metavar="RUN",
        help="run directories with a per_case.csv, or per-case CSV files (RUN/per_case_evaluate.csv: the run "
        "evaluated again by evaluate.yaml; its methods are named RUN:evaluate/<method>)",
    )
    p.add_argument(
        "--baseline",
        help="baseline method for p-values and ΔDSC: the CSV's method name with one RUN, else "
        "'<run dir name>/<method>' ('<run dir name>:evaluate/<method>' for a per_case_evaluate.csv; default: no "
        "tests)",
    )
    p.add_argument("-o", "--output", type=Path, help="write <OUTPUT>.md and <OUTPUT>.csv (default: Markdown to stdout)")
    p.add_argument("--metrics", nargs="+", choices=METRICS, default=list(METRICS), help="metrics of the table")
    p.add_argument(
        "--classes",
        nargs="+",
        type=int,
        help="foreground classes to average over (default: the --task's reported classes, else all)",
    )
    from jcsaug.tasks import list_tasks

    p.add_argument(
        "--task",
        choices=list_tasks(),
        help="the runs' dataset task: average over the classes the paper reports for it (its headline "
        "report_classes, e.g. kits19_tumor: tumour = class 2) unless --classes is given",
    )
    p.add_argument(
        "--absent-classes",
        choices=ABSENT_CLASSES,
        default="score",
        help="a class absent from a case's label: 'score' counts it as the metrics do (Dice 1 if none is "
        "predicted, else 0; the default), 'ignore' leaves it out of the case's mean, as MONAI's "
        "DiceMetric(ignore_empty=True)",
    )
    p.add_argument(
        "--pair-by",
        choices=PAIR_BY,
        default="path",
        help="pair the runs' cases by their images' paths (the default) or by the paths' file names (runs evaluated "
        "on copies of one dataset at different places)",
    )


def report_classes(task: str | None, classes: Sequence[int] | None) -> tuple[list[int] | None, str | None]:
    """The classes of a report and their name: ``classes`` if given (named when they are one of the task's reported
    subsets), else the ``task``'s headline subset (KiTS: ``([2], "tumour")``), else ``(None, None)``: all."""
    if task is None:
        return (None if classes is None else [int(c) for c in classes]), None
    from jcsaug.tasks import get_task

    try:
        spec = get_task(task)
    except KeyError as error:
        raise ReportError(str(error.args[0])) from error
    if classes is not None:
        chosen = [int(c) for c in classes]
        names = [n for n, subset in spec.report_classes.items() if sorted(subset) == sorted(chosen)]
        return chosen, (names[0] if names else None)
    headline = spec.headline_classes
    return (None, None) if headline is None else ([int(c) for c in headline[1]], headline[0])


def run_report(args: argparse.Namespace) -> int:
    """Build the report; print it or write ``<output>.md``/``<output>.csv``. Exit code 2 on bad input."""
    try:
        classes, name = report_classes(getattr(args, "task", None), args.classes)
        report = build_report(
            args.run_dirs, args.baseline, metrics=args.metrics, classes=classes,
            absent_classes=getattr(args, "absent_classes", "score"), pair_by=getattr(args, "pair_by", "path"),
        )  # fmt: skip
    except ReportError as error:
        print(f"jcsaug report: error: {error}", file=sys.stderr)
        return 2
    report.classes_name = name
    if args.output is None:
        print(report.to_markdown(), end="")
        return 0
    markdown, table = Path(f"{args.output}.md"), Path(f"{args.output}.csv")
    atomic_write_text(markdown, report.to_markdown())
    report.to_csv(table)
    print(f"wrote {markdown} and {table}")
    return 0
