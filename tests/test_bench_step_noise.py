"""The step-noise benchmark drives the library's own op effects and step rules (no timing here)."""

from __future__ import annotations

import pytest

from helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_step_noise")


def test_noise_alone_makes_rare_ops_likelier_unless_the_step_is_corrected(bench):
    """With effects of pure noise, ``natural-recent`` adds non-identity series to the preset's 3.15 per sample;
    ``natural-unbiased`` keeps about the preset's count (a short run of 120 updates, two seeds)."""
    ops = bench.find_op("split-signs", "rotate_frontal/rot90+"), bench.find_op("split-signs", "rotate_sagittal/rot90+")
    ends = {}
    for rule in ("natural-recent", "natural-unbiased"):
        runs = [bench.simulate(rule, seed, 0.0, *ops, updates=120) for seed in (0, 1)]
        assert all(abs(r["start"] - 3.15) < 0.01 for r in runs)
        ends[rule] = sum(r["end"] for r in runs) / len(runs)
    assert ends["natural-recent"] > 3.6
    assert abs(ends["natural-unbiased"] - 3.15) < ends["natural-recent"] - 3.15


def test_the_command_prints_a_row_per_rule_and_signal_and_names_a_bad_op(bench, capsys):
    rows = bench.main(["--rules", "natural", "--signals", "0", "0.5", "--seeds", "1", "--updates", "10"])
    assert [(r["rule"], r["signal"]) for r in rows] == [("natural", 0.0), ("natural", 0.5)]
    out = capsys.readouterr().out
    assert "| natural | 0 |" in out and "| natural | 0.5 |" in out
    with pytest.raises(SystemExit, match=r"--harmful: series .rotate_frontal. has no op .rot91\+.; ops: \[.identity."):
        bench.main(["--helpful", "rotate_frontal/rot91+"])
