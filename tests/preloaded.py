"""``python -m MODULE ARGS`` for the tests, without paying MONAI's import each time.

A fresh ``python -m monai.bundle run`` spends about 5 s of a CPU core importing torch and MONAI (MONAI imports all
its submodules) before it reads a config; the suite starts about 30 of them. Here one server process imports
them once and *forks* a child per command. The child is a whole process of its own, as a fresh one would be: it
changes to the command's folder, writes its stdout and stderr to files, sets ``sys.argv``, runs the module as
``python -m`` does and leaves through the interpreter's normal shutdown (atexit handlers, flushes, exit code; a
traceback and exit code 1 on an uncaught error). The standard library's ``forkserver`` is not used because its
children leave with ``os._exit`` (no atexit handlers, no interpreter shutdown: not how a user's command ends).

The child gets this process's environment at the time of the command. What it does not get afresh: modules already
imported (a command whose environment changes a variable read at import, :data:`READ_AT_IMPORT`, or that is given
``env``, runs in a fresh interpreter), and the server's random states and hash seed (the bundles seed what they
draw). The server is single-threaded and runs no torch operation, so no OpenMP thread pool is lost across the fork.
``JCSAUG_TEST_FRESH_PROCESSES=1`` runs every command in a fresh interpreter.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

#: what the server imports before it forks (what every bundle run and the CLI import first)
PRELOAD = ("torch", "numpy", "scipy.ndimage", "nibabel", "yaml", "fire", "monai", "monai.bundle", "ignite.engine",
           "ignite.handlers", "jcsaug")  # fmt: skip
FRESH_ENV = "JCSAUG_TEST_FRESH_PROCESSES"
#: forking after these imports is safe on Linux; macOS's system libraries are not fork-safe once loaded (the reason
#: Python's multiprocessing spawns there) and Windows has no fork: fresh interpreters elsewhere
FORK_SAFE = sys.platform.startswith("linux")


def run_module(
    module: str, args: list[str], *, cwd: Path | str | None = None, timeout: float | None = None, env=None
) -> subprocess.CompletedProcess:
    """``python -m module *args`` with its output captured as text, like ``subprocess.run(..., capture_output=True,
    text=True)``, in this process's environment: forked from the preloaded server, or run in a fresh interpreter
    when ``env`` is given, when a variable read at import (:data:`READ_AT_IMPORT`) is no longer what the server
    started with (a test's ``monkeypatch.setenv``), off Linux, or with ``JCSAUG_TEST_FRESH_PROCESSES=1``. A command past
    ``timeout`` is killed with its process group and raises :class:`subprocess.TimeoutExpired`."""
    argv = [sys.executable, "-m", module, *map(str, args)]
    fresh = env is not None or os.environ.get(FRESH_ENV) == "1" or not FORK_SAFE
    now = _read_at_import(os.environ)
    if not fresh and now != _START:  # said, so that a suite that stopped forking does not go unnoticed
        changed = sorted(k for k in {*now, *_START} if now.get(k) != _START.get(k))
        warnings.warn(f"{', '.join(changed)} changed since the tests started: {module} runs in a fresh interpreter",
                      stacklevel=2)  # fmt: skip
        fresh = True
    if fresh:
        return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=timeout, env=env)
    return _server().run(argv, module, argv[3:], Path(cwd or os.getcwd()), timeout)


#: environment variables that Python, torch's threading libraries or CUDA read at start-up or when imported, and that
#: a test may set for a child: a command whose environment changes one of them runs in a fresh interpreter. Any
#: other variable reaches the forked child as it is now (libraries set some while the tests run, e.g.
#: ``CUBLAS_WORKSPACE_CONFIG``, ``TORCHINDUCTOR_CACHE_DIR``: a fresh child would inherit them too).
READ_AT_IMPORT = ("PYTHONPATH", "PYTHONHASHSEED", "PYTHONWARNINGS", "PYTHONOPTIMIZE", "CUDA_VISIBLE_DEVICES",
                  "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "LD_PRELOAD")  # fmt: skip


def _read_at_import(environment) -> dict[str, str]:
    return {k: environment[k] for k in READ_AT_IMPORT if k in environment}


#: those variables as the server starts with them: this process's when the tests are collected
_START_ENV = dict(os.environ)
_START = _read_at_import(_START_ENV)


class _Server:
    """The client's end: one server per test process, started at the first command, stopped at exit."""

    def __init__(self):
        self.folder = Path(tempfile.mkdtemp(prefix="jcsaug-preloaded-"))
        self.log = self.folder / "server.log"
        with open(self.log, "w") as log:
            self.process = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=log, env=_START_ENV)  # fmt: skip
        self.pending = b""  # read from the server, not yet a whole line
        self.lock = threading.Lock()
        self.count = 0
        atexit.register(self.close)

    def run(self, argv, module, args, cwd: Path, timeout) -> subprocess.CompletedProcess:
        with self.lock:
            self.count += 1
            out, err = self.folder / f"{self.count}.out", self.folder / f"{self.count}.err"
            request = {"module": module, "args": args, "cwd": str(cwd), "stdout": str(out), "stderr": str(err),
                       "env": dict(os.environ)}  # fmt: skip
            try:
                self.process.stdin.write(json.dumps(request).encode() + b"\n")
                self.process.stdin.flush()
                pid = int(self._reply(None)["pid"])
                try:
                    returncode = int(self._reply(timeout)["returncode"])
                except subprocess.TimeoutExpired:
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except ProcessLookupError:  # it ended meanwhile
                        pass
                    self._reply(None)
                    raise subprocess.TimeoutExpired(argv, timeout, out.read_text(), err.read_text()) from None
            except subprocess.TimeoutExpired:
                raise
            except BaseException:  # cut off mid-request (an interrupt, a dead server): the next command starts anew
                self.close(kill=True)
                raise
            result = subprocess.CompletedProcess(argv, returncode, out.read_text(), err.read_text())
            out.unlink()
            err.unlink()
            return result

    def _reply(self, timeout: float | None) -> dict:
        """The server's next line, within ``timeout`` seconds (None: however long it takes)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        fd = self.process.stdout.fileno()
        while b"\n" not in self.pending:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], wait)[0]:
                raise subprocess.TimeoutExpired("", timeout)
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"the preloaded test server stopped; its log: {self.log.read_text()[-3000:]}")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def close(self, kill: bool = False):
        """Stop the server (at once with ``kill``: it may be waiting for a child) and remove its folder."""
        if self.process.poll() is None:
            if kill:
                self.process.kill()
            else:
                self.process.stdin.close()
            self.process.wait(timeout=30)
        shutil.rmtree(self.folder, ignore_errors=True)


_SERVER: _Server | None = None


def _server() -> _Server:
    global _SERVER
    if _SERVER is None or _SERVER.process.poll() is not None:
        _SERVER = _Server()
    return _SERVER


# ------------------------------------------------------------------------------------------------ the server's end
def _serve() -> dict | None:
    """Read requests; fork a child per request and wait for it. Returns the request in the child, None at EOF."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    if threading.active_count() != 1:  # a thread would not survive the fork: say so rather than hang a child
        raise RuntimeError(f"the preloaded imports started threads: {threading.enumerate()}")
    requests, replies = sys.stdin, sys.stdout
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            return request
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()
    return None


def _become(request: dict) -> None:
    """In the child: the command's own process group, folder, environment, input, output and argv, as a fresh
    ``python -m`` in that folder would have them."""
    os.setpgid(0, 0)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path in ((0, os.devnull), (1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    # sys.stdout and sys.stderr already write to descriptors 1 and 2, buffered as a fresh process's would be (stdout
    # by blocks, stderr by lines: the server's are a pipe and a file); stdin may hold the server's read-ahead
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's own input, open until it exits)
    sys.path[0] = os.getcwd()  # `python -m` puts the current folder first, where a script puts its own folder
    sys.argv = ["-m", *request["args"]]


if __name__ == "__main__":
    _request = _serve()
    if _request is not None:
        import runpy

        _become(_request)
        runpy.run_module(_request["module"], run_name="__main__", alter_sys=True)
