"""The jcsaug command line."""

from __future__ import annotations

import json

import pytest

from jcsaug.cli import main
from jcsaug.policy import make_tea_policy, make_tra_policy
from jcsaug.policy.io import save_policies


def _json(capsys, *argv):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_ops_tra_json(capsys):
    series = _json(capsys, "ops", "--tra", "--json")
    assert len(series) == 15
    assert sum(len(s["ops"]) for s in series) == 62
    assert all(s["ops"][0]["name"] == "identity" for s in series)
    assert series[12]["series"] == "blur_sharpen" and len(series[12]["ops"]) == 7


def test_ops_tea_json(capsys):
    ops = _json(capsys, "ops", "--tea", "--json")
    assert [op["id"] for op in ops] == list(range(84))
    assert all("name" in op for op in ops)


def test_ops_tables(capsys):
    assert main(["ops", "--tra"]) == 0
    assert "rotate_frontal" in capsys.readouterr().out
    assert main(["ops", "--tea"]) == 0
    assert "mirror_all" in capsys.readouterr().out


def test_policy_show_preset(capsys):
    data = _json(capsys, "policy", "show", "--preset", "deepmedic", "--json")
    groups = data["tra"]["groups"]
    assert len(groups) == 2
    mirror_frontal = groups[1]["series"][5]
    assert mirror_frontal["series"] == "mirror_frontal"
    assert mirror_frontal["ops"][1]["probability"] == pytest.approx(0.05, rel=1e-4)
    assert main(["policy", "show", "--preset", "nnunet"]) == 0
    assert "class group 1" in capsys.readouterr().out


def test_policy_show_file(tmp_path, capsys):
    path = save_policies(tmp_path / "policies.json", make_tra_policy("uniform", 3), make_tea_policy())
    data = _json(capsys, "policy", "show", str(path), "--json")
    assert len(data["tra"]["groups"]) == 3 and len(data["tea"]["ops"]) == 84


def test_policy_show_errors(tmp_path, capsys):
    assert main(["policy", "show", "--preset", "nope"]) == 2
    assert "unknown TRA preset 'nope'" in capsys.readouterr().err
    bad = tmp_path / "p.json"
    bad.write_text('{"format": "jcsaug-policies", "tea": {"ops": [{"name": "identity", "logit": 0}]}}')
    assert main(["policy", "show", str(bad)]) == 2
    assert "do not match the catalogue" in capsys.readouterr().err
    assert main(["policy", "show", str(tmp_path / "missing.json")]) == 2
    assert "cannot read policy file" in capsys.readouterr().err
    assert main(["policy", "show"]) == 2


def test_make_synthetic(tmp_path, capsys):
    assert main(["make-synthetic", str(tmp_path / "d"), "--num-train", "1", "--num-val", "1", "--num-test", "1",
                 "--shape", "16", "16", "16"]) == 0  # fmt: skip
    assert (tmp_path / "d" / "dataset.json").exists()
