"""The examples a user copies from still run (tiny settings)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from jcsaug.policy.io import load_policies

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compose_learnable(tmp_path):
    policy = _load("compose_learnable").main(iterations=3, data_dir=str(tmp_path / "data"))
    assert not torch.allclose(policy.logits, torch.zeros_like(policy.logits))


def test_custom_ignite_loop(tmp_path):
    path = _load("custom_ignite_loop").main(
        iterations=4, output_dir=str(tmp_path / "run"), data_dir=str(tmp_path / "d")
    )
    tra, tea = load_policies(path)
    assert tra.num_groups == 2 and tea is not None
