"""tests/preloaded.py: a command forked from the preloaded server behaves as the same command in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import preloaded

pytestmark = pytest.mark.skipif(
    not preloaded.FORK_SAFE or os.environ.get(preloaded.FRESH_ENV) == "1",
    reason="every command runs in a fresh interpreter (off Linux, or asked to)",
)

#: a module run with ``python -m probe ARGS`` from the folder it lies in: it prints what a process can see of itself
#: and leaves as its first argument says
PROBE = """
import atexit, os, sys
atexit.register(lambda: print("atexit ran", flush=True))
print("argv", sys.argv[1:], "cwd", os.getcwd(), "path0", sys.path[0], "main", __name__)
print("stdin", repr(sys.stdin.read()), "env", os.environ.get("PROBE_VALUE"), "PYTEST_CURRENT_TEST" in os.environ)
print("pgid", os.getpgid(0) == os.getpid())
print("to stderr", file=sys.stderr)
how = sys.argv[1]
if how == "raise":
    raise ValueError("bad probe")
if how == "exit":
    sys.exit(3)
if how == "sleep":  # with a child of its own, as a bundle run has its DataLoader workers
    import subprocess, time
    worker = subprocess.Popen(["sleep", "300"])
    open("worker.pid", "w").write(str(worker.pid))
    time.sleep(120)
"""


def _both(tmp_path, *args):
    (tmp_path / "probe.py").write_text(PROBE)
    fresh = subprocess.run([sys.executable, "-m", "probe", *args], capture_output=True, text=True, cwd=tmp_path)
    forked = preloaded.run_module("probe", list(args), cwd=tmp_path)
    return fresh, forked


@pytest.mark.parametrize("how", ["return", "raise", "exit"])
def test_a_forked_command_ends_as_a_fresh_one(tmp_path, how):
    fresh, forked = _both(tmp_path, how, "second")
    assert forked.args == fresh.args
    assert forked.returncode == fresh.returncode == {"return": 0, "raise": 1, "exit": 3}[how]
    assert "main __main__" in forked.stdout and "atexit ran" in forked.stdout and "env None True" in forked.stdout
    assert f"cwd {tmp_path} path0 {tmp_path}" in forked.stdout and "stdin ''" in forked.stdout
    assert forked.stdout.replace("pgid True", "pgid False") == fresh.stdout  # the forked child leads its own group
    assert forked.stderr.startswith("to stderr\n") and fresh.stderr.startswith("to stderr\n")
    assert ("ValueError: bad probe" in forked.stderr) == (how == "raise")


def test_the_environment_reaches_the_command(tmp_path, monkeypatch):
    """A new variable reaches the forked child; one that torch or Python may read at import (a thread count) runs
    the command in a fresh interpreter instead."""
    monkeypatch.setenv("PROBE_VALUE", "seen")
    _, forked = _both(tmp_path, "return")
    assert "env seen" in forked.stdout and "pgid True" in forked.stdout
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with pytest.warns(UserWarning, match="OMP_NUM_THREADS changed since the tests started: probe runs in a fresh"):
        _, fresh = _both(tmp_path, "return")
    assert "env seen" in fresh.stdout and "pgid False" in fresh.stdout


def test_a_command_past_its_timeout_is_killed_with_its_children(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    with pytest.raises(subprocess.TimeoutExpired):
        preloaded.run_module("probe", ["sleep"], cwd=tmp_path, timeout=3)
    worker = int((tmp_path / "worker.pid").read_text())
    for _ in range(100):  # the orphaned worker, killed with the command's process group, is reaped by init
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the command's child {worker} outlived the timeout")
    assert preloaded.run_module("probe", ["return"], cwd=tmp_path).returncode == 0  # the server serves on
