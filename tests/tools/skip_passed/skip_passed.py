"""A pytest plugin that deselects the tests an earlier ``pytest -v`` log shows PASSED: the rest of a suite a time
limit cut (a GPU machine's lease), rerun without what already passed. Failed, errored and unfinished tests run again.

    JCSAUG_SKIP_PASSED=earlier.log PYTHONPATH=tests/tools/skip_passed python -m pytest -p skip_passed -v ...

Ids are matched as the log prints them (one line each; xdist's ``[gwN] [ NN%] PASSED id`` or ``id PASSED``), so a
test whose id holds a line break runs again.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

#: a result line of ``pytest -v``, with or without xdist's worker and progress prefix
_PASSED = re.compile(r"^(?:\[gw\d+\] \[\s*\d+%\] PASSED (?P<xdist>.+?)|(?P<plain>\S.*?) PASSED(?: +\[\s*\d+%\])?)\s*$")


def passed_ids(log: Path) -> set[str]:
    """The ids of the tests ``log`` (a ``pytest -v`` log) shows PASSED."""
    found = set()
    for line in log.read_text(errors="replace").splitlines():
        match = _PASSED.match(line)
        if match:
            found.add((match["xdist"] or match["plain"]).strip())
    return found


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    log = os.environ.get("JCSAUG_SKIP_PASSED")
    if not log:
        return
    if not Path(log).is_file():
        raise pytest.UsageError(f"JCSAUG_SKIP_PASSED={log}: no such log")
    done = passed_ids(Path(log))
    skipped = [item for item in items if item.nodeid in done]
    if skipped:
        config.hook.pytest_deselected(items=skipped)
        items[:] = [item for item in items if item.nodeid not in done]
