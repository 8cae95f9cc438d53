"""Exact resume: stop after epoch 1 of 2 and resume == 2 epochs straight (CPU, seeded, DataLoader workers)."""

from __future__ import annotations

import pytest
import torch

from helpers import run_bundle, small_dataset
from jcsaug.engine import ResumeCheckpoint
from jcsaug.policy import make_tea_policy, make_tra_policy


def _state(run_dir):
    return torch.load(run_dir / "resume.pt", map_location="cpu", weights_only=True)


def test_stop_and_resume_equals_straight_run(tmp_path):
    small_dataset(tmp_path)
    # exact resume is promised on the CPU (CUDA kernels such as index_put/scatter-add backward are not deterministic)
    common = dict(max_epochs=2, epoch_length=3, num_workers=2, tra_update_every=1, tea_update_every=1, device="cpu")
    straight = tmp_path / "straight"
    run_bundle(tmp_path, "train.yaml", output_dir=straight, **common)
    resumed = tmp_path / "resumed"
    run_bundle(tmp_path, "train.yaml", output_dir=resumed, stop_after_epochs=1, **common)
    assert _state(resumed)["trainer"]["iteration"] == 3  # stopped after epoch 1 (3 iterations)
    run_bundle(tmp_path, "train.yaml", output_dir=resumed, resume=True, **common)

    a, b = _state(straight), _state(resumed)
    initial = {"tra_updater": make_tra_policy("nnunet", 2).logits, "tea_updater": make_tea_policy("nnunet").logits}
    assert a["trainer"]["iteration"] == b["trainer"]["iteration"] == 6
    for key, tensor in a["network"].items():
        assert torch.equal(tensor, b["network"][key]), key
    for updater in ("tra_updater", "tea_updater"):
        assert torch.equal(a[updater]["policy"]["logits"], b[updater]["policy"]["logits"]), updater
        assert a[updater]["updates"] == b[updater]["updates"] > 0
        assert a[updater]["skipped"] == b[updater]["skipped"]
        assert torch.equal(a[updater]["generator"], b[updater]["generator"])
        assert not torch.allclose(a[updater]["policy"]["logits"], initial[updater])
    assert (resumed / "policies.json").read_text() == (straight / "policies.json").read_text()


def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
    handler = ResumeCheckpoint(tmp_path, {}, resume=True)
    with pytest.raises(FileNotFoundError, match="resume.pt does not exist"):
        handler.load()
    (tmp_path / "resume.pt").write_bytes(b"\x00truncated")
    with pytest.raises(ValueError, match="cannot read checkpoint .*resume.pt"):
        handler.load()
