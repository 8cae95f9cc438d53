"""The comparison report (SPEC §6): means, ranks, average rank, paired Wilcoxon, ΔDSC — against hand computation."""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

import pytest
from scipy.stats import wilcoxon

from jcsaug.evaluation import METRICS, ReportError, build_report, build_report_parser, run_report

NAN = math.nan
CASES = ["c1", "c2", "c3", "c4", "c5"]
# 3 methods x 4 metrics x 5 cases, one foreground class; A is the baseline.
DATA = {
    "A": {
        "dice": [0.5, 0.6, 0.7, 0.8, 0.9],
        "sensitivity": [0.75] * 5,
        "precision": [0.9] * 5,
        "hd95": [5.0] * 5,
    },
    "B": {
        "dice": [0.60, 0.72, 0.78, 0.91, 0.99],  # A + (0.10, 0.12, 0.08, 0.11, 0.09): mean 0.8
        "sensitivity": [0.5, 1.0, 0.75, 0.75, 0.75],  # mean 0.75, tied with A
        "precision": [0.7] * 5,
        "hd95": [2.0, 4.0, 3.0, 3.0, 3.0],  # mean 3
    },
    "C": {
        "dice": [0.55, 0.58, 0.73, 0.81, 0.94],  # A + (0.05, -0.02, 0.03, 0.01, 0.04): mean 0.722
        "sensitivity": [1.0, 0.75, 1.0, 0.75, 1.0],  # mean 0.9
        "precision": [0.8] * 5,
        "hd95": [3.0, 3.0, NAN, 3.0, 3.0],  # mean over defined 3 (tied with B), one undefined
    },
}


