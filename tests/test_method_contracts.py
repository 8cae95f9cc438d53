"""The method's smaller contracts, each pinned by numbers or by an exact expectation: the paired TEA update by hand,
the updaters' own seeded draws, restored state, and the rules for skipping. Mutation testing (tests/README.md) found
each of these unpinned by the equation tests of test_method_equations.py."""

from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest
import torch
from ignite.engine import Engine, Events
from torch import nn

from helpers import lesion_batch, paired_batch, tiny_unet, train_engine
from jcsaug.engine import (
    TEAPolicyUpdater,
    TRAPolicyUpdater,
    finite_difference_hypergradient,
    get_loss,
    normalise_hypergradient,
)
from jcsaug.engine.base import PolicyUpdater, SkipUpdate, ValidationStream
from jcsaug.engine.losses import batch_dice_loss
from jcsaug.engine.paired import OpEffects
from jcsaug.engine.tea_updater import predict_by_shape
from jcsaug.engine.tra_updater import tea_transform_batch
from jcsaug.ops.tea import TEA_OPS
from jcsaug.policy import CategoricalPolicy, make_tea_policy, make_tra_policy
from jcsaug.policy.gumbel import gumbel_noise
from test_method_equations import _GivenGradient, _sigmoid, _soft_dice_loss, _t, _Threshold

pytestmark = pytest.mark.method  # part of the mutation run's test set (tests/README.md)

F64 = torch.float64


def _octant_patch() -> tuple[torch.Tensor, torch.Tensor]:
    """An 8^3 patch whose lesion fills one octant, and its label (as in the TEA equation test)."""
    label = torch.zeros(1, 8, 8, 8)
    label[0, 4:, 4:, 4:] = 1
    return label.clone(), label


# ---------------------------------------------------------------------------------------------------------------
# the paired TEA update
def test_tea_paired_update_by_hand():
    """Catalogue identity, mirror all, +0.05, +0.15; Z = 3 draws every non-identity op once per update, in a random
    order. Mapped back, the mirror scores the untouched Dice loss D0 (effect 0) and the shifts D1 and D2 (effects
    D1 - D0, D2 - D0). With uniform probabilities pi = 1/4 (lr 0 keeps them) the baseline is
    ``b = (D1 + D2 - 2 D0) / 4`` and the gradient ``pi_m (D_m - b)`` for every op (the identity with ``D_0 = 0``),
    the same in each update whatever the order of the copies."""
    ops = [TEA_OPS[0], TEA_OPS[41], TEA_OPS[54], TEA_OPS[55]]
    policy = CategoricalPolicy([len(ops)]).double()
    image, label = _octant_patch()
    updater = TEAPolicyUpdater(
        policy, _Threshold(), [{"image": image[None], "label": label[None]}], lr=0.0, num_copies=3, ops=ops,
        estimator="paired",
    )  # fmt: skip
    engine = Engine(lambda e, b: None)
    updater.attach(engine)
    grads, dice = [], []

    @engine.on(Events.ITERATION_COMPLETED)
    def record(_):
        grads.append(policy.logits.grad[0].clone())
        dice.append(dict(updater.last_dice))

    engine.run([0, 0, 0], max_epochs=1)
    assert updater.updates == 3 and updater.skipped == 0

    lab = label.numpy()
    d0, d1, d2 = (_soft_dice_loss(_sigmoid(6 * (lab + c - 0.5)), lab) for c in (0.0, 0.05, 0.15))
    assert min(d1 - d0, d2 - d1) > 1e-3  # distinct scores, not lost in the tolerance
    effect = np.array([0.0, 0.0, d1 - d0, d2 - d0])
    for grad, scores in zip(grads, dice):
        np.testing.assert_allclose(grad.numpy(), 0.25 * (effect - effect.mean()), rtol=1e-5, atol=1e-7)  # float32 Dice
        assert scores == pytest.approx({"untouched": d0, "augmented_mean": (d0 + d1 + d2) / 3}, rel=1e-6)


@pytest.mark.parametrize("mask_undrawn", [True, False])
def test_tea_gumbel_update_scores_copies_and_masks_undrawn_ops(mask_undrawn):
    """Copies drawn +0.05 and identity (the mirror not drawn): ``last_dice`` holds the untouched patch's loss and
    the copies' mean; the undrawn mirror takes no Adam step unless ``mask_undrawn=False``."""
    ops = [TEA_OPS[0], TEA_OPS[41], TEA_OPS[54]]
    policy = CategoricalPolicy([len(ops)]).double()
    choices = torch.tensor([[2], [0]])
    image, label = _octant_patch()
    updater = TEAPolicyUpdater(
        policy, _Threshold(), [{"image": image[None], "label": label[None]}], lr=0.1, num_copies=2, ops=ops,
        mask_undrawn=mask_undrawn,
    )  # fmt: skip

    def gumbel_sample(groups, generator=None):  # weights with dw/dp = 1 at the drawn op
        picked = policy.logits[0][choices]
        return choices, picked - picked.detach() + 1

    updater.policy.gumbel_sample = gumbel_sample
    engine = Engine(lambda e, b: None)
    updater.attach(engine)
    engine.run([0], max_epochs=1)
    lab = label.numpy()
    d0, d1 = (_soft_dice_loss(_sigmoid(6 * (lab + c - 0.5)), lab) for c in (0.0, 0.05))
    assert updater.last_dice == pytest.approx({"untouched": d0, "augmented_mean": (d0 + d1) / 2}, rel=1e-6)
    steps = updater.optimizer.state[policy.logits]["step"][0].tolist()
    assert steps == ([1.0, 0.0, 1.0] if mask_undrawn else [1.0, 1.0, 1.0])


def test_tea_gumbel_update_scores_every_patch_with_its_own_copies():
    """``patches=2`` (the bundles' ``tea_patches``) with Z = 2: patch A's copies drawn +0.05 and identity, patch B's
    +0.05 and mirror all (mapped back: B's untouched loss). Each patch's losses are centred on its own copies,
    ``h = (D - mean_patch) / Z / patches``, then divided by the op's count over both patches: with ``dw/dp = 1``
    at the drawn op the gradient is ``-(A1 - A0) / 8`` (identity), ``-(B1 - B0) / 8`` (mirror) and
    ``((A1 - A0) + (B1 - B0)) / 16`` (+0.05, drawn twice); ``last_dice`` is the patches' mean."""
    ops = [TEA_OPS[0], TEA_OPS[41], TEA_OPS[54]]
    policy = CategoricalPolicy([len(ops)]).double()
    choices = torch.tensor([[2], [0], [2], [1]])
    _, label = _octant_patch()
    images = torch.stack([label, 0.6 * label + 0.1])  # two lesion-centred patches with different losses
    val = [{"image": images, "label": torch.stack([label, label])}]
    updater = TEAPolicyUpdater(policy, _Threshold(), val, lr=0.1, num_copies=2, ops=ops, patches=2, poly_power=0)
    predicted = []
    updater.model.register_forward_hook(lambda module, args, out: predicted.append(args[0].shape[0]))

    def gumbel_sample(groups, generator=None):  # weights with dw/dp = 1 at the drawn op
        picked = policy.logits[0][choices[: len(groups)]]
        return choices[: len(groups)], picked - picked.detach() + 1

    updater.policy.gumbel_sample = gumbel_sample
    engine = Engine(lambda e, b: None)
    updater.attach(engine)
    engine.run([0], max_epochs=1)
    assert (updater.updates, sum(predicted)) == (1, 2 * 3)  # each patch and its Z copies
    lab = label.numpy()
    a0, a1, b0, b1 = (_soft_dice_loss(_sigmoid(6 * (s * lab + c - 0.5)), lab)
                      for s, c in ((1.0, 0.0), (1.0, 0.05), (0.6, 0.1), (0.6, 0.15)))  # fmt: skip
    expected = [-(a1 - a0) / 8, -(b1 - b0) / 8, ((a1 - a0) + (b1 - b0)) / 16]
    np.testing.assert_allclose(policy.logits.grad[0].numpy(), expected, rtol=1e-5, atol=1e-9)
    mean = {"untouched": (a0 + b0) / 2, "augmented_mean": ((a0 + a1) / 2 + (b0 + b1) / 2) / 2}
    assert updater.last_dice == pytest.approx(mean, rel=1e-5)


