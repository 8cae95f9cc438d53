"""The paired (counterfactual) estimators of issue 10: counterfactual copies, op effects, the derivative they
estimate, a known-answer task, and the fixed-policy reuse of a learned ``policies.json``."""

from __future__ import annotations

import copy
import math
import warnings

import numpy as np
import pytest
import torch
from monai.data import list_data_collate
from monai.utils import set_determinism

from helpers import TwoHeadNet, lesion_batch, tiny_unet, train_engine
from jcsaug.engine import AugmentationSetup, StepRule, TEAPolicyUpdater, TRAPolicyUpdater
from jcsaug.engine.losses import batch_dice_loss, chunked_loss
from jcsaug.engine.paired import OpEffects
from jcsaug.ops.tra import INTENSITY_FIELDS, TRA_SERIES, TRAParams, apply_tra, replace_series_op, sample_tra_params
from jcsaug.policy import CategoricalPolicy, ClassGroupd, TRACascaded, make_tea_policy, make_tra_policy
from jcsaug.policy.io import save_policies

pytestmark = pytest.mark.usefixtures("single_thread")
method = pytest.mark.method  # part of the mutation run's test set (tests/README.md)

ROT90_FRONTAL = (1, 4)  # (series, op): rotate_frontal / rot90, the quarter turn that swaps array axes 0 and 2


# ------------------------------------------------------------------------------------------- counterfactual copies
def _series_fields(params, series: int) -> dict:
    """The parts of ``params`` that series ``series``'s ops set (e.g. one rotation angle, or its quarter turns)."""
    fields = {}
    for op in TRA_SERIES[series].ops:
        if op.kind == "rotate":
            fields["angle"] = params.angles[op.axis]
        elif op.kind == "rot90":
            fields["rot90"] = [(a, k) for a, k in params.rot90 if a == op.axis]
        elif op.kind == "flip":
            fields["flip"] = [a for a in params.flip_axes if a == op.axis]
        elif op.kind == "noise":
            fields["noise"] = (params.noise_std, params.noise_seed if params.noise_std else 0)  # seed unused at 0
        else:
            fields[op.kind] = getattr(params, INTENSITY_FIELDS.get(op.kind, op.kind))
    return fields


def test_replace_series_op_changes_that_series_only():
    rng = np.random.RandomState(0)
    # two rotation series with a quarter turn each (frontal, longitudinal) and a sagittal flip
    choices = np.array([3, 4, 0, 4, 1, 0, 0, 2, 0, 1, 0, 3, 4, 2, 1])
    params = sample_tra_params(choices, rng)
    original = copy.deepcopy(params)
    image = torch.randn(1, 12, 12, 12)
    for series in range(len(TRA_SERIES)):
        for op in range(TRA_SERIES[series].size):
            replaced = replace_series_op(params, series, op, rng)
            for other in range(len(TRA_SERIES)):  # every other series keeps its exact draw
                if other != series:
                    assert _series_fields(replaced, other) == _series_fields(params, other), (series, op, other)
            if op == 0:
                identity = replace_series_op(TRAParams(), series, 0, rng)
                assert _series_fields(replaced, series) == _series_fields(identity, series), (series, op)
        if choices[series] == 0:  # already the identity: the copy is the sample, bit for bit
            same = replace_series_op(params, series, 0, rng)
            assert torch.equal(apply_tra({"x": image}, {}, same)[0]["x"], apply_tra({"x": image}, {}, params)[0]["x"])
    assert params == original  # the original is untouched (a copy)
    rot90 = replace_series_op(params, *ROT90_FRONTAL, rng)
    assert [a for a, _ in rot90.rot90].count(TRA_SERIES[1].ops[3].axis) == 1


def test_counterfactual_quarter_turns_keep_the_cascade_order():
    """Quarter turns about different axes do not commute: a copy that adds the frontal turn to a sample with a
    sagittal one must turn in the order the cascade would have drawn them (frontal series first)."""
    rng = np.random.RandomState(0)
    choices = np.zeros(len(TRA_SERIES), dtype=np.int64)
    choices[2] = 4  # rotate_sagittal / rot90
    params = sample_tra_params(choices, rng)
    copy = replace_series_op(params, *ROT90_FRONTAL, rng)
    both = choices.copy()
    both[ROT90_FRONTAL[0]] = ROT90_FRONTAL[1]
    drawn_together = sample_tra_params(both, np.random.RandomState(1))
    assert [axis for axis, _ in copy.rot90] == [axis for axis, _ in drawn_together.rot90]


