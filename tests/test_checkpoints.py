"""Safe checkpoints: atomic saving, weights-only all-or-nothing loading, clear errors naming the file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from ignite.engine import Engine, Events
from monai.handlers import CheckpointSaver

from jcsaug.engine import (
    AtomicCheckpointSaver,
    SafeCheckpointLoader,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint_atomic,
)
from jcsaug.policy import make_tra_policy


def _objects(seed: int = 0, width: int = 4) -> dict:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.ReLU(), torch.nn.Linear(width, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    return {"network": net, "optimizer": opt, "tra_policy": make_tra_policy("uniform", num_groups=2)}


def _train(objects: dict, out: Path, epochs: int, saver_cls=CheckpointSaver) -> Engine:
    net, opt = objects["network"], objects["optimizer"]

    def step(engine, batch):
        opt.zero_grad()
        loss = net(torch.randn(5, 3)).pow(2).mean()
        loss.backward()
        opt.step()
        with torch.no_grad():
            objects["tra_policy"].logits.add_(0.1)
        return loss.item()

    trainer = Engine(step)
    saver_cls(
        save_dir=str(out), save_dict=objects, save_final=False, epoch_level=True, save_interval=1, n_saved=1
    ).attach(trainer)
    trainer.run(range(2), max_epochs=epochs)
    return trainer


def _snapshot(objects: dict) -> dict:
    return {
        "network": {k: v.clone() for k, v in objects["network"].state_dict().items()},
        "momentum": len(objects["optimizer"].state),
        "tra_policy": objects["tra_policy"].logits.detach().clone(),
    }


def _assert_same(objects: dict, snap: dict) -> None:
    for k, v in objects["network"].state_dict().items():
        assert torch.equal(v, snap["network"][k]), k
    assert len(objects["optimizer"].state) == snap["momentum"]
    assert torch.equal(objects["tra_policy"].logits.detach(), snap["tra_policy"])


def test_monai_checkpoint_round_trip(tmp_path):
    trained = _objects(0)
    _train(trained, tmp_path, epochs=2)
    path = latest_checkpoint(tmp_path)
    fresh = _objects(1)
    load_checkpoint(path, fresh)
    for k, v in trained["network"].state_dict().items():
        assert torch.equal(fresh["network"].state_dict()[k], v)
    assert torch.equal(fresh["tra_policy"].logits, trained["tra_policy"].logits)
    assert len(fresh["optimizer"].state) == len(trained["optimizer"].state) > 0


def test_truncated_checkpoint_is_refused_and_previous_one_survives(tmp_path):
    trained = _objects(0)
    _train(trained, tmp_path, epochs=1)
    good = latest_checkpoint(tmp_path)
    # a crash while MONAI's (non-atomic) saver writes epoch 2 in place: a half-written newest file
    data = good.read_bytes()
    bad = tmp_path / good.name.replace("=1.pt", "=2.pt")
    bad.write_bytes(data[: len(data) // 2])
    assert latest_checkpoint(tmp_path) == bad

    fresh = _objects(1)
    snap = _snapshot(fresh)
    with pytest.raises(ValueError, match=rf"cannot read checkpoint .*{bad.name}.*truncated, corrupted"):
        load_checkpoint(bad, fresh)
    _assert_same(fresh, snap)

    # the previous good checkpoint is still there, found and loadable
    assert good.exists()
    with pytest.warns(UserWarning, match=rf"skipping unreadable .*{bad.name}"):
        assert latest_checkpoint(tmp_path, skip_unreadable=True) == good
    load_checkpoint(good, fresh)
    assert torch.equal(fresh["tra_policy"].logits, trained["tra_policy"].logits)


@pytest.mark.parametrize("cut", [0, 10, 100, -10])
def test_any_cut_or_garbage_is_a_clear_error(tmp_path, cut):
    path = save_checkpoint_atomic(tmp_path / "c.pt", _objects(0))
    data = path.read_bytes()
    path.write_bytes(data[:cut] if cut else b"not a checkpoint at all")
    fresh = _objects(1)
    snap = _snapshot(fresh)
    with pytest.raises(ValueError, match=r"cannot read checkpoint .*c\.pt"):
        load_checkpoint(path, fresh)
    _assert_same(fresh, snap)


def test_foreign_checkpoint_names_missing_entries(tmp_path):
    path = tmp_path / "foreign.pt"
    torch.save({"model": torch.nn.Linear(2, 2).state_dict(), "epoch": 3}, path)
    with pytest.raises(
        ValueError,
        match=r"foreign\.pt is not a checkpoint of this run: missing entries "
        r"\['network', 'optimizer', 'tra_policy'\] \(entries present: \['epoch', 'model'\]\)",
    ):
        load_checkpoint(path, _objects(0))


def test_pickled_objects_are_refused_weights_only(tmp_path):
    path = tmp_path / "pickled.pt"
    torch.save({"network": torch.nn.Linear(2, 2)}, path)  # a whole module: not weights-only
    with pytest.raises(ValueError, match=r"cannot read checkpoint .*pickled\.pt"):
        load_checkpoint(path, {"network": torch.nn.Linear(2, 2)})


def test_shape_mismatch_names_the_key_and_loads_nothing(tmp_path):
    path = save_checkpoint_atomic(tmp_path / "wide.pt", _objects(0, width=8))
    fresh = _objects(1, width=4)
    snap = _snapshot(fresh)
    with pytest.raises(ValueError, match=r"wide\.pt: shape mismatch for network\.0\.weight: checkpoint \(8, 3\)"):
        load_checkpoint(path, fresh)
    _assert_same(fresh, snap)


def test_late_refusal_rolls_back_earlier_objects(tmp_path):
    """The network fits but the optimizer (2 parameter groups here, 1 in the file) does not: the network,
    loaded first, is restored."""
    trained = _objects(0)
    _train(trained, tmp_path, epochs=1)
    fresh = _objects(1)
    net = fresh["network"]
    fresh["optimizer"] = torch.optim.SGD([{"params": net[0].parameters()}, {"params": net[2].parameters()}], lr=0.1)
    snap = _snapshot(fresh)
    with pytest.raises(ValueError, match=r"epoch=1\.pt: state 'optimizer' does not fit the SGD .*nothing was loaded"):
        load_checkpoint(latest_checkpoint(tmp_path), fresh)
    _assert_same(fresh, snap)


def test_safe_checkpoint_loader_handler(tmp_path):
    trained = _objects(0)
    _train(trained, tmp_path, epochs=1)
    fresh = _objects(1)
    engine = Engine(lambda e, b: None)
    SafeCheckpointLoader(load_path=latest_checkpoint(tmp_path), load_dict=fresh).attach(engine)
    engine.run(range(1), max_epochs=1)
    assert torch.equal(fresh["tra_policy"].logits, trained["tra_policy"].logits)

    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"\x00" * 64)
    engine = Engine(lambda e, b: None)
    SafeCheckpointLoader(bad, _objects(2)).attach(engine)
    with pytest.raises(ValueError, match=r"cannot read checkpoint .*bad\.pt"):
        engine.run(range(1), max_epochs=1)


def test_atomic_save_leaves_no_temp_file(tmp_path):
    path = save_checkpoint_atomic(tmp_path / "c.pt", _objects(0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    load_checkpoint(path, _objects(1))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_interrupted_atomic_save_keeps_the_old_file(tmp_path, monkeypatch):
    old = _objects(0)
    path = save_checkpoint_atomic(tmp_path / "c.pt", old)
    before = path.read_bytes()
    real_save = torch.save

    def dying_save(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        f.seek(f.tell() // 2)
        f.truncate()
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint_atomic(path, _objects(5))
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]
    load_checkpoint(path, _objects(1))


def test_atomic_checkpoint_saver_is_a_drop_in(tmp_path, monkeypatch):
    import jcsaug.engine.checkpoints as ck

    calls = []
    real = ck.save_state_atomic
    monkeypatch.setattr(ck, "save_state_atomic", lambda p, s: calls.append(Path(p).name) or real(p, s))
    trained = _objects(0)
    _train(trained, tmp_path, epochs=2, saver_cls=AtomicCheckpointSaver)
    assert calls == ["checkpoint_epoch=1.pt", "checkpoint_epoch=2.pt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_epoch=2.pt"]
    fresh = _objects(1)
    load_checkpoint(latest_checkpoint(tmp_path), fresh)
    assert torch.equal(fresh["tra_policy"].logits, trained["tra_policy"].logits)


def test_failed_save_keeps_the_last_good_checkpoint_until_a_new_one_is_written(tmp_path, monkeypatch):
    """``n_saved=1``: ignite retires the epoch-1 file *before* writing epoch 2's; the epoch-2 write fails (disk
    full), and the epoch-1 file must still be there, complete and loadable. Epoch 3's write succeeds: only then
    do the retired files go (n_saved honoured); the final checkpoint is written beside it."""
    objects = _objects(0)
    net, opt = objects["network"], objects["optimizer"]

    def step(engine, batch):
        opt.zero_grad()
        net(torch.randn(5, 3)).pow(2).mean().backward()
        opt.step()
        with torch.no_grad():
            objects["tra_policy"].logits.add_(0.1)

    trainer = Engine(step)
    saver = AtomicCheckpointSaver(save_dir=str(tmp_path), save_dict=objects, save_final=True, epoch_level=True,
                                  save_interval=1, n_saved=1)  # fmt: skip
    real_save, failures, files = torch.save, [], {}
    logits = {}

    def save(obj, f, *args, **kwargs):
        if trainer.state.epoch == 2:
            raise OSError(28, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)

    @trainer.on(Events.EPOCH_COMPLETED)
    def save_and_check(engine):  # the saver's own epoch handler, its failure caught so that training goes on
        logits[engine.state.epoch] = objects["tra_policy"].logits.detach().clone()
        try:
            saver.interval_completed(engine)
        except OSError:
            failures.append(engine.state.epoch)
        files[engine.state.epoch] = sorted(p.name for p in tmp_path.iterdir())
        if engine.state.epoch == 2:  # the last good checkpoint survived the failed write, complete
            fresh = _objects(1)
            load_checkpoint(tmp_path / "checkpoint_epoch=1.pt", fresh)
            assert torch.equal(fresh["tra_policy"].logits, logits[1])

    trainer.add_event_handler(Events.COMPLETED, saver.completed)
    trainer.run(range(2), max_epochs=3)
    assert failures == [2]
    assert files == {1: ["checkpoint_epoch=1.pt"], 2: ["checkpoint_epoch=1.pt"], 3: ["checkpoint_epoch=3.pt"]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_epoch=3.pt", "checkpoint_final_iteration=6.pt"]
    fresh = _objects(1)
    load_checkpoint(tmp_path / "checkpoint_epoch=3.pt", fresh)
    assert torch.equal(fresh["tra_policy"].logits, logits[3])


class _Payload:
    def __reduce__(self):
        return (os.system, ("echo this must never run",))


class _Custom:
    pass


@pytest.mark.parametrize(
    ("payload", "refused"),
    [
        (_Payload(), r"Trying to load unsupported GLOBAL (posix|nt)\.system whose module (posix|nt) is blocked"),
        (_Custom(), r"Unsupported global: GLOBAL test_checkpoints\._Custom was not an allowed global by default"),
    ],
)
def test_refusal_names_the_global_without_unsafe_advice(tmp_path, payload, refused):
    """Issue 12 item 11: torch's reason (the refused global) is kept; its weights_only=False advice is not."""
    path = tmp_path / "foreign.pt"
    torch.save({"network": payload}, path)
    expected = rf"cannot read checkpoint {path}: not a weights-only torch checkpoint \(refused by the weights-only"
    with pytest.raises(ValueError, match=rf"{expected} loader: {refused}\)$") as err:
        load_checkpoint(path, {"network": torch.nn.Linear(2, 2)})
    assert "weights_only" not in str(err.value).replace("weights-only", "") and "\n" not in str(err.value)
