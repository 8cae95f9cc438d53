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