def test_cascade_counterfactual_copies():
    policy = make_tra_policy("nnunet", num_groups=2)
    cascade = TRACascaded("image", policy, label_keys="label", counterfactuals=6).set_random_state(3)
    sample = {"image": torch.randn(1, 12, 12, 12), "label": (torch.rand(1, 12, 12, 12) > 0.7).to(torch.uint8),
              "class_group": 1}  # fmt: skip
    out = cascade(sample)
    assert out["image_cf"].shape == (6, 1, 12, 12, 12) and out["label_cf"].shape == (6, 1, 12, 12, 12)
    assert out["label_cf"].dtype == torch.uint8 and out["tra_cf_ops"].shape == (6, 2)
    for series, op in out["tra_cf_ops"].tolist():
        drawn = int(out["tra_ops"][series])
        assert (op == 0) == (drawn != 0)  # a drawn op is scored against the identity, else an op is explored
        assert 0 <= op < TRA_SERIES[series].size
    # each copy is the sample's own draw with that one series replaced: replay the cascade's random stream
    replay = TRACascaded("image", policy, label_keys="label", counterfactuals=6).set_random_state(3)
    choices, params = replay.randomize(sample)
    assert np.array_equal(choices, out["tra_ops"].numpy())
    counterfactuals = replay.randomize_counterfactuals(choices, params)
    assert [[s, j] for s, j, _ in counterfactuals] == out["tra_cf_ops"].tolist()
    for (_, _, copy_params), image_cf in zip(counterfactuals, out["image_cf"]):
        image = apply_tra({"image": sample["image"]}, {"label": sample["label"]}, copy_params)[0]["image"]
        assert torch.equal(image_cf, image)
    plain = TRACascaded("image", policy, label_keys="label").set_random_state(3)(sample)
    assert "image_cf" not in plain and "tra_cf_ops" not in plain  # off: nothing added
    assert torch.equal(plain["image"], out["image"])  # and the sample itself is the same draw
    batch = list_data_collate([cascade(sample), cascade(sample)])
    assert batch["image_cf"].shape == (2, 6, 1, 12, 12, 12) and batch["tra_cf_ops"].shape == (2, 6, 2)


def test_explored_ops_are_uniform_over_all_ops():
    policy = make_tra_policy({}, num_groups=1)  # identity everywhere: every copy explores
    cascade = TRACascaded("image", policy, counterfactuals=8).set_random_state(0)
    counts = np.zeros(len(cascade._explorable))
    index = {pair: i for i, pair in enumerate(cascade._explorable)}
    for _ in range(300):
        rng_choices = np.zeros(len(TRA_SERIES), dtype=int)
        params = sample_tra_params(rng_choices, cascade.R)
        for s, op, _ in cascade.randomize_counterfactuals(rng_choices, params):
            counts[index[(s, op)]] += 1
    expected = counts.sum() / len(counts)
    assert len(counts) == 47 and (counts > 0).all()
    assert abs(counts - expected).max() < 5 * math.sqrt(expected)


def _explored(cascade: TRACascaded, choices: np.ndarray, draws: int) -> np.ndarray:
    """How often each (series, op) of the catalogue is explored (applied where the sample drew another op)."""
    index = {pair: i for i, pair in enumerate(cascade._explorable)}
    counts = np.zeros(len(index))
    for _ in range(draws):
        params = sample_tra_params(choices, cascade.R)
        for s, op, _ in cascade.randomize_counterfactuals(choices, params):
            if op != 0 and op != choices[s]:
                counts[index[(s, op)]] += 1
    return counts


def test_uniform_exploration_pairs_copies_and_explores_whatever_the_policy():
    """``exploration="uniform"``: copies in pairs on one series (the identity and an explored op where the sample
    drew an op there, two explored ops where it drew the identity), and every op is explored even when the
    sample drew a non-identity op in every series, where ``"drawn"`` explores nothing."""
    policy = make_tra_policy({}, num_groups=1)
    choices = np.ones(len(TRA_SERIES), dtype=np.int64)  # no identity drawn anywhere
    uniform = TRACascaded("image", policy, counterfactuals=4, exploration="uniform").set_random_state(0)
    drawn = TRACascaded("image", policy, counterfactuals=4).set_random_state(0)
    assert _explored(drawn, choices, 50).sum() == 0  # the default only scores the sample's own ops here
    counts = _explored(uniform, choices, 400)
    own = [i for i, (s, op) in enumerate(uniform._explorable) if op == 1]
    assert counts[own].sum() == 0  # never the sample's own op
    assert (np.delete(counts, own) > 0).all()  # every other op of every series
    for own in (choices, np.zeros(len(TRA_SERIES), dtype=np.int64)):
        params = sample_tra_params(own, uniform.R)
        copies = [(s, op) for s, op, _ in uniform.randomize_counterfactuals(own, params)]
        assert len(copies) == 4
        for (s1, op1), (s2, op2) in zip(copies[::2], copies[1::2]):
            assert s1 == s2
            if own[s1]:  # the identity there, then an op other than the sample's own
                assert op1 == 0 and op2 not in (0, own[s1])
            else:  # two explored ops
                assert op1 != 0 and op2 != 0
    image = {"image": torch.randn(1, 8, 8, 8), "class_group": 0}
    assert uniform(image)["tra_cf_ops"].shape == (4, 2)
    with pytest.raises(ValueError, match=r"in pairs: counterfactuals must be even, got 3"):
        TRACascaded("image", policy, counterfactuals=3, exploration="uniform")
    with pytest.raises(KeyError, match=r"unknown counterfactual exploration 'everywhere'; valid names: drawn, uniform"):
        TRACascaded("image", policy, counterfactuals=2, exploration="everywhere")