def test_tea_gumbel_draws_come_from_the_updaters_seeded_generator():
    ops = TEA_OPS[:12]
    image, label = _octant_patch()

    def logits_after_two_updates(global_seed: int) -> torch.Tensor:
        torch.manual_seed(global_seed)
        policy = CategoricalPolicy([len(ops)]).double()
        val = [{"image": image[None], "label": label[None]}]
        updater = TEAPolicyUpdater(policy, _Threshold(), val, lr=0.1, num_copies=3, ops=ops, seed=5)
        engine = Engine(lambda e, b: None)
        updater.attach(engine)
        engine.run([0, 0], max_epochs=1)
        return policy.logits.detach().clone()

    first = logits_after_two_updates(1)
    assert (first != 0).any() and torch.equal(first, logits_after_two_updates(2))


def test_tea_patches_prefer_foreground_centred_ones_then_any_with_foreground():
    """Two patches wanted from [background only, centred on the lesion, two off-centre lesions]: the centred one,
    then the first off-centre one, in that order; none with foreground at all is a skipped update."""
    label = torch.zeros(4, 1, 8, 8, 8)
    label[1, 0, 3:6, 3:6, 3:6] = 1  # centred
    label[2, 0, :2, :2, :2] = 1  # off-centre
    label[3, 0, 6:, 6:, 6:] = 1  # off-centre
    image = torch.arange(4.0).reshape(4, 1, 1, 1, 1).expand(4, 1, 8, 8, 8)
    updater = TEAPolicyUpdater(CategoricalPolicy([2]), _Threshold(), [{"image": image, "label": label}],
                               ops=TEA_OPS[:2], patches=2, max_batches=1)  # fmt: skip
    patches = updater._foreground_patches(2)
    assert [int(p[0][0, 0, 0, 0]) for p in patches] == [1, 2] and all(p[3] == [] for p in patches)
    empty = TEAPolicyUpdater(CategoricalPolicy([2]), _Threshold(), [{"image": image[:1], "label": label[:1]}],
                             ops=TEA_OPS[:2], max_batches=2)  # fmt: skip
    with pytest.raises(SkipUpdate, match="no validation patch with foreground"):
        empty._foreground_patches(1)


def _measured_tea_ops(seed: int, global_seed: int, updates: int = 3) -> list[list[int]]:
    """The ops the paired TEA updater measured in each update (Z = 2 of 11 non-identity ops)."""
    ops = TEA_OPS[:12]
    torch.manual_seed(global_seed)  # the updater's draws must not depend on the global stream
    image, label = _octant_patch()
    updater = TEAPolicyUpdater(
        CategoricalPolicy([len(ops)]), _Threshold(), [{"image": image[None], "label": label[None]}], lr=0.1,
        num_copies=2, ops=ops, estimator="paired", seed=seed,
    )  # fmt: skip
    measured = []
    dice = updater._mapped_back_dice
    updater._mapped_back_dice = lambda im, lab, drawn, *rest: (
        measured.append([ops.index(o) for o in drawn]) or dice(im, lab, drawn, *rest)
    )
    engine = Engine(lambda e, b: None)
    updater.attach(engine)
    engine.run([0] * updates, max_epochs=1)
    return measured


def test_tea_paired_draws_come_from_the_updaters_seeded_generator():
    """Z distinct non-identity ops per update, from the updater's own generator: the same seed measures the same
    ops whatever the global torch seed, another seed other ops."""
    first = _measured_tea_ops(seed=0, global_seed=1)
    assert first == _measured_tea_ops(seed=0, global_seed=2)
    assert first != _measured_tea_ops(seed=1, global_seed=1)
    for drawn in first:
        assert len(set(drawn)) == 2 and all(1 <= k <= 11 for k in drawn)


# ---------------------------------------------------------------------------------------------------------------
# restored state
def test_op_effects_restore_as_float64_from_any_stored_dtype():
    """Running effects restored from a float32 (or plain list) state are float64 again, so that later measurements
    fold in at full precision."""
    policy = CategoricalPolicy([3, 2], num_groups=2)
    effects = OpEffects(policy)
    stored = {"estimate": torch.full((2, 5), 0.1, dtype=torch.float32), "count": [[1.0] * 5, [2.0] * 5]}
    effects.load_state_dict(stored)
    assert effects.estimate.dtype == F64 and effects.count.dtype == F64
    assert effects.count.tolist() == stored["count"]
    with pytest.raises(ValueError, match="op-effect count of shape"):
        effects.load_state_dict({"estimate": torch.zeros(2, 5), "count": torch.zeros(1, 5)})


def test_updater_checkpoint_round_trip_and_older_states():
    """Counts, skip reasons and the paired estimator's op effects come back from a checkpoint; a state written
    before they existed loads with zero counts and fresh effects; a gumbel updater ignores stored op effects; a
    state without a generator is refused before anything is loaded."""
    ops = [TEA_OPS[0], TEA_OPS[38], TEA_OPS[54], TEA_OPS[41]]
    image, label = _octant_patch()

    def make(estimator: str = "paired") -> TEAPolicyUpdater:
        return TEAPolicyUpdater(
            CategoricalPolicy([len(ops)]).double(), _Threshold(), [{"image": image[None], "label": label[None]}],
            lr=0.1, num_copies=3, ops=ops, estimator=estimator,
        )  # fmt: skip

    trained = make()
    engine = Engine(lambda e, b: None)
    trained.attach(engine)
    engine.run([0, 0], max_epochs=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for reason in ("no validation patch with foreground", "non-finite TEA Dice", "non-finite TEA Dice"):
            trained.skip(reason)
    state = trained.state_dict()
    assert torch.equal(state["effects"]["count"], torch.tensor([[0.0, 2.0, 2.0, 2.0]], dtype=F64))
    assert state["skip_reasons"] == {"no validation patch with foreground": 1, "non-finite TEA Dice": 2}
    restored = make()
    restored.load_state_dict(state)
    assert torch.equal(restored.effects.estimate, trained.effects.estimate)
    assert torch.equal(restored.effects.count, trained.effects.count)
    assert (restored.updates, restored.skipped, restored.skip_reasons) == (2, 3, trained.skip_reasons)

    older = {k: state[k] for k in ("policy", "optimizer", "generator")}
    restored.load_state_dict(older)  # no counts, no effects: counted from zero, the effects as they were
    assert (restored.updates, restored.skipped, dict(restored.skip_reasons)) == (0, 0, {})
    fresh = make()
    fresh.load_state_dict(older)
    assert not fresh.effects.count.any()
    gumbel = make("gumbel")
    gumbel.load_state_dict(state)  # the op effects of a paired run are not the gumbel estimator's business
    assert gumbel.effects is None and gumbel.updates == 2

    fresh = make()
    before = fresh.policy.logits.detach().clone()
    with pytest.raises(KeyError, match=r"missing \['generator'\]"):
        fresh.load_state_dict({k: v for k, v in state.items() if k != "generator"})
    assert torch.equal(fresh.policy.logits.detach(), before)  # refused before anything was loaded


# ---------------------------------------------------------------------------------------------------------------
# the paired TRA step: which op each (sample, counterfactual) pair scores, and its sign
def _paired_tra_updater(policy: CategoricalPolicy) -> tuple[TRAPolicyUpdater, Engine]:
    updater = TRAPolicyUpdater(policy, nn.Linear(1, 1), [], torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1),
                               lr=0.1, estimator="paired", poly_power=0.0)  # fmt: skip
    engine = Engine(lambda e, b: None)
    engine.state.iteration, engine.state.max_epochs, engine.state.epoch_length = 1, 1, 1
    return updater, engine


def test_paired_tra_step_scores_each_pair_by_hand():
    """Two samples (groups 0 and 1) of a policy with series of 3 and 2 ops, two copies each. Sample 0 drew ops
    (1, 0): copy (series 0, identity) scores op 1 as ``s0 - c00``; copy (series 1, op 1) scores op 1 of series 1
    as ``c01 - s0``. Sample 1 drew (2, 1): copy (series 0, identity) scores op 2 as ``s1 - c10``, copy (series 1,
    identity) op 1 of series 1 as ``s1 - c11``. Uniform probabilities: ``grad = pi (D - b)``, ``b = pi . D`` per
    series, on the scored ops and their series' identities only; the other ops keep their logits and Adam state."""
    policy = CategoricalPolicy([3, 2], num_groups=2).double()
    updater, engine = _paired_tra_updater(policy)
    scores, cf_scores = _t([1.0, -2.0]), _t([[0.5, 4.0], [1.0, -3.0]])
    choices, groups = torch.tensor([[1, 0], [2, 1]]), torch.tensor([0, 1])
    cf_ops = torch.tensor([[[0, 0], [1, 1]], [[0, 0], [1, 0]]])
    updater._paired_step(engine, scores, cf_scores, choices, groups, cf_ops)

    d = {(0, 1): 1.0 - 0.5, (0, 4): 4.0 - 1.0, (1, 2): -2.0 - 1.0, (1, 4): -2.0 - -3.0}  # (group, logit): effect
    expected = np.zeros((2, 5))
    for g in range(2):
        for lo, hi in ((0, 3), (3, 5)):
            effect = np.array([d.get((g, j), 0.0) for j in range(lo, hi)])
            if effect.any():
                expected[g, lo:hi] = (effect - effect.mean()) / (hi - lo)
    expected[0, 2] = expected[1, 1] = 0.0  # not scored: no step
    np.testing.assert_allclose(policy.logits.grad.numpy(), expected, rtol=1e-12, atol=1e-15)
    stepped = updater.optimizer.state[policy.logits]["step"] > 0
    assert stepped.tolist() == [[True, True, False, True, True], [True, False, True, True, True]]