def _write(run_dir: Path, data: dict, cases=CASES, classes=(1,)) -> Path:
    """A per_case.csv as evaluate_cases writes it (every class gets the same values unless given per class)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / "per_case.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["method", "case", "class", *METRICS, "status"])
        for method, values in data.items():
            for i, case in enumerate(cases):
                for c in classes:
                    row = [values[m][i][c - 1] if isinstance(values[m][i], list) else values[m][i] for m in METRICS]
                    writer.writerow([method, case, c, *(repr(float(v)) for v in row), "ok"])
    return run_dir


def test_means_ranks_and_average_ranks_match_hand_computation(tmp_path):
    report = build_report([_write(tmp_path / "run", DATA)], baseline="A")
    assert report.methods == ["A", "B", "C"] and report.cases == CASES
    assert report.means["B"]["dice"] == pytest.approx(0.8) and report.means["C"]["dice"] == pytest.approx(0.722)
    assert report.means["C"]["hd95"] == pytest.approx(3.0) and report.n_undefined["C"]["hd95"] == 1
    # by hand: dice B>C>A; sensitivity C > A = B; precision A>C>B; hd95 (lower better) B = C < A
    expected = {
        "A": {"dice": 3, "sensitivity": 2.5, "precision": 1, "hd95": 3},
        "B": {"dice": 1, "sensitivity": 2.5, "precision": 3, "hd95": 1.5},
        "C": {"dice": 2, "sensitivity": 1, "precision": 2, "hd95": 1.5},
    }
    assert report.ranks == expected
    assert report.average_rank == pytest.approx({"A": 9.5 / 4, "B": 8 / 4, "C": 6.5 / 4})
    assert report.dice_improvement == pytest.approx({"A": 0.0, "B": 10.0, "C": 2.2})


def test_wilcoxon_p_values_match_hand_computation(tmp_path):
    report = build_report([_write(tmp_path / "run", DATA)], baseline="A")
    # B - A dice: 5 positive differences, exact two-sided p = 2 / 2^5
    assert report.p_values["B"]["dice"] == pytest.approx(2 / 32)
    # C - A dice: |d| ranks 5, 2, 3, 1, 4 with rank 2 negative: T = 2, P(T <= 2) = #{{}, {1}, {2}} / 32
    assert report.p_values["C"]["dice"] == pytest.approx(2 * 3 / 32)
    for method in "BC":
        for metric in METRICS:
            pairs = [(m, b) for m, b in zip(DATA[method][metric], DATA["A"][metric]) if not math.isnan(m)]
            x, y = zip(*pairs)
            assert report.p_values[method][metric] == pytest.approx(wilcoxon(x, y).pvalue), (method, metric)
            assert report.n_pairs[method][metric] == len(pairs)
    assert report.n_pairs["C"]["hd95"] == 4  # the undefined case is dropped from the pair
    assert all(math.isnan(p) for p in report.p_values["A"].values())  # the baseline itself


def test_identical_method_gets_p_one(tmp_path):
    report = build_report([_write(tmp_path / "run", {"A": DATA["A"], "A2": DATA["A"]})], baseline="A")
    assert report.p_values["A2"] == {m: 1.0 for m in METRICS}
    assert report.ranks["A2"] == report.ranks["A"] == {m: 1.5 for m in METRICS}


def test_per_case_values_average_classes_and_class_selection(tmp_path):
    per_class = {
        "A": {m: [[0.2, 0.4]] * 5 for m in METRICS},
        "B": {m: [[0.3, NAN]] * 5 for m in METRICS},  # class 2 undefined: the case value is class 1's
    }
    run = _write(tmp_path / "run", per_class, classes=(1, 2))
    report = build_report([run], baseline="A")
    assert report.means["A"]["dice"] == pytest.approx(0.3) and report.means["B"]["dice"] == pytest.approx(0.3)
    only_two = build_report([run], baseline="A", classes=[2])
    assert only_two.means["A"]["dice"] == pytest.approx(0.4) and math.isnan(only_two.means["B"]["dice"])
    assert only_two.n_undefined["B"]["dice"] == 5 and only_two.ranks["B"]["dice"] == 2  # undefined ranks last
    with pytest.raises(ReportError, match=r"no class \[3\]"):
        build_report([run], baseline="A", classes=[3])


def test_several_run_dirs_name_methods_by_directory(tmp_path):
    first = _write(tmp_path / "heuristic", {"none": DATA["A"], "tea": DATA["C"]})
    second = _write(tmp_path / "learned", {"none": DATA["B"]})
    report = build_report([first, second], baseline="heuristic/none", metrics=["dice", "hd95"])
    assert report.methods == ["heuristic/none", "heuristic/tea", "learned/none"]
    assert report.ranks["learned/none"] == {"dice": 1, "hd95": 1.5}
    assert report.p_values["learned/none"]["dice"] == pytest.approx(2 / 32)
    with pytest.raises(ReportError, match="unknown baseline 'none'.*heuristic/none"):
        build_report([first, second], baseline="none")


def test_markdown_and_csv_outputs(tmp_path):
    report = build_report([_write(tmp_path / "run", DATA)], baseline="A")
    markdown = report.to_markdown()
    lines = markdown.splitlines()
    assert lines[0].startswith("| Method | DSC (%) | Sens. (%) | Prec. (%) | HD95 (mm) | Avg. rank | ΔDSC | p DSC")
    assert lines[2].startswith("| A (baseline) | 70.0 | 75.0 | **90.0** | 5.00 | 2.38 | +0.0 | — |")
    assert lines[3].startswith("| B | **80.0** | 75.0 | 70.0 | **3.00** | 2.00 | +10.0 | 0.062 |")
    assert "C: hd95 1" in markdown
    rows = list(csv.DictReader(report.to_csv(tmp_path / "table.csv").splitlines()))
    assert [r["method"] for r in rows] == ["A", "B", "C"]
    assert float(rows[2]["average_rank"]) == pytest.approx(1.625) and rows[0]["dice_p"] == "nan"
    assert (tmp_path / "table.csv").read_text().splitlines()[0].startswith("method,is_baseline,n_cases,dice_mean")


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    build_report_parser(parser)
    return run_report(parser.parse_args(argv))


def test_cli_prints_or_writes_and_reports_bad_input(tmp_path, capsys):
    run = _write(tmp_path / "run", DATA)
    assert _cli([str(run), "--baseline", "A"]) == 0
    assert "| A (baseline) |" in capsys.readouterr().out
    assert _cli([str(run), "--baseline", "A", "-o", str(tmp_path / "out" / "table")]) == 0
    assert (tmp_path / "out" / "table.md").is_file() and (tmp_path / "out" / "table.csv").is_file()
    capsys.readouterr()

    assert _cli([str(tmp_path / "nowhere"), "--baseline", "A"]) == 2
    assert "nowhere: no per_case.csv" in capsys.readouterr().err
    assert _cli([str(run), "--baseline", "Z"]) == 2
    assert "unknown baseline 'Z'; methods are ['A', 'B', 'C']" in capsys.readouterr().err

    other = _write(tmp_path / "other", {"D": DATA["A"]}, cases=["c1", "c2", "c3", "c4", "x9"])
    assert _cli([str(run), str(other), "--baseline", "run/A"]) == 2
    err = capsys.readouterr().err
    assert "'other/D'" in err and "missing ['c5']" in err and "extra ['x9']" in err


def test_without_a_baseline_means_and_ranks_only(tmp_path, capsys):
    run = _write(tmp_path / "run", DATA)
    report = build_report([run])
    tested = build_report([run], baseline="A")
    assert report.means == tested.means and report.ranks == tested.ranks
    assert report.average_rank == tested.average_rank
    assert report.p_values == {} and report.dice_improvement == {} and report.baseline is None
    lines = report.to_markdown().splitlines()
    assert lines[0] == "| Method | DSC (%) | Sens. (%) | Prec. (%) | HD95 (mm) | Avg. rank |"
    assert lines[2] == "| A | 70.0 | 75.0 | **90.0** | 5.00 | 2.38 |" and "No baseline" in lines[-2]
    assert not [c for c in report.to_csv().splitlines()[0].split(",") if c.endswith("_p") or c == "dice_improvement"]
    assert _cli([str(run)]) == 0 and "| B | **80.0** |" in capsys.readouterr().out
    other = _write(tmp_path / "other", {"D": DATA["A"]}, cases=["c1", "c2", "c3", "c4", "x9"])
    with pytest.raises(ReportError, match="'other/D' is not evaluated on the same cases as 'run/A'"):
        build_report([run, other])


def test_task_defaults_the_classes_to_its_reported_ones(tmp_path, capsys):
    """Defect 4: ``--task kits19_tumor`` averages over the tumour (class 2), as the paper reports; --classes wins."""
    per_class = {"A": {m: [[0.9, 0.2]] * 5 for m in METRICS}, "B": {m: [[0.8, 0.4]] * 5 for m in METRICS}}
    run = _write(tmp_path / "run", per_class, classes=(1, 2))
    assert _cli([str(run), "--task", "kits19_tumor"]) == 0
    out = capsys.readouterr().out
    assert "| A | 20.0 |" in out and "| B | **40.0** |" in out and "classes [2] (tumour)" in out
    assert _cli([str(run), "--task", "kits19_tumor", "--classes", "1"]) == 0
    out = capsys.readouterr().out
    assert "| A | **90.0** |" in out and "classes [1]." in out
    assert _cli([str(run)]) == 0 and "| A | 55.0 |" in capsys.readouterr().out  # no task: all classes, as before
    with pytest.raises(SystemExit):
        _cli([str(run), "--task", "nope"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_report_classes_of_every_task():
    """The headline subset is the first of a task's report_classes: BTCV and the cardiac tasks report all classes
    first (rare organs / one structure beside them); KiTS the tumour only."""
    from jcsaug.evaluation.report import report_classes

    assert report_classes("kits19_tumor", None) == ([2], "tumour")
    assert report_classes("atlas_stroke", None) == ([1], "lesion")
    assert report_classes("btcv_abdomen", None) == (list(range(1, 14)), "organs")
    assert report_classes("btcv_abdomen", [13, 12, 11, 10, 9, 8, 5, 4]) == ([13, 12, 11, 10, 9, 8, 5, 4], "rare organs")
    assert report_classes("cardiac_crosssite", None) == ([1, 2, 3], "AVG")
    assert report_classes("cardiac_crosssequence", [3]) == ([3], "RV")
    assert report_classes(None, None) == (None, None) and report_classes(None, [2]) == ([2], None)
    with pytest.raises(ReportError, match="unknown task 'nope'"):
        report_classes("nope", None)


def _absent_class_cases() -> dict:
    """``{case: (prediction, label)}``: class 2 is in case a's label only; case b's prediction has none either
    (both empty), case c's has some (a false positive); class 1 is half found in b and c (Dice 2/3)."""
    import torch

    label = torch.zeros(8, 8, 8, dtype=torch.long)
    label[:4] = 1  # class 1 in every case
    with_two = label.clone()
    with_two[6:] = 2
    half_one = label.clone()
    half_one[2:4] = 0
    false_two = half_one.clone()
    false_two[7] = 2
    return {"a": (with_two, with_two), "b": (half_one, label), "c": (false_two, label)}


