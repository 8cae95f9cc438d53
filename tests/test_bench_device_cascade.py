"""The device cascade benchmark runs and prints what the copies' schedule saves (its timings are not checked)."""

from __future__ import annotations

import re

import pytest

from helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_device_cascade")


def test_the_copies_rows_default_to_the_synthetic_bundle_and_print_the_saving(bench, capsys):
    assert (bench.SYNTHETIC_COPIES, bench.SYNTHETIC_UPDATE_EVERY) == (2, 2)  # the bundle's train.yaml
    bench.main(["--device", "cpu", "--size", "8", "--batch", "2", "--repeats", "1", "--warmup", "0", "--threads", "1"])
    out = capsys.readouterr().out
    assert "batched + 2 copies" in out and "batched, copies drawn only" in out
    assert re.search(r"2 counterfactual copies, a TRA update every 2 iterations: .*\(\d+\.\d+x faster", out)


def test_no_copies_rows_with_zero_copies_and_bad_values_refused(bench, capsys):
    bench.main(["--device", "cpu", "--size", "8", "--batch", "2", "--repeats", "1", "--warmup", "0",
                "--counterfactuals", "0"])  # fmt: skip
    assert "copies" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main(["--update-every", "0"])
    assert "--update-every >= 1" in capsys.readouterr().err