def test_paired_tra_step_needs_one_scored_op():
    """An update whose copies all replaced an identity by the identity has nothing to learn from: skipped. One
    measurement is enough."""
    policy = CategoricalPolicy([3, 2]).double()
    updater, engine = _paired_tra_updater(policy)
    choices, groups = torch.tensor([[0, 0]]), torch.tensor([0])
    with pytest.raises(SkipUpdate, match="no counterfactual scored a non-identity op"):
        updater._paired_step(engine, _t([1.0]), _t([[2.0]]), choices, groups, torch.tensor([[[0, 0]]]))
    updater._paired_step(engine, _t([1.0]), _t([[2.0]]), choices, groups, torch.tensor([[[1, 1]]]))
    np.testing.assert_allclose(policy.logits.grad[0].numpy(), [0, 0, 0, -0.25, 0.25], atol=1e-15)


def test_paired_tra_update_refuses_missing_or_misshapen_counterfactuals():
    policy = CategoricalPolicy([3, 2]).double()
    updater, _ = _paired_tra_updater(policy)
    image = torch.zeros(2, 1, 2, 2, 2)
    with pytest.raises(KeyError, match="the paired estimator needs the counterfactual copies"):
        updater._counterfactuals({"image": image, "label": image}, 2)
    copies = {"image_cf": torch.zeros(2, 2, 1, 2, 2, 2), "label_cf": torch.zeros(2, 2, 1, 2, 2, 2)}
    for cf_ops in (torch.zeros(2, 2, dtype=torch.long), torch.zeros(3, 2, 2, dtype=torch.long)):  # no K axis; n = 3
        batch = {"image": image, "label": image, "tra_cf_ops": cf_ops, **copies}
        if cf_ops.ndim == 3:
            batch.update(image_cf=torch.zeros(3, 2, 1, 2, 2, 2), label_cf=torch.zeros(3, 2, 1, 2, 2, 2))
        with pytest.raises(ValueError, match="counterfactuals of shapes"):
            updater._counterfactuals(batch, 2)


def test_op_effects_smoothing_range():
    policy = CategoricalPolicy([3, 2]).to(torch.float32)
    effects = OpEffects(policy, smoothing=1.0)  # 1: the latest measurement only
    assert effects.estimate.dtype == F64 and effects.count.dtype == F64  # float64 whatever the policy's dtype
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="smoothing must be in"):
            OpEffects(policy, smoothing=bad)


# ---------------------------------------------------------------------------------------------------------------
# the logit budget's learning rate at the edges
@pytest.mark.parametrize(
    ("update_every", "total", "power", "expected"),
    [
        (2, 40, 0.9, 3.0 / sum((1 - (t - 1) / 40) ** 0.9 for t in range(2, 41, 2))),  # in float64
        (3, 10, 0.0, 3.0 / 3),  # no decay: the budget shared by the updates at 3, 6, 9
        (1, 1, 0.0, 3.0),  # one iteration, one update
        (3, 3, 0.9, 3.0 / (1 - 2 / 3) ** 0.9),  # one update, at the last iteration
        (3, 2, 0.9, 0.0),  # no update planned: nothing to spend the budget on
        (5, 2, 0.9, 0.0),
    ],
    # ids without the computed floats: their last digits follow the platform's pow, so ids passed on a command
    # line elsewhere (a GPU machine) would not be found
    ids=[
        "every-2-of-40-decayed",
        "every-3-of-10-constant",
        "one-iteration",
        "last-iteration",
        "none-planned",
        "none-planned-5",
    ],
)
def test_logit_budget_learning_rate_by_hand(update_every, total, power, expected):
    policy = CategoricalPolicy([3])
    updater = _GivenGradient(policy, lambda t: None, lr=1.0, update_every=update_every, poly_power=power)
    assert updater.lr_for_budget(3.0, total) == pytest.approx(expected, rel=1e-13, abs=0.0)


# ---------------------------------------------------------------------------------------------------------------
# joint mode's transformed validation batch
def test_tea_transform_batch_draws_from_the_given_generator_and_moves_image_and_label_together():
    """Identity, sagittal mirror or +0.15 in thirds: each sample comes back as itself, mirrored or brighter, its label
    mirrored alike but never brightened, the draws from the given generator only. A quarter turn of non-cubic
    patches changes their shape: the samples come back in one mini-batch per shape."""
    tea = CategoricalPolicy([3])
    image = torch.arange(16 * 8, dtype=F64).reshape(16, 1, 8, 1, 1)
    label = (image % 3 == 0).to(F64)

    def transformed(global_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(global_seed)
        generator = torch.Generator().manual_seed(0)
        ((x, y),) = tea_transform_batch(image, label, tea, [TEA_OPS[0], TEA_OPS[38], TEA_OPS[55]], generator)
        return x, y

    x, y = transformed(1)
    x2, y2 = transformed(2)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    seen = set()
    for i in range(16):
        candidates = {0: (image[i], label[i]), 1: (image[i].flip(1), label[i].flip(1)), 2: (image[i] + 0.15, label[i])}
        op = next(k for k, (xi, _) in candidates.items() if torch.allclose(x[i], xi))
        torch.testing.assert_close(y[i], candidates[op][1])
        seen.add(op)
    assert seen == {0, 1, 2}

    cube = torch.rand(6, 1, 4, 4, 2, dtype=F64)
    chunks = tea_transform_batch(cube, cube, tea, [TEA_OPS[0], TEA_OPS[14], TEA_OPS[0]], torch.Generator())
    assert sorted(tuple(xs.shape[2:]) for xs, _ in chunks) == [(2, 4, 4), (4, 4, 2)]
    assert sum(len(xs) for xs, _ in chunks) == 6


def test_tea_transform_batch_share_leaves_the_rest_of_the_samples_as_they_are():
    """``share`` mixes the catalogue's identity into the policy: with every mass on the mirror, share 0.25 mirrors a
    quarter of the samples on average and leaves the others untouched; share 1 draws exactly as without it (the
    same generator draws, bit for bit)."""
    tea = CategoricalPolicy([2])
    with torch.no_grad():
        tea.logits[0].copy_(torch.tensor([-30.0, 30.0]))  # the mirror, always
    ops = [TEA_OPS[0], TEA_OPS[38]]
    image = torch.arange(4000 * 8, dtype=F64).reshape(4000, 1, 8, 1, 1)
    ((x, _),) = tea_transform_batch(image, image, tea, ops, torch.Generator().manual_seed(0), share=0.25)
    mirrored = (x != image).flatten(1).any(1)
    assert torch.equal(x[~mirrored], image[~mirrored]) and torch.equal(x[mirrored], image[mirrored].flip(2))
    assert 0.22 < mirrored.double().mean() < 0.28
    full = tea_transform_batch(image[:64], image[:64], tea, ops, torch.Generator().manual_seed(3), share=1.0)
    plain = tea_transform_batch(image[:64], image[:64], tea, ops, torch.Generator().manual_seed(3))
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(full, plain))
    with pytest.raises(ValueError, match="identity op"):
        tea_transform_batch(image, image, tea, [TEA_OPS[38], TEA_OPS[38]], torch.Generator(), share=0.5)


def test_predict_by_shape_batches_equal_shapes_and_keeps_the_order():
    """Copies rotated by 90 degrees change a non-cubic patch's shape: each shape goes through the network on its
    own, and every prediction comes back in its copy's place."""
    net = _Threshold()
    images = [torch.rand(1, 4, 4, 2), torch.rand(1, 2, 4, 4), torch.rand(1, 4, 4, 2)]
    for image, prob in zip(images, predict_by_shape(net, images)):
        torch.testing.assert_close(prob, torch.softmax(net(image[None]), dim=1)[0])


