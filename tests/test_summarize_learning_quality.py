"""The summary of the learning-quality records: one row per record, read from the benchmark's own files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import load_benchmark
from jcsaug.data.synthetic import TARGET_SHIFTS, shift_undoing_ops
from jcsaug.policy import make_tea_policy, make_tra_policy
from jcsaug.policy.io import policies_to_dict


@pytest.fixture(scope="module")
def summary():
    return load_benchmark("summarize_learning_quality")


def record(
    shift: str,
    settings: list[str],
    joint_tta: list[float],
    verdicts: dict[str, str],
    seeds=(0, 1, 2),
    oracle_gain: float = 14.0,
) -> dict:
    """A record as ``bench_learning_quality.py`` writes it (heuristic at 60 / 64 per seed)."""
    seeds = list(seeds)
    return {
        "shift": shift, "target_domain": {}, "seeds": seeds, "device": "cpu", "settings": settings,
        "baseline": "heuristic+mirror",
        "dice": {"heuristic+mirror": {"none": [60.0] * len(seeds), "tta": [64.0] * len(seeds)},
                 "class-specific+joint": {"none": [t - 2 for t in joint_tta], "tta": joint_tta}},
        "seconds": {"heuristic+mirror": [100.0] * len(seeds), "class-specific+joint": [560.0] * len(seeds)},
        "oracle_gain": oracle_gain,
        "targets": [{"target": f"{label} (long text)", "label": label, "verdict": v} for label, v in verdicts.items()],
    }  # fmt: skip


def write(path: Path, content: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content))
    return path


def test_one_row_per_record_in_the_order_given(summary, tmp_path, capsys):
    two = write(tmp_path / "k2" / "learning_quality_default.json", record(
        "default", ["tra_step=natural-unbiased"], [84.0, 85.0, 83.0],
        {"joint - heuristic+mirror +20.0": "PASS",
         "class-specific+joint: TRA gamma/gamma+[0.4,0.6) 0.04 / 0.13": "MISS",
         "class-specific+joint: TEA rotate_frontal_acw_90 rank 14": "MISS"}))  # fmt: skip
    write(tmp_path / "k4" / "learning_quality_blur.json", record(
        "blur", [], [64.0, 65.0, 63.0, 64.0, 64.0], {"joint - heuristic+mirror +0.0": "N/A",
                                                     "class-specific+mirror: TRA blur/x 0.1 / 0.2": "N/A"},
        seeds=range(5), oracle_gain=-0.6))  # fmt: skip
    write(tmp_path / "k4" / "learning_quality_default.json", record(
        "default", ["tra_step=natural-unbiased", "tra_counterfactuals=4"], [85.0, 85.0, 85.0],
        {"joint - heuristic+mirror +21.0": "PASS", "class-specific+mirror: TRA flip 0.2 / 0.5": "MISS"},
        seeds=(0, 2, 4)))  # fmt: skip

    summary.main([str(two), str(tmp_path / "k4"), "--output", str(tmp_path / "table.md")])

    out = capsys.readouterr().out
    assert out == (tmp_path / "table.md").read_text()
    header, rule, *rows = out.splitlines()
    assert header.startswith("| shift | settings | seeds | joint − heuristic+mirror, TTA / none (≥ +6 / +4) |")
    assert rule == "|---|---|---|---|---|---|---|---|"
    assert rows == [  # the joint's lead is the mean of the per-seed differences; its mode's name is left out
        "| default | tra_step=natural-unbiased | 0–2 | +20.0 / +22.0 | +14.0 | 560 | 1 of 3 | "
        "TRA gamma/gamma+[0.4,0.6) 0.04 / 0.13; TEA rotate_frontal_acw_90 rank 14 |",
        "| blur | defaults | 0–4 | +0.0 / +2.0 | -0.6 | 560 | – (2 N/A) | – |",  # the oracle gains nothing: no verdict
        "| default | tra_step=natural-unbiased tra_counterfactuals=4 | 0, 2, 4 | +21.0 / +23.0 | +14.0 | 560 | "
        "1 of 2 | class-specific+mirror: TRA flip 0.2 / 0.5 |",
    ]


def test_a_lead_or_oracle_gain_just_under_its_bound_does_not_round_up_to_it(summary, tmp_path, capsys):
    """The table prints the judged figures as the benchmark's targets do: a lead of +5.96 is not a "+6.0" under the
    header's "≥ +6" (nor +3.96 a "+4.0"), an oracle gain of 0.96 is not a "+1.0" beside its "N/A" verdicts."""
    with_tta = write(tmp_path / "a" / "learning_quality_default.json", record(
        "default", [], [69.96] * 3, {"joint - heuristic+mirror +5.96": "MISS"}, oracle_gain=0.96))  # fmt: skip
    without_tta = write(tmp_path / "b" / "learning_quality_default.json", record(
        "default", [], [65.96] * 3, {"joint - heuristic+mirror +1.96": "MISS"}))  # fmt: skip

    summary.main([str(with_tta), str(without_tta)])

    rows = capsys.readouterr().out.splitlines()[2:]
    assert rows[0].startswith("| default | defaults | 0–2 | +5.96 / +8.0 | +0.96 | 560 |")
    assert rows[1].startswith("| default | defaults | 0–2 | +2.0 / +3.96 | +14.0 | 560 |")


