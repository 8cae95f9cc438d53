"""The jcsaug command line."""

from __future__ import annotations

import json
import re

import pytest
import torch

from jcsaug.cli import COMMANDS, main
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


def test_ops_tra_of_the_split_signs_catalogue(capsys):
    series = _json(capsys, "ops", "--tra", "--catalogue", "split-signs", "--json")
    assert sum(len(s["ops"]) for s in series) == 62 + 32
    assert [op["name"] for op in series[1]["ops"][-2:]] == ["rot90+", "rot90-"]
    assert series[0]["ops"][2] == {"index": 2, "name": "scale-[0,0.1)", "kind": "scale", "magnitude": [0.0, 0.1],
                                   "signed": False, "sign": "-"}  # fmt: skip
    for command in (["ops", "--tra"], ["policy", "show", "--preset", "nnunet"]):  # one error, one wording
        assert main([*command, "--catalogue", "signs"]) == 2
        assert "unknown TRA catalogue 'signs'; valid names: spec, split-signs" in capsys.readouterr().err
    assert main(["policy", "show", "--preset", "nnunet", "--catalogue", "split-signs"]) == 0
    assert "rot90-=0.012" in capsys.readouterr().out


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


@pytest.mark.parametrize(
    ("shift", "recorded", "name"),
    [
        ("rotate-longitudinal", "rotate-longitudinal", "rotate-longitudinal"),
        ('{"long_axis": 1, "gamma": [1.3, 1.45]}', {"long_axis": 1, "mirror_axis0": False, "gamma": [1.3, 1.45],
         "blur": None, "scale": None, "noise": None, "low_resolution": None}, "custom"),
    ],
)  # fmt: skip
def test_make_synthetic_writes_the_shift_it_is_given(tmp_path, capsys, shift, recorded, name):
    """``--shift`` takes a name or a JSON object, as the benchmark's does; the dataset records it and the ops that
    undo it."""
    out = tmp_path / "d"
    assert main(["make-synthetic", str(out), "--num-train", "1", "--num-val", "1", "--num-test", "1",
                 "--shape", "16", "16", "16", "--shift", shift]) == 0  # fmt: skip
    assert capsys.readouterr().out.strip() == str(out / "dataset.json")
    meta = json.loads((out / "dataset.json").read_text())
    assert meta["target_shift"] == recorded and meta["domain_shift"]["name"] == name
    assert meta["domain_shift"]["lesion_long_axis"]["target"] == 1 and meta["domain_shift"]["undone_by"]


def test_the_help_names_what_each_sub_command_does(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # argparse wraps at the terminal's width, also at a hyphen
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    for name, (_, run) in COMMANDS.items():
        summary = " ".join(run.__doc__.strip().splitlines()[0].split())
        assert f"{name} {summary}" in shown


def _policy_file(tmp_path, edit) -> str:
    path = save_policies(tmp_path / "policies.json", make_tra_policy("nnunet", 2), make_tea_policy())
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    return str(path)


def _set_logit(value):
    def edit(doc):
        doc["tra"]["groups"][1]["series"][3]["ops"][1]["logit"] = value

    return edit


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda t: _policy_file(t, _set_logit(float("nan"))), r"policies\.json: NaN is not a number"),
        (lambda t: _policy_file(t, _set_logit(float("-inf"))), r"policies\.json: -Infinity is not a number"),
        (
            lambda t: _policy_file(t, _set_logit(1e39)),
            r"series 'rotate_longitudinal': op .*: logit 1e\+39 is not a fin",
        ),
        (lambda t: _policy_file(t, _set_logit("2")), r"series 'rotate_longitudinal': op .*: logit '2' is not a number"),
        (lambda t: _policy_file(t, lambda d: d["tea"]["ops"].__setitem__(0, 7)), r"TEA policy: ops must be a list of"),
        (lambda t: _policy_file(t, lambda d: d["tra"].pop("groups")), r"policies\.json: 'tra' has no 'groups' entry"),
        (lambda t: _policy_file(t, lambda d: d.__setitem__("tea", [])), r"'tea' is a list, expected an object"),
    ],
)
def test_policy_show_bad_files_are_one_line_errors(tmp_path, capsys, make, expected):
    """Issue 12 item 10: NaN/Inf/overflowing logits and malformed entries: one line naming the file, exit 2."""
    path = make(tmp_path)
    for extra in ([], ["--json"]):
        assert main(["policy", "show", path, *extra]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        err = captured.err.strip()
        assert "\n" not in err and err.startswith(f"jcsaug policy show: {path}") and re.search(expected, err), err


def test_policy_show_of_a_checkpoint_says_what_it_is(tmp_path, capsys):
    path = tmp_path / "x.pt"
    torch.save({"network": {"w": torch.zeros(3)}}, path)
    assert main(["policy", "show", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"jcsaug policy show: cannot read policy file {path}: not a UTF-8 text file (a policies.json is " \
        "JSON text; is it a checkpoint?)"  # fmt: skip


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--num-train", "0"], "num_train must be a positive integer, got 0"),
        (["--shape", "8", "8", "8"], "shape must be a sequence of 3 integers >= 16"),
        (["--seed", "-3"], "seed must be a non-negative integer, got -3"),
        (["--shift", "rot"], "unknown target_shift 'rot'; choose one of"),
        (["--shift", '{"gamma": [2, 1]}'], "target_shift 'gamma' must be null or a pair [lo, hi]"),
        (["--shift", '{"gamma": '], "target_shift is not a JSON object"),
        (["--shift", '{"angle": 90}'], "unknown target_shift key(s) ['angle']"),
    ],
)
def test_make_synthetic_bad_arguments_are_one_line_errors(tmp_path, capsys, args, expected):
    assert main(["make-synthetic", str(tmp_path / "d"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jcsaug make-synthetic: error: ") and expected in err and "\n" not in err
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("value", ["-1", "0", "two"])
def test_prepare_max_cases_must_be_positive(tmp_path, capsys, value):
    """A negative --max-cases used to slice off subjects silently (-1: all but one)."""
    with pytest.raises(SystemExit) as exit_:
        main(["prepare", "kits19_tumor", str(tmp_path), "--out", str(tmp_path / "out"), "--max-cases", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--max-cases" in err and ("positive integer" in err or "invalid int value" in err)
    assert not (tmp_path / "out").exists()


def test_python_dash_m_jcsaug_is_the_command():
    """``python -m jcsaug`` runs the same command line, its exit code and errors too (one interpreter start: the
    sub-commands themselves are tested through ``main``)."""
    import subprocess
    import sys

    bad = subprocess.run([sys.executable, "-m", "jcsaug", "report", "nowhere"], capture_output=True, text=True)
    assert bad.returncode == 2 and "jcsaug report: error: nowhere: no per_case.csv" in bad.stderr
