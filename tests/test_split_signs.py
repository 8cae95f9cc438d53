"""The ``split-signs`` TRA catalogue: each signed op of SPEC §2 as two ops, so a learned policy chooses the sign."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers import load_benchmark
from jcsaug.data.synthetic import shift_undoing_ops
from jcsaug.engine import check_settings
from jcsaug.engine.modes import AugmentationSetup
from jcsaug.ops.catalogue import OpSpec, find_op, split_signs
from jcsaug.ops.tra import TRA_SERIES, sample_tra_params, tra_catalogue, tra_catalogue_name
from jcsaug.policy import BatchTRACascaded, TRACascaded, make_tea_policy, make_tra_policy
from jcsaug.policy.io import load_policies, save_policies

SPLIT = tra_catalogue("split-signs")


def test_find_op_locates_series_slash_op_in_either_catalogue_and_names_what_is_valid():
    assert find_op(TRA_SERIES, "rotate_frontal/rot90") == (1, 4)  # SPEC's quarter turn
    assert find_op(SPLIT, "rotate_frontal/rot90-") == (1, SPLIT[1].size - 1)
    with pytest.raises(KeyError, match=r"series 'rotate_frontal' has no op 'rot90-'; ops: \['identity'"):
        find_op(TRA_SERIES, "rotate_frontal/rot90-")  # a half exists in split-signs only
    with pytest.raises(KeyError, match=r"'rotate/rot90': expected 'series/op' with a series of \['scale', 'rotate_"):
        find_op(TRA_SERIES, "rotate/rot90")
    with pytest.raises(KeyError, match="expected 'series/op'"):
        find_op(TRA_SERIES, "rot90")


def test_every_signed_op_becomes_its_plus_and_minus_half_next_to_each_other():
    assert [s.name for s in SPLIT] == [s.name for s in TRA_SERIES]
    signed = sum(op.signed for s in TRA_SERIES for op in s.ops)
    assert signed == 32 and sum(len(s.ops) for s in SPLIT) == 47 + signed
    scale = SPLIT[0]
    assert scale.op_names[-2:] == ["scale+[0.4,0.5)", "scale-[0.4,0.5)"]
    assert SPLIT[1].op_names[-2:] == ["rot90+", "rot90-"]
    for s in SPLIT:
        assert not any(op.signed for op in s.ops)
    assert tra_catalogue("spec") is TRA_SERIES and split_signs(SPLIT) == SPLIT  # nothing left to split


def test_a_half_keeps_its_sign_every_draw():
    rng = np.random.RandomState(0)
    series = list(SPLIT)
    s_scale, s_rot = 0, 1
    plus = [0] * len(series)
    minus = [0] * len(series)
    plus[s_scale], minus[s_scale] = SPLIT[0].index_of("scale+[0.4,0.5)"), SPLIT[0].index_of("scale-[0.4,0.5)")
    plus[s_rot], minus[s_rot] = SPLIT[1].index_of("rotate+[20,30)"), SPLIT[1].index_of("rot90-")
    axis = SPLIT[s_rot].ops[0].axis
    for _ in range(20):
        up, down = sample_tra_params(plus, rng, series), sample_tra_params(minus, rng, series)
        assert 1.4 <= up.scale < 1.5 and 1 / 1.5 < down.scale <= 1 / 1.4
        assert np.radians(20) <= up.angles[axis] < np.radians(30)
        assert down.rot90 == [(axis, 3)]  # 270 degrees, never 90
    spec = [0] * len(TRA_SERIES)
    spec[s_scale] = TRA_SERIES[0].index_of("scale±[0.4,0.5)")
    factors = {sample_tra_params(spec, rng).scale > 1 for _ in range(40)}
    assert factors == {True, False}  # SPEC's op draws its sign


def test_a_signed_op_cannot_have_a_fixed_sign():
    with pytest.raises(ValueError, match="fixed_sign"):
        OpSpec("x", "scale", 0.1, 0.2, signed=True, fixed_sign="-")
    with pytest.raises(ValueError, match="fixed_sign"):
        OpSpec("x", "scale", 0.1, 0.2, fixed_sign="*")


@pytest.mark.parametrize("preset", ["nnunet", "deepmedic", "randaugment-m", "randaugment-l"])
def test_a_preset_makes_the_same_augmentation_distribution_in_both_catalogues(preset):
    """Each signed op's probability is shared equally by its halves: the same draws, only the sign is a choice."""
    spec, split = make_tra_policy(preset, 1), make_tra_policy(preset, 1, catalogue="split-signs")
    for s, series in enumerate(TRA_SERIES):
        p_spec, p_split = spec.probabilities()[s][0], split.probabilities()[s][0]
        # (zero-probability ops are finite logits: sums agree to ~1e-5)
        assert float(p_split[0]) == pytest.approx(float(p_spec[0]), abs=1e-4)
        for j, op in enumerate(series.ops, start=1):
            halves = [op.name] if not op.signed else [op.name.replace("±", c) if "±" in op.name else op.name + c
                                                      for c in "+-"]  # fmt: skip
            got = [float(p_split[SPLIT[s].index_of(h)]) for h in halves]
            assert sum(got) == pytest.approx(float(p_spec[j]), abs=1e-4)
            assert max(got) - min(got) < 1e-5


