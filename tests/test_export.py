"""PolicyExporter and policies.json: history, TensorBoard scalars, atomic export, catalogue checks."""

from __future__ import annotations

import json
import os
import sys
import types

import pytest
import torch
from ignite.engine import Engine, Events

from jcsaug.engine import PolicyExporter
from jcsaug.engine.export import append_line
from jcsaug.engine.paired import OpEffects
from jcsaug.policy import make_tea_policy, make_tra_policy
from jcsaug.policy.io import load_policies, policies_to_dict, save_policies


class _FakeWriter:
    scalars: list = []

    def __init__(self, log_dir):
        self.log_dir = log_dir

    def add_scalar(self, tag, value, step):
        _FakeWriter.scalars.append((tag, value, step))

    def flush(self):
        pass


def test_exporter_writes_history_scalars_and_policies(tmp_path, monkeypatch):
    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = _FakeWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    _FakeWriter.scalars = []
    tra, tea = make_tra_policy("nnunet", 2), make_tea_policy()

    def step(engine, batch):
        with torch.no_grad():
            tra.logits[1, 0] += 0.5  # something changes every iteration

    engine = Engine(step)
    PolicyExporter(tmp_path, tra, tea, tensorboard_dir=tmp_path / "tb").attach(engine)
    engine.run([0, 1], max_epochs=3)
    history = [json.loads(line) for line in (tmp_path / "policy_history.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in history] == [1, 2, 3]
    key = "tra/group1/scale/identity"
    assert history[0]["probabilities"][key] < history[2]["probabilities"][key]
    assert len([s for s in _FakeWriter.scalars if s[2] == 6]) == 62 * 2 + 84  # one scalar per op probability
    loaded_tra, loaded_tea = load_policies(tmp_path / "policies.json")
    assert torch.allclose(loaded_tra.logits, tra.logits) and torch.allclose(loaded_tea.logits, tea.logits)
    assert not list(tmp_path.glob(".policies.json.*"))  # no temporary file left behind


def test_history_holds_the_paired_estimators_op_effects_by_the_ops_names(tmp_path):
    """Each epoch's line carries the running effect estimate and the measurement count of every op a paired
    updater measured (under the op's probability name); an updater without op effects adds nothing."""
    tra = make_tra_policy("nnunet", 2)
    paired = types.SimpleNamespace(name="TRA", policy=tra, effects=OpEffects(tra))
    gumbel = types.SimpleNamespace(name="TEA", policy=make_tea_policy(), effects=None)
    series, op = 1, 2
    measured = iter([-0.5, 1.0])

    def step(engine, batch):  # one measurement of one op of class group 1 per iteration
        sums, counts = paired.effects.accumulate(
            torch.tensor([1]), torch.tensor([series]), torch.tensor([op]), torch.tensor([next(measured)])
        )
        paired.effects.gradient(sums, counts)

    engine = Engine(step)
    PolicyExporter(tmp_path, tra, updaters=[paired, gumbel]).attach(engine)
    engine.run([0], max_epochs=2)
    history = [json.loads(line) for line in (tmp_path / "policy_history.jsonl").read_text().splitlines()]
    tag = f"tra/group1/{tra.series_names[series]}/{tra.op_names[series][op]}"
    assert tag in history[0]["probabilities"]
    assert history[0]["op_effects"] == {tag: {"estimate": -0.5, "measurements": 1}}
    assert history[1]["op_effects"] == {tag: {"estimate": 0.25, "measurements": 2}}  # the first two averaged


@pytest.mark.parametrize("exporter_first", [True, False])
def test_tensorboard_scalars_carry_each_update_at_its_own_iteration(tmp_path, monkeypatch, exporter_first):
    """A bundle lists the exporter among its train_handlers *before* the policy updaters: the scalars must still
    show each update at the iteration it happened (not one late), the last iteration's update included."""
    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = _FakeWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    _FakeWriter.scalars = []
    tea = make_tea_policy()
    engine = Engine(lambda engine, batch: None)
    identity = [float(tea.probabilities()[0][0, 0])]  # at the start, then after each iteration

    def update(engine):  # a policy updater: updates on iterations 2 and 3 (the last)
        if engine.state.iteration >= 2:
            with torch.no_grad():
                tea.logits[0, 0] += 0.5
        identity.append(float(tea.probabilities()[0][0, 0]))

    exporter = PolicyExporter(tmp_path, tea_policy=tea, tensorboard_dir=tmp_path / "tb")
    if exporter_first:
        exporter.attach(engine)
    engine.add_event_handler(Events.ITERATION_COMPLETED, update)
    if not exporter_first:
        exporter.attach(engine)
    engine.run(range(3), max_epochs=1)
    logged = [(step, value) for tag, value, step in _FakeWriter.scalars if tag == "tea/tea/identity"]
    assert logged == [(0, pytest.approx(identity[0])), (2, pytest.approx(identity[2])), (3, pytest.approx(identity[3]))]


def test_policies_json_round_trip_and_names(tmp_path):
    tra = make_tra_policy("deepmedic", 3)
    path = save_policies(tmp_path / "p.json", tra, None)
    data = json.loads(path.read_text())
    assert data["tra"]["groups"][2]["series"][12]["ops"][4]["name"] == "sharpen[0.8,1)"
    loaded, tea = load_policies(path)
    assert tea is None and torch.allclose(loaded.logits, tra.logits)


def test_policy_file_for_another_catalogue_is_refused(tmp_path):
    data = policies_to_dict(make_tra_policy(), make_tea_policy())
    data["tra"]["groups"][0]["series"][0]["ops"].pop()
    (tmp_path / "a.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="series 'scale': op names .* do not match the catalogue"):
        load_policies(tmp_path / "a.json")
    data = policies_to_dict(make_tra_policy(), make_tea_policy())
    data["tea"]["ops"][5]["name"] = "scale_down_9"
    (tmp_path / "b.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="TEA policy: op names"):
        load_policies(tmp_path / "b.json")
    (tmp_path / "c.json").write_text("{}")
    with pytest.raises(ValueError, match="not a jcsaug policies file"):
        load_policies(tmp_path / "c.json")


def test_history_lines_are_whole_after_a_torn_write_and_a_failed_write(tmp_path, monkeypatch):
    """Issue 12 item 14: a torn last line (crash mid-write) is cut before the next record; a write that fails
    part-way (disk full) is rolled back; the file only ever holds whole records."""
    path = tmp_path / "policy_history.jsonl"
    append_line(path, json.dumps({"epoch": 1}))
    path.write_bytes(path.read_bytes() + b'{"epoch": 2, "probabil')  # interrupted mid-write
    append_line(path, json.dumps({"epoch": 2}))
    assert [json.loads(line)["epoch"] for line in path.read_text().splitlines()] == [1, 2]

    real_write = os.write

    def disk_full(fd, data):
        real_write(fd, bytes(data[:5]))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", disk_full)
    with pytest.raises(OSError, match="No space left"):
        append_line(path, json.dumps({"epoch": 3}))
    monkeypatch.setattr(os, "write", real_write)
    assert [json.loads(line)["epoch"] for line in path.read_text().splitlines()] == [1, 2]
    assert path.read_text().endswith("\n")
