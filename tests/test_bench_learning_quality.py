"""The learning-quality benchmark reads what it reports from the run's own files (no bundle run here)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path
from types import SimpleNamespace

import nibabel as nib
import numpy as np
import pytest
import torch

from helpers import COMBINED_SHIFT, COMBINED_SHIFT_RECORDED, load_benchmark
from jcsaug.data.synthetic import TARGET_SHIFTS, shift_undoing_ops
from jcsaug.policy import make_tea_policy, make_tra_policy
from jcsaug.policy.io import load_policies, policies_to_dict


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_learning_quality")


@pytest.mark.parametrize("shift", sorted(TARGET_SHIFTS))
def test_oracle_sets_each_undoing_op_to_one_half_in_a_real_policy(bench, shift):
    undone = shift_undoing_ops(TARGET_SHIFTS[shift])
    preset = bench.oracle_preset(undone)
    policy = make_tra_policy(json.loads(json.dumps(preset)), num_groups=2)  # as the bundle reads the override
    nnunet = make_tra_policy("nnunet", num_groups=2)
    for entry in undone["tra"]:
        s = policy.series_names.index(entry["series"])
        op = policy.op_names[s].index(entry["op"])
        probs = policy.probabilities()[s]
        if entry.get("partial"):  # a random-sign op keeps the preset
            assert probs.tolist() == nnunet.probabilities()[s].tolist()
        else:
            assert probs[:, 0].tolist() == pytest.approx([0.5, 0.5], abs=1e-5)
            assert probs[:, op].tolist() == pytest.approx([0.5, 0.5], abs=1e-5)
    untouched = {e["series"] for e in undone["tra"] if not e.get("partial")}
    for s, name in enumerate(policy.series_names):
        if name not in untouched:
            assert policy.probabilities()[s].tolist() == nnunet.probabilities()[s].tolist()


@pytest.mark.parametrize("shift", ["default", "gamma"])
def test_the_partial_oracle_also_sets_the_random_sign_ops(bench, shift):
    """``oracle-partial+mirror``: the oracle plus the "partial" (random-sign) ops at identity 0.5 / op 0.5; on the
    ``gamma`` shift, whose only aspect is partial, ``oracle+mirror`` is the heuristic itself."""
    undone = shift_undoing_ops(TARGET_SHIFTS[shift])
    full, plain = bench.oracle_preset(undone, partial=True), bench.oracle_preset(undone)
    partial = [e for e in undone["tra"] if e.get("partial")]
    assert partial and all(e["series"] not in plain for e in partial)
    policy = make_tra_policy(json.loads(json.dumps(full)), num_groups=2)
    for entry in partial:
        s = policy.series_names.index(entry["series"])
        probs = policy.probabilities()[s]
        assert probs[:, 0].tolist() == pytest.approx([0.5, 0.5], abs=1e-5)
        assert probs[:, policy.op_names[s].index(entry["op"])].tolist() == pytest.approx([0.5, 0.5], abs=1e-5)
    assert {k: v for k, v in full.items() if k not in {e["series"] for e in partial}} == plain
    if shift == "gamma":
        assert plain == {"base": "nnunet"}


def test_the_ceiling_is_the_larger_gain_of_the_oracles_run(bench):
    assert bench.oracle_gain_of({}) is None
    assert bench.oracle_gain_of({"oracle+mirror": [0.1, -0.5], "oracle-partial+mirror": [4.0, 2.0]}) == 3.0
    assert bench.oracle_gain_of({"oracle+mirror": [14.0, 15.0]}) == 14.5
    assert set(bench.ORACLE_GAIN_MODES) <= set(bench.MODES)


def test_the_oracle_tea_policy_weighs_the_identity_and_the_undoing_ops_equally(bench, tmp_path):
    """``heuristic+oracle-tea``: the TEA policy file ``tea_mode fixed`` reads, and the ``tea_z`` that tests with
    exactly those ops."""
    from jcsaug.inference import TEAInferer
    from jcsaug.policy.io import load_policies

    undone = shift_undoing_ops(TARGET_SHIFTS["default"])
    path, z = bench.oracle_tea_policy_file(tmp_path, undone)
    names = ["identity", "rotate_frontal_acw_90", "rotate_frontal_cw_90", "mirror_sagittal", "gamma_compress_0.5"]
    assert z == len(names)
    tra, tea = load_policies(path)
    assert tra is None
    inferer = TEAInferer.from_policy(tea, z)
    assert sorted(op.name for op in inferer.ops) == sorted(names)
    assert [float(w) for w in inferer.weights] == pytest.approx([1 / z] * z, abs=1e-4)
    assert bench.MODES["heuristic+oracle-tea"] == {"tra_mode": "heuristic", "tea_mode": "fixed"}


def test_tra_targets_do_not_apply_where_only_a_test_time_oracle_gains(bench):
    """The TRA-only targets are judged against the TRA oracles' gain, the others against the largest oracle's."""
    target = bench.Target
    checks = [target("joint >= 6", False, 3.0), target("no TTA >= 4", False, 0.3), target("TEA op in top 8", True, 3.0)]
    lines = bench.target_lines(checks, oracle_gain=3.0, tra_gain=0.3)
    assert "the TRA-only targets do not apply" in lines[0]
    assert lines[2:] == ["- MISS joint >= 6", "- N/A no TTA >= 4", "- PASS TEA op in top 8"]
    nothing = bench.target_lines([target("joint >= 6", True, -0.2)], oracle_gain=-0.2, tra_gain=-0.2)
    assert "the targets do not apply" in nothing[0] and nothing[-1] == "- N/A joint >= 6"
    assert bench.target_lines([target("joint >= 6", True, None)], None, None) == ["- PASS joint >= 6"]  # no oracle


@pytest.mark.parametrize("group", [0, 1])
def test_a_per_group_oracle_is_the_oracle_in_that_group_and_the_heuristic_in_the_other(bench, tmp_path, group):
    """``oracle-background+mirror`` / ``oracle-lesion+mirror``: the policy file ``tra_mode fixed`` reads."""
    from jcsaug.policy.io import load_policies

    undone = shift_undoing_ops(TARGET_SHIFTS["default"])
    path = bench.oracle_group_policy_file(tmp_path, undone, group)
    tra, _ = load_policies(path)
    oracle = make_tra_policy(bench.oracle_preset(undone), num_groups=2)
    nnunet = make_tra_policy("nnunet", num_groups=2)
    for s in range(tra.num_series):
        got = tra.probabilities()[s]
        assert got[group].tolist() == pytest.approx(oracle.probabilities()[s][group].tolist(), abs=1e-6)
        assert got[1 - group].tolist() == pytest.approx(nnunet.probabilities()[s][1 - group].tolist(), abs=1e-6)
    rot90 = bench.tra_probability(json.loads(path.read_text()), "rotate_frontal", "rot90")
    assert rot90[group] == pytest.approx(0.5, abs=1e-5) and rot90[1 - group] == pytest.approx(0.025, abs=1e-5)
    assert {m: bench.MODES[m]["tra_mode"] for m in bench.ORACLE_GROUP_MODES} == dict.fromkeys(
        bench.ORACLE_GROUP_MODES, "fixed"
    )


@pytest.mark.parametrize("mode", ["oracle-flip-off-background+mirror", "oracle-flip-off+mirror"])
def test_a_flip_off_oracle_is_the_oracle_without_the_shifts_flip_in_its_groups(bench, tmp_path, mode):
    """The oracle in both groups, the shift's sagittal flip off (identity 1) in the mode's groups only."""
    from jcsaug.policy.io import load_policies

    groups = bench.ORACLE_FLIP_OFF_MODES[mode]
    undone = shift_undoing_ops(TARGET_SHIFTS["default"])
    path = bench.oracle_flip_off_policy_file(tmp_path, undone, groups)
    tra, _ = load_policies(path)
    oracle = make_tra_policy(bench.oracle_preset(undone), num_groups=2)
    policies = json.loads(path.read_text())
    flip = bench.tra_probability(policies, "mirror_sagittal", "flip")
    for group in (0, 1):
        assert flip[group] == pytest.approx(0.0 if group in groups else 0.5, abs=1e-5)
        assert bench.tra_probability(policies, "rotate_frontal", "rot90")[group] == pytest.approx(0.5, abs=1e-5)
    for s, name in enumerate(tra.series_names):
        if name != "mirror_sagittal":
            torch.testing.assert_close(tra.probabilities()[s], oracle.probabilities()[s], atol=1e-6, rtol=0)
    assert bench.MODES[mode]["tra_mode"] == "fixed"
    with pytest.raises(ValueError, match="mirror aspect"):  # rotate-longitudinal: no mirror to switch off
        bench.oracle_flip_off_policy_file(tmp_path, shift_undoing_ops(TARGET_SHIFTS["rotate-longitudinal"]), groups)


def test_probabilities_and_ranks_are_read_from_policies_json(bench):
    tra = make_tra_policy("nnunet", num_groups=2)
    s = tra.series_names.index("rotate_frontal")
    op = tra.op_names[s].index("rot90")
    probs = [p.numpy().copy() for p in tra.probabilities()]
    probs[s][:] = 0.0
    probs[s][:, 0], probs[s][:, op] = [0.9, 0.6], [0.1, 0.4]
    tra.set_probabilities(probs)
    tea = make_tea_policy()
    names = tea.op_names[0]
    probs = [1.0] * len(names)
    probs[names.index("rotate_frontal_cw_90")] = 50.0  # the most likely op
    probs[names.index("mirror_sagittal")] = 20.0  # the second
    tea.set_probabilities([[p / sum(probs) for p in probs]])
    policies = json.loads(json.dumps(policies_to_dict(tra, tea)))  # what policies.json holds

    assert bench.tra_probability(policies, "rotate_frontal", "rot90") == pytest.approx([0.1, 0.4], abs=1e-5)
    ranks = bench.tea_ranks(policies)
    assert ranks["rotate_frontal_cw_90"] == 1 and ranks["mirror_sagittal"] == 2


def test_parallel_runs_share_out_the_cores(bench, monkeypatch):
    monkeypatch.setattr(bench.os, "cpu_count", lambda: 8)
    assert bench.threads_per_run(jobs=3, threads=0) == 2
    assert bench.threads_per_run(jobs=16, threads=0) == 1
    assert bench.threads_per_run(jobs=2, threads=3) == 3  # an explicit --threads wins


def test_targets_and_shares_do_not_apply_where_the_oracle_gains_nothing(bench):
    """A shift the heuristic already copes with (the ``blur`` shift: the oracle −0.6): no share, targets N/A."""
    assert bench.verdict(True) == "PASS" and bench.verdict(False) == "MISS"  # no oracle run: the targets apply
    assert bench.verdict(False, oracle_gain=14.0) == "MISS" and bench.verdict(True, oracle_gain=1.0) == "PASS"
    assert bench.verdict(True, oracle_gain=0.99) == bench.verdict(False, oracle_gain=-0.6) == "N/A"
    assert bench.oracle_share(7.0, 14.0) == "50 %" and bench.oracle_share(18.1, 14.0) == "129 %"
    assert bench.oracle_share(0.1, -0.6) == bench.oracle_share(0.5, 0.5) == bench.oracle_share(3.0, None) == "-"


def test_ranks_are_reported_for_every_mode_that_learns_its_tea_and_probabilities_for_every_learned_tra(bench):
    """``heuristic+learned-tea`` learns only its TEA: its TEA ranks are reported and judged, no TRA probability."""
    undone_by = shift_undoing_ops(TARGET_SHIFTS["default"])
    tra = make_tra_policy("nnunet", num_groups=2)
    tea = make_tea_policy()
    names = tea.op_names[0]
    probs = [1.0] * len(names)
    probs[names.index("rotate_frontal_cw_90")] = 50.0  # rank 1: the quarter turn's aspect met in every seed
    tea.set_probabilities([[p / sum(probs) for p in probs]])
    policies = json.loads(json.dumps(policies_to_dict(tra, tea)))
    modes = ["heuristic+mirror", "heuristic+learned-tea", "class-specific+joint"]
    results = {(m, s): {"policies": policies} for m in modes for s in (0, 1)}

    lines, checks = bench.undoing_op_report(modes, results, [0, 1], undone_by, 8, tra_gain=14.0, oracle_gain=14.0)

    assert bench.MODES["heuristic+learned-tea"] == {"tra_mode": "heuristic", "tea_mode": "joint"}
    assert not any(line.startswith("- heuristic+mirror") for line in lines)  # learns nothing: nothing reported
    learned_tea = [line for line in lines if line.startswith("- heuristic+learned-tea")]
    assert learned_tea and all(": TEA " in line for line in learned_tea)  # its TEA ranks, no TRA probability
    assert len(learned_tea) == len(undone_by["tea"])
    assert "- heuristic+learned-tea: TEA rotate_frontal_acw_90 / rotate_frontal_cw_90: rank 1, 1" in lines
    joint = [line for line in lines if line.startswith("- class-specific+joint")]
    assert len(joint) == len(undone_by["tra"]) + len(undone_by["tea"])
    by_text = {t.text: t.met for t in checks}
    quarter_turn = "heuristic+learned-tea: TEA rotate_frontal_acw_90 (or equivalent) in the top 8 (median seed: rank 1)"
    assert by_text[quarter_turn]
    # the nnU-Net preset's rot90 (0.025) misses the TRA target; its mirror (0.5) meets it
    rot90 = "class-specific+joint: TRA rotate_frontal/rot90 >= 0.3 in every group (mean over seeds: 0.02 / 0.02)"
    assert not by_text[rot90]
    flip = "class-specific+joint: TRA mirror_sagittal/flip >= 0.3 in every group (mean over seeds: 0.50 / 0.50)"
    assert by_text[flip]
    labels = {t.label for t in checks}  # the summary's short form, with the figure judged
    assert "class-specific+joint: TRA rotate_frontal/rot90 0.02 / 0.02" in labels  # the preset's 0.025
    assert "heuristic+learned-tea: TEA rotate_frontal_acw_90 rank 1" in labels


def test_a_probability_just_below_the_target_never_reads_as_the_target(bench):
    """A mean of 0.2996 judged a MISS of ">= 0.3" reads "0.299", not "0.30" (a gain of 5.96 "+5.96", not "+6.0");
    every other figure keeps its decimals."""
    assert bench.figure_against(0.2996, 0.3) == "0.299"
    assert bench.figure_against(0.297, 0.3) == "0.297"
    assert bench.figure_against(0.3, 0.3) == bench.figure_against(0.3004, 0.3) == "0.30"
    assert bench.figure_against(0.294, 0.3) == "0.29" and bench.figure_against(0.02, 0.3) == "0.02"
    # the Dice targets' gains, signed to one decimal
    assert bench.figure_against(5.96, 6, 1, "+") == "+5.96" and bench.figure_against(3.99, 4, 1, "+") == "+3.99"
    assert bench.figure_against(6.04, 6, 1, "+") == "+6.0" and bench.figure_against(-1.44, 6, 1, "+") == "-1.4"
    # a mean of float differences a hair under its two decimals (69.96 - 64 = 5.9599...) is not truncated a step down
    assert bench.figure_against(69.96 - 64, 6, 1, "+") == "+5.96" and bench.figure_against(0.3 - 1e-12, 0.3) == "0.299"
    # an oracle's gain just under the bound that makes the targets not apply
    note = bench.target_lines([], 0.96, None)[0]
    assert note.startswith("The oracle gains +0.96 Dice points on this shift (< 1)")
    note = bench.target_lines([], 5.0, 0.96)[0]
    assert note.startswith("The TRA's oracle gains +0.96 Dice points (< 1; the best oracle +5.0)")
    undone_by = shift_undoing_ops(TARGET_SHIFTS["default"])
    tra = make_tra_policy("nnunet", num_groups=2)
    probs = [p.numpy().copy() for p in tra.probabilities()]
    series = tra.series_names.index("rotate_frontal")
    rot = tra.op_names[series].index("rot90")
    probs[series][:, 0] += probs[series][:, rot] - 0.2996  # the quarter turn at 0.2996 in both groups
    probs[series][:, rot] = 0.2996
    tra.set_probabilities(probs)
    policies = json.loads(json.dumps(policies_to_dict(tra, make_tea_policy())))
    modes = ["heuristic+mirror", "class-specific+joint"]
    results = {(m, seed): {"policies": policies} for m in modes for seed in (0, 1)}

    _, checks = bench.undoing_op_report(modes, results, [0, 1], undone_by, 8, tra_gain=14.0, oracle_gain=14.0)

    by_text = {t.text: t.met for t in checks}
    assert by_text["class-specific+joint: TRA rotate_frontal/rot90 >= 0.3 in every group (mean over seeds: "
                   "0.299 / 0.299)"] is False  # fmt: skip


def test_a_random_sign_op_is_judged_by_its_half_in_a_split_signs_run_and_not_at_all_with_spec(bench):
    """The zoom's magnifying half at 0.5 / 0.4 (its shrinking half 0): a target met in a ``split-signs`` run; in a
    ``spec`` run the signed op is reported without a target (half its draws shrink)."""
    undone_by = shift_undoing_ops({"scale": [1.4, 1.5]})
    modes = ["heuristic+mirror", "class-specific+joint"]
    for catalogue in ("split-signs", "spec"):
        tra = make_tra_policy("nnunet", num_groups=2, catalogue=catalogue)
        names = tra.op_names[0]
        probs = [p.numpy().copy() for p in tra.probabilities()]
        probs[0][:] = 0.0
        probs[0][:, 0] = [0.5, 0.6]
        probs[0][:, names.index("scale-[0.4,0.5)" if catalogue == "split-signs" else "scale±[0.4,0.5)")] = [0.5, 0.4]
        tra.set_probabilities(probs)
        policies = json.loads(json.dumps(policies_to_dict(tra, make_tea_policy())))
        results = {(m, seed): {"policies": policies} for m in modes for seed in (0, 1)}

        lines, checks = bench.undoing_op_report(modes, results, [0, 1], undone_by, 8, tra_gain=9.0, oracle_gain=9.0)

        by_text = {t.text: t.met for t in checks}
        if catalogue == "split-signs":
            assert "- class-specific+joint: TRA `scale/scale±[0.4,0.5)`: 0.50, 0.40; 0.50, 0.40 (+ / - halves: " \
                   "0.00 / 0.50, 0.00 / 0.40; 0.00 / 0.50, 0.00 / 0.40)" in lines  # fmt: skip
            assert ("- class-specific+joint: TRA `scale/scale-[0.4,0.5)` (the half that reproduces the shift): "
                    "0.50, 0.40; 0.50, 0.40") in lines  # fmt: skip
            judged = "class-specific+joint: TRA scale/scale-[0.4,0.5) >= 0.3 in every group (mean over seeds: "
            assert by_text[judged + "0.50 / 0.40)"]
        else:
            assert lines[0].endswith("(partial: its sign is drawn; no target)")
            assert not any("TRA scale" in text for text in by_text)
    # the default shift in a split-signs run: the quarter turn undoes it with either sign (both halves, summed), the
    # gamma by its + half
    policies = json.loads(json.dumps(policies_to_dict(make_tra_policy("nnunet", 2, catalogue="split-signs"),
                                                      make_tea_policy())))  # fmt: skip
    results = {(m, seed): {"policies": policies} for m in modes for seed in (0, 1)}
    _, checks = bench.undoing_op_report(modes, results, [0, 1], shift_undoing_ops(TARGET_SHIFTS["default"]), 8,
                                        tra_gain=14.0, oracle_gain=14.0)  # fmt: skip
    judged = [t.text.split(": TRA ")[1].split(" >= ")[0] for t in checks if ": TRA " in t.text]
    assert judged == ["rotate_frontal/rot90", "mirror_sagittal/flip", "gamma/gamma+[0.4,0.6)"]


def test_reuse_keeps_only_runs_made_with_the_same_settings(bench, tmp_path, monkeypatch):
    """``--reuse`` must not return a run made with other overrides or on another device as if it were this one."""
    launched = []

    def fake_bundle(args, **kwargs):  # writes what a finished run leaves
        launched.append(args)
        run_dir = Path(args[args.index("--output_dir") + 1])
        (run_dir / "metrics.json").write_text(json.dumps({"none": {"mean_dice": 0.5}}))
        (run_dir / "policies.json").write_text("{}")
        return SimpleNamespace(returncode=0)

    monkeypatch.setattr(bench.subprocess, "run", fake_bundle)
    data, run_dir = tmp_path / "data_default", tmp_path / "run"
    first = {"tra_mode": "heuristic", "max_epochs": "20"}
    bench.run_one("heuristic+mirror", 0, data, run_dir, first, "cpu", True, 1)
    bench.run_one("heuristic+mirror", 0, data, run_dir, first, "cpu", True, 1)
    assert len(launched) == 1  # same settings: reused
    bench.run_one("heuristic+mirror", 0, data, run_dir, {**first, "max_epochs": "80"}, "cpu", True, 1)
    bench.run_one("heuristic+mirror", 0, data, run_dir, {**first, "max_epochs": "80"}, "cuda", True, 1)
    assert len(launched) == 3  # other overrides, another device: run again
    (run_dir / "bench_settings.json").unlink()  # a run from before the settings were written down
    bench.run_one("heuristic+mirror", 0, data, run_dir, first, "cpu", True, 1)
    assert len(launched) == 3


def finished_run() -> dict:
    """What ``run_one`` returns for a finished run (nnU-Net's presets as its policies): the fakes' result."""
    policies = policies_to_dict(make_tra_policy("nnunet", 2), make_tea_policy())
    return {"none": 50.0, "tta": 55.0, "policies": policies, "seconds": 1.0}


def test_tea_z_reaches_the_runs_and_the_rank_targets(bench, tmp_path, monkeypatch):
    seen = {}

    def fake_run_one(mode, seed, data, run_dir, overrides, *rest):
        seen[mode] = overrides
        return finished_run()

    def fake_report(modes, results, seeds, undone_by, tea_z, *rest):
        seen["targets_z"] = tea_z
        return [], []

    monkeypatch.setattr(bench, "run_one", fake_run_one)
    monkeypatch.setattr(bench, "undoing_op_report", fake_report)
    no_shift = {"undone_by": {"tra": [], "tea": []}}
    monkeypatch.setattr(bench, "prepare_dataset", lambda out, shift, **_: (out / "data", no_shift))
    argv = ["bench", "--modes", "heuristic+mirror", "--seeds", "0", "--out", str(tmp_path)]
    monkeypatch.setattr(bench.sys, "argv", [*argv, "--tea-z", "4"])
    bench.main()
    assert seen["heuristic+mirror"]["tea_z"] == "4" and seen["targets_z"] == 4
    seen.clear()
    monkeypatch.setattr(bench.sys, "argv", [*argv, "--set", "tea_z=2"])
    bench.main()
    assert seen["heuristic+mirror"]["tea_z"] == "2" and seen["targets_z"] == 2
    monkeypatch.setattr(bench.sys, "argv", argv)
    bench.main()
    assert "tea_z" not in seen["heuristic+mirror"] and seen["targets_z"] == 8  # the bundle's own default
    monkeypatch.setattr(bench.sys, "argv", [*argv, "--tea-z", "4", "--set", "tea_z=2"])
    with pytest.raises(SystemExit):
        bench.main()


def test_a_relative_out_reaches_the_runs_as_the_folder_it_names_here(bench, tmp_path, monkeypatch):
    """The runs start in the repository root: a relative ``--out`` must still name the folder under the caller's
    working directory (it once sent the runs to a new dataset of the default shift under the repository)."""
    seen = {}

    def fake_run_one(mode, seed, data, run_dir, *rest):
        seen["data"], seen["run_dir"] = data, run_dir
        return finished_run()

    monkeypatch.setattr(bench, "run_one", fake_run_one)
    monkeypatch.setattr(bench, "undoing_op_report", lambda *args: ([], []))
    no_shift = {"undone_by": {"tra": [], "tea": []}}
    monkeypatch.setattr(bench, "prepare_dataset", lambda out, shift, **_: (out / "data", no_shift))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench.sys, "argv", ["bench", "--modes", "heuristic+mirror", "--seeds", "0", "--out", "rel"])
    bench.main()
    assert seen["data"] == tmp_path / "rel" / "data"
    assert seen["run_dir"].is_absolute() and seen["run_dir"].is_relative_to(tmp_path / "rel")


COMBINED = json.dumps(COMBINED_SHIFT)  # a shift no name stands for, as --shift takes it


def test_a_json_shift_is_parsed_checked_and_named_by_its_mapping(bench):
    assert bench.parse_shift("blur") == "blur"
    combined = bench.parse_shift(COMBINED)
    assert combined == {"long_axis": 1, "mirror_axis0": True, "blur": [0.8, 1.0]}
    canonical = '{"blur":[0.8,1.0],"long_axis":1,"mirror_axis0":true}'  # the aspects that differ from the source
    name = bench.shift_name(combined)
    assert name == f"custom-{hashlib.sha1(canonical.encode()).hexdigest()[:8]}"
    # the same mapping written otherwise has the same name; a named shift's mapping is that shift
    assert bench.shift_name({"mirror_axis0": True, "gamma": None, "blur": (0.8, 1), "long_axis": 1}) == name
    assert bench.shift_name({**combined, "scale": None, "noise": None}) == name  # a key at its source value
    assert bench.shift_name({**combined, "blur": [0.6, 0.8]}) not in (name, "blur")
    assert bench.shift_name(bench.parse_shift('{"blur": [0.8, 1]}')) == bench.shift_name("blur") == "blur"
    for text, shown in [('{"long_axis": 5}', "'long_axis' .* got 5"), ('{"flip": true}', r"\['flip'\]"),
                        ('{"gamma": [2, 1]}', r"'gamma' .* got \[2, 1\]"), ('{"blur": ', "not a JSON object"),
                        ("nope", "unknown target_shift 'nope'")]:  # fmt: skip
        with pytest.raises(argparse.ArgumentTypeError, match=shown):
            bench.parse_shift(text)


def test_a_json_shift_gets_its_own_dataset_runs_report_and_oracle(bench, tmp_path, monkeypatch, capsys):
    """``--shift JSON``: its dataset, runs and report named by its mapping, its oracle read from its dataset."""
    import jcsaug.data

    real = jcsaug.data.make_synthetic_dataset
    tiny = {"num_train": 1, "num_test": 1, "shape": (24, 24, 24)}  # (one validation volume: --num-val 1)
    monkeypatch.setattr(jcsaug.data, "make_synthetic_dataset", lambda out, **kw: real(out, **{**kw, **tiny}))
    seen = {}

    def fake_run_one(mode, seed, data, run_dir, overrides, *rest):
        seen[mode] = (data, run_dir, overrides)
        return finished_run()

    monkeypatch.setattr(bench, "run_one", fake_run_one)
    argv = ["bench", "--modes", "heuristic+mirror", "oracle+mirror", "heuristic+oracle-tea", "--seeds", "0", "--out",
            str(tmp_path), "--num-val", "1"]  # fmt: skip
    monkeypatch.setattr(bench.sys, "argv", [*argv, "--shift", COMBINED])
    bench.main()
    name = bench.shift_name(json.loads(COMBINED))
    data, run_dir, overrides = seen["oracle+mirror"]
    first_tea = seen["heuristic+oracle-tea"][2]["tea_policy"]
    assert data == tmp_path / f"data_{name}" and run_dir == tmp_path / "runs" / name / "oracle+mirror" / "seed0"
    assert bench.run_settings("oracle+mirror", 0, data, overrides, "cpu")["dataset"] == f"data_{name}"
    recorded = json.loads((data / "dataset.json").read_text())
    assert recorded["target_shift"] == COMBINED_SHIFT_RECORDED
    preset = json.loads(overrides["tra_preset"])  # the oracle: the undoing ops of the dataset's own metadata
    assert set(preset) == {"base", "rotate_longitudinal", "mirror_sagittal", "blur_sharpen"}
    report = (tmp_path / f"learning_quality_{name}.md").read_text()
    assert report.startswith(f"## Learning quality, shift `{name}`")
    mapping = '`{"long_axis": 1, "mirror_axis0": true, "blur": [0.8, 1.0]}`'
    described = "lesion long axis rotated from array axis 0 to 1, placement and bias field mirrored along axis 0, "
    assert f"Target domain {mapping}: {described}Gaussian blur sigma 0.8-1 voxel. Validation volumes: 1." in report
    # another mapping: another dataset and other runs (--reuse cannot mix them)
    monkeypatch.setattr(bench.sys, "argv", [*argv, "--shift", '{"long_axis": 1, "blur": [0.6, 0.8]}'])
    bench.main()
    other = seen["oracle+mirror"]
    assert other[0] != data and other[1].parent.parent != run_dir.parent.parent
    assert set(json.loads(other[2]["tra_preset"])) == {"base", "rotate_longitudinal", "blur_sharpen"}
    # each shift's oracle TEA policy file is its own (two benchmarks sharing --out do not overwrite each other's)
    other_tea = seen["heuristic+oracle-tea"][2]["tea_policy"]
    assert Path(first_tea).parent == tmp_path / "runs" / name and Path(other_tea).parent == other[1].parent.parent
    first, second = load_policies(first_tea)[1], load_policies(other_tea)[1]
    assert not torch.equal(first.logits, second.logits)  # the mirror undoes only the first shift
    monkeypatch.setattr(bench.sys, "argv", [*argv, "--shift", '{"long_axis": 1, "gamma": [0, 2]}'])
    with pytest.raises(SystemExit):
        bench.main()
    assert "argument --shift: target_shift 'gamma' must be" in capsys.readouterr().err


def test_num_val_adds_validation_volumes_and_keeps_the_test_volumes(bench, tmp_path, monkeypatch, capsys):
    """``--num-val``: the dataset's validation volumes, the first ones and the test volumes the same arrays as with
    fewer; its count in the report and the record; an ``--out`` whose dataset has another count is refused."""
    import jcsaug.data

    assert bench.default_validation_volumes() == 4  # the synthetic bundle's dataset, every report so far
    real = jcsaug.data.make_synthetic_dataset
    tiny = {"num_train": 1, "num_test": 2, "shape": (24, 24, 24)}
    monkeypatch.setattr(jcsaug.data, "make_synthetic_dataset", lambda out, **kw: real(out, **{**kw, **tiny}))
    few, _ = bench.prepare_dataset(tmp_path / "few", "default", num_val=1)
    more, _ = bench.prepare_dataset(tmp_path / "more", "default", num_val=3)
    lists = [json.loads((d / "dataset.json").read_text()) for d in (few, more)]
    assert [len(d["validation"]) for d in lists] == [1, 3] and [len(d["test"]) for d in lists] == [2, 2]

    def arrays(data, entry):  # noqa: ANN001, ANN202
        return [np.asarray(nib.load(data / entry[k]).dataobj) for k in ("image", "label")]

    for split, count in (("validation", 1), ("test", 2)):
        for a, b in zip(lists[0][split][:count], lists[1][split][:count]):
            assert all(np.array_equal(x, y) for x, y in zip(arrays(few, a), arrays(more, b)))
    with pytest.raises(SystemExit, match="holds a dataset with 1 validation volumes, not the 3"):
        bench.prepare_dataset(tmp_path / "few", "default", num_val=3)

    monkeypatch.setattr(bench, "run_one", lambda *args, **kw: finished_run())
    out = tmp_path / "more"
    monkeypatch.setattr(bench.sys, "argv", ["bench", "--modes", "heuristic+mirror", "--seeds", "0", "--out", str(out),
                                            "--num-val", "3"])  # fmt: skip
    bench.main()
    assert ". Validation volumes: 3." in (out / "learning_quality_default.md").read_text()
    assert json.loads((out / "learning_quality_default.json").read_text())["validation_volumes"] == 3
    monkeypatch.setattr(bench.sys, "argv", ["bench", "--seeds", "0", "--out", str(out), "--num-val", "0"])
    with pytest.raises(SystemExit):
        bench.main()
    assert "--num-val must be >= 1, got 0" in capsys.readouterr().err


def test_validation_evaluates_each_run_once_with_its_own_settings_and_reads_its_own_tta(bench, tmp_path, monkeypatch):
    """``--validation``: the bundle's evaluate.yaml on the validation and the test split, with the run's overrides;
    kept while newer than the run's metrics.json; the Dice read with the TTA method the run itself was tested with,
    and its lead over mirroring on the same network on both splits."""
    launched = []

    def fake_bundle(args, **kwargs):  # writes what evaluate.yaml leaves for the split it was given
        launched.append(args)
        run_dir = Path(args[args.index("--output_dir") + 1])
        split = args[args.index("--evaluate_split") + 1]
        learned = 0.7 if split == "validation" else 0.65
        metrics = {"none": {"mean_dice": 0.6}, "heuristic": {"mean_dice": 0.62}, "learned": {"mean_dice": learned}}
        name = "metrics_evaluate.json" if split == "test" else f"metrics_evaluate_{split}.json"
        (run_dir / name).write_text(json.dumps(metrics))
        return SimpleNamespace(returncode=0)

    monkeypatch.setattr(bench.subprocess, "run", fake_bundle)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.json").write_text(json.dumps({"none": {"mean_dice": 0.5}, "learned": {"mean_dice": 0.55}}))
    overrides = {"tra_mode": "class-specific", "tea_mode": "joint"}
    got = bench.evaluate_validation(run_dir, tmp_path / "data", overrides, "cpu", 1)
    # the run's own TTA ("learned"), not mirroring; its lead over mirroring: 8 points on validation, 3 on test
    assert got == pytest.approx({"none": 60.0, "tta": 70.0, "lead_validation": 8.0, "lead_test": 3.0})
    assert sorted(a[a.index("--evaluate_split") + 1] for a in launched) == ["test", "validation"]
    for args in launched:
        assert "evaluate.yaml" in args[args.index("--config_file") + 1]
        assert args[args.index("--tea_mode") + 1] == "joint"
        assert args[args.index("--dataset_dir") + 1] == str(tmp_path / "data")
    bench.evaluate_validation(run_dir, tmp_path / "data", overrides, "cpu", 1)
    assert len(launched) == 2  # kept
    later = (run_dir / "metrics_evaluate_validation.json").stat().st_mtime + 10
    os.utime(run_dir / "metrics.json", (later, later))  # the run was made again since: evaluated again
    bench.evaluate_validation(run_dir, tmp_path / "data", overrides, "cpu", 1)
    assert len(launched) == 4
    (run_dir / "metrics.json").write_text(json.dumps({"none": {"mean_dice": 0.5}, "heuristic": {"mean_dice": 0.5}}))
    assert bench.evaluate_validation(run_dir, tmp_path / "data", overrides, "cpu", 1)["lead_test"] == 0.0  # mirroring
    monkeypatch.setattr(bench.subprocess, "run", lambda args, **kwargs: SimpleNamespace(returncode=1))
    os.utime(run_dir / "metrics.json", (later + 10, later + 10))
    with pytest.raises(RuntimeError, match="on the validation split failed .*bench_evaluate_validation.log"):
        bench.evaluate_validation(run_dir, tmp_path / "data", overrides, "cpu", 1)


def test_the_validation_table_sets_each_modes_validation_dice_beside_its_test_dice(bench):
    test = {("heuristic+mirror", 0): {"none": 80.0, "tta": 81.0}, ("heuristic+mirror", 1): {"none": 82.0, "tta": 83.0},
            ("class-specific+joint", 0): {"none": 79.0, "tta": 80.0},
            ("class-specific+joint", 1): {"none": 81.0, "tta": 82.0}}  # fmt: skip
    mirror = {"lead_validation": 0.0, "lead_test": 0.0}
    val = {("heuristic+mirror", 0): {"none": 70.0, "tta": 71.0, **mirror},
           ("heuristic+mirror", 1): {"none": 72.0, "tta": 73.0, **mirror},
           ("class-specific+joint", 0): {"none": 73.0, "tta": 77.0, "lead_validation": 3.0, "lead_test": 1.0},
           ("class-specific+joint", 1): {"none": 75.0, "tta": 79.0, "lead_validation": 2.0, "lead_test": 0.0},
           }  # fmt: skip
    lines = bench.validation_lines(["heuristic+mirror", "class-specific+joint"], test, val, [0, 1], 4)
    assert "4 cases" in lines[0]
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines if line.startswith("| ") and "mode" not in line}
    # validation 74 / 78, test 80 / 81; against the baseline (71 / 72 and 81 / 82): +6 / +3 and -1 / -1; the leads
    assert rows["class-specific+joint"] == (
        "| class-specific+joint | 74.0 / 78.0 | 80.0 / 81.0 | +6.0 / +3.0 | -1.0 / -1.0 | +2.5 / +0.5 |"
    )
    assert rows["heuristic+mirror"].endswith("| +0.0 / +0.0 | +0.0 / +0.0 | +0.0 / +0.0 |")


def test_validation_reaches_the_report_only_when_asked(bench, tmp_path, monkeypatch, capsys):
    evaluated = []
    monkeypatch.setattr(bench, "run_one", lambda *args: finished_run())
    on_validation = {**finished_run(), "lead_validation": 1.0, "lead_test": 0.5}
    monkeypatch.setattr(bench, "evaluate_validation", lambda run_dir, *rest: evaluated.append(run_dir) or on_validation)
    monkeypatch.setattr(bench, "undoing_op_report", lambda *args: ([], []))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "dataset.json").write_text(json.dumps({"validation": [{}, {}, {}]}))
    no_shift = {"undone_by": {"tra": [], "tea": []}}
    monkeypatch.setattr(bench, "prepare_dataset", lambda out, shift, **_: (out / "data", no_shift))
    argv = ["bench", "--modes", "heuristic+mirror", "class-specific+joint", "--seeds", "0", "1", "--out", str(tmp_path)]
    monkeypatch.setattr(bench.sys, "argv", argv)
    bench.main()
    assert evaluated == [] and "Validation split" not in capsys.readouterr().out
    monkeypatch.setattr(bench.sys, "argv", [*argv, "--validation"])
    bench.main()
    assert len(evaluated) == 4  # every run
    report = (tmp_path / "learning_quality_default.md").read_text()
    assert "Validation split (3 cases" in report
    assert "| class-specific+joint | 50.0 / 55.0 | 50.0 / 55.0 | +0.0 / +0.0 | +0.0 / +0.0 | +1.0 / +0.5 |" in report


def test_the_record_beside_the_report_holds_its_figures_and_verdicts(bench, tmp_path, monkeypatch):
    """``learning_quality_NAME.json``: the settings, Dice per mode and seed, the report's verdicts line for line."""
    dice = {"heuristic+mirror": (50.0, 55.0), "class-specific+joint": (56.0, 62.0)}

    def fake_run_one(mode, seed, *rest):
        return {**finished_run(), "none": dice[mode][0] + seed, "tta": dice[mode][1] + seed, "seconds": 10.0 + seed}

    monkeypatch.setattr(bench, "run_one", fake_run_one)
    shift = {"undone_by": shift_undoing_ops(TARGET_SHIFTS["default"])}
    monkeypatch.setattr(bench, "prepare_dataset", lambda out, _, **__: (out / "data", shift))
    argv = ["bench", "--modes", "class-specific+joint", "--seeds", "0", "1", "--out", str(tmp_path), "--set",
            "tra_counterfactuals=4"]  # fmt: skip
    monkeypatch.setattr(bench.sys, "argv", argv)
    bench.main()

    record = json.loads((tmp_path / "learning_quality_default.json").read_text())
    report = (tmp_path / "learning_quality_default.md").read_text()
    assert record["shift"] == "default" and record["seeds"] == [0, 1] and record["device"] == "cpu"
    assert record["target_domain"] == {"long_axis": 2, "mirror_axis0": True, "gamma": [1.4, 1.6]}
    assert record["settings"] == ["tra_counterfactuals=4"] and record["baseline"] == "heuristic+mirror"
    assert record["dice"]["class-specific+joint"] == {"none": [56.0, 57.0], "tta": [62.0, 63.0]}
    assert record["seconds"]["heuristic+mirror"] == [10.0, 11.0] and record["oracle_gain"] is None
    verdicts = [f"- {t['verdict']} {t['target']}" for t in record["targets"]]
    assert verdicts == [line for line in report.splitlines() if line.startswith(("- PASS ", "- MISS ", "- N/A "))]
    assert verdicts[:2] == ["- PASS joint - heuristic+mirror >= 6 Dice points (mean +7.0)",
                            "- PASS learned TRA without TTA - heuristic without TTA >= 4 (mean +6.0)"]  # fmt: skip
    assert record["targets"][2] == {  # the preset's quarter turn: the figure judged is in the text and the label
        "target": "class-specific+joint: TRA rotate_frontal/rot90 >= 0.3 in every group (mean over seeds: 0.02 / 0.02)",
        "label": "class-specific+joint: TRA rotate_frontal/rot90 0.02 / 0.02",
        "verdict": "MISS",
    }
