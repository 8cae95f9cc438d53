"""The thread loader benchmark runs every loader, checks that the lockstep ones repeat their draws, and prints each
loader's time per iteration against MONAI's ``ThreadDataLoader`` (its timings are not checked)."""

from __future__ import annotations

import re

import pytest

from helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_thread_loader")


def test_each_loader_gets_a_row_and_the_lockstep_ones_repeat_their_draws(bench, capsys):
    bench.main(["--lags", "2", "--iterations", "2", "--repeats", "2", "--patch", "16", "--volume", "24"])
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^(\S.*?) +\d+\.\d{3} +(\d+\.\d\dx +(?:yes|no))$", out, re.M))
    assert list(rows) == ["DataLoader", "ThreadDataLoader", "lockstep, lag 2"], out
    assert rows["ThreadDataLoader"].startswith("1.00x")
    assert rows["lockstep, lag 2"].endswith("yes") and rows["DataLoader"].endswith("yes")
    with pytest.raises(SystemExit):
        bench.main(["--lags", "0"])