def test_a_record_the_benchmark_writes_is_summarized(summary, tmp_path, monkeypatch, capsys):
    """The benchmark's own record (its fakes: nnU-Net's presets as the learned policies) reaches the table."""
    bench = load_benchmark("bench_learning_quality")
    policies = policies_to_dict(make_tra_policy("nnunet", 2), make_tea_policy())
    tta = {"heuristic+mirror": 60.0, "class-specific+joint": 70.0}
    monkeypatch.setattr(bench, "run_one", lambda mode, seed, *rest: {
        "none": tta[mode] - 1, "tta": tta[mode] + seed, "policies": policies, "seconds": 5.0})  # fmt: skip
    shift = {"undone_by": shift_undoing_ops(TARGET_SHIFTS["default"])}
    monkeypatch.setattr(bench, "prepare_dataset", lambda out, _, **__: (out / "data", shift))
    argv = ["bench", "--modes", "class-specific+joint", "--seeds", "0", "1", "--out", str(tmp_path)]
    monkeypatch.setattr(bench.sys, "argv", argv)
    bench.main()
    capsys.readouterr()

    summary.main([str(tmp_path)])

    row = capsys.readouterr().out.splitlines()[2]
    assert row.startswith("| default | defaults | 0, 1 | +10.0 / +10.0 | – | 5 | 4 of 7 (no oracle run) | "
                          "TRA rotate_frontal/rot90 0.02 / 0.02; ")  # fmt: skip
    assert "TEA rotate_frontal_acw_90 rank " in row and "joint - heuristic" not in row  # only the missed ones


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no such file or folder"),
        ("folder", "no learning_quality_*.json in it"),
        ("{not json", "not a readable JSON record"),
        ('{"shift": "default"}', "not a bench_learning_quality.py record (missing ['seeds', 'settings',"),
        ("[1, 2]", "not a bench_learning_quality.py record (missing ['shift',"),
    ],
)
def test_a_bad_path_or_record_is_refused_by_name(summary, tmp_path, capsys, content, message):
    path = tmp_path / "learning_quality_x.json"
    if content == "folder":
        path = tmp_path / "empty"
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as stop:
        summary.main([str(path)])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"{path}: {message}" in err


def test_a_record_without_its_baselines_dice_is_refused(summary, tmp_path, capsys):
    bad = record("default", [], [80.0, 80.0, 80.0], {})
    bad["baseline"] = "oracle+mirror"
    path = write(tmp_path / "learning_quality_default.json", bad)
    with pytest.raises(SystemExit):
        summary.main([str(path)])
    assert f"{path}: no Dice of the baseline 'oracle+mirror'" in capsys.readouterr().err


def test_a_pipe_in_a_setting_stays_in_its_cell(summary):
    piped = record("default", ['tra_preset={"a": "x|y"}'], [80.0, 80.0, 80.0], {})
    cells = summary.row(piped).split(" | ")
    assert cells[1] == 'tra_preset={"a": "x\\|y"}' and len(summary.row(piped).replace("\\|", "").split("|")) == 10


