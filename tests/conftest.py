"""Shared pytest fixtures."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def single_thread():
    """Tiny 3D convolutions run faster on one intra-op thread (and are immune to CPU contention);
    the thread count is restored afterwards. Use with ``pytestmark = pytest.mark.usefixtures("single_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def hide_gpus(monkeypatch):
    """Child processes started by the test (spawned gloo ranks) see no GPU, whatever the machine
    (:data:`helpers.NO_GPUS`, which says why)."""
    from helpers import NO_GPUS

    for key, value in NO_GPUS.items():
        monkeypatch.setenv(key, value)


@pytest.fixture(scope="session")
def prepared(tmp_path_factory):
    """task -> (raw_dir, prepared dataset dir): every task's fake raw data through `jcsaug prepare`, once."""
    from fake_raw import TASK_NAMES, make_fake_raw
    from jcsaug.tasks import prepare_task

    root = tmp_path_factory.mktemp("prepared")
    out = {}
    for task in TASK_NAMES:
        raw = make_fake_raw(task, root / task / "raw")
        prepare_task(task, raw, root / task / "data", progress=False)
        out[task] = (raw, root / task / "data")
    return out