def test_validation_stream_restart_begins_a_fresh_pass():
    stream = ValidationStream(["a", "b", "c"])
    assert [stream.next(), stream.next()] == ["a", "b"]
    stream.restart()  # as a resumed run does
    assert [stream.next(), stream.next(), stream.next(), stream.next()] == ["a", "b", "c", "a"]
    assert ValidationStream([]).next() is None and ValidationStream(None).next() is None


# ---------------------------------------------------------------------------------------------------------------
# sampling in the workers, the TEA validation patches
def test_sample_ops_is_shift_invariant_even_for_large_logits_and_checks_the_group():
    """Softmax sampling does not change when the logits of a series move by the same amount, even by hundreds
    (learned logits are unbounded; ``exp`` of them would overflow); series are drawn independently; a group past
    the last is refused."""
    policy = CategoricalPolicy([3, 2], num_groups=2, init_probs=[[0.2, 0.5, 0.3], [0.6, 0.4]])

    def draws() -> np.ndarray:
        rng = np.random.RandomState(7)
        return np.stack([policy.sample_ops(1, rng) for _ in range(200)])

    before = draws()
    assert len(np.unique(before, axis=0)) == 6  # every combination drawn: a change of probabilities would show
    with torch.no_grad():
        policy.logits[1, :3] += 800.0  # one series only: each series is normalised on its own
    assert np.array_equal(draws(), before)
    with torch.no_grad():
        policy.logits[1, 3:] += 500.0
    assert np.array_equal(draws(), before)
    twins = CategoricalPolicy([2, 2])  # the same probabilities in both series, drawn independently
    rng = np.random.RandomState(0)
    pairs = np.stack([twins.sample_ops(0, rng) for _ in range(100)])
    assert 30 < int((pairs[:, 0] != pairs[:, 1]).sum()) < 70
    with pytest.raises(ValueError, match="class group 2 out of range"):
        policy.sample_ops(2, np.random.RandomState(0))


def test_each_tea_update_takes_the_next_validation_patch():
    """One foreground patch per update, in the validation stream's order: none is skipped over."""
    ops = [TEA_OPS[0], TEA_OPS[41]]
    image, label = _octant_patch()
    batches = [{"image": image[None] * (1 + k), "label": label[None]} for k in range(3)]
    updater = TEAPolicyUpdater(CategoricalPolicy([2]), _Threshold(), batches, lr=0.1, num_copies=2, ops=ops)
    scored = []
    dice = updater._mapped_back_dice
    updater._mapped_back_dice = lambda im, lab, *rest: scored.append(float(im.max())) or dice(im, lab, *rest)
    engine = Engine(lambda e, b: None)
    updater.attach(engine)
    engine.run([0] * 3, max_epochs=1)
    assert scored == [1.0, 2.0, 3.0]


# ---------------------------------------------------------------------------------------------------------------
# Gumbel noise
def test_gumbel_noise_is_float64_from_the_generator_and_finite_at_u_zero(monkeypatch):
    """``-log(-log U)`` with U drawn in float64 from the given generator whatever the logits' dtype (the far tails
    need it), and finite even when ``torch.rand`` returns exactly 0 (it can: its range is [0, 1))."""
    like = torch.zeros(3, dtype=torch.float32)
    noise = gumbel_noise(torch.Size([1000]), like, torch.Generator().manual_seed(3))
    u = torch.rand(1000, generator=torch.Generator().manual_seed(3), dtype=F64)
    assert noise.dtype == F64
    torch.testing.assert_close(noise, -torch.log(-torch.log(u)), rtol=0, atol=0)
    monkeypatch.setattr(torch, "rand", lambda shape, **kwargs: torch.zeros(shape, dtype=kwargs.get("dtype")))
    assert torch.isfinite(gumbel_noise(torch.Size([4]), like)).all()


# ---------------------------------------------------------------------------------------------------------------
# the defaults (SPEC §6: Z = 10, gamma = 5e-5, poly 0.9)
def test_updater_defaults_are_the_papers():
    net = nn.Linear(1, 1)
    tea = TEAPolicyUpdater(make_tea_policy(), net, [])
    assert (tea.base_lr, tea.num_copies, tea.poly_power, tea.max_batches, tea.patches) == (5e-5, 10, 0.9, 4, 1)
    assert (tea.name, tea.estimator, tea.effects, tea.mask_undrawn, tea.update_every) == (
        "TEA",
        "gumbel",
        None,
        True,
        1,
    )
    assert tea.optimizer.param_groups[0]["frequency_scaling"] is False
    assert torch.equal(
        tea.generator.get_state(), TEAPolicyUpdater(make_tea_policy(), net, [], seed=0).generator.get_state()
    )
    paired = TEAPolicyUpdater(make_tea_policy(), net, [], estimator="paired")
    assert paired.effects.smoothing == 0.1 and paired.optimizer.param_groups[0]["frequency_scaling"] is True

    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    tra = TRAPolicyUpdater(make_tra_policy("nnunet", 2), net, [], opt)
    assert (tra.base_lr, tra.poly_power, tra.name, tra.estimator, tra.effects) == (1e-3, 0.9, "TRA", "gumbel", None)
    assert (tra.val_batches, tra.val_average, tra.meta_mode, tra.mask_undrawn) == (1, 1.0, "eval", True)
    assert tra.train_loss is get_loss("ce+dice")
    chunks = _val_chunks()
    assert torch.allclose(tra.val_loss(chunks), torch.cat([get_loss("dice")(x, y) for x, y in chunks]).mean())
    assert tra.hypergradient is finite_difference_hypergradient and tra.tea_policy is None
    assert tra.optimizer.param_groups[0]["frequency_scaling"] is False
    assert torch.equal(tra.generator.get_state(), torch.Generator().manual_seed(0).get_state())
    paired = TRAPolicyUpdater(make_tra_policy("nnunet", 2), net, [], opt, estimator="paired")
    assert paired.effects.smoothing == 0.1 and paired.optimizer.param_groups[0]["frequency_scaling"] is True
    joint = TRAPolicyUpdater(make_tra_policy("nnunet", 2), net, [], opt, tea_policy=make_tea_policy())
    assert joint.tea_ops is TEA_OPS


# ---------------------------------------------------------------------------------------------------------------
# the policy's probabilities
def test_set_probabilities_normalises_floors_and_checks_by_hand():
    policy = CategoricalPolicy([3, 2], num_groups=2)
    policy.set_probabilities([[2, 1, 1], [[1.0, 0.0], [1.0, 3.0]]])  # weights (ints too), per group or shared
    probs = policy.probabilities()
    np.testing.assert_allclose(probs[0].numpy(), [[0.5, 0.25, 0.25]] * 2, rtol=1e-6)
    np.testing.assert_allclose(probs[1].numpy(), [[1 / (1 + 1e-6), 1e-6 / (1 + 1e-6)], [0.25, 0.75]], rtol=1e-5)
    assert probs[0].dtype == policy.logits.dtype == torch.float32
    expected_logits = np.log([[0.5, 0.25, 0.25, 1 / (1 + 1e-6), 1e-6 / (1 + 1e-6)], [0.5, 0.25, 0.25, 0.25, 0.75]])
    np.testing.assert_allclose(policy.logits.detach().numpy(), expected_logits, rtol=1e-5)  # log-probabilities
    for bad in ([[0.5, 0.5], [1.0, 0.0]], [[0.5, -0.1, 0.6], [1.0, 0.0]], [[0.2, 0.3, 0.5], [[0.5, 0.5]] * 3],
                [[0.2, 0.3, 0.5], [[[0.5, 0.5]] * 2]]):  # fmt: skip
        with pytest.raises(ValueError, match="series"):
            policy.set_probabilities(bad)


def test_probabilities_are_shift_invariant_per_series_and_the_index_is_cached():
    policy = CategoricalPolicy([3, 2], num_groups=2, init_probs=[[0.2, 0.5, 0.3], [0.6, 0.4]])
    before = [p.clone() for p in policy.probabilities()]
    with torch.no_grad():
        policy.logits[1, :3] += 800.0  # one series of one group: the others' probabilities must not move
    for p, q in zip(policy.probabilities(), before):
        torch.testing.assert_close(p, q)
    assert policy._padded_index() is policy._padded_index()  # built once per policy (the layout never changes)


def test_weights_draw_their_noise_from_the_given_generator():
    policy = CategoricalPolicy([3, 2], num_groups=2).double()
    choices, groups = torch.tensor([[1, 0], [2, 1]]), torch.tensor([0, 1])

    def gradient(global_seed: int) -> torch.Tensor:
        torch.manual_seed(global_seed)
        policy.logits.grad = None
        policy.weights(choices, groups, torch.Generator().manual_seed(0)).sum().backward()
        return policy.logits.grad.clone()

    first = gradient(1)
    assert first[0].abs().sum() > 0 and first[1].abs().sum() > 0  # each sample's own group
    assert torch.equal(first, gradient(2))