@method
def test_an_explored_op_is_scored_against_the_copy_with_the_identity():
    """Where the sample drew an op in the series a copy explores, the explored op's effect is its copy's score
    minus the score of the copy with the identity there (same patch), not the sample's."""
    scores = torch.tensor([1.0, 2.0])
    cf_scores = torch.tensor([[5.0, 7.0], [11.0, 13.0]])
    series = torch.tensor([[3, 3], [4, 4]])
    cf_op = torch.tensor([[0, 2], [1, 2]])  # sample 0: identity + op 2 (drew op 1); sample 1: ops 1 and 2 (drew 0)
    drawn = torch.tensor([[1, 1], [0, 0]])
    reference = TRAPolicyUpdater._identity_scores(scores, cf_scores, series, cf_op, drawn)
    assert reference.tolist() == [[1.0, 5.0], [2.0, 2.0]]
    with pytest.raises(ValueError, match=r"copy 0 of sample 0 applies op 2 of series 3, where the sample drew op 1"):
        TRAPolicyUpdater._identity_scores(scores, cf_scores, series, torch.tensor([[2, 2], [1, 2]]), drawn)


# ------------------------------------------------------------------------------------------- op effects
@method
def test_op_effects_gradient_by_hand():
    policy = CategoricalPolicy([3, 2], num_groups=2)
    with torch.no_grad():
        policy.logits.copy_(torch.log(torch.tensor([[0.5, 0.25, 0.25, 0.8, 0.2], [0.6, 0.3, 0.1, 0.5, 0.5]])))
    effects = OpEffects(policy, smoothing=0.5)
    groups, series, ops = torch.tensor([0, 0, 0, 1, 1]), torch.tensor([0, 0, 1, 0, 0]), torch.tensor([1, 1, 1, 2, 0])
    sums, counts = effects.accumulate(groups, series, ops, torch.tensor([-2.0, -4.0, 1.0, 5.0, 7.0]))
    assert counts.tolist() == [[0, 2, 0, 0, 1], [0, 0, 1, 0, 0]]  # an identity "measurement" counts for nothing
    grad, mask = effects.gradient(sums, counts)
    # group 0, series 0: D = [0, -3, 0] (mean of -2, -4), b = 0.25 * -3; series 1: D = [0, 1], b = 0.2
    b00, b01 = 0.25 * -3.0, 0.2 * 1.0
    expected = torch.zeros(2, 5, dtype=torch.float64)
    expected[0, :3] = torch.tensor([0.5 * (0 - b00), 0.25 * (-3 - b00), 0.0])
    expected[0, 3:] = torch.tensor([0.8 * (0 - b01), 0.2 * (1 - b01)])
    b10 = 0.1 * 5.0  # group 1, series 0: D = [0, 0, 5]
    expected[1, :3] = torch.tensor([0.6 * (0 - b10), 0.0, 0.1 * (5 - b10)])
    torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-9)
    assert mask.tolist() == [[True, True, False, True, True], [True, False, True, False, False]]
    # a second measurement folds into the running estimate (mean of the first 1/smoothing, then moving average)
    sums, counts = effects.accumulate(torch.tensor([0]), torch.tensor([0]), torch.tensor([1]), torch.tensor([1.0]))
    effects.gradient(sums, counts)
    assert float(effects.estimate[0, 1]) == pytest.approx(-3.0 + 0.5 * (1.0 + 3.0))
    restored = OpEffects(policy)
    restored.load_state_dict(effects.state_dict())
    assert torch.equal(restored.estimate, effects.estimate) and torch.equal(restored.count, effects.count)


