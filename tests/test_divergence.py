"""Issue 12 item 2: a diverged run fails (non-zero exit) and never replaces a finite checkpoint by a NaN one."""

from __future__ import annotations

import logging

import pytest
import torch
from ignite.engine import Engine

from jcsaug.engine import (
    AtomicCheckpointSaver,
    ResumeCheckpoint,
    StopOnNonFiniteLoss,
    TrainingDiverged,
    latest_checkpoint,
    nonfinite_entries,
    read_checkpoint,
    save_checkpoint_atomic,
)


def _diverging_run(tmp_path, blow_up_at: int, loss_check: bool = True, epochs: int = 3):
    """Two iterations per epoch; from iteration ``blow_up_at`` on the weights (and the loss) are NaN."""
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)

    def step(engine, batch):
        opt.zero_grad()
        loss = net(torch.ones(4, 3)).pow(2).mean()
        loss.backward()
        opt.step()
        if engine.state.iteration >= blow_up_at:
            with torch.no_grad():
                net.weight.fill_(float("nan"))
            loss = loss * float("nan")
        return [{"loss": loss.detach()}]  # a decollated SupervisedTrainer output

    trainer = Engine(step)
    if loss_check:
        StopOnNonFiniteLoss().attach(trainer)
    objects = {"network": net, "optimizer": opt}
    ResumeCheckpoint(tmp_path, objects).attach(trainer)
    AtomicCheckpointSaver(save_dir=str(tmp_path), save_dict=objects, save_final=True, epoch_level=True,
                          save_interval=1, n_saved=1).attach(trainer)  # fmt: skip
    trainer.run(range(2), max_epochs=epochs)


def _finite_files(tmp_path) -> dict:
    files = {p.name: read_checkpoint(p) for p in tmp_path.glob("*.pt")}
    assert files and all(not nonfinite_entries(state) for state in files.values()), files
    return files


def test_nonfinite_loss_fails_the_run_and_keeps_the_last_finite_epoch(tmp_path):
    with pytest.raises(TrainingDiverged, match=r"training diverged: the loss is nan at epoch 2, iteration 4"):
        _diverging_run(tmp_path, blow_up_at=4)
    files = _finite_files(tmp_path)
    assert set(files) == {"resume.pt", "checkpoint_epoch=1.pt"}  # no final checkpoint of the NaN state
    assert files["resume.pt"]["trainer"]["iteration"] == 2
    assert latest_checkpoint(tmp_path).name == "checkpoint_epoch=1.pt"


def test_nonfinite_weights_at_an_epoch_end_are_never_saved(tmp_path, caplog):
    """The weights turn NaN on the last iteration of epoch 2 while the checks see no loss: the savers refuse."""
    with caplog.at_level(logging.ERROR), pytest.raises(TrainingDiverged, match=r"not saving .*resume\.pt: .*network"):
        _diverging_run(tmp_path, blow_up_at=4, loss_check=False)
    files = _finite_files(tmp_path)
    assert set(files) == {"resume.pt", "checkpoint_epoch=1.pt"}
    assert "not saving a final checkpoint" in caplog.text


def test_a_finite_run_ends_with_its_final_checkpoint(tmp_path):
    _diverging_run(tmp_path, blow_up_at=10**6, epochs=2)
    assert set(_finite_files(tmp_path)) == {"resume.pt", "checkpoint_epoch=2.pt", "checkpoint_final_iteration=4.pt"}


def test_save_checkpoint_atomic_refuses_a_nonfinite_state(tmp_path):
    net = torch.nn.Linear(2, 2)
    path = save_checkpoint_atomic(tmp_path / "state.pt", {"network": net})
    before = path.read_bytes()
    with torch.no_grad():
        net.bias[1] = float("inf")
    assert nonfinite_entries({"network": net, "nested": {"x": [torch.tensor([float("nan")])]}}) == [
        "network.bias",
        "nested.x.0",
    ]
    with pytest.raises(TrainingDiverged, match=r"not saving .*state\.pt: the state holds NaN/Inf values \(network\.b"):
        save_checkpoint_atomic(path, {"network": net})
    assert path.read_bytes() == before
    save_checkpoint_atomic(path, {"network": net}, check_finite=False)  # explicitly allowed
    assert path.read_bytes() != before