def test_tea_updater_arguments_are_checked():
    net, ops = nn.Linear(1, 1), TEA_OPS[:4]
    assert TEAPolicyUpdater(CategoricalPolicy([4]), net, [], ops=ops, num_copies=1).num_copies == 1
    paired = TEAPolicyUpdater(CategoricalPolicy([4]), net, [], ops=ops, num_copies=3, estimator="paired",
                              effect_smoothing=0.5)  # fmt: skip
    assert paired.effects.smoothing == 0.5 and paired.last_dice == {}  # no scores before the first update
    keyed = TEAPolicyUpdater(CategoricalPolicy([4]), net, [], ops=ops, image_key="ct", label_key="seg")
    x, y = torch.zeros(1, 1, 2, 2, 2), torch.ones(1, 1, 2, 2, 2)
    image, seg = keyed.prepare_batch({"ct": x, "seg": y}, torch.device("cpu"))
    assert torch.equal(image, x) and torch.equal(seg, y)
    with pytest.raises(ValueError, match="num_copies"):
        TEAPolicyUpdater(CategoricalPolicy([4]), net, [], ops=ops, num_copies=0)
    with pytest.raises(ValueError, match=r"num_copies \(Z\) must be <= 3"):  # Z distinct non-identity ops
        TEAPolicyUpdater(CategoricalPolicy([4]), net, [], ops=ops, num_copies=4, estimator="paired")
    for policy in (CategoricalPolicy([4, 4]), CategoricalPolicy([3])):  # one series of exactly the catalogue's ops
        with pytest.raises(ValueError, match="TEA policy must have one series of 4 ops"):
            TEAPolicyUpdater(policy, net, [], ops=ops)


def _val_chunks() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two ``(logits, label)`` chunks of one validation batch, of different shapes and sizes."""
    g = torch.Generator().manual_seed(0)
    shapes = ((3, 4, 5, 6), (1, 6, 5, 4))
    return [(torch.randn(b, 2, *sp, generator=g), torch.randint(0, 2, (b, 1, *sp), generator=g)) for b, *sp in shapes]


def test_tra_updater_arguments_are_checked():
    net = nn.Linear(1, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    policy = make_tra_policy("nnunet", 2)
    updater = TRAPolicyUpdater(policy, net, [], opt, estimator="paired", effect_smoothing=0.5, val_average=1.0,
                               val_batches=3, meta_mode="train", val_loss="batch-dice")  # fmt: skip
    assert (updater.effects.smoothing, updater.val_batches, updater.meta_mode) == (0.5, 3, "train")
    chunks = _val_chunks()  # one soft Dice over both chunks, not the mean of per-sample ones
    assert torch.allclose(updater.val_loss(chunks), batch_dice_loss(chunks))
    assert not torch.allclose(updater.val_loss(chunks), torch.cat([get_loss("dice")(x, y) for x, y in chunks]).mean())
    bad_settings = ({"val_batches": 0}, {"val_average": 1.5}, {"val_average": 0.0}, {"meta_mode": "test"},
                    {"tea_share": 0.0}, {"tea_share": 1.5})  # fmt: skip
    for bad in bad_settings:
        with pytest.raises(ValueError, match=next(iter(bad))):
            TRAPolicyUpdater(policy, net, [], opt, **bad)


def test_class_centring_with_three_groups_by_hand():
    g = _t([1.0, 2.0, 4.0, 8.0, 16.0, 32.0])
    groups = torch.tensor([0, 1, 2, 0, 1, 2])
    choices = torch.tensor([[0], [1], [2], [3], [4], [5]])  # every op drawn once: counts 1
    expected = [1 - 4.5, 2 - 9.0, 4 - 18.0, 8 - 4.5, 16 - 9.0, 32 - 18.0]
    np.testing.assert_allclose(normalise_hypergradient(g, groups, choices)[:, 0].numpy(), expected)


def test_batch_dice_validation_loss_is_one_dice_over_the_validation_batch():

    net = _Threshold()
    opt = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    updater = TRAPolicyUpdater(CategoricalPolicy([2]), net, [], opt, val_loss="batch-dice")
    image, label = _octant_patch()
    chunks = [(image[None], label[None]), (image[None] * 0.5, label[None])]
    expected = batch_dice_loss([(net(x), y) for x, y in chunks])
    torch.testing.assert_close(updater._validation_loss(chunks), expected)


# ------------------------------------------------------------------------------------- the validation gradient
def test_validation_gradient_zero_for_unused_parameters_seeded_in_joint_mode_and_not_averaged_by_default():
    """``v``: a zero entry for a parameter L_val does not reach; joint mode's TEA ops drawn from the updater's own
    generator (the global RNG does not change ``v``); with ``val_average = 1`` nothing is averaged or checkpointed."""

    def v_of(updater: TRAPolicyUpdater, global_seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(global_seed)
        return updater._validation_gradient()

    net = tiny_unet()
    net.unused = torch.nn.Parameter(torch.ones(3))  # requires grad, not in forward
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    batches = [lesion_batch(4, seed=20)]
    plain_updater = TRAPolicyUpdater(make_tra_policy("nnunet", 2), net, batches, opt)
    v = v_of(plain_updater, 0)
    assert torch.equal(v["unused"], torch.zeros(3))
    assert any(float(g.abs().sum()) > 0 for name, g in v.items() if name != "unused")
    assert plain_updater._v_average is None and "val_gradient_average" not in plain_updater.state_dict()

    def joint(seed: int) -> TRAPolicyUpdater:
        policy = make_tra_policy("nnunet", 2)
        return TRAPolicyUpdater(policy, net, batches, opt, tea_policy=make_tea_policy(), seed=seed)

    a, b, other = v_of(joint(5), 0), v_of(joint(5), 1), v_of(joint(6), 0)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0)
    assert any(not torch.equal(a[name], other[name]) for name in a)  # the TEA draws do change v


def test_as_batch_keeps_dictionaries_collates_sample_lists_and_refuses_the_rest():
    from jcsaug.engine.base import as_batch

    batch = {"image": torch.zeros(2, 1, 2, 2, 2)}
    assert as_batch(batch) is batch
    samples = [{"image": torch.zeros(1, 2, 2, 2)}, {"image": torch.ones(1, 2, 2, 2)}]
    assert as_batch(samples)["image"].shape == (2, 1, 2, 2, 2)
    for bad in ([], (torch.zeros(1), torch.zeros(1)), "image"):
        with pytest.raises(TypeError, match="dictionary batch"):
            as_batch(bad)


class _ModeRecorder(nn.Module):
    """tiny_unet that records ``self.training`` at every forward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_unet()
        self.modes: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.modes.append(self.training)
        return self.net(x)


@pytest.mark.parametrize("meta_mode", ["eval", "train"])
def test_single_group_gumbel_tra_updates_and_runs_its_extra_passes_in_meta_mode(meta_mode):
    """One TRA policy for all patches (``learned`` mode): every update runs (no 'one class group' skip) and
    the validation and theta ± eps v passes run in ``meta_mode`` while the trainer's own step trains."""
    policy = make_tra_policy("nnunet", num_groups=1)
    net = _ModeRecorder()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    batch = lesion_batch(4, seed=3)  # its class groups are ignored: one group
    batch["tra_ops"] = torch.as_tensor(np.stack([policy.sample_ops(0, np.random.RandomState(i)) for i in range(4)]))
    before = policy.logits.detach().clone()
    updater = TRAPolicyUpdater(policy, net, [lesion_batch(4, seed=4)], opt, lr=0.05, meta_mode=meta_mode)
    engine = train_engine(net, opt)
    updater.attach(engine)
    engine.run([batch, batch], max_epochs=1)
    assert (updater.updates, updater.skipped) == (2, 0)
    assert not torch.equal(policy.logits.detach(), before)
    extra = net.modes[1:]  # after the first training forward pass
    assert extra and (all(extra) if meta_mode == "train" else (False in extra and extra.count(True) == 1))