@method
def test_natural_gradient_is_the_softmax_gradient_without_the_probability():
    """``OpEffects(natural=True)``: ``D_m - b`` on the same entries, i.e. the softmax gradient divided by ``pi``."""
    policy = CategoricalPolicy([3, 2], num_groups=2)
    with torch.no_grad():
        policy.logits.copy_(torch.log(torch.tensor([[0.5, 0.25, 0.25, 0.8, 0.2], [0.6, 0.3, 0.1, 0.5, 0.5]])))
    measured = (torch.tensor([0, 0, 0, 1]), torch.tensor([0, 0, 1, 0]), torch.tensor([1, 2, 1, 2]))
    values = torch.tensor([-2.0, 3.0, 1.0, 5.0])
    plain, natural = OpEffects(policy), OpEffects(policy, natural=True)
    grad, mask = plain.gradient(*plain.accumulate(*measured, values))
    natural_grad, natural_mask = natural.gradient(*natural.accumulate(*measured, values))
    probs = torch.cat([p.double() for p in policy.probabilities()], dim=1)
    assert torch.equal(natural_mask, mask)
    torch.testing.assert_close(natural_grad[mask], (grad / probs)[mask], rtol=1e-9, atol=1e-12)
    assert (natural_grad[~mask] == 0).all()
    b00 = 0.25 * -2.0 + 0.25 * 3.0  # group 0, series 0: D = [0, -2, 3]
    assert natural_grad[0, :3].tolist() == pytest.approx([-b00, -2.0 - b00, 3.0 - b00])


def test_batch_dice_is_one_dice_over_the_batch():
    from monai.losses import DiceLoss

    torch.manual_seed(0)
    logits, label = torch.randn(4, 3, 6, 6, 6), torch.randint(0, 3, (4, 1, 6, 6, 6))
    reference = DiceLoss(include_background=False, to_onehot_y=True, softmax=True, batch=True)(logits, label)
    torch.testing.assert_close(batch_dice_loss([(logits, label)]), reference, rtol=1e-5, atol=1e-6)
    split = batch_dice_loss([(logits[:1], label[:1]), (logits[1:], label[1:])])
    torch.testing.assert_close(split, reference, rtol=1e-5, atol=1e-6)  # chunks add up before the ratio


