"""Figures: policy bars, policy history, the ops gallery, the PolicyPlotter handler and the CLI functions."""

from __future__ import annotations

import argparse
import json
import logging
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("matplotlib")

import matplotlib.image as mpimg  # noqa: E402
import nibabel as nib  # noqa: E402
from ignite.engine import Engine  # noqa: E402

from jcsaug.engine import PolicyExporter  # noqa: E402
from jcsaug.ops.tea import TEA_OPS  # noqa: E402
from jcsaug.policy import make_tea_policy, make_tra_policy  # noqa: E402
from jcsaug.policy.io import save_policies  # noqa: E402
from jcsaug.viz import (  # noqa: E402
    PolicyPlotter,
    build_gallery_parser,
    build_policy_plot_parser,
    ops_gallery,
    plot_policy,
    plot_policy_history,
    read_policy_history,
    run_gallery,
    run_policy_plot,
    tra_short_name,
)
from jcsaug.viz.plots import gallery_figsize, policy_figsize  # noqa: E402


def _check_png(path, size_inches, dpi):
    """A PNG of ``size_inches * dpi`` pixels (Agg truncates fractional pixels) that is not blank."""
    assert path.is_file() and path.stat().st_size > 0
    img = mpimg.imread(path)
    expected = (size_inches[1] * dpi, size_inches[0] * dpi)
    assert all(abs(n - e) < 1 for n, e in zip(img.shape[:2], expected)), (img.shape, expected)
    assert float(img[..., :3].std()) > 0
    return img


def _trained_policies(num_groups=2, seed=0):
    torch.manual_seed(seed)
    tra, tea = make_tra_policy("nnunet", num_groups), make_tea_policy()
    with torch.no_grad():
        tra.logits += torch.randn_like(tra.logits)
        tea.logits += torch.randn_like(tea.logits)
    return tra, tea


@pytest.fixture
def policies_file(tmp_path):
    return save_policies(tmp_path / "policies.json", *_trained_policies())