def _evaluated_run(run_dir: Path) -> Path:
    """A per_case.csv as evaluate_cases writes it, from the label maps of :func:`_absent_class_cases`."""
    from jcsaug.evaluation.metrics import case_metrics
    from jcsaug.evaluation.segmentation import per_case_csv

    rows = [{"case": case, **case_metrics(pred, true, 3)} for case, (pred, true) in _absent_class_cases().items()]
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "per_case.csv").write_text(per_case_csv({"none": {"per_case": rows}}))
    return run_dir


def test_absent_classes_are_scored_or_left_out_of_the_case_mean(tmp_path, capsys):
    """``--absent-classes ignore`` leaves a class absent from a case's label out of that case's mean whatever the
    prediction (MONAI's ``DiceMetric(ignore_empty=True)``); by default it counts as the metrics score it."""
    from monai.metrics import DiceMetric
    from monai.networks.utils import one_hot

    run = _evaluated_run(tmp_path / "run")
    statuses = [row["status"] for row in csv.DictReader((run / "per_case.csv").read_text().splitlines())]
    assert statuses == ["ok", "ok", "ok", "both_empty", "ok", "label_empty"]
    scored = build_report([run], metrics=["dice"])
    assert scored.values["none"]["dice"] == pytest.approx([1.0, (2 / 3 + 1) / 2, (2 / 3 + 0) / 2])
    ignored = build_report([run], metrics=["dice", "precision"], absent_classes="ignore")
    assert ignored.values["none"]["dice"] == pytest.approx([1.0, 2 / 3, 2 / 3])
    assert ignored.values["none"]["precision"] == pytest.approx([1.0, 1.0, 1.0])  # the false positive's 0 left out
    # the same per-case means as MONAI's Dice with empty labels ignored
    monai_dice = DiceMetric(include_background=False, ignore_empty=True, reduction="none")
    for (pred, true), value in zip(_absent_class_cases().values(), ignored.values["none"]["dice"]):
        assert float(monai_dice(one_hot(pred[None, None], 3), one_hot(true[None, None], 3)).nanmean()) == (
            pytest.approx(value)
        )
    # from the command line, named in the table's note; a CSV without statuses is refused for ignore
    assert _cli([str(run), "--metrics", "dice", "--absent-classes", "ignore"]) == 0
    out = capsys.readouterr().out
    assert "| none | **77.8** |" in out and "absent from a case's label left out" in out
    assert _cli([str(run), "--metrics", "dice"]) == 0 and "| none | **72.2** |" in capsys.readouterr().out
    old = tmp_path / "old" / "per_case.csv"
    old.parent.mkdir()
    old.write_text("\n".join(line.rsplit(",", 1)[0] for line in (run / "per_case.csv").read_text().splitlines()))
    with pytest.raises(ReportError, match=r"old/per_case.csv: missing column\(s\) \['status'\]"):
        build_report([old.parent], absent_classes="ignore")
    assert build_report([old.parent], metrics=["dice"]).values["none"]["dice"] == scored.values["none"]["dice"]
    with pytest.raises(ReportError, match="absent_classes 'skip'"):
        build_report([run], absent_classes="skip")