def test_the_catalogue_is_known_from_a_policys_op_names_and_an_unknown_one_is_named():
    assert tra_catalogue_name(make_tra_policy("nnunet", 2).op_names) == "spec"
    assert tra_catalogue_name(make_tra_policy("nnunet", 2, catalogue="split-signs").op_names) == "split-signs"
    with pytest.raises(ValueError, match="no TRA catalogue"):
        tra_catalogue_name([["identity", "a"]])
    # a policy whose ops are not named as a catalogue's: the catalogue of its series sizes
    unnamed = [[f"op{j}" for j in range(s.size)] for s in SPLIT]
    assert tra_catalogue_name(unnamed) == "split-signs"
    with pytest.raises(KeyError, match="split-signs"):
        make_tra_policy("nnunet", 2, catalogue="split")


def _sample(group: int = 1) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"image": torch.rand(1, 12, 12, 12, generator=g), "label": (torch.rand(1, 12, 12, 12, generator=g) > 0.7)
            .float(), "class_group": group}  # fmt: skip


def test_the_cascade_draws_and_records_ops_of_the_policys_catalogue():
    policy = make_tra_policy("uniform", 2, catalogue="split-signs")
    tra = TRACascaded("image", policy, label_keys="label", counterfactuals=3).set_random_state(1)
    assert tra.series == SPLIT
    ops = torch.stack([tra(_sample())["tra_ops"] for _ in range(30)])
    assert (ops.max(0).values > torch.tensor([s.size for s in TRA_SERIES]) - 1).any()  # indices only split has
    out = tra(_sample())
    assert out["image_cf"].shape == (3, 1, 12, 12, 12)
    for s, j in out["tra_cf_ops"].tolist():
        assert 0 <= j < SPLIT[s].size


def test_the_batch_cascade_gives_the_per_sample_cascades_draws_with_split_signs():
    policy = make_tra_policy("uniform", 2, catalogue="split-signs")
    per_sample = TRACascaded("image", policy, label_keys="label").set_random_state(3)
    batched = BatchTRACascaded("image", policy, label_keys="label").set_random_state(3)
    samples = [_sample(g) for g in (0, 1, 1)]
    expected = torch.stack([per_sample(s)["tra_ops"] for s in samples])
    batch = {"image": torch.stack([s["image"] for s in samples]), "label": torch.stack([s["label"] for s in samples]),
             "class_group": torch.tensor([0, 1, 1])}  # fmt: skip
    assert torch.equal(batched(batch)["tra_ops"], expected)


def test_a_policy_of_neither_catalogue_is_refused_by_the_cascade():
    from jcsaug.policy.categorical import CategoricalPolicy

    with pytest.raises(ValueError, match="TRACascaded needs a policy over the 15 TRA series"):
        TRACascaded("image", CategoricalPolicy([2, 3]))