@pytest.fixture
def history_file(tmp_path):
    tra, tea = _trained_policies(num_groups=2, seed=1)
    path = tmp_path / "policy_history.jsonl"
    with open(path, "w") as f:
        for it in (10, 20, 30, 40):
            with torch.no_grad():
                tra.logits[1, 0] += 0.7  # group 1 scale identity rises
                tea.logits[0, 5] += 0.5
            probs = {}
            for prefix, pol in (("tra", tra), ("tea", tea)):
                for s, p in enumerate(pol.probabilities()):
                    for g in range(pol.num_groups):
                        group = f"group{g}/" if pol.num_groups > 1 else ""
                        for j, v in enumerate(p[g].tolist()):
                            probs[f"{prefix}/{group}{pol.series_names[s]}/{pol.op_names[s][j]}"] = v
            f.write(json.dumps({"epoch": it // 10, "iteration": it, "probabilities": probs}) + "\n")
    return path


@pytest.fixture
def nifti_file(tmp_path):
    rng = np.random.RandomState(0)
    vol = rng.randn(24, 24, 16).astype(np.float32) * 0.3
    vol[8:16, 6:14, 4:12] += 2.0  # an off-centre bright box: spatial ops visibly move it
    path = tmp_path / "case.nii.gz"
    nib.save(nib.Nifti1Image(vol, np.eye(4)), str(path))
    return path


def _no_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)


# ----------------------------------------------------------------------------- policy figures
def test_plot_policy_from_file_and_from_policies(tmp_path, policies_file):
    out = plot_policy(policies_file, tmp_path / "a" / "p.png", figsize=(9, 5), dpi=50)
    _check_png(out, (9, 5), 50)
    tra, tea = _trained_policies(num_groups=1)
    for pair, name in (((tra, None), "tra.png"), ((None, tea), "tea.png"), ((tra, tea), "both.png")):
        out = plot_policy(pair, tmp_path / name, top_k=5, dpi=40)
        _check_png(out, policy_figsize(1 if pair[0] is not None else 0, pair[1] is not None), 40)
    with pytest.raises(ValueError, match="no TRA or TEA"):
        plot_policy((None, None), tmp_path / "none.png")


def test_plot_policy_history(tmp_path, history_file):
    iterations, panels = read_policy_history(history_file)
    assert iterations.tolist() == [10, 20, 30, 40]
    assert list(panels) == ["TRA group 0", "TRA group 1", "TEA"]
    rising = panels["TRA group 1"]["scale: identity"]
    assert np.all(np.diff(rising) > 0)
    assert len(panels["TEA"]) == len(TEA_OPS)
    out = plot_policy_history(history_file, tmp_path / "h.png", top_k=3, figsize=(10, 4), dpi=50)
    _check_png(out, (10, 4), 50)


def test_history_of_one_group_policy_and_bad_history(tmp_path):
    path = tmp_path / "h.jsonl"
    records = [{"epoch": e, "iteration": e, "probabilities": {"tra/scale/identity": 0.5 + e / 10}} for e in (1, 2)]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    _, panels = read_policy_history(path)
    assert panels == {"TRA": {"scale: identity": pytest.approx(np.array([0.6, 0.7]))}}
    path.write_text("not json\n" + json.dumps(records[0]) + "\n")  # a bad line before the last: an error
    with pytest.raises(ValueError, match=r"h\.jsonl:1: not a policy history record"):
        read_policy_history(path)
    path.write_text("")
    with pytest.raises(ValueError, match="no policy history"):
        plot_policy_history(path, tmp_path / "x.png")


def test_history_with_a_truncated_last_line_is_read_with_a_warning(tmp_path, history_file):
    """Issue 12 item 14: a run interrupted mid-write leaves a torn last line; the records before it are read."""
    whole = history_file.read_text()
    history_file.write_text(whole + whole.splitlines()[0][:-1000])
    with pytest.warns(UserWarning, match=r"policy_history\.jsonl:5: skipped an incomplete last record"):
        iterations, panels = read_policy_history(history_file)
    assert iterations.tolist() == [10, 20, 30, 40] and len(panels["TEA"]) == len(TEA_OPS)


# ----------------------------------------------------------------------------- gallery
def test_ops_gallery(tmp_path, nifti_file):
    out = ops_gallery(nifti_file, tmp_path / "g.png", tra_draws=2, seed=1, dpi=40)
    _check_png(out, gallery_figsize(len(TEA_OPS), 2 * 2), 40)


def test_tra_short_names():
    assert tra_short_name(0, 0) == "id"
    assert tra_short_name(0, 2) == "sc2"
    assert tra_short_name(3, 4) == "rotL90"
    assert tra_short_name(4, 1) == "mirS"
    assert [tra_short_name(12, j) for j in (1, 4)] == ["blur1", "shrp1"]


# ----------------------------------------------------------------------------- handler
def test_policy_plotter_writes_at_completed(tmp_path):
    tra, tea = _trained_policies()

    def step(engine, batch):
        with torch.no_grad():
            tra.logits[0, 0] += 0.3

    engine = Engine(step)
    PolicyExporter(tmp_path, tra, tea).attach(engine)
    plotter = PolicyPlotter(tmp_path, tra, tea)
    plotter.attach(engine)
    engine.run([0, 1], max_epochs=2)
    for name in ("policies.png", "policy_history.png"):
        assert mpimg.imread(tmp_path / name)[..., :3].std() > 0
    # policies.png has a second row: the change from the start (the policies when the plotter was made)
    _check_png(tmp_path / "policies.png", policy_figsize(2, True, with_changes=True), 120)
    assert plotter() == [tmp_path / "policies.png", tmp_path / "policy_history.png"]  # unchanged: not redrawn
    assert plotter.initial[0].logits[0, 0] != tra.logits[0, 0]


def test_plot_policy_shows_the_change_from_the_start(tmp_path, policies_file):
    start = (make_tra_policy("nnunet", 2), make_tea_policy())
    out = plot_policy(policies_file, tmp_path / "changes.png", initial=start, dpi=40)
    with_changes = _check_png(out, policy_figsize(2, True, with_changes=True), 40)
    without = mpimg.imread(plot_policy(policies_file, tmp_path / "final.png", dpi=40))
    assert with_changes.shape[0] > without.shape[0]
    initial = save_policies(tmp_path / "start.json", *start)
    args = _policy_args([str(policies_file), "-o", str(tmp_path / "cli.png"), "--initial", str(initial), "--dpi", "40"])
    assert run_policy_plot(args) == 0
    _check_png(tmp_path / "cli.png", policy_figsize(2, True, with_changes=True), 40)


def test_policy_plotter_without_history_or_on_other_ranks(tmp_path, monkeypatch):
    tra, _ = _trained_policies()
    engine = Engine(lambda e, b: None)
    PolicyPlotter(tmp_path / "a", tra, None).attach(engine)
    engine.run([0], max_epochs=1)
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["policies.png"]

    import ignite.distributed as idist

    monkeypatch.setattr(idist, "get_rank", lambda: 1)
    engine = Engine(lambda e, b: None)
    PolicyPlotter(tmp_path / "b", tra, None).attach(engine)
    engine.run([0], max_epochs=1)
    assert not (tmp_path / "b").exists()


def test_policy_plotter_disabled_draws_nothing(tmp_path):
    """``enabled=False`` (the bundles' ``plots: false``): no figure at the end, nor when called."""
    tra, tea = _trained_policies()
    engine = Engine(lambda e, b: None)
    plotter = PolicyPlotter(tmp_path / "run", tra, tea, enabled=False)
    plotter.attach(engine)
    engine.run([0], max_epochs=1)
    assert plotter() == [] and not (tmp_path / "run").exists()


def test_policy_plotter_without_matplotlib_warns_once(tmp_path, monkeypatch, caplog):
    _no_matplotlib(monkeypatch)
    tra, tea = _trained_policies()
    plotter = PolicyPlotter(tmp_path, tra, tea)
    engine = Engine(lambda e, b: None)
    plotter.attach(engine)
    with caplog.at_level(logging.WARNING, logger="jcsaug.engine"):
        engine.run([0], max_epochs=1)
        assert plotter(engine) == []
    warnings = [r for r in caplog.records if "jcsaug[plot]" in r.getMessage()]
    assert len(warnings) == 1
    assert not list(tmp_path.glob("*.png"))


# ----------------------------------------------------------------------------- CLI functions
def _policy_args(argv):
    p = argparse.ArgumentParser()
    build_policy_plot_parser(p)
    return p.parse_args(argv)


def _gallery_args(argv):
    p = argparse.ArgumentParser()
    build_gallery_parser(p)
    return p.parse_args(argv)


def test_cli_policy_plot(tmp_path, policies_file, history_file, capsys):
    out = tmp_path / "fig" / "pol.png"
    args = _policy_args([str(policies_file), "-o", str(out), "--history", str(history_file), "--dpi", "40"])
    assert run_policy_plot(args) == 0
    assert capsys.readouterr().out.split() == [str(out), str(out.with_name("pol_history.png"))]
    assert out.is_file() and out.with_name("pol_history.png").is_file()
    assert run_policy_plot(_policy_args([str(policies_file), "--dpi", "30"])) == 0  # default: PATH.png
    assert policies_file.with_suffix(".png").is_file()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "missing.json", "no policy file"),
        (lambda d: (d / "x.json").write_text('{"a": 1}') and d / "x.json", "not a jcsaug policies file"),
        (lambda d: (d / "y.json").write_text("{") and d / "y.json", "cannot read policy file"),
    ],
)
def test_cli_policy_plot_bad_input(tmp_path, capsys, make, message):
    assert run_policy_plot(_policy_args([str(make(tmp_path)), "-o", str(tmp_path / "o.png")])) == 2
    err = capsys.readouterr().err
    assert err.startswith("jcsaug policy plot:") and message in err
    assert not (tmp_path / "o.png").exists()


