"""tests/tools/skip_passed: a suite a time limit cut, rerun without the tests an earlier log shows PASSED."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PLUGIN = Path(__file__).parent / "tools" / "skip_passed"


def _pytest(cwd: Path, *args: str, log: Path | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "JCSAUG_SKIP_PASSED"}
    env["PYTHONPATH"] = str(PLUGIN)
    if log is not None:
        env["JCSAUG_SKIP_PASSED"] = str(log)
    command = [sys.executable, "-m", "pytest", "-p", "skip_passed", "-p", "no:cacheprovider", "-v", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)


def test_only_the_tests_an_earlier_log_shows_passed_are_deselected(tmp_path):
    (tmp_path / "test_suite.py").write_text(
        "import pytest\n"
        "def test_passed(): pass\n"
        "def test_passed_on_a_worker(): pass\n"
        "def test_failed(): pass\n"
        "def test_not_reached(): pass\n"
        "@pytest.mark.parametrize('x', [1, 2])\n"
        "def test_param(x): pass\n"
    )  # fmt: skip
    log = tmp_path / "earlier.log"
    log.write_text(
        "test_suite.py::test_passed PASSED                                  [ 20%]\n"
        "[gw3] [ 40%] PASSED test_suite.py::test_passed_on_a_worker \n"
        "[gw1] [ 60%] FAILED test_suite.py::test_failed \n"
        "[gw0] [ 80%] PASSED test_suite.py::test_param[2] \n"
    )  # fmt: skip
    rerun = _pytest(tmp_path, log=log)
    assert rerun.returncode == 0, rerun.stdout
    ran = sorted(line.split(" PASSED")[0] for line in rerun.stdout.splitlines() if " PASSED" in line)
    assert ran == ["test_suite.py::test_failed", "test_suite.py::test_not_reached", "test_suite.py::test_param[1]"]
    assert "3 deselected" in rerun.stdout
    assert "6 passed" in _pytest(tmp_path, log=None).stdout  # not asked: nothing deselected
    missing = _pytest(tmp_path, log=tmp_path / "nowhere.log")
    assert missing.returncode != 0 and "JCSAUG_SKIP_PASSED=" in missing.stderr and "no such log" in missing.stderr