def test_paired_scores_are_the_hypergradient_made_scale_free(monkeypatch):
    """``update()``: each paired score is ``g_i * N / (alpha * ||v||)`` (N = the samples and their copies, all
    scored in one batch), handed to the paired step as the samples' scores and the copies' ``[n, K]`` scores; the
    hypergradient gets ``||v||`` rather than recomputing it."""
    from jcsaug.engine.hypergradient import flat_norm

    torch.manual_seed(0)
    net = nn.Conv3d(1, 2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(2, 1, 4, 4, 4)
    y = (x > 0).float()
    updater = TRAPolicyUpdater(CategoricalPolicy([3, 2], num_groups=2), net, [{"image": x, "label": y}], opt,
                               estimator="paired")  # fmt: skip
    norm = float(flat_norm(updater._validation_gradient()))
    g = torch.arange(1.0, 7.0, dtype=F64)  # 2 samples, then 2 x 2 copies
    seen: dict = {}

    def hypergradient(model, theta, v, image, label, loss, alpha, v_norm=None):
        seen.update(n=image.shape[0], v_norm=v_norm)
        return g.clone()

    monkeypatch.setattr(updater, "hypergradient", hypergradient)
    monkeypatch.setattr(updater, "_paired_step", lambda engine, s, cf, *rest: seen.update(s=s, cf=cf))
    updater._theta, updater._alpha = {n: p.detach().clone() for n, p in net.named_parameters()}, 0.05
    engine = Engine(lambda e, b: None)
    engine.state.batch = paired_batch(x, y)
    updater.update(engine)
    assert seen["n"] == 6 and seen["v_norm"] == pytest.approx(norm, rel=1e-6)
    expected = g * 6 / (0.05 * norm)
    torch.testing.assert_close(seen["s"], expected[:2], rtol=1e-6, atol=0)
    torch.testing.assert_close(seen["cf"], expected[2:].reshape(2, 2), rtol=1e-6, atol=0)


def test_tra_updater_passes_its_seed_and_logit_budget_on_and_can_leave_undrawn_ops_unmasked():
    """The seed and the logit budget reach :class:`PolicyUpdater`; ``mask_undrawn=False`` (gumbel) lets every op of
    a drawn series take the plain Gumbel-softmax gradient, ``True`` only the drawn ones."""
    net = tiny_unet()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)

    def make(**kwargs) -> TRAPolicyUpdater:
        return TRAPolicyUpdater(make_tra_policy("nnunet", 2), net, [lesion_batch(4, seed=4)], opt, lr=0.05, **kwargs)

    assert make(logit_budget=6.0).logit_budget == 6.0
    assert torch.equal(make(seed=5).generator.get_state(), torch.Generator().manual_seed(5).get_state())
    grads = {}
    for mask in (True, False):
        updater = make(mask_undrawn=mask)
        batch = lesion_batch(4, seed=3, tra_policy=updater.policy)
        engine = train_engine(net, opt)
        updater.attach(engine)
        engine.run([batch], max_epochs=1)
        assert updater.updates == 1
        grads[mask] = updater.policy.logits.grad.detach().clone()
        drawn = updater.policy.drawn_mask(batch["tra_ops"], batch["class_group"])
    assert (grads[True][~drawn] == 0).all() and (grads[False][~drawn] != 0).any()


# ---------------------------------------------------------------------------------------------------------------
# the base updater: batch preparation, defaults, skips, the learning rate's end, DEBUG changes


def test_default_batch_preparation_gives_plain_tensors_on_the_device_and_names_missing_keys():
    """``make_prepare_batch()`` reads ``image`` and ``label``, strips MONAI's metadata (plain ``torch.Tensor``s, as the
    functional passes need) and moves both to the device asked for; a batch without one of the keys is refused
    with the key named. (The ``meta`` device stands in for a GPU: no data, but a device of its own.)"""
    from monai.data import MetaTensor

    from jcsaug.engine.base import make_prepare_batch, plain

    image, label = MetaTensor(torch.arange(8.0).reshape(1, 1, 2, 2, 2)), MetaTensor(torch.ones(1, 1, 2, 2, 2))
    assert type(plain(image)) is torch.Tensor
    prepare = make_prepare_batch()
    x, y = prepare({"image": image, "label": label}, torch.device("cpu"))
    assert type(x) is torch.Tensor and type(y) is torch.Tensor
    assert torch.equal(x, image.as_tensor()) and torch.equal(y, label.as_tensor())
    x, y = prepare({"image": image, "label": label}, torch.device("meta"))
    assert (x.device.type, y.device.type) == ("meta", "meta") and x.shape == y.shape == (1, 1, 2, 2, 2)
    with pytest.raises(KeyError, match=r"no key\(s\) \['label'\]; keys are \['image', 'seg'\]"):
        prepare({"image": image, "seg": label}, torch.device("cpu"))


def test_the_meta_passes_run_on_the_network_inside_a_data_parallel_wrapper():
    """``updater.model`` (the network the extra passes use) is the wrapped module, not the ``DataParallel`` /
    DDP wrapper; an unwrapped network is used as it is."""
    from torch.nn.parallel import DataParallel

    net = nn.Conv3d(1, 2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for model in (DataParallel(net), net):
        assert TRAPolicyUpdater(CategoricalPolicy([2]), model, None, opt).model is net


def test_policy_updater_defaults_and_argument_checks():
    """:class:`PolicyUpdater` on its own (a subclass that gives only ``lr``): poly power 0.9, seed 0 plus the rank
    (rank 1 here), name ``policy`` in its warnings, the given learning rate in its Adam from the start, no frequency
    scaling, no op effects in its state, no changes recorded; a negative or non-finite ``lr`` and a budget <= 0 are
    refused, a budget below 1 is not."""
    import ignite.distributed as idist

    def make(**kwargs) -> _GivenGradient:
        return _GivenGradient(CategoricalPolicy([3]), lambda t: None, **kwargs)

    updater = make(lr=0.1)
    engine = Engine(lambda e, b: None)
    engine.state.max_epochs, engine.state.epoch_length, engine.state.iteration = 1, 10, 6  # progress 1/2
    assert updater.current_lr(engine) == pytest.approx(0.1 * 0.5**0.9, rel=1e-12)
    assert torch.equal(updater.generator.get_state(), torch.Generator().manual_seed(0).get_state())
    assert updater.optimizer.param_groups[0]["lr"] == 0.1
    assert updater.optimizer.param_groups[0]["frequency_scaling"] is False
    assert updater.last_changes == [] and "effects" not in updater.state_dict()
    with pytest.warns(UserWarning, match=r"^policy update skipped: nothing to learn this time"):
        updater._run_update(engine)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(idist, "get_rank", lambda: 1)
        assert torch.equal(make(lr=0.1, seed=5).generator.get_state(), torch.Generator().manual_seed(6).get_state())
    for lr in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="policy learning rate"):
            make(lr=lr)
    for budget in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="logit_budget"):
            make(lr=0.1, logit_budget=budget)
    assert make(lr=0.1, logit_budget=0.5).logit_budget == 0.5


class _Surrogates(PolicyUpdater):
    """An updater whose update ``t`` steps on ``surrogates[t - 1](logits)``."""

    def __init__(self, policy: CategoricalPolicy, surrogates) -> None:
        super().__init__(policy, nn.Identity(), lr=0.1, poly_power=0.0)
        self.surrogates = surrogates

    def update(self, engine: Engine) -> None:
        self.step(engine, self.surrogates[engine.state.iteration - 1](self.policy.logits))


def test_an_update_whose_surrogate_misses_the_policy_is_skipped_and_leaves_it_unchanged():
    """A surrogate that does not depend on the logits is skipped ("no gradient reached the policy"), also after an
    update that did step (its gradient must not linger: Adam would take another, momentum-only, step)."""
    unrelated = torch.zeros(1, requires_grad=True)
    policy = CategoricalPolicy([3])
    updater = _Surrogates(
        policy,
        [lambda z: unrelated.sum(), lambda z: (z * torch.tensor([[0.0, 2.0, -1.0]])).sum(), lambda z: unrelated.sum()],
    )
    engine = Engine(lambda e, b: None)
    updater.attach(engine)
    after: list[torch.Tensor] = []
    engine.add_event_handler(Events.ITERATION_COMPLETED, lambda e: after.append(policy.logits.detach().clone()))
    with pytest.warns(UserWarning, match="no gradient reached the policy"):
        engine.run([0, 0, 0], max_epochs=1)
    assert (updater.updates, updater.skipped) == (1, 2)
    assert updater.skip_reasons == {"no gradient reached the policy": 2}
    torch.testing.assert_close(after[0], torch.zeros(1, 3))
    torch.testing.assert_close(after[1], torch.tensor([[0.0, -0.1, 0.1]]))
    assert torch.equal(after[2], after[1])


