"""The TRA context benchmark runs and prints the cost and the padding in view (its timings are not checked)."""

from __future__ import annotations

import re

import pytest

from helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_tra_context")


def test_the_context_removes_padding_from_view_and_its_cost_is_printed(bench, capsys):
    row = bench.bench_size(16, factor=3.0, samples=12, repeats=1, seed=0)
    assert row["context"] == 9 and row["ratio"] > 0  # tra_context((16, 16, 16))
    assert row["plain_padding"] > 1.0 and row["context_padding"] < row["plain_padding"] / 2
    bench.main(["--sizes", "12", "--samples", "2", "--repeats", "1"])
    out = capsys.readouterr().out
    assert re.search(r" 12³ +\d+ +\d+\.\d+ +\d+\.\d+ +\d+\.\d+x", out)
    with pytest.raises(SystemExit):
        bench.main(["--samples", "0"])