def test_paired_compares_each_shifts_records_with_its_first_seed_by_seed(summary, tmp_path, capsys):
    """``--paired``: the candidate against the defaults on the seeds both hold; another shift pairs within itself."""
    defaults = record("default", [], [80.0, 82.0, 84.0], {}, seeds=(0, 1, 2))
    candidate = record("default", ["tra_lookahead=48"], [81.0, 81.5, 86.0, 90.0], {}, seeds=(1, 2, 0, 3))
    gamma = record("gamma", [], [70.0, 70.0], {}, seeds=(0, 1))
    gamma_candidate = record("gamma", ["tra_lookahead=48"], [69.0, 72.0], {}, seeds=(0, 1))
    paths = [write(tmp_path / name / "learning_quality_x.json", content) for name, content in
             [("a", defaults), ("b", candidate), ("c", gamma), ("d", gamma_candidate)]]  # fmt: skip

    summary.main([str(p) for p in paths] + ["--paired"])

    out = capsys.readouterr().out
    paired = out[out.index("| shift | settings | against |") :].splitlines()
    # seed order of the candidate's record: 1, 2, 0 shared (3 is not in the defaults); joint none = tta - 2 in both
    assert paired[2] == ("| default | tra_lookahead=48 | defaults | 1, 2, 0 | -1.0, -2.5, +6.0 | -1.0, -2.5, +6.0 | "
                         "+0.83 / +0.83 | 1 / 1 of 3 | level / level |")  # fmt: skip
    assert paired[3] == ("| gamma | tra_lookahead=48 | defaults | 0, 1 | -1.0, +2.0 | -1.0, +2.0 | +0.50 / +0.50 | "
                         "1 / 1 of 2 | level / level |")  # fmt: skip
    assert "Over 5 paired runs: mean Δ +0.70 with TTA, +0.70 without (2 / 2 gaining)." in out
    assert "`*`" not in out  # the same heuristic in every record


def test_paired_reading_follows_the_rule_written_before_the_runs(summary):
    """The rule: "costs" at a mean <= -0.5 with at most one seed gaining, "gains" at >= +0.5 with two or more."""
    assert summary.paired_reading([-1.6, -8.5, 0.9]) == "costs"  # the shrunk scene's seeds 0-2 with TTA
    assert summary.paired_reading([-0.5, -0.5]) == "costs"  # at the margin
    assert summary.paired_reading([-3.0, 0.5, 0.5]) == "level"  # -0.67, but two seeds gain
    assert summary.paired_reading([-0.4, -0.5, -0.5]) == "level"  # -0.47: inside the margin
    assert summary.paired_reading([1.0, 1.0, -0.1]) == "gains"
    assert summary.paired_reading([2.0, -0.5, -0.5]) == "level"  # +0.33
    assert summary.paired_reading([3.0, -0.5, -0.5]) == "level"  # +0.67, but one seed gains


def test_paired_flags_a_seed_whose_baseline_was_not_reproduced(summary, tmp_path, capsys):
    defaults = record("default", [], [80.0, 82.0], {}, seeds=(0, 1))
    other_machine = record("default", ["tra_lookahead=48"], [81.0, 83.0], {}, seeds=(0, 1))
    other_machine["dice"]["heuristic+mirror"]["tta"][1] = 64.5  # seed 1's heuristic differs by 0.5
    paths = [write(tmp_path / n / "learning_quality_x.json", c) for n, c in [("a", defaults), ("b", other_machine)]]

    summary.main([str(p) for p in paths] + ["--paired"])

    out = capsys.readouterr().out
    assert "| 0, 1 | +1.0, +1.0* |" in out
    assert "`*`: the seed's class-specific+joint pair compares runs whose baseline differs by more than 0.1." in out


def test_paired_without_a_pair_says_so(summary, tmp_path, capsys):
    no_joint = record("default", ["x=1"], [80.0], {}, seeds=(0,))
    del no_joint["dice"]["class-specific+joint"]
    contents = [record("default", [], [80.0], {}, seeds=(0,)), no_joint, record("gamma", [], [80.0], {}, seeds=(1,))]
    paths = [write(tmp_path / str(i) / "learning_quality_x.json", c) for i, c in enumerate(contents)]

    summary.main([str(p) for p in paths] + ["--paired"])

    assert "No paired runs: give two records of one shift with a joint run on a seed they share." in (
        capsys.readouterr().out
    )


def test_a_record_with_dice_not_one_per_seed_is_refused(summary, tmp_path, capsys):
    short = record("default", [], [80.0, 80.0], {}, seeds=(0, 1, 2))  # the joint's Dice for two seeds of three
    path = write(tmp_path / "learning_quality_default.json", short)
    with pytest.raises(SystemExit):
        summary.main([str(path)])
    err = capsys.readouterr().err
    assert f"{path}: class-specific+joint's Dice (none, tta) is not one per seed of [0, 1, 2]" in err