def test_cli_policy_plot_bad_history(tmp_path, policies_file, capsys):
    args = _policy_args([str(policies_file), "-o", str(tmp_path / "o.png"), "--history", str(tmp_path / "no.jsonl")])
    assert run_policy_plot(args) == 2
    assert "no policy history" in capsys.readouterr().err


def test_cli_without_matplotlib(tmp_path, policies_file, nifti_file, monkeypatch, capsys):
    _no_matplotlib(monkeypatch)
    assert run_policy_plot(_policy_args([str(policies_file), "-o", str(tmp_path / "o.png")])) == 2
    assert 'pip install "jcsaug[plot]"' in capsys.readouterr().err
    assert run_gallery(_gallery_args([str(nifti_file), "-o", str(tmp_path / "g.png")])) == 2
    assert 'pip install "jcsaug[plot]"' in capsys.readouterr().err


def test_cli_gallery_bad_input(tmp_path, policies_file, capsys):
    assert run_gallery(_gallery_args([str(tmp_path / "none.nii.gz"), "-o", str(tmp_path / "g.png")])) == 2
    assert "no image" in capsys.readouterr().err
    bad = tmp_path / "bad.nii.gz"
    bad.write_text("not an image")
    assert run_gallery(_gallery_args([str(bad), "-o", str(tmp_path / "g.png")])) == 2
    assert "cannot read image" in capsys.readouterr().err
    tea_only = save_policies(tmp_path / "tea.json", None, make_tea_policy())
    args = _gallery_args([str(bad), "-o", str(tmp_path / "g.png"), "--policy", str(tea_only)])
    assert run_gallery(args) == 2
    assert "holds no TRA policy" in capsys.readouterr().err
    assert not (tmp_path / "g.png").exists()