@pytest.mark.parametrize("total", [1, 4])
def test_policy_learning_rate_is_zero_past_the_planned_end(total):
    """Iterations past the planned total (``max_epochs x epoch_length``; ignite's ``max_iters`` can run past it)
    get a learning rate of 0, not a negative or complex power of ``1 - t / T``."""
    updater = _GivenGradient(CategoricalPolicy([3]), lambda t: None, lr=0.1, poly_power=0.9)
    engine = Engine(lambda e, b: None)
    engine.state.max_epochs, engine.state.epoch_length = 1, total
    for iteration, expected in [(1, 0.1), (total + 1, 0.0), (total + 2, 0.0), (2 * total + 3, 0.0)]:
        engine.state.iteration = iteration
        assert updater.current_lr(engine) == expected


@pytest.mark.parametrize("level", [logging.DEBUG, logging.INFO], ids=["debug", "info"])
def test_each_update_records_its_most_changed_ops_only_when_debug_logging_is_on(caplog, level):
    """With DEBUG logging on, every update records the ops whose probability changed most (largest first, signed)
    in ``last_changes`` and logs them; otherwise nothing is computed and ``last_changes`` stays empty. The first
    Adam step moves the logits by ``-0.1 sign(g)`` for g = (0, 2, -1): op2 gains most, op1 loses, op0 barely."""
    caplog.set_level(level, logger="jcsaug.engine")
    policy = CategoricalPolicy([3])
    updater = _GivenGradient(policy, lambda t: ([0.0, 2.0, -1.0], None), lr=0.1, poly_power=0.0)
    engine = Engine(lambda e, b: None)
    updater.attach(engine)
    engine.run([0], max_epochs=1)
    assert updater.updates == 1
    if level == logging.INFO:
        assert updater.last_changes == [] and "policy update 1" not in caplog.text  # the epoch's INFO line only
        return
    p = torch.softmax(torch.tensor([0.0, -0.1, 0.1], dtype=F64), 0).numpy() - 1 / 3
    assert [name for name, _ in updater.last_changes] == ["series0/op2", "series0/op1", "series0/op0"]
    np.testing.assert_allclose([d for _, d in updater.last_changes], p[[2, 1, 0]], rtol=1e-4)
    assert "iteration 1: policy update 1; most changed: series0/op2 (+3.38e-02)" in caplog.text


# ---------------------------------------------------------------------------------------------------------------
# the TRA updater's own keys, parameter snapshots and noise


def _small_tra(policy: CategoricalPolicy, **kwargs) -> tuple[TRAPolicyUpdater, dict]:
    """A TRA updater on a 1x1x1 convolution, with a four-sample training batch (groups 0, 1, 0, 1) for it."""
    torch.manual_seed(0)
    net = nn.Conv3d(1, 2, 1)
    x = torch.randn(4, 1, 4, 4, 4)
    y = (x + torch.randn(4, 1, 4, 4, 4) > 0).float()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    updater = TRAPolicyUpdater(policy, net, [{"image": x.flip(2), "label": y.flip(2)}], opt, lr=0.05, **kwargs)
    return updater, {
        "image": x,
        "label": y,
        "tra_ops": torch.tensor([[1, 0], [2, 1], [0, -1], [1, 1]]),
        "class_group": torch.tensor([0, 1, 0, 1]),
    }


def test_tra_updater_prepares_batches_with_its_own_image_and_label_keys():
    image, label = torch.zeros(1, 1, 2, 2, 2), torch.ones(1, 1, 2, 2, 2)
    updater, _ = _small_tra(CategoricalPolicy([3, 2], num_groups=2), image_key="img", label_key="seg")
    x, y = updater.prepare_batch({"img": image, "seg": label}, torch.device("cpu"))
    assert torch.equal(x, image) and torch.equal(y, label)


def test_tra_update_needs_a_fresh_parameter_snapshot():
    """An update runs on the ``theta`` snapshot taken when its iteration started and drops it: an update with no
    snapshot (the first, before any was taken; the third, whose iteration took none) is skipped, not run on a
    missing or stale ``theta``."""
    updater, batch = _small_tra(CategoricalPolicy([3, 2], num_groups=2))
    engine = Engine(lambda e, b: None)
    engine.add_event_handler(Events.ITERATION_STARTED(event_filter=lambda e, i: i == 2), updater._snapshot)
    engine.add_event_handler(Events.ITERATION_COMPLETED, updater._run_update)
    with pytest.warns(UserWarning, match="no parameter snapshot"):
        engine.run([batch] * 3, max_epochs=1)
    assert (updater.updates, updater.skipped) == (1, 2) and updater._theta is None
    assert list(updater.skip_reasons.values()) == [2] and "no parameter snapshot" in next(iter(updater.skip_reasons))


def test_gumbel_tra_update_draws_its_noise_from_its_own_seeded_generator():
    """The conditional Gumbel noise behind the weights' gradient comes from the updater's generator: the same seed
    gives the same policy gradient whatever torch's global random state, another seed another gradient."""
    grads = {}
    for seed, global_seed in [(3, 1), (3, 2), (4, 1)]:
        updater, batch = _small_tra(CategoricalPolicy([3, 2], num_groups=2), seed=seed)
        engine = Engine(lambda e, b: None)
        updater.attach(engine)
        torch.manual_seed(global_seed)
        engine.run([batch], max_epochs=1)
        assert updater.updates == 1
        grads[seed, global_seed] = updater.policy.logits.grad.clone()
    assert torch.equal(grads[3, 1], grads[3, 2]) and not torch.equal(grads[3, 1], grads[4, 1])


# ---------------------------------------------------------------------------------------------------------------
# the policy's structure and the dtypes of recorded choices


def test_policy_structure_one_op_series_names_and_checks():
    """A series may hold a single op (always drawn); given series and op names are kept (``op<j>`` otherwise);
    empty or non-positive sizes, and names that do not match the sizes, are refused."""
    policy = CategoricalPolicy([1, 2], series_names=["only", "pair"], op_names=[["identity"], ["a", "b"]])
    assert policy.series_names == ["only", "pair"] and policy.op_names == [["identity"], ["a", "b"]]
    np.testing.assert_allclose(policy.probabilities()[0].numpy(), [[1.0]])
    assert [int(policy.sample_ops(0, np.random.RandomState(i))[0]) for i in range(5)] == [0] * 5
    assert CategoricalPolicy([2, 1]).op_names == [["op0", "op1"], ["op0"]]
    for sizes in ([], [0], [2, -1]):
        with pytest.raises(ValueError, match="series_sizes"):
            CategoricalPolicy(sizes)
    for names in ({"series_names": ["a"]}, {"op_names": [["a", "b"], []]}, {"op_names": [["a"], ["b"]]}):
        with pytest.raises(ValueError, match="do not match"):
            CategoricalPolicy([2, 1], **names)


def test_recorded_choices_and_groups_are_read_as_indices_whatever_their_dtype():
    """``drawn_mask`` and ``series_weights`` read choices and class groups as integer indices: float choices (a
    collated MetaTensor), ``uint8`` groups (which torch would take for a boolean mask), int32 or numpy arrays give
    what int64 tensors give."""
    policy = CategoricalPolicy([2, 3], num_groups=2)
    choices, groups = torch.tensor([[0, 2], [1, -1]]), torch.tensor([0, 1])
    mask = torch.tensor([[1, 0, 0, 0, 1], [0, 1, 0, 0, 0]], dtype=torch.bool)  # (group, series offset + op)

    def weight_grad(c, g) -> torch.Tensor:
        w = policy.series_weights(c, g, torch.Generator().manual_seed(0))
        assert torch.equal(w.detach(), torch.ones(2, 2))
        return torch.autograd.grad((w * torch.tensor([[1.0, -2.0], [3.0, 0.5]])).sum(), policy.logits)[0]

    expected = weight_grad(choices, groups)
    assert expected.abs().sum() > 0
    for c, g in [
        (choices.float(), groups.to(torch.uint8)),
        (choices.int(), groups.int()),
        (choices.numpy().astype(np.int32), groups.numpy().astype(np.uint8)),
    ]:
        assert torch.equal(policy.drawn_mask(c, g), mask)
        assert torch.equal(weight_grad(c, g), expected)