def test_runs_on_copies_of_one_dataset_are_paired_by_file_name_when_asked(tmp_path, capsys):
    """Cases are paired by their images' paths; runs evaluated on copies of one dataset (another machine, a moved
    folder) are refused with a hint, and ``--pair-by name`` pairs them by file name, giving the table of the runs
    evaluated at one place; file names shared within a run are refused."""
    here = [f"/data/a/imagesTs/{c}.nii.gz" for c in CASES]
    there = [f"/mnt/copy/imagesTs/{c}.nii.gz" for c in CASES]
    first = _write(tmp_path / "heuristic", {"none": DATA["A"]}, cases=here)
    second = _write(tmp_path / "learned", {"none": DATA["B"]}, cases=there)
    same_place = _write(tmp_path / "same" / "learned", {"none": DATA["B"]}, cases=here)
    with pytest.raises(ReportError, match="Their file names pair them: .* relative and once as an absolute path "
                       r"\(--dataset_dir\), give --pair-by name"):  # fmt: skip
        build_report([first, second], baseline="heuristic/none")
    paired = build_report([first, second], baseline="heuristic/none", pair_by="name")
    expected = build_report([first, same_place], baseline="heuristic/none")
    assert paired.cases == [f"{c}.nii.gz" for c in CASES] and paired.pair_by == "name"
    assert paired.means == expected.means and paired.p_values == expected.p_values
    assert "paired by the images' file names" in paired.to_markdown()
    assert "paired by" not in expected.to_markdown()
    assert _cli([str(first), str(second), "--baseline", "heuristic/none", "--pair-by", "name"]) == 0
    assert "| learned/none | **80.0** |" in capsys.readouterr().out

    twice = _write(tmp_path / "twice", {"none": DATA["B"]}, cases=[*here[:4], "/elsewhere/c1.nii.gz"])
    with pytest.raises(ReportError, match=r"'twice/none': cases \['c1.nii.gz'\] share a file name"):
        build_report([first, twice], pair_by="name")
    other = _write(tmp_path / "other", {"none": DATA["B"]}, cases=[*there[:4], "/mnt/copy/imagesTs/x9.nii.gz"])
    with pytest.raises(ReportError, match=r"extra \['/mnt/copy/imagesTs/c1.nii.gz'") as error:
        build_report([first, other])
    assert "pair-by" not in str(error.value)  # the file names would not pair them either: no hint
    with pytest.raises(ReportError, match="pair_by 'id': must be one of"):
        build_report([first], pair_by="id")


