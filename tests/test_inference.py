"""TTA inferers: learned top-z TEA, nnU-Net mirroring, none; loading policies."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from monai.inferers import SlidingWindowInferer

from jcsaug.engine import AugmentationSetup
from jcsaug.inference import MirrorTTAInferer, NoTTAInferer, TEAInferer, load_tea_policy, make_tta_inferer
from jcsaug.policy import make_tea_policy, make_tra_policy
from jcsaug.policy.io import save_policies
from jcsaug.policy.presets import TEA_FLIP_IDS


def _net(x):
    """Not flip-equivariant: depends on position."""
    ramp = torch.linspace(0, 1, x.shape[2]).view(1, 1, -1, 1, 1)
    return torch.cat([x * ramp, 1 - x], dim=1)


def _symmetric_net(x):
    """Flip-equivariant (pointwise) toy model."""
    return torch.cat([x, -x], dim=1)


def test_identity_top_op_equals_plain_inference():
    policy = make_tea_policy("nnunet")
    with torch.no_grad():
        policy.logits[0, 0] = 50.0  # identity dominates: softmax weight ~1
    x = torch.rand(2, 1, 8, 9, 10)
    out = TEAInferer.from_policy(policy, z=4)(x, _net)
    torch.testing.assert_close(out, _net(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(NoTTAInferer()(x, _net), _net(x))


def test_mirror_tta_of_flip_equivariant_model_equals_plain():
    x = torch.rand(1, 1, 8, 9, 10)
    out = MirrorTTAInferer()(x, _symmetric_net)
    torch.testing.assert_close(out.softmax(1), _symmetric_net(x).softmax(1), atol=1e-5, rtol=1e-5)
    assert [op.id for op in MirrorTTAInferer().ops] == list(TEA_FLIP_IDS)


def test_mirror_tta_averages_the_probabilities_of_the_eight_mirrorings():
    """Against a hand-computed nnU-Net mirroring, on a model that is not flip-equivariant (the eight flips of the
    three axes, each prediction flipped back, probabilities averaged with equal weights)."""
    x = torch.rand(1, 1, 8, 9, 10)
    flips = [dims for n in range(4) for dims in itertools.combinations((2, 3, 4), n)]
    probs = [torch.flip(_net(torch.flip(x, dims)), dims).softmax(1) if dims else _net(x).softmax(1) for dims in flips]
    expected = torch.log(torch.stack(probs).mean(0))
    out = MirrorTTAInferer()(x, _net)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out.softmax(1), _net(x).softmax(1), atol=1e-3)  # the mirrorings do change it


def test_top_z_weights_are_softmax_of_chosen_logits_and_wrap_sliding_window():
    policy = make_tea_policy("uniform")
    logits = torch.linspace(-1, 1, 84)
    with torch.no_grad():
        policy.logits[0] = logits
    inferer = TEAInferer.from_policy(policy, z=3, base_inferer=SlidingWindowInferer(roi_size=(8, 8, 8)))
    assert [op.id for op in inferer.ops] == [83, 82, 81]
    np.testing.assert_allclose(inferer.weights, torch.softmax(logits[[83, 82, 81]].double(), 0).numpy(), rtol=1e-6)
    out = inferer(torch.rand(1, 1, 12, 12, 12), _symmetric_net)
    assert out.shape == (1, 2, 12, 12, 12)


def test_non_cubic_rotations_are_batched_by_shape_and_mapped_back():
    ops_policy = make_tea_policy("uniform")
    with torch.no_grad():
        ops_policy.logits[0, [14, 19, 0]] = 10.0  # rot90 ACW/CW about frontal + identity
    x = torch.rand(1, 1, 6, 8, 10)
    out = TEAInferer.from_policy(ops_policy, z=3)(x, _symmetric_net)
    torch.testing.assert_close(out, _symmetric_net(x), atol=1e-5, rtol=1e-5)


def test_loading_policies_and_errors(tmp_path):
    path = save_policies(tmp_path / "policies.json", tea=make_tea_policy())
    assert load_tea_policy(path).logits.shape == (1, 84)
    torch.save({"tea_policy": make_tea_policy().state_dict()}, tmp_path / "c.pt")
    assert load_tea_policy(tmp_path / "c.pt").logits.shape == (1, 84)
    only_tra = save_policies(tmp_path / "tra.json", tra=make_tra_policy())
    with pytest.raises(ValueError, match="holds no TEA policy"):
        load_tea_policy(only_tra)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tea_policy(tmp_path / "nope.json")
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot read checkpoint"):
        load_tea_policy(tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="not a TEA policy"):
        TEAInferer.from_policy(make_tra_policy(), z=4)


@pytest.mark.parametrize("tea_mode", ["none", "heuristic", "learned-posthoc"])
def test_checkpoints_of_runs_without_a_tested_tea_policy_offer_none(tmp_path, tea_mode):
    """While training, these modes hold only the untrained TEA preset: a checkpoint must not pass it off as a TEA
    policy to test with (``learned-posthoc`` learns its policy after training, into ``policies.json``)."""
    items = AugmentationSetup("heuristic", tea_mode).updaters(None, None, None).checkpoint_items()
    torch.save({k: v.state_dict() for k, v in items.items()}, tmp_path / "c.pt")
    with pytest.raises(ValueError, match="holds no TEA policy"):
        load_tea_policy(tmp_path / "c.pt")
    with pytest.raises(ValueError, match="holds none"):
        make_tta_inferer("learned", tea_policy=tmp_path / "c.pt")


def test_checkpoints_of_a_fixed_tea_policy_hold_it(tmp_path):
    tea = make_tea_policy("uniform")
    path = save_policies(tmp_path / "policies.json", tea=tea)
    items = AugmentationSetup("heuristic", "fixed", tea_policy_file=path).updaters(None, None, None).checkpoint_items()
    torch.save({k: v.state_dict() for k, v in items.items()}, tmp_path / "c.pt")
    torch.testing.assert_close(load_tea_policy(tmp_path / "c.pt").logits, tea.logits)
    with pytest.raises(ValueError, match="z must be in"):
        TEAInferer.from_policy(make_tea_policy(), z=0)


def test_one_factory_builds_every_test_time_method(tmp_path):
    from jcsaug.inference import make_tta_inferer, make_tta_inferers

    path = save_policies(tmp_path / "policies.json", tea=make_tea_policy())
    assert isinstance(make_tta_inferer("none", None, path), NoTTAInferer)
    assert isinstance(make_tta_inferer("heuristic", None, path), MirrorTTAInferer)
    assert len(make_tta_inferer("learned", None, path, z=4).ops) == 4  # from a policies.json
    assert len(make_tta_inferer("learned", None, make_tea_policy(), z=3).ops) == 3  # from a policy
    with pytest.raises(KeyError, match="unknown test-time augmentation 'mirror'; valid names: heuristic, learned"):
        make_tta_inferer("mirror", None, path)
    only_tra = save_policies(tmp_path / "tra.json", tra=make_tra_policy())
    with pytest.raises(ValueError, match="tra.json holds none"):
        make_tta_inferer("learned", None, only_tra)
    methods = ["none", "heuristic", "learned"]
    assert list(make_tta_inferers(methods, None, only_tra, skip_unavailable=True)) == ["none", "heuristic"]
    assert list(make_tta_inferers(methods, None, path)) == methods


def test_identity_weight_makes_the_ensemble_the_probability_weighted_mixture_of_identity_op_pairs(tmp_path):
    """``identity_weight=w``: the identity at ``w`` (once, whatever its own logit) and the top ``z - 1`` other ops
    sharing ``1 - w`` by the softmax of their logits; with 1/2 the output logits are the probability-weighted
    mean of the (identity, op) pairs' averaged logits, the pairs a ``with-identity`` TEA score rates. Bad values
    are refused; the factories pass it to ``learned`` only."""
    from jcsaug.inference import make_tta_inferers

    policy = make_tea_policy("uniform")
    with torch.no_grad():
        policy.logits[0] = torch.linspace(0.0, -3.0, policy.logits.shape[1])
        policy.logits[0, 0] = 5.0  # the identity most probable: not counted twice
        policy.logits[0, 38], policy.logits[0, 54] = 2.0, 1.0  # mirror_sagittal, shift_add_0.05
    inferer = TEAInferer.from_policy(policy, z=3, identity_weight=0.5)
    assert [op.id for op in inferer.ops] == [0, 38, 54]
    p = torch.softmax(torch.tensor([2.0, 1.0], dtype=torch.float64), 0)
    np.testing.assert_allclose(inferer.weights, [0.5, 0.5 * float(p[0]), 0.5 * float(p[1])], rtol=1e-12)
    x = torch.rand(1, 1, 8, 9, 10)
    plain = _net(x)
    mirrored = torch.flip(_net(torch.flip(x, (2,))), (2,))
    shifted = _net(x + 0.05)
    pairs = float(p[0]) * (plain + mirrored) / 2 + float(p[1]) * (plain + shifted) / 2
    torch.testing.assert_close(inferer(x, _net), pairs, atol=1e-5, rtol=1e-5)
    assert [op.id for op in TEAInferer.from_policy(policy, z=3).ops] == [0, 38, 54]  # the paper's: by probability
    for bad, match in (({"identity_weight": 0.0}, "identity_weight"), ({"identity_weight": 1.0}, "identity_weight"),
                       ({"identity_weight": 0.5, "z": 1}, "z must be >= 2")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            TEAInferer.from_policy(policy, **{"z": 3, **bad})
    path = save_policies(tmp_path / "policies.json", tea=policy)
    inferers = make_tta_inferers(["none", "heuristic", "learned"], None, path, z=3, identity_weight=0.5)
    assert isinstance(inferers["none"], NoTTAInferer) and isinstance(inferers["heuristic"], MirrorTTAInferer)
    assert inferers["learned"].weights[0] == pytest.approx(0.5)


def test_equal_identity_weight_gives_the_identity_and_the_top_other_ops_one_zth_each(tmp_path):
    """``identity_weight="equal"``: the identity (once, whatever its logit) and the ``z - 1`` other ops of highest
    probability, 1/z each, whatever their logits: the output is the plain mean of the copies' mapped-back logits. From
    a policy file too; a string other than ``"equal"`` (a numeric one too) or a bool is refused, naming the setting."""
    from jcsaug.inference import EQUAL_WEIGHTS, make_tta_inferers

    policy = make_tea_policy("uniform")
    with torch.no_grad():
        policy.logits[0] = torch.linspace(0.0, -3.0, policy.logits.shape[1])
        policy.logits[0, 0] = -9.0  # the identity least probable: kept all the same
        policy.logits[0, 38], policy.logits[0, 54] = 4.0, 1.0  # mirror_sagittal, shift_add_0.05
    inferer = TEAInferer.from_policy(policy, z=3, identity_weight=EQUAL_WEIGHTS)
    assert [op.id for op in inferer.ops] == [0, 38, 54]
    np.testing.assert_allclose(inferer.weights, [1 / 3] * 3, rtol=1e-12)
    x = torch.rand(1, 1, 8, 9, 10)
    mirrored = torch.flip(_net(torch.flip(x, (2,))), (2,))
    torch.testing.assert_close(inferer(x, _net), (_net(x) + mirrored + _net(x + 0.05)) / 3, atol=1e-5, rtol=1e-5)
    path = save_policies(tmp_path / "policies.json", tea=policy)
    learned = make_tta_inferers(["learned"], None, path, z=4, identity_weight="equal")["learned"]
    assert learned.ops[0].id == 0 and len(learned.ops) == 4
    np.testing.assert_allclose(learned.weights, [0.25] * 4, rtol=1e-12)
    for bad in ("half", "Equal", "0.5", True, float("nan")):  # a numeric string or a bool is not a weight
        with pytest.raises(ValueError, match=r"identity_weight must be a number in \(0, 1\), 'equal' or None"):
            TEAInferer.from_policy(policy, z=3, identity_weight=bad)
    with pytest.raises(ValueError, match="z must be >= 2"):
        TEAInferer.from_policy(policy, z=1, identity_weight=EQUAL_WEIGHTS)


def test_learned_plus_mirror_averages_the_learned_and_mirrored_probabilities(tmp_path):
    """``learned+mirror``: the learned TEA's top ``z`` ops and nnU-Net's 8 mirrorings, their class probabilities
    averaged 1:1 and returned as a log (so ``argmax`` and ``softmax`` downstream read it as the others); like
    ``learned`` it needs a TEA policy, and is left out without one where unavailable methods are skipped."""
    from jcsaug.inference import BlendedTTAInferer, make_tta_inferer, make_tta_inferers

    policy = make_tea_policy("uniform")
    with torch.no_grad():
        policy.logits[0, 38], policy.logits[0, 54] = 2.0, 1.0  # mirror_sagittal, shift_add_0.05 on top
    path = save_policies(tmp_path / "policies.json", tea=policy)
    blended = make_tta_inferer("learned+mirror", None, path, z=3)
    assert isinstance(blended, BlendedTTAInferer) and blended.weights == [0.5, 0.5]
    x = torch.rand(1, 1, 8, 9, 10)
    learned = torch.softmax(make_tta_inferer("learned", None, path, z=3)(x, _net), 1)
    mirrored = torch.softmax(make_tta_inferer("heuristic", None, path)(x, _net), 1)
    out = blended(x, _net)
    torch.testing.assert_close(out.exp(), (learned + mirrored) / 2, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(torch.softmax(out, 1), (learned + mirrored) / 2, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(learned, mirrored, atol=1e-3)  # the two members differ: the mean is no accident
    only_tra = save_policies(tmp_path / "tra.json", tra=make_tra_policy())
    with pytest.raises(ValueError, match="tra.json holds none"):
        make_tta_inferer("learned+mirror", None, only_tra)
    methods = ["none", "learned", "learned+mirror"]
    assert list(make_tta_inferers(methods, None, only_tra, skip_unavailable=True)) == ["none"]
    for bad in ([], [NoTTAInferer()] * 2):
        with pytest.raises(ValueError, match="at least one member|non-negative weights"):
            BlendedTTAInferer(bad, weights=None if not bad else [1.0, -1.0])


def test_evaluate_cases_predicts_a_blends_members_once(tmp_path):
    """Evaluating every method, ``learned+mirror`` combines the outputs ``learned`` and ``heuristic`` just gave
    (built from the same member objects): the network sees 1 + 8 + z copies per case, not 1 + 2 (8 + z), and each
    method's figures are those it gets evaluated alone."""
    from jcsaug.evaluation import evaluate_cases
    from jcsaug.inference import list_tta_inferers, make_tta_inferers

    policy = make_tea_policy("uniform")
    with torch.no_grad():
        policy.logits[0, 38], policy.logits[0, 54] = 2.0, 1.0
    path = save_policies(tmp_path / "policies.json", tea=policy)
    generator = torch.Generator().manual_seed(0)
    data = {"image": torch.rand(1, 8, 9, 10, generator=generator)}
    data["label"] = (data["image"] > 0.5).float()
    seen = []

    class CountingNet(torch.nn.Module):
        def forward(self, x):
            seen.append(x.shape[0])
            return _net(x) * 4  # sharper probabilities

    counting_net = CountingNet()

    methods = list_tta_inferers()
    assert methods.index("learned+mirror") > max(methods.index("learned"), methods.index("heuristic"))

    def evaluate(names):
        seen.clear()
        inferers = make_tta_inferers(names, None, path, z=3)
        metrics = evaluate_cases(
            counting_net, [{"image": "a"}], lambda e: data, inferers, 2, spacing=1.0, progress=False
        )
        return metrics, sum(seen)

    every, copies = evaluate(methods)
    assert copies == 1 + 8 + 3
    assert evaluate(["learned+mirror"])[1] == 8 + 3
    for name in methods:
        assert every[name]["per_case"][0]["dice"] == evaluate([name])[0][name]["per_case"][0]["dice"], name