def test_ce_plus_batch_dice_is_the_batch_cross_entropy_plus_one_dice_over_the_batch():
    """The dataset bundles' "DSC+CE" L_val (the reference's): torch's batch cross-entropy + the batch soft Dice,
    by name and from chunks of a batch."""
    torch.manual_seed(1)
    logits, label = torch.randn(4, 3, 6, 6, 6), torch.randint(0, 3, (4, 1, 6, 6, 6))
    expected = torch.nn.functional.cross_entropy(logits, label[:, 0]) + batch_dice_loss([(logits, label)])
    chunks = [(logits[:1], label[:1]), (logits[1:], label[1:])]
    torch.testing.assert_close(chunked_loss("CE+batch-DSC")(chunks), expected, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------- the derivative
def _counterfactual_batch(n: int, copies: int, seed: int, policy: CategoricalPolicy) -> dict:
    raw = lesion_batch(n, size=12, seed=seed)
    cascade = TRACascaded("image", policy, label_keys="label", counterfactuals=copies).set_random_state(seed)
    samples = [cascade({"image": raw["image"][i], "label": raw["label"][i],
                        "class_group": int(raw["class_group"][i])}) for i in range(n)]  # fmt: skip
    batch = list_data_collate(samples)
    return {k: (v.double() if torch.is_floating_point(v) and k != "label" else v) for k, v in batch.items()}


@method
@pytest.mark.parametrize(
    ("hypergradient", "min_cosine", "network"),
    [("jvp", 0.999, tiny_unet), ("finite-difference", 0.99, tiny_unet), ("jvp", 0.999, TwoHeadNet)],
)
def test_paired_effects_are_the_derivative_of_the_stepped_validation_loss(hypergradient, min_cosine, network):
    """Each measured effect equals dL_val(theta*)/d(weight of op vs identity on that patch), found by brute force:
    taking the training step with that pair's weight perturbed and re-evaluating the validation loss. With two
    deep-supervision heads the step trains on both (weighted) and L_val reads the first alone, as in the bundles."""
    torch.manual_seed(0)
    net = network().double()
    alpha = 0.05
    opt = torch.optim.SGD(net.parameters(), lr=alpha)
    policy = make_tra_policy("nnunet", num_groups=2)
    batch = _counterfactual_batch(4, 3, seed=1, policy=policy)
    val = {k: (v.double() if k == "image" else v) for k, v in lesion_batch(4, size=12, seed=7).items()}
    # the heads exist in training mode only: the extra passes run in it (tiny_unet has no dropout or BatchNorm)
    meta_mode = "train" if network is TwoHeadNet else "eval"
    updater = TRAPolicyUpdater(policy, net, [val], opt, lr=0.01, train_loss="ce", val_loss="ce",
                               hypergradient=hypergradient, estimator="paired", meta_mode=meta_mode)  # fmt: skip
    measured = {}
    accumulate = updater.effects.accumulate

    def capture(groups, series, ops, effects):
        measured["effects"] = effects.clone()
        return accumulate(groups, series, ops, effects)

    updater.effects.accumulate = capture
    theta = {k: v.detach().clone() for k, v in net.state_dict().items()}
    engine = train_engine(net, opt, loss="ce")
    updater.attach(engine)
    engine.run([batch], max_epochs=1)
    assert updater.updates == 1

    # brute force: theta*(delta) = theta - alpha grad [L_train + delta (l_op - l_identity)], then L_val(theta*(delta))
    from jcsaug.engine.losses import per_sample_ce, per_sample_training_losses

    cf_ops = batch["tra_cf_ops"]
    n, k = cf_ops.shape[:2]

    def train_losses(model, image, label):
        return per_sample_training_losses(per_sample_ce, model(image), label)

    def val_loss_after_step(i: int, j: int, delta: float) -> float:
        model = network().double()
        model.load_state_dict(theta)
        params = list(model.parameters())
        loss = train_losses(model, batch["image"], batch["label"]).mean()
        main = train_losses(model, batch["image"][i : i + 1], batch["label"][i : i + 1])[0]
        copy = train_losses(model, batch["image_cf"][i, j : j + 1], batch["label_cf"][i, j : j + 1])[0]
        op_minus_identity = copy - main if int(cf_ops[i, j, 1]) != 0 else main - copy
        grads = torch.autograd.grad(loss + delta * op_minus_identity, params)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p -= alpha * g
        model.eval()
        with torch.no_grad():
            return float(per_sample_ce(model(val["image"]), val["label"]).mean())

    brute = torch.tensor([(val_loss_after_step(i, j, 1e-4) - val_loss_after_step(i, j, -1e-4)) / 2e-4
                          for i in range(n) for j in range(k)], dtype=torch.float64)  # fmt: skip
    paired = measured["effects"]
    cosine = float(torch.nn.functional.cosine_similarity(paired, brute, dim=0))
    assert cosine > min_cosine, (cosine, paired, brute)
    scale = float((brute @ paired) / (paired @ paired))  # effects are scale-free: brute = alpha ||v|| D
    assert scale > 0


# ------------------------------------------------------------------------------------------- a known answer
def _oriented_sample(rng: np.random.RandomState, size: int, lesion_axis: int, centre_on_lesion: bool) -> dict:
    """Noise with two bright bars: the lesion along ``lesion_axis`` (label 1) and a distractor along the other
    in-plane axis of a frontal quarter turn (label 0). Only the orientation tells them apart."""
    other = 2 if lesion_axis == 0 else 0
    img = rng.randn(1, size, size, size).astype(np.float32) * 0.3
    lab = np.zeros((1, size, size, size), dtype=np.float32)
    c, off = size // 2, size // 4
    centres = {"lesion": (c, c, c), "distractor": (c, c + off, c + off)}
    if not centre_on_lesion:
        centres = {"lesion": (c, c + off, c + off), "distractor": (c, c, c)}
    for name, axis in (("lesion", lesion_axis), ("distractor", other)):
        sl = [slice(p - 1, p + 1) for p in centres[name]]
        sl[axis] = slice(1, size - 1)
        img[(0, *sl)] += 1.5
        if name == "lesion":
            lab[(0, *sl)] = 1
    return {"image": torch.from_numpy(img), "label": torch.from_numpy(lab)}


def _oriented_batches(policy, lesion_axis: int, seed: int, n: int = 8, size: int = 12, copies: int = 4):
    rng = np.random.RandomState(seed)
    group = ClassGroupd("label")
    cascade = TRACascaded("image", policy, label_keys="label", counterfactuals=copies).set_random_state(seed)
    while True:
        yield list_data_collate(
            [cascade(group(_oriented_sample(rng, size, lesion_axis, i % 2 == 0))) for i in range(n)]
        )


@pytest.mark.parametrize(
    ("estimator", "lookahead", "step_rule", "poly_power"),
    [("paired", 1, "adam", 0.9), ("paired", 8, "adam", 0.9), ("paired", 1, "natural", 0.9),
     ("paired", 1, "natural-recent", 0.0), ("paired", 1, "natural-unbiased", 0.0), ("gumbel", 1, "adam", 0.9)],
)  # fmt: skip  # natural-unbiased at a constant beta: the synthetic bundle's default (its convexity
# correction must not crush the helpful op under a short run of large steps: unclipped it fell to 1e-13 here)
def test_rotated_validation_domain_raises_the_quarter_turn_in_both_groups(estimator, lookahead, step_rule, poly_power):
    set_determinism(seed=0)
    net = tiny_unet()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    policy = make_tra_policy("nnunet", num_groups=2)
    start = policy.probabilities()[ROT90_FRONTAL[0]][:, ROT90_FRONTAL[1]].clone()
    rng = np.random.RandomState(100)
    group = ClassGroupd("label")
    val = [list_data_collate([group(_oriented_sample(rng, 12, 2, i % 2 == 0)) for i in range(8)]) for _ in range(4)]
    updater = TRAPolicyUpdater(policy, net, val, opt, estimator=estimator, val_loss="batch-dice", logit_budget=6.0,
                               seed=0, train_loss="ce+dice", lookahead=lookahead, step_rule=step_rule,
                               poly_power=poly_power)  # fmt: skip
    engine = train_engine(net, opt)
    updater.attach(engine)
    engine.run(_oriented_batches(policy, lesion_axis=0, seed=0), max_epochs=1, epoch_length=40)
    set_determinism(None)
    end = policy.probabilities()[ROT90_FRONTAL[0]][:, ROT90_FRONTAL[1]]
    assert torch.isfinite(policy.logits).all() and updater.updates == 40
    if estimator == "paired":  # the estimator finds the op that undoes the shift, in both class groups (with and
        # without the look-ahead beyond one step, with each step rule)
        assert (end > 2 * start).all(), (start, end)
    else:  # the paper's estimator still runs on the same task (it needs far more updates to find the op)
        assert updater.skipped < 40 and not torch.equal(end, start)


# ------------------------------------------------------------------------------------------- learn once, reuse
def test_fixed_mode_reuses_a_learned_policy_unchanged(tmp_path):
    learned = make_tra_policy("nnunet", num_groups=2)
    with torch.no_grad():
        learned.logits[1, 4] += 3.0  # "learned": the foreground group's quarter turn
    path = save_policies(tmp_path / "policies.json", learned)
    setup = AugmentationSetup("fixed", "none", tra_policy_file=path)
    for a, b in zip(setup.tra_policy.probabilities(), learned.probabilities()):
        torch.testing.assert_close(a, b)
    assert not setup.learn_tra and setup.counterfactuals == 0
    net = tiny_unet()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    assert setup.updaters(net, opt, [lesion_batch(4)]) == []  # no updater: never learned
    before = setup.tra_policy.logits.detach().clone()
    batch = lesion_batch(4, seed=2, tra_policy=setup.tra_policy)
    engine = train_engine(net, opt)
    engine.run([batch, batch], max_epochs=2)
    assert torch.equal(setup.tra_policy.logits.detach(), before)
    with pytest.raises(ValueError, match="tra_policy"):
        AugmentationSetup("fixed", "none")
    only_tea = save_policies(tmp_path / "tea_only.json", None, None)
    with pytest.raises(ValueError, match="no TRA policy"):
        AugmentationSetup("fixed", "none", tra_policy_file=only_tea)


def test_fixed_tea_mode_tests_with_a_learned_tea_policy_unchanged(tmp_path):
    """``tea_mode fixed``: the TEA policy of a ``policies.json``, tested with as the learned TTA, never updated."""
    from jcsaug.policy import make_tea_policy

    learned = make_tea_policy("nnunet")
    with torch.no_grad():
        learned.logits[0, 14] += 4.0  # "learned": rotate_frontal_acw_90 on top
    path = save_policies(tmp_path / "policies.json", make_tra_policy("nnunet", num_groups=2), learned)
    setup = AugmentationSetup("heuristic", "fixed", tea_policy_file=path)
    torch.testing.assert_close(setup.tea_policy.probabilities()[0], learned.probabilities()[0])
    assert not setup.learn_tea and setup.tests_learned_tea and setup.test_methods == ["none", "learned"]
    assert not setup.tea_policy.logits.requires_grad
    net = tiny_unet()
    assert setup.updaters(net, torch.optim.SGD(net.parameters(), lr=0.01), [lesion_batch(4)]) == []
    assert setup.test_tea_policy() is setup.tea_policy  # no post-hoc learning either
    with pytest.raises(ValueError, match="tea_mode 'fixed' needs the policies.json to reuse: set tea_policy"):
        AugmentationSetup("heuristic", "fixed")
    only_tra = save_policies(tmp_path / "tra_only.json", make_tra_policy("nnunet"))
    with pytest.raises(ValueError, match="holds no TEA policy"):
        AugmentationSetup("heuristic", "fixed", tea_policy_file=only_tra)


# ------------------------------------------------------------------------------------------- validation sample
@method
def test_validation_pool_and_running_average():
    net = tiny_unet()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    batches = [lesion_batch(4, seed=20 + i) for i in range(2)]

    def v_of(updater, calls=1):
        v = None
        for _ in range(calls):
            v = updater._validation_gradient()
        return torch.cat([t.reshape(-1) for t in v.values()])

    policy = make_tra_policy("nnunet", 2)
    v1 = v_of(TRAPolicyUpdater(policy, net, batches[:1], opt))
    v2 = v_of(TRAPolicyUpdater(policy, net, batches[1:], opt))
    pooled = v_of(TRAPolicyUpdater(policy, net, batches, opt, val_batches=2))  # the mean loss of both batches
    torch.testing.assert_close(pooled, (v1 + v2) / 2, rtol=1e-5, atol=1e-7)
    averaging = TRAPolicyUpdater(policy, net, batches, opt, val_average=0.25)
    torch.testing.assert_close(v_of(averaging, calls=2), 0.75 * v1 + 0.25 * v2, rtol=1e-5, atol=1e-7)
    restored = TRAPolicyUpdater(policy, net, batches, opt, val_average=0.25)
    restored.load_state_dict(averaging.state_dict())
    assert restored._v_average.keys() == averaging._v_average.keys()
    assert "val_gradient_average" not in TRAPolicyUpdater(policy, net, batches, opt).state_dict()
    with pytest.raises(ValueError, match="val_average"):
        TRAPolicyUpdater(policy, net, batches, opt, val_average=0.0)


# ------------------------------------------------------------------------------------------- the shift's answer
def test_dataset_metadata_names_the_ops_that_undo_each_shift(tmp_path):
    import json

    from jcsaug.data.synthetic import TARGET_SHIFTS, make_synthetic_dataset, shift_undoing_ops, synthesize_case
    from jcsaug.policy import make_tea_policy

    tea_names = set(make_tea_policy().op_names[0])
    by_series = {s.name: s for s in TRA_SERIES}
    for shift in TARGET_SHIFTS.values():
        undone = shift_undoing_ops(shift)
        for entry in undone["tra"]:  # every named op exists in the catalogues
            assert entry["op"] in by_series[entry["series"]].op_names
        assert all(name in tea_names for aspect in undone["tea"] for name in aspect)
    default = shift_undoing_ops(TARGET_SHIFTS["default"])
    assert {"series": "rotate_frontal", "op": "rot90"} in default["tra"]
    assert ["rotate_frontal_acw_90", "rotate_frontal_cw_90"] in default["tea"]
    other = shift_undoing_ops(TARGET_SHIFTS["rotate-longitudinal"])
    assert other["tra"][0] == {"series": "rotate_longitudinal", "op": "rot90"}
    assert other["tea"][-1] == ["gamma_expand_0.5"]  # a power below 1 is undone by the expanding gamma
    assert other["tra"][-1]["sign"] == "-"  # and reproduced by the TRA gamma's - half (an exponent below 1)
    blur = shift_undoing_ops(TARGET_SHIFTS["blur"])  # no geometric aspect: the blur alone
    assert blur == {"tra": [{"series": "blur_sharpen", "op": "blur[0.8,1)"}], "tea": [["sharpen_0.9"]]}
    gamma = shift_undoing_ops(TARGET_SHIFTS["gamma"])  # the default's intensity change alone
    assert gamma == {"tra": [{"series": "gamma", "op": "gamma±[0.4,0.6)", "partial": True, "sign": "+"}],
                     "tea": [["gamma_compress_0.5"]]}  # fmt: skip
    # the ops are looked up in the catalogues: the bin that holds the magnitude, the nearest one outside them
    weak = shift_undoing_ops({**TARGET_SHIFTS["blur"], "blur": (0.5, 0.55)})
    assert weak == {"tra": [{"series": "blur_sharpen", "op": "blur[0.4,0.6)"}], "tea": [["sharpen_0.5"]]}
    strong = shift_undoing_ops({**TARGET_SHIFTS["blur"], "blur": (2.0, 2.5)})
    assert strong == {"tra": [{"series": "blur_sharpen", "op": "blur[0.8,1)"}], "tea": [["sharpen_0.9"]]}
    slight = shift_undoing_ops({**TARGET_SHIFTS["rotate-longitudinal"], "gamma": (1.05, 1.1)})
    assert slight["tra"][-1]["op"] == "gamma±[0,0.2)" and slight["tea"][-1] == ["gamma_compress_0.1"]

    path = make_synthetic_dataset(tmp_path / "d", 1, 1, 1, shape=(24, 24, 24), target_shift="rotate-longitudinal",
                                  progress=False)  # fmt: skip
    meta = json.loads(path.read_text())["domain_shift"]
    assert meta["name"] == "rotate-longitudinal" and meta["undone_by"] == other
    # the folder is returned as it is; asked for another shift (the default included) it warns, asked for any not
    for asked in ("gamma", "default"):
        with pytest.warns(UserWarning, match=f"'target_shift': '{asked}'"):
            make_synthetic_dataset(tmp_path / "d", 1, 1, 1, shape=(24, 24, 24), target_shift=asked, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert make_synthetic_dataset(tmp_path / "d", 1, 1, 1, shape=(24, 24, 24), target_shift=None) == path
    _, label = synthesize_case(np.random.default_rng(0), (32, 32, 32), TARGET_SHIFTS["rotate-longitudinal"])
    from scipy import ndimage

    pieces, n = ndimage.label(label)
    long_axes = [int(np.argmax(np.var(np.nonzero(pieces == i), axis=1))) for i in range(1, n + 1)]
    assert max(set(long_axes), key=long_axes.count) == 1  # the lesions now lie along array axis 1
    with pytest.raises(ValueError, match="target_shift"):
        make_synthetic_dataset(tmp_path / "e", 1, 1, 1, shape=(24, 24, 24), target_shift="nope", progress=False)


def test_batched_cascade_makes_the_same_kind_of_counterfactuals():
    from jcsaug.policy import BatchTRACascaded

    policy = make_tra_policy("nnunet", num_groups=2)
    batch = {"image": torch.randn(3, 1, 12, 12, 12), "label": (torch.rand(3, 1, 12, 12, 12) > 0.7).to(torch.uint8),
             "class_group": torch.tensor([0, 1, 1])}  # fmt: skip
    out = BatchTRACascaded("image", policy, label_keys="label", counterfactuals=4).set_random_state(5)(batch)
    assert out["image_cf"].shape == (3, 4, 1, 12, 12, 12) and out["label_cf"].shape == (3, 4, 1, 12, 12, 12)
    assert out["tra_cf_ops"].shape == (3, 4, 2) and out["label_cf"].dtype == torch.uint8
    for i in range(3):
        for series, op in out["tra_cf_ops"][i].tolist():
            assert (op == 0) == (int(out["tra_ops"][i, series]) != 0)
    plain = BatchTRACascaded("image", policy, label_keys="label").set_random_state(5)(batch)
    assert torch.equal(plain["tra_ops"], out["tra_ops"]) and torch.equal(plain["image"], out["image"])


def test_unknown_estimators_and_missing_copies_are_refused_by_name():
    with pytest.raises(KeyError, match=r"unknown TRA estimator 'pairs'; valid names: gumbel, paired"):
        AugmentationSetup("class-specific", "joint", tra_estimator="pairs")
    with pytest.raises(KeyError, match=r"unknown TEA estimator 'gumble'; valid names: gumbel, paired"):
        AugmentationSetup("class-specific", "joint", tea_estimator="gumble")
    with pytest.raises(ValueError, match=r"tra_counterfactuals=0: the paired TRA estimator needs at least 1"):
        AugmentationSetup("class-specific", "joint", tra_estimator="paired", tra_counterfactuals=0)
    assert AugmentationSetup("heuristic", "joint", tra_estimator="paired", tra_counterfactuals=0).counterfactuals == 0
    net, policy = tiny_unet(), make_tra_policy("nnunet", num_groups=2)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    with pytest.raises(KeyError, match=r"unknown policy step rule 'sgd'; valid names: adam, natural, natural-recent, "):
        TRAPolicyUpdater(policy, net, None, opt, estimator="paired", step_rule="sgd")
    with pytest.raises(ValueError, match=r"step_rule 'natural' needs the paired estimator \(op effects\), got 'gu"):
        TRAPolicyUpdater(policy, net, None, opt, estimator="gumbel", step_rule="natural")
    with pytest.raises(ValueError, match=r"step_rule 'natural' needs the paired estimator"):
        TEAPolicyUpdater(make_tea_policy(), net, None, estimator="gumbel", step_rule="natural")
    tea = TEAPolicyUpdater(make_tea_policy(), net, None, estimator="paired", step_rule="natural")
    assert tea.step_rule == "natural" and tea.optimizer.param_groups[0]["second_moment"] == "row"
    assert tea.optimizer.param_groups[0]["row_blocks"] is None  # one second moment for the whole class group
    adam = TEAPolicyUpdater(make_tea_policy(), net, None, estimator="paired")
    assert tea.effects.natural and not adam.effects.natural
    by_series = TRAPolicyUpdater(policy, net, None, opt, estimator="paired", step_rule="natural-series")
    assert by_series.effects.natural and by_series.optimizer.param_groups[0]["row_blocks"] == policy.offsets
    with pytest.raises(ValueError, match=r"step_rule 'natural-series' needs the paired estimator"):
        TRAPolicyUpdater(policy, net, None, opt, estimator="gumbel", step_rule="natural-series")
    recent = TRAPolicyUpdater(policy, net, None, opt, estimator="paired", step_rule="natural-recent")
    assert recent.optimizer.param_groups[0]["betas"] == (0.9, 0.98) and recent.effects.natural
    assert not recent.optimizer.param_groups[0]["convexity_correction"]
    unbiased = TRAPolicyUpdater(policy, net, None, opt, estimator="paired", step_rule="natural-unbiased")
    assert unbiased.optimizer.param_groups[0]["convexity_correction"] and unbiased.effects.natural
    assert unbiased.optimizer.param_groups[0]["betas"] == (0.9, 0.98)
    with pytest.raises(ValueError, match=r"step rule 'mine': second_moment must be 'entry', 'group' or 'series'"):
        StepRule("mine", "a rule of one's own", second_moment="row")
    with pytest.raises(ValueError, match=r"step rule 'mine': beta2 must be in \[0, 1\), got 1.0"):
        StepRule("mine", "a rule of one's own", beta2=1.0)