def test_per_case_csv_files_are_inputs_named_by_their_folder_and_suffix(tmp_path, capsys):
    """A per-case CSV itself is an input (``evaluate.yaml``'s ``per_case_evaluate.csv``): named ``<folder>:<suffix>``
    beside other inputs (``per_case.csv`` as its folder), by its path where two share a name; a file that is no CSV,
    or a CSV that is not there, is refused naming it."""
    run = _write(tmp_path / "a" / "run", {"none": DATA["A"]})
    (run / "per_case.csv").replace(run / "per_case_evaluate_validation.csv")
    _write(run, {"none": DATA["B"]})
    report = build_report([run, run / "per_case_evaluate_validation.csv"], baseline="run/none")
    assert report.methods == ["run/none", "run:evaluate_validation/none"]
    assert report.dice_improvement["run:evaluate_validation/none"] == pytest.approx(-10.0)
    with pytest.raises(ReportError, match=r"run: the same per-case CSV as .*run/per_case\.csv"):
        build_report([run / "per_case.csv", run])
    other = _write(tmp_path / "b" / "run", {"none": DATA["C"]})
    assert build_report([run / "per_case.csv", other / "per_case.csv"]).methods == [
        f"{run.as_posix()}/none", f"{other.as_posix()}/none"]  # fmt: skip
    (run / "per_case_evaluate_validation.csv").replace(run / "mine.csv")  # a CSV named otherwise: its stem
    assert build_report([run, run / "mine.csv"]).methods == ["run/none", "run:mine/none"]
    (run / "notes.txt").write_text("x")
    assert _cli([str(run / "notes.txt")]) == 2
    assert "notes.txt: not a per-case CSV; give a run directory or a per-case CSV" in capsys.readouterr().err
    assert _cli([str(run / "per_case_evaluate.csv")]) == 2
    assert "per_case_evaluate.csv: no such file" in capsys.readouterr().err