def test_a_learned_tta_from_a_file_follows_the_file(tmp_path):
    """``learned`` from a ``policies.json`` tests the TEA policy the file holds when it predicts (read again when the
    file is replaced, as a run that is still learning replaces it); until the file exists, a ``TEAPolicyFile``'s
    initial policy, with a warning, and without one the method is unavailable (left out where unavailable methods
    are skipped). A file rewritten without a TEA policy is an error naming it; a deleted one keeps the last."""
    from jcsaug.inference import PolicyFileTEAInferer, TEAPolicyFile, make_tta_inferers

    def policy_with(**top: float):
        policy = make_tea_policy("uniform")
        with torch.no_grad():
            for op, logit in top.items():
                policy.logits[0, int(op[1:])] = logit
        return policy

    path = tmp_path / "run" / "policies.json"
    methods = ["none", "heuristic", "learned", "learned+mirror"]
    assert list(make_tta_inferers(methods, None, path, skip_unavailable=True)) == ["none", "heuristic"]
    with pytest.raises(ValueError, match="policies.json does not exist"):
        make_tta_inferer("learned", None, path)
    initial, first, second = policy_with(o38=5.0, o54=4.0), policy_with(o6=5.0, o3=4.0), policy_with(o12=5.0, o9=4.0)
    with pytest.warns(UserWarning, match="does not exist yet: the learned TTA uses the initial TEA policy"):
        inferers = make_tta_inferers(methods, None, TEAPolicyFile(path, initial=initial), z=2)
    learned, blended = inferers["learned"], inferers["learned+mirror"]
    assert isinstance(learned, PolicyFileTEAInferer) and blended.members[0] is learned
    x = torch.rand(1, 1, 8, 9, 10)
    for policy in (initial, first, second):
        if policy is not initial:
            path.parent.mkdir(exist_ok=True)
            save_policies(path, tea=policy)
        torch.testing.assert_close(learned(x, _net), TEAInferer.from_policy(policy, z=2)(x, _net))
        assert learned.refresh() is False  # read once per change
    assert [op.id for op in learned.ops] == [12, 9]
    assert [op.id for op in make_tta_inferers(methods, None, path, z=2)["learned"].ops] == [12, 9]
    save_policies(path, tra=make_tra_policy())
    with pytest.raises(ValueError, match="policies.json holds no TEA policy"):
        learned(x, _net)
    save_policies(path, tea=first)
    learned(x, _net)
    path.unlink()
    assert learned.refresh() is False and [op.id for op in learned.ops] == [6, 3]
    members = (TEAInferer.from_policy(first, z=2), MirrorTTAInferer())
    torch.testing.assert_close(blended(x, _net).exp(), sum(torch.softmax(m(x, _net), 1) for m in members) / 2)


def test_an_evaluation_tests_the_initial_tea_policy_only_of_a_mode_that_learns_it_during_training():
    """``initial_tea_policy``: the ``tea_preset`` for ``joint`` (learned during training, so an evaluation built before
    the first epoch tests it until ``policies.json`` is written), ``None`` for the others."""
    from jcsaug.engine import initial_tea_policy

    torch.testing.assert_close(initial_tea_policy("joint", "nnunet").logits, make_tea_policy("nnunet").logits)
    assert [initial_tea_policy(m) for m in ("none", "heuristic", "learned-posthoc", "fixed")] == [None] * 4