def test_the_schedule_is_planned_over_max_iters_and_an_unknown_run_length_is_refused_at_the_start():
    """The poly decay and the logit budget are planned over the run's iterations: ``max_iters`` when ``engine.run``
    gets it (ignite then leaves ``max_epochs`` unset), else epochs x epoch length. Data without a length and no
    ``epoch_length`` leave the length unknown: refused before the first iteration, naming the fix; a constant lr
    (``poly_power=0``, no budget) needs no length."""
    recorded = []

    def make(**kwargs) -> _GivenGradient:
        updater = _GivenGradient(CategoricalPolicy([3]), lambda t: ([0.0, 2.0, -1.0], None), **kwargs)
        engine = Engine(lambda e, b: recorded.append(updater.current_lr(e)))
        updater.attach(engine)
        return updater, engine

    updater, engine = make(lr=0.1, logit_budget=3.0, update_every=2)
    engine.run(list(range(4)), max_iters=10)  # 2.5 epochs of 4
    assert engine.state.max_epochs is None and updater.updates == 5
    assert updater.base_lr == pytest.approx(updater.lr_for_budget(3.0, 10))
    assert updater.lr_for_budget(3.0, 10) != pytest.approx(updater.lr_for_budget(3.0, 4))
    # the last iteration (10 of 10) still gets a positive lr: the decay runs over max_iters, not one epoch
    assert recorded[-1] == pytest.approx(updater.base_lr * (1 - 9 / 10) ** 0.9)

    def no_length():
        yield from range(3)

    for kwargs in ({"lr": 0.1}, {"lr": 0.1, "poly_power": 0.0, "logit_budget": 2.0}):
        updater, engine = make(**kwargs)
        with pytest.raises(ValueError, match=r"policy updater: the run's length is unknown.*pass epoch_length"):
            engine.run(no_length(), max_epochs=2)
        assert updater.updates == 0
    updater, engine = make(lr=0.1)
    engine.run(no_length(), max_epochs=1, epoch_length=3)  # told the length: planned over 3
    assert updater.updates == 3 and recorded[-1] == pytest.approx(0.1 * (1 - 2 / 3) ** 0.9)
    updater, engine = make(lr=0.1, poly_power=0.0)  # constant lr: no length needed
    recorded.clear()
    engine.run(no_length(), max_epochs=1)
    assert updater.updates == 3 and recorded == [0.1, 0.1, 0.1]


def test_per_sample_validation_loss_is_the_mean_over_samples_whatever_the_chunks():
    """``chunked_loss`` (the updater's L_val and ``bench_op_effects.py``'s): a per-sample loss averages over every
    sample of the chunks (a chunk of 1 and one of 3 weigh 1 : 3), a batch loss is passed through."""
    from jcsaug.engine.losses import BATCH_LOSSES, chunked_loss, per_sample_dice

    torch.manual_seed(0)
    logits, labels = torch.randn(4, 2, 4, 4, 4), (torch.rand(4, 1, 4, 4, 4) > 0.5).long()
    chunks = [(logits[:1], labels[:1]), (logits[1:], labels[1:])]
    torch.testing.assert_close(chunked_loss("dice")(chunks), per_sample_dice(logits, labels).mean())
    assert chunked_loss("batch-dice") is BATCH_LOSSES.get("batch-dice")
    net = _Threshold()
    updater = TRAPolicyUpdater(CategoricalPolicy([2]), net, [], torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1))
    image, label = _octant_patch()
    two = [(image[None], label[None]), (torch.cat([image[None], image[None] * 0.5]), torch.cat([label[None]] * 2))]
    expected = torch.cat([per_sample_dice(net(x), y) for x, y in two]).mean()
    torch.testing.assert_close(updater._validation_loss(two), expected)


def test_without_component_removes_the_projection_on_g_and_leaves_v_for_a_zero_g():
    from jcsaug.engine.tra_updater import without_component

    v = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([[3.0]])}
    g = {"a": torch.tensor([1.0, 0.0]), "b": torch.tensor([[1.0]])}  # v . g = 4, |g|^2 = 2: v - 2 g
    out = without_component(v, g)
    torch.testing.assert_close(out["a"], torch.tensor([-1.0, 2.0]))
    torch.testing.assert_close(out["b"], torch.tensor([[1.0]]))
    zero = without_component(v, {k: torch.zeros_like(t) for k, t in g.items()})
    assert all(torch.equal(zero[k], v[k]) for k in v)


@pytest.mark.parametrize("lookahead", [1, 8])
@pytest.mark.parametrize("direction", ["validation", "beyond-training"])
def test_tra_direction_scores_against_v_or_v_beyond_the_training_batchs_gradient(monkeypatch, direction, lookahead):
    """``direction="beyond-training"``: the hypergradient gets ``v`` less its component along the gradient of the
    training batch's mean loss at the network's present parameters (orthogonal to it, the rest of ``v`` kept);
    ``"validation"`` gets ``v`` itself. With the look-ahead on (its first update: ``u = v``) the same, the gradient
    taken from the look-ahead's own passes. An unknown direction is refused, naming the valid ones."""
    from jcsaug.engine.hypergradient import flat_norm
    from jcsaug.registry import UnknownNameError

    torch.manual_seed(0)
    net = nn.Conv3d(1, 2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(2, 1, 4, 4, 4)
    y = (x > 0).float()
    val = [{"image": torch.randn(2, 1, 4, 4, 4), "label": (torch.randn(2, 1, 4, 4, 4) > 1).float()}]
    updater = TRAPolicyUpdater(CategoricalPolicy([3, 2], num_groups=2), net, val, opt, estimator="paired",
                               direction=direction, lookahead=lookahead)  # fmt: skip
    v = updater._validation_gradient()
    params = dict(net.named_parameters())
    g_train = dict(zip(params, torch.autograd.grad(updater.train_loss(net(x), y).mean(), list(params.values()))))
    seen: dict = {}

    def hypergradient(model, theta, direction_v, image, label, loss, alpha, v_norm=None):
        seen["v"] = {k: t.detach().clone() for k, t in direction_v.items()}
        return torch.ones(image.shape[0], dtype=F64)

    monkeypatch.setattr(updater, "hypergradient", hypergradient)
    monkeypatch.setattr(updater, "_paired_step", lambda *a: None)
    updater._theta, updater._alpha = {n: p.detach().clone() for n, p in net.named_parameters()}, 0.05
    engine = Engine(lambda e, b: None)
    engine.state.batch = paired_batch(x, y)
    updater.update(engine)
    dot = sum(float((seen["v"][k].double() * g_train[k].double()).sum()) for k in v)
    if direction == "validation":
        assert all(torch.equal(seen["v"][k], v[k]) for k in v)
    else:
        assert abs(dot) < 1e-6 * float(flat_norm(v) * flat_norm(g_train))
        removed = {k: v[k] - seen["v"][k] for k in v}  # a multiple of g_train
        c = sum(float((removed[k].double() * g_train[k].double()).sum()) for k in v) / float(flat_norm(g_train)) ** 2
        for k in v:
            torch.testing.assert_close(removed[k], c * g_train[k], rtol=1e-4, atol=1e-7)
        assert c != 0
    assert updater._settings["direction"] == direction
    with pytest.raises(UnknownNameError, match="beyond-training"):
        TRAPolicyUpdater(CategoricalPolicy([3, 2], num_groups=2), net, val, opt, direction="orthogonal")


@pytest.mark.parametrize("lookahead", [1, 8])
def test_beyond_training_costs_one_pass_of_the_batch_without_the_look_ahead_and_none_with_it(monkeypatch, lookahead):
    """The training batch's gradient that ``beyond-training`` removes is the base the look-ahead's finite
    differences compute anyway: with the look-ahead on, the direction adds no forward pass to an update; without
    it, one (with the batch's samples, not their paired copies)."""
    torch.manual_seed(0)
    net = nn.Conv3d(1, 2, 1)
    x = torch.randn(2, 1, 4, 4, 4)
    y = (x > 0).float()
    val = [{"image": torch.randn(2, 1, 4, 4, 4), "label": (torch.randn(2, 1, 4, 4, 4) > 1).float()}]
    passes = []
    net.register_forward_hook(lambda module, args, out: passes.append(args[0].shape[0]))

    def passes_per_update(direction: str) -> list[int]:
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        updater = TRAPolicyUpdater(CategoricalPolicy([3, 2], num_groups=2), net, val, opt, estimator="paired",
                                   direction=direction, lookahead=lookahead)  # fmt: skip
        monkeypatch.setattr(updater, "_paired_step", lambda *a: None)
        engine = Engine(lambda e, b: None)
        engine.state.batch = paired_batch(x, y)
        counts = []
        for _ in range(2):  # the second update: the look-ahead's series carries u, one more product
            updater._theta, updater._alpha = {n: p.detach().clone() for n, p in net.named_parameters()}, 0.05
            passes.clear()
            updater.update(engine)
            counts.append(list(passes))
        return counts

    plain, beyond = passes_per_update("validation"), passes_per_update("beyond-training")
    for before, after in zip(plain, beyond):
        extra = list(after)
        for size in before:
            extra.remove(size)
        assert extra == ([] if lookahead > 1 else [2])