def test_cli_gallery_learned_policy(tmp_path, nifti_file, capsys):
    tra, _ = _trained_policies(num_groups=3)
    policy = save_policies(tmp_path / "p.json", tra, None)
    out = tmp_path / "grid.png"
    args = _gallery_args([str(nifti_file), "-o", str(out), "--tra-draws", "1", "--policy", str(policy), "--dpi", "30"])
    assert run_gallery(args) == 0
    assert capsys.readouterr().out.strip() == str(out)
    _check_png(out, gallery_figsize(len(TEA_OPS), 3), 30)


def test_tra_panel_stacks_each_series_ops_by_their_probabilities():
    """Each series' row of a TRA group's panel: one bar per op, as wide as its probability, each starting where the
    one before ends, so the row fills [0, 1]."""
    from matplotlib.figure import Figure

    from jcsaug.viz.plots import _draw_tra_group

    tra, _ = _trained_policies()
    probs = [p.numpy() for p in tra.probabilities()]
    ax = Figure().subplots()
    _draw_tra_group(ax, tra, probs, group=1, show_names=True)
    bars = ax.patches
    assert len(bars) == sum(len(p[1]) for p in probs)
    start = 0
    for s, p in enumerate(probs):
        row = bars[start : start + len(p[1])]
        start += len(p[1])
        y = tra.num_series - 1 - s
        assert all(bar.get_y() + bar.get_height() / 2 == pytest.approx(y) for bar in row)
        assert [bar.get_width() for bar in row] == pytest.approx(p[1].tolist())
        assert [bar.get_x() for bar in row] == pytest.approx(np.concatenate([[0.0], np.cumsum(p[1])[:-1]]).tolist())
        assert len({bar.get_facecolor() for bar in row}) == len(row)  # shades of the series' colour map