def test_a_split_policy_round_trips_through_policies_json_and_is_used_fixed(tmp_path):
    policy = make_tra_policy("nnunet", 2, catalogue="split-signs")
    with torch.no_grad():
        policy.logits[1, SPLIT[0].index_of("scale-[0.4,0.5)")] += 3.0
    path = save_policies(tmp_path / "policies.json", policy, make_tea_policy())
    assert json.loads(path.read_text())["tra"]["groups"][0]["series"][0]["ops"][2]["name"] == "scale-[0,0.1)"
    tra, _ = load_policies(path)
    assert tra.op_names == policy.op_names and torch.allclose(tra.logits, policy.logits)
    fixed = AugmentationSetup("fixed", "none", tra_policy_file=path)
    assert tra_catalogue_name(fixed.tra_policy.op_names) == "split-signs"
    assert torch.allclose(fixed.tra_policy.logits, policy.logits)


def test_the_run_setting_builds_the_catalogue_and_a_bad_name_is_refused_before_the_run():
    setup = AugmentationSetup("class-specific", "joint", tra_catalogue="split-signs")
    assert tra_catalogue_name(setup.tra_policy.op_names) == "split-signs"
    assert tra_catalogue_name(AugmentationSetup("heuristic", "none").tra_policy.op_names) == "spec"
    with pytest.raises(ValueError, match="tra_catalogue.*'signs'"):
        check_settings(tra_catalogue="signs")


def test_the_benchmark_reads_and_sets_a_split_op_by_its_spec_name():
    bench = load_benchmark("bench_learning_quality")
    assert bench.op_names_in(SPLIT[1].op_names, "rot90") == ["rot90+", "rot90-"]
    assert bench.op_names_in(TRA_SERIES[0].op_names, "scale±[0.4,0.5)") == ["scale±[0.4,0.5)"]
    undone = shift_undoing_ops({"scale": [1.4, 1.5], "long_axis": 1})
    spec = make_tra_policy(bench.oracle_preset(undone, partial=True), 2)
    split = make_tra_policy(bench.oracle_preset(undone, partial=True, catalogue="split-signs"), 2, "split-signs")
    policies = json.loads(json.dumps({"tra": {"groups": [
        {"series": [{"series": n, "ops": [{"name": o, "probability": float(p)} for o, p in zip(ops, probs[g])]}
                    for n, ops, probs in zip(split.series_names, split.op_names, split.probabilities())]}
        for g in range(2)]}}))  # fmt: skip
    for entry in undone["tra"]:
        s = spec.series_names.index(entry["series"])
        expected = float(spec.probabilities()[s][0, spec.op_names[s].index(entry["op"])])
        assert expected == pytest.approx(0.5, abs=1e-5)
        assert bench.tra_probability(policies, entry["series"], entry["op"]) == pytest.approx([expected] * 2, abs=1e-5)
        halves = bench.tra_halves(policies, entry["series"], entry["op"])
        # rot90 undoes the rotation with either sign: both halves; the zoom's magnifying half alone
        expected = {"rot90": [0.25, 0.25], "scale±[0.4,0.5)": [0.0, 0.5]}[entry["op"]]
        assert [p for group in halves for p in group] == pytest.approx(expected * 2, abs=1e-5)


def test_the_oracle_sets_a_random_sign_op_by_its_recorded_half_and_by_both_halves_without_one():
    """In ``split-signs`` the half ``dataset.json`` names is exact (set by both oracles); a dataset written before
    the sign was recorded keeps the random-sign treatment: both halves, only in ``oracle-partial+mirror``."""
    bench = load_benchmark("bench_learning_quality")
    undone = shift_undoing_ops({"gamma": [1.4, 1.6]})
    assert bench.exact_op_names(SPLIT[7].op_names, undone["tra"][0]) == ["gamma+[0.4,0.6)"]
    assert bench.exact_op_names(TRA_SERIES[7].op_names, undone["tra"][0]) is None  # spec draws the sign
    assert bench.oracle_preset(undone) == {"base": "nnunet"}
    for partial in (False, True):
        preset = bench.oracle_preset(undone, partial=partial, catalogue="split-signs")
        assert preset["gamma"] == [0.5, 0, 0, 0, 0, 0.5, 0]
    unsigned = {"tra": [{k: v for k, v in e.items() if k != "sign"} for e in undone["tra"]], "tea": undone["tea"]}
    assert bench.oracle_preset(unsigned, catalogue="split-signs") == {"base": "nnunet"}
    preset = bench.oracle_preset(unsigned, partial=True, catalogue="split-signs")
    assert preset["gamma"] == [0.5, 0, 0, 0, 0, 0.25, 0.25]


