"""The worker counterfactuals benchmark runs, checks that both arms draw the same ops, and prints what the sampler
saves (its timings are not checked)."""

from __future__ import annotations

import re

import pytest

from helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_worker_counterfactuals")


def test_copies_on_update_batches_only_carry_fewer_bytes_and_the_saving_is_printed(bench, capsys):
    bench.main(["--counterfactuals", "2", "--update-every", "2", "--patch", "16", "--volume", "24", "--batches", "4",
                "--repeats", "1"])  # fmt: skip
    out = capsys.readouterr().out
    row = re.search(r"^2 +2 +(\d+\.\d) +(\d+\.\d) +(\d+\.\d\d)x +(\d+\.\d\d) +(\d+\.\d\d)$", out, re.M)
    assert row, out
    every_mb, update_mb = float(row.group(4)), float(row.group(5))
    # half the batches without their 2 copies: (1 + 2 + 1 + 0) / (2 * 3) of the bytes, 2/3
    assert update_mb == pytest.approx(every_mb * 2 / 3, abs=0.01) and update_mb < every_mb
    with pytest.raises(SystemExit):
        bench.main(["--update-every", "0"])