@pytest.mark.parametrize("shift", [{"scale": [1.4, 1.5]}, {"scale": [0.65, 0.7]}, {"gamma": [1.4, 1.6]},
                                   {"gamma": [0.6, 0.7]}])  # fmt: skip
def test_the_half_the_dataset_names_changes_a_source_case_the_way_the_shift_does(shift):
    """``shift_undoing_ops`` records, per random-sign op, the ``split-signs`` half that reproduces the shift: applied
    to a source case it moves a measure of the shift (lesion volume for a zoom; mean rescaled intensity for a gamma)
    the way the target domain's case of the same seed differs from the source one; the other half the other way."""
    from jcsaug.data.synthetic import synthesize_case
    from jcsaug.ops.catalogue import half_names
    from jcsaug.ops.tra import apply_tra

    def measure(image: torch.Tensor, label: torch.Tensor) -> float:
        if "scale" in shift:
            return float(label.sum())
        return float(((image - image.min()) / (image.max() - image.min())).mean())

    (entry,) = shift_undoing_ops(shift)["tra"]
    source = [torch.as_tensor(a, dtype=torch.float32)[None] for a in synthesize_case(np.random.default_rng(1),
              (48, 48, 48), "source")]  # fmt: skip
    target = [torch.as_tensor(a, dtype=torch.float32)[None] for a in synthesize_case(np.random.default_rng(1),
              (48, 48, 48), shift)]  # fmt: skip
    shift_direction = np.sign(measure(*target) - measure(*source))
    series = [s.name for s in SPLIT].index(entry["series"])
    for sign, name in zip("+-", half_names(entry["op"])):
        choices = [0] * len(SPLIT)
        choices[series] = SPLIT[series].index_of(name)
        params = sample_tra_params(choices, np.random.RandomState(0), SPLIT)
        images, labels = apply_tra({"image": source[0]}, {"label": source[1]}, params)
        moved = np.sign(measure(images["image"], labels["label"]) - measure(*source))
        assert moved == (shift_direction if sign == entry["sign"] else -shift_direction), name


@pytest.mark.parametrize("power", [[1.4, 1.6], [0.62, 0.71]])
def test_the_gamma_op_the_dataset_names_reproduces_the_target_patches_best(power):
    """The synthetic target's gamma bends the rescaled image's curve and is then z-scored, so a patch keeps its
    brightness; the catalogue's gamma keeps each patch's mean and std too (as the reference code's does). So of the
    gamma series' ops, identity included, the one ``dataset.json`` names comes nearest (mean squared error) to the
    target case's patches, cut where the source case's are (the two cases of a seed differ by the gamma alone).
    A gamma that moved the patch's mean (MONAI's default) made the identity the nearest."""
    from jcsaug.data.synthetic import synthesize_case
    from jcsaug.ops.tra import apply_tra

    (entry,) = shift_undoing_ops({"gamma": power})["tra"]
    (named,) = [n for n in SPLIT[7].op_names if n.startswith("gamma" + entry["sign"]) and n.endswith("[0.4,0.6)")]
    assert entry["op"] == "gamma±[0.4,0.6)"
    errors = {name: 0.0 for name in SPLIT[7].op_names}
    pick = np.random.default_rng(0)
    for seed in range(3):
        source, label = synthesize_case(np.random.default_rng(seed), (48, 48, 48), "source")
        target, _ = synthesize_case(np.random.default_rng(seed), (48, 48, 48), {"gamma": power})
        for group in (0, 1):  # a background- and a lesion-centred 32^3 patch
            centre = pick.choice(np.argwhere(label == group))
            box = tuple(slice(c, c + 32) for c in np.clip(centre - 16, 0, 16))
            patch, want = torch.as_tensor(source[box])[None], torch.as_tensor(target[box])[None]
            for name in errors:
                choices = [0] * len(SPLIT)
                choices[7] = SPLIT[7].index_of(name)
                params = sample_tra_params(choices, np.random.RandomState(seed), SPLIT)
                out, _ = apply_tra({"image": patch}, {}, params)
                errors[name] += float(((out["image"] - want) ** 2).mean())
    assert min(errors, key=errors.get) == named, errors
    assert errors[named] < 0.5 * errors["identity"], errors
