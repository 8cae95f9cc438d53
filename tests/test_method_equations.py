"""The equations of SPEC §4-5 pinned by numbers, on tiny float64 models whose answers are known in closed form.

Every expectation here is written by hand (or by a formula independent of the code under test), so that a changed
sign or factor, theta* for theta, a missing inverse, a sum for a mean or a lost class group fails a test. The
Gumbel factor ``dw/dp`` of the sample weights is pinned on its own (against a Monte-Carlo estimate); the updater
tests replace it by an indicator (``dw_is/dp = 1`` at the sample's group and op) so that their policy gradients
are exact numbers.
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from ignite.engine import Engine, Events
from torch import nn

from jcsaug.engine import (
    TEAPolicyUpdater,
    TRAPolicyUpdater,
    finite_difference_hypergradient,
    jvp_hypergradient,
    normalise_hypergradient,
    shutdown_distributed,
)
from jcsaug.engine.base import PolicyUpdater, SkipUpdate
from jcsaug.engine.hypergradient import call_with, flat_norm
from jcsaug.ops.tea import TEA_OPS
from jcsaug.policy import NOT_APPLIED, CategoricalPolicy
from jcsaug.policy.gumbel import gumbel_softmax

pytestmark = pytest.mark.method  # part of the mutation run's test set (tests/README.md)

F64 = torch.float64


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


# ---------------------------------------------------------------------------------------------------------------
# a linear "network" theta . x with per-sample losses whose derivatives are known
def squared_error(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``l_i = (theta . x_i - y_i)^2``: quadratic in theta, so a central difference is exact."""
    return ((out - y) ** 2).flatten(1).sum(1)


def cubed_error(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``l_i = (theta . x_i - y_i)^3``: a central difference of step eps is off by exactly ``(x_i . v)^3 eps^2``."""
    return ((out - y) ** 3).sum(1)


def linear(weight: list[float]) -> nn.Linear:
    net = nn.Linear(len(weight), 1, bias=False).double()
    with torch.no_grad():
        net.weight.copy_(_t([weight]))
    return net


X = _t([[1.0, 0.0], [0.0, 1.0], [2.0, 1.0]])
Y = _t([[0.0], [1.0], [-1.0]])
THETA = {"weight": _t([[1.0, -2.0]])}
V = {"weight": _t([[0.5, 1.0]])}


@pytest.mark.parametrize("estimator", [finite_difference_hypergradient, jvp_hypergradient])
@pytest.mark.parametrize("pass_norm", [False, True])
def test_hypergradient_of_a_linear_model_in_closed_form(estimator, pass_norm):
    """``g_i = -alpha/n * grad l_i(theta) . v = -alpha/n * 2 r_i (x_i . v)``, ``r_i = theta . x_i - y_i``.

    theta = (1, -2), v = (0.5, 1), alpha = 0.3, n = 3: r = (1, -3, 1), x.v = (0.5, 1, 2), so g = -0.1 (1, -6, 4).
    The network itself holds other parameters, (3, 3), as it does after the trainer's step: the estimate must be
    taken at the ``theta`` it is given (there it would be -0.1 (3, 4, 40))."""
    net = linear([3.0, 3.0])
    norm = flat_norm(V) if pass_norm else None
    g = estimator(net, THETA, V, X, Y, squared_error, 0.3, v_norm=norm)
    assert g.dtype == F64
    torch.testing.assert_close(g, _t([-0.1, 0.6, -0.4]), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(net.weight.detach(), _t([[3.0, 3.0]]))  # the network is left as it was


def test_equal_norm_hypergradient_keeps_each_gradients_direction_at_the_batchs_mean_length():
    """``g_i = -alpha/n * grad l_i . v * mean_j |grad l_j| / |grad l_i|`` with ``grad l_i = 2 r_i x_i``:
    r = (1, -3, 1), |x_i| = (1, 1, sqrt 5), so |grad l_i| = 2 (1, 3, sqrt 5), mean m = 2 (4 + sqrt 5) / 3, and
    grad l_i . v = 2 r_i (x_i . v) = (1, -6, 4): g = -0.1 m (1/2, -1, 2/sqrt 5). The third sample, with the longest
    gradient, no longer outscores the second (the plain estimate: -0.1 (1, -6, 4)). A sample with a zero gradient
    scores 0."""
    from jcsaug.engine.hypergradient import equal_norm_hypergradient, get_hypergradient

    assert get_hypergradient("equal-norm") is equal_norm_hypergradient
    net = linear([3.0, 3.0])
    g = equal_norm_hypergradient(net, THETA, V, X, Y, squared_error, 0.3)
    m = 2 * (4 + math.sqrt(5)) / 3
    assert g.dtype == F64
    torch.testing.assert_close(g, -0.1 * m * _t([0.5, -1.0, 2 / math.sqrt(5)]), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(net.weight.detach(), _t([[3.0, 3.0]]))  # the network is left as it was
    fitted = _t([[1.0], [1.0], [-1.0]])  # y_0 = 1: sample 0 is fitted, r_0 = theta . x_0 - y_0 = 0
    zero = equal_norm_hypergradient(net, THETA, V, X, fitted, squared_error, 0.3)
    assert zero[0] == 0 and torch.isfinite(zero).all() and (zero[1:] != 0).all()


def test_finite_difference_step_is_r_over_the_norm_of_v():
    """On a cubic loss the central difference carries its known error: ``(l(+eps) - l(-eps)) / 2 eps =
    3 r_i^2 (x_i . v) + (x_i . v)^3 eps^2``. With r = 0.5 and ||v||^2 = 1.25, eps^2 = 0.2:
    g = -0.1 * (3 * (1, 9, 1) * (0.5, 1, 2) + (0.125, 1, 8) * 0.2) = -0.1 * (1.525, 27.2, 7.6); the exact
    derivative (JVP) lacks the eps^2 term: -0.1 * (1.5, 27, 6)."""
    net = linear([0.0, 0.0])
    fd = finite_difference_hypergradient(net, THETA, V, X, Y, cubed_error, 0.3, r=0.5)
    torch.testing.assert_close(fd, _t([-0.1525, -2.72, -0.76]), rtol=1e-9, atol=1e-12)
    exact = jvp_hypergradient(net, THETA, V, X, Y, cubed_error, 0.3)
    torch.testing.assert_close(exact, _t([-0.15, -2.7, -0.6]), rtol=1e-9, atol=1e-12)


class _TwoPaths(nn.Module):
    """One linear layer reachable by two module paths (as MONAI's DynUNet reaches its encoder blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(2, 1, bias=False).double()
        self.skip = nn.ModuleList([self.first])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.skip[0](x)


def test_call_with_puts_shared_parameters_back():
    net = _TwoPaths()
    weight = net.first.weight
    out = call_with(net, {"first.weight": _t([[2.0, 1.0]])}, _t([[1.0, 1.0]]))
    torch.testing.assert_close(out, _t([[3.0]]))
    assert net.first.weight is weight and net.skip[0].weight is weight
    assert isinstance(net.skip[0].weight, nn.Parameter)


# ---------------------------------------------------------------------------------------------------------------
# class centring, per-series count normalisation, drawn mask
def test_normalisation_by_hand_with_interleaved_groups():
    """Groups [1, 0, 1, 1, 0]. Group 1 (samples 0, 2, 3): g = 1, 3, 8, mean 4 -> h = -3, -1, 4; group 0 (samples
    1, 4): g = 10, 20, mean 15 -> h = -5, 5. Counts are per class group: sample 1 drew op 0 of series 0 like
    samples 0 and 3, but in another group, so its count is 1 (theirs is 2)."""
    g = _t([1.0, 10.0, 3.0, 8.0, 20.0])
    groups = torch.tensor([1, 0, 1, 1, 0])
    choices = torch.tensor([[0, 1], [0, 1], [2, 1], [0, 0], [1, 1]])
    expected = _t(
        [
            [-3 / 2, -3 / 2],  # series 0: group 1 op 0 twice; series 1: group 1 op 1 twice
            [-5 / 1, -5 / 2],  # series 0: group 0 op 0 once; series 1: group 0 op 1 twice
            [-1 / 1, -1 / 2],
            [4 / 2, 4 / 1],
            [5 / 1, 5 / 2],
        ]
    )
    torch.testing.assert_close(normalise_hypergradient(g, groups, choices), expected, rtol=0, atol=1e-15)


def test_drawn_mask_marks_each_class_groups_own_draws():
    policy = CategoricalPolicy([3, 2], num_groups=3)
    choices = torch.tensor([[1, 0], [2, NOT_APPLIED], [1, 1], [0, NOT_APPLIED]])
    groups = torch.tensor([0, 2, 2, 0])
    expected = torch.tensor(
        [
            # series 0: op 0, 1, 2 | series 1: op 0, 1
            [1, 1, 0, 1, 0],  # group 0: samples 0 and 3
            [0, 0, 0, 0, 0],  # group 1: no sample
            [0, 1, 1, 0, 1],  # group 2: samples 1 and 2 (sample 1 did not pass through series 1)
        ],
        dtype=torch.bool,
    )
    assert torch.equal(policy.drawn_mask(choices, groups), expected)
    no_groups = torch.tensor([[0, 1, 0, 1, 0], [0] * 5, [0] * 5], dtype=torch.bool)  # groups left out: group 0
    assert torch.equal(policy.drawn_mask(choices[:1]), no_groups)


# ---------------------------------------------------------------------------------------------------------------
# the sample weights' gradient under conditional Gumbel noise
def test_series_weight_gradient_is_the_filtered_unconditional_expectation():
    """With op k recorded, ``E[dw/dp]`` under the conditional noise equals the mean of ``ds_k/dp_j = s_k (d_kj -
    s_j)`` over unconditional Gumbel-softmax draws whose argmax was k. k is the least likely op, where conditioning
    matters most: the unconditional mean is far off (checked, so the test can tell the two apart)."""
    logits, k, n = _t([1.0, 0.0, -1.0]), 2, 40_000
    policy = CategoricalPolicy([3]).double()
    with torch.no_grad():
        policy.logits.copy_(logits[None])
    w = policy.series_weights(torch.full((n, 1), k), torch.zeros(n, dtype=torch.long), torch.Generator().manual_seed(0))
    assert torch.equal(w.detach(), torch.ones(n, 1, dtype=F64))
    w.sum().backward()
    conditional = policy.logits.grad[0] / n

    index, s = gumbel_softmax(logits.expand(400_000, -1), torch.Generator().manual_seed(1))
    s = s.detach()
    per_draw = s[:, k : k + 1] * (torch.eye(3, dtype=F64)[k] - s)
    kept = per_draw[index == k]
    monte_carlo, spread = kept.mean(0), kept.std(0)
    tolerance = 5 * spread * math.sqrt(1 / len(kept) + 1 / n)
    assert ((conditional - monte_carlo).abs() < tolerance).all(), (conditional, monte_carlo, tolerance)
    unconditional = per_draw.mean(0)
    assert ((unconditional - monte_carlo).abs() > 20 * tolerance).all(), (unconditional, monte_carlo)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_gumbel_draws_follow_the_seeded_generator_and_keep_the_dtype(dtype):
    """SPEC's determinism: the same seeded generator gives the same noise (never the global RNG's)."""
    logits = torch.tensor([[0.3, -0.2, 1.1]], dtype=dtype).expand(64, -1)
    policy = CategoricalPolicy([3]).to(dtype)
    draws = []
    for _ in range(2):
        torch.manual_seed(len(draws))  # a different global stream each time: it must not matter
        index, s = gumbel_softmax(logits, torch.Generator().manual_seed(3))
        k, w = policy.gumbel_sample(torch.zeros(64, dtype=torch.long), torch.Generator().manual_seed(3))
        weights = policy.series_weights(k, None, torch.Generator().manual_seed(4))
        w.sum().backward()
        weights.sum().backward()
        policy.weights(k, None, torch.Generator().manual_seed(5)).sum().backward()
        draws.append((index, s.detach(), k, policy.logits.grad.clone()))
        policy.logits.grad = None
    for first, second in zip(*draws):
        assert torch.equal(first, second)
    assert draws[0][1].dtype == dtype and draws[0][3].dtype == dtype


def _indicator_weights(policy: CategoricalPolicy):
    """``series_weights`` with value 1 and ``dw_is/dp = 1`` at (group c_i, op k_is): the update's coefficients
    reach the logits as they are."""
    offsets = torch.tensor(policy.offsets[:-1])

    def series_weights(choices, groups=None, generator=None):
        picked = policy.logits[torch.as_tensor(groups)[:, None], torch.as_tensor(choices) + offsets]
        return picked - picked.detach() + 1

    return series_weights


# ---------------------------------------------------------------------------------------------------------------
# the TRA update end to end on the linear model: theta, theta*, v, g, centring, counts, the policy gradient
TRAIN_X = _t([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, -1.0], [0.5, 2.0]])
TRAIN_Y = _t([[1.0], [-1.0], [0.5], [2.0], [0.0]])
VAL_X = _t([[1.0, 2.0], [-1.0, 1.0], [2.0, 0.5]])
VAL_Y = _t([[0.0], [1.0], [3.0]])
GROUPS = [0, 0, 0, 1, 1]
CHOICES = [[1, 0], [1, 1], [2, 0], [1, 0], [0, 1]]  # policy series sizes [3, 2]
THETA0, ALPHA = [0.5, -0.5], 0.25


def _expected_tra_gradient(val_x: np.ndarray, at_theta_star: bool = False) -> np.ndarray:
    """SPEC §4 by hand: ``theta* = theta - alpha grad (1/n) sum l_i``, ``v = grad (1/m) sum l_val(theta*)``,
    ``g_i = -alpha/n grad l_i(theta) . v``, centred per group, divided per series by the group's count of the op."""
    x, y, theta = TRAIN_X.numpy(), TRAIN_Y.numpy()[:, 0], np.array(THETA0)
    n = len(x)
    theta_star = theta - ALPHA * 2 / n * ((x @ theta - y)[:, None] * x).sum(0)
    val_y = VAL_Y.numpy()[:, 0]
    v = 2 / len(val_x) * ((val_x @ theta_star - val_y)[:, None] * val_x).sum(0)
    at = theta_star if at_theta_star else theta
    g = -ALPHA / n * 2 * (x @ at - y) * (x @ v)
    h = g.copy()
    for c in set(GROUPS):
        members = [i for i in range(n) if GROUPS[i] == c]
        h[members] -= g[members].mean()
    grad = np.zeros((2, 5))
    for i in range(n):
        for s, offset in enumerate((0, 3)):
            k = CHOICES[i][s]
            count = sum(GROUPS[j] == GROUPS[i] and CHOICES[j][s] == k for j in range(n))
            grad[GROUPS[i], offset + k] += h[i] / count
    return grad


class _VolumeLinear(nn.Module):
    """The linear model on two-voxel volumes ``[B, 1, 2, 1, 1]`` (so that TEA ops apply), output ``[B, 1, 1, 1, 1]``."""

    def __init__(self, weight: list[float]) -> None:
        super().__init__()
        self.lin = linear(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.flatten(1)).reshape(-1, 1, 1, 1, 1)


def _volumes(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(len(x), 1, -1, 1, 1)


def _sgd_engine(net: nn.Module, opt: torch.optim.Optimizer) -> Engine:
    def step(engine, batch):
        opt.zero_grad()
        squared_error(net(batch["image"]), batch["label"]).mean().backward()
        opt.step()

    return Engine(step)


@pytest.mark.parametrize("hypergradient", ["finite-difference", "jvp"])
@pytest.mark.parametrize("joint", [False, True])
def test_tra_update_on_a_linear_model_by_hand(monkeypatch, hypergradient, joint):
    """One trainer step and one TRA update: the policy gradient equals SPEC §4 computed by hand, with the
    hypergradient taken at theta (at theta* it differs clearly). In joint mode the validation batch the TRA step
    sees is the one transformed by the TEA policy (here: all mass on the sagittal mirror, which swaps the voxels)."""
    net = _VolumeLinear(THETA0)
    opt = torch.optim.SGD(net.parameters(), lr=ALPHA)
    policy = CategoricalPolicy([3, 2], num_groups=2).double()
    monkeypatch.setattr(policy, "series_weights", _indicator_weights(policy))
    tea_kwargs = {}
    if joint:
        tea = CategoricalPolicy([2])
        with torch.no_grad():
            tea.logits.copy_(torch.tensor([[-1e4, 0.0]]))  # probability 0 of keeping the batch as it is
        tea_kwargs = {"tea_policy": tea, "tea_ops": [TEA_OPS[0], TEA_OPS[38]]}
    val = [{"image": _volumes(VAL_X), "label": _volumes(VAL_Y)}]
    updater = TRAPolicyUpdater(
        policy, net, val, opt, lr=0.1, train_loss=squared_error, val_loss=squared_error,
        hypergradient=hypergradient, seed=0, **tea_kwargs,
    )  # fmt: skip
    engine = _sgd_engine(net, opt)
    updater.attach(engine)
    batch = {"image": _volumes(TRAIN_X), "label": _volumes(TRAIN_Y)}
    batch.update(tra_ops=torch.tensor(CHOICES), class_group=torch.tensor(GROUPS))
    engine.run([batch], max_epochs=1)
    assert updater.updates == 1 and updater.skipped == 0

    mirrored = VAL_X.numpy()[:, ::-1]
    val_x = mirrored if joint else VAL_X.numpy()
    expected = _expected_tra_gradient(val_x)
    np.testing.assert_allclose(policy.logits.grad.numpy(), expected, rtol=1e-8, atol=1e-12)
    at_theta_star = _expected_tra_gradient(val_x, at_theta_star=True)
    other_batch = _expected_tra_gradient(VAL_X.numpy() if joint else mirrored)
    for wrong in (at_theta_star, other_batch):  # the test tells these apart
        assert np.abs(wrong - expected).max() > 0.2 * np.abs(expected).max()


# ---------------------------------------------------------------------------------------------------------------
# the TEA update: inverses, centring, count division
class _Threshold(nn.Module):
    """A fixed per-voxel 'network': foreground probability sigmoid(6 (x - 1/2))."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = 3.0 * (x - 0.5)
        return torch.cat([-z, z], dim=1)


def _soft_dice_loss(prob: np.ndarray, label: np.ndarray) -> float:
    """MONAI's soft Dice loss (smooth_nr = smooth_dr = 1e-5) written out."""
    return 1 - (2 * (prob * label).sum() + 1e-5) / (prob.sum() + label.sum() + 1e-5)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


def test_tea_update_maps_back_centres_and_divides_by_counts(monkeypatch):
    """Z = 8 copies of a patch whose lesion fills one octant (so that every mirror moves it off itself), drawn ops
    identity, mirror sagittal (4 times), +0.05 (twice), mirror all. Mapped back, a mirror's prediction is the
    untouched one, so it scores the untouched Dice D0; +0.05 scores D1. The gradient of op k is
    ``sum_copies (D_c - mean D) / Z / count_k = (D_k - mean D) / Z``."""
    ops = [TEA_OPS[0], TEA_OPS[38], TEA_OPS[54], TEA_OPS[41]]
    draws = [1, 1, 2, 1, 3, 2, 1, 0]
    policy = CategoricalPolicy([len(ops)]).double()
    choices = torch.tensor(draws)[:, None]

    def gumbel_sample(groups, generator=None):
        picked = policy.logits[0][choices]
        return choices, picked - picked.detach() + 1

    monkeypatch.setattr(policy, "gumbel_sample", gumbel_sample)
    label = torch.zeros(1, 8, 8, 8)
    label[0, 4:, 4:, 4:] = 1
    image = label.clone()
    val = [{"image": image[None], "label": label[None]}]
    updater = TEAPolicyUpdater(policy, _Threshold(), val, lr=0.1, num_copies=len(draws), ops=ops, seed=0)
    engine = Engine(lambda e, b: None)
    updater.attach(engine)
    engine.run([0], max_epochs=1)
    assert updater.updates == 1

    lab = label.numpy()
    d0 = _soft_dice_loss(_sigmoid(6 * (lab - 0.5)), lab)
    d1 = _soft_dice_loss(_sigmoid(6 * (lab + 0.05 - 0.5)), lab)
    per_op = np.array([d0, d0, d1, d0])
    mean = per_op[draws].mean()
    np.testing.assert_allclose(policy.logits.grad[0].numpy(), (per_op - mean) / len(draws), rtol=1e-5, atol=1e-9)
    assert updater.last_dice == pytest.approx({"untouched": d0, "augmented_mean": mean}, rel=1e-5)
    # without the inverse a mirror's prediction would miss the lesion entirely: a loss near 1, far from D0
    unmapped = _soft_dice_loss(np.flip(_sigmoid(6 * (lab - 0.5)), axis=1), lab)
    assert unmapped - d0 > 0.5


@pytest.mark.parametrize("op_name", ["scale_down_0.45", "scale_up_0.25", "rotate_frontal_acw_15"])
def test_tea_op_scores_alone_map_back_probabilities_or_logits(op_name):
    """``op_score="alone"`` (the default) scores a copy by its softmax probabilities mapped back; ``"alone-logits"``
    by the softmax of its logits mapped back, exactly what the TTA averages (``TEAInferer``, the reference code's
    inversion). With an interpolating inverse the two differ."""
    from jcsaug.engine.tea_updater import soft_dice_loss
    from jcsaug.inference import TEAInferer
    from jcsaug.ops.tea import get_tea_op

    torch.manual_seed(0)
    net = nn.Conv3d(1, 2, 1).double()  # a confident threshold at 2: logits -+3 (x - 2)
    with torch.no_grad():
        net.weight.copy_(torch.tensor([-3.0, 3.0]).view(2, 1, 1, 1, 1))
        net.bias.copy_(torch.tensor([6.0, -6.0]))
    label = torch.zeros(1, 16, 16, 16)
    label[0, 5:11, 4:12, 6:10] = 1
    image = (4 * label + 0.3 * torch.randn_like(label)).double()
    op = get_tea_op(op_name)
    policy = CategoricalPolicy([len(TEA_OPS)]).double()
    with torch.no_grad():
        by_logits = soft_dice_loss(torch.softmax(TEAInferer([op])(image[None], net), 1), label[None]).double()
        by_probs = soft_dice_loss(op.invert(torch.softmax(net(op.transform_image(image[None])), 1)), label[None])
    scored = {
        score: TEAPolicyUpdater(policy, net, [], num_copies=1, op_score=score)._mapped_back_dice(image, label, [op])
        for score in ("alone", "alone-logits")
    }
    torch.testing.assert_close(scored["alone-logits"][1:], by_logits, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(scored["alone"][1:], by_probs.double(), rtol=1e-4, atol=1e-6)
    assert abs(float(by_logits) - float(by_probs)) > 1e-3  # the two orders differ for this op
    assert scored["alone"][0] == scored["alone-logits"][0]  # the untouched copy is scored alike


class _BorderSensitive(nn.Module):
    """Two zero-padded 3x3x3 convolutions: a window's prediction near its border differs from a whole pass's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Conv3d(1, 4, 3, padding=1), nn.Tanh(), nn.Conv3d(4, 2, 3, padding=1)).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.mark.parametrize("score", ["alone", "alone-logits"])
def test_tea_ops_scored_with_an_inferer_are_predicted_as_the_tta_predicts(score):
    """``inferer``: each copy is predicted by it, e.g. the sliding window the test uses on a volume larger than the
    training patches, so that an op is scored on the prediction the TTA averages (``TEAInferer`` on that base);
    without it, one pass of the network, which differs at the windows' borders."""
    from monai.inferers import SlidingWindowInferer

    from jcsaug.engine.tea_updater import soft_dice_loss
    from jcsaug.inference import TEAInferer
    from jcsaug.ops.tea import get_tea_op

    net = _BorderSensitive().eval()
    label = torch.zeros(1, 20, 20, 20)
    label[0, 6:14, 5:15, 7:13] = 1
    torch.manual_seed(0)
    image = (label + 0.3 * torch.randn_like(label)).double()
    window = SlidingWindowInferer(roi_size=(12, 12, 12), sw_batch_size=4, overlap=0.25, mode="gaussian")
    ops = [get_tea_op(name) for name in ("scale_down_0.25", "rotate_frontal_acw_15", "gamma_compress_0.5")]
    policy = CategoricalPolicy([len(TEA_OPS)]).double()

    def scored(inferer):
        updater = TEAPolicyUpdater(policy, net, [], num_copies=1, op_score=score, inferer=inferer)
        return updater._mapped_back_dice(image, label, ops)

    with torch.no_grad():
        expected = [soft_dice_loss(torch.softmax(window(image[None], net), 1), label[None])]
        for op in ops:
            if score == "alone-logits":  # exactly the TTA's one-op prediction
                probs = torch.softmax(TEAInferer([op], base_inferer=window)(image[None], net), 1)
            else:  # the probabilities of the op's copy, predicted by the window, mapped back
                probs = op.invert(torch.softmax(window(op.transform_image(image[None]), net), 1))
            expected.append(soft_dice_loss(probs, label[None]))
    by_window = scored(window)
    torch.testing.assert_close(by_window, torch.cat(expected).double(), rtol=1e-5, atol=1e-7)
    assert (by_window - scored(None)).abs().max() > 1e-3  # one whole pass scores the ops otherwise
    assert scored(None).tolist() == TEAPolicyUpdater(policy, net, [], num_copies=1, op_score=score)._mapped_back_dice(
        image, label, ops).tolist()  # fmt: skip


@pytest.mark.parametrize("estimator", ["gumbel", "paired"])
def test_tea_op_score_with_identity_scores_each_op_in_the_ttas_pair(estimator):
    """``op_score="with-identity"``: a copy is scored by the soft Dice loss of its mapped-back *logits* averaged
    with the untouched copy's (the TTA's ensemble of identity and op): a mirror mapped back is the untouched
    prediction again (D0); +0.05 averages to logits of +0.025 (D½), not the +0.05 of the op alone."""
    ops = [TEA_OPS[0], TEA_OPS[38], TEA_OPS[54]]
    label = torch.zeros(1, 8, 8, 8)
    label[0, 4:, 4:, 4:] = 1
    val = [{"image": label[None].clone(), "label": label[None]}]
    policy = CategoricalPolicy([len(ops)]).double()
    updater = TEAPolicyUpdater(policy, _Threshold(), val, lr=0.1, num_copies=2, ops=ops, seed=0,
                               estimator=estimator, op_score="with-identity")  # fmt: skip
    lab = label.numpy()
    losses = updater._mapped_back_dice(label, label, [ops[1], ops[2]]).numpy()
    d0 = _soft_dice_loss(_sigmoid(6 * (lab - 0.5)), lab)
    half = _soft_dice_loss(_sigmoid(6 * (lab + 0.025 - 0.5)), lab)
    alone = _soft_dice_loss(_sigmoid(6 * (lab + 0.05 - 0.5)), lab)
    np.testing.assert_allclose(losses, [d0, d0, half], rtol=1e-5)
    assert abs(half - alone) > 1e-4  # the pair is not the op alone
    assert updater.resume_settings()["op_score"] == "with-identity"  # a resume must keep it
    engine = Engine(lambda e, b: None)
    updater.attach(engine)
    engine.run([0], max_epochs=1)
    assert updater.updates == 1
    assert TEAPolicyUpdater(policy, _Threshold(), val, ops=ops).resume_settings()["op_score"] == "alone"
    with pytest.raises(KeyError, match="with-identity"):
        TEAPolicyUpdater(policy, _Threshold(), val, ops=ops, op_score="pair")


def _faint_half(faint: float) -> tuple[torch.Tensor, torch.Tensor, list[dict]]:
    """``(image, label, validation batches)`` of 8³: 64 foreground voxels, 32 at 0.6 (found by :class:`_Threshold`)
    and 32 at ``faint``, background at 0.3."""
    label = torch.zeros(1, 8, 8, 8)
    label[0, 4:, 4:, 4:] = 1
    image = 0.3 + label * 0.3
    image[0, 4:6, 4:, 4:] = faint
    return image, label, [{"image": image[None], "label": label[None]}]


_HALF_FOUND = 1 - 2 * 32 / (32 + 64)  # hard Dice loss when 32 of the 64 foreground voxels are found, none too many


@pytest.mark.parametrize("estimator", ["gumbel", "paired"])
@pytest.mark.parametrize(
    "score, soft_score, faint_found",
    [("with-identity-hard", "with-identity", ((0.48, True), (0.46, False))),
     ("alone-hard", "alone-logits", ((0.46, True), (0.40, False)))],
)  # fmt: skip
def test_tea_hard_op_scores_score_the_ttas_argmax_segmentation(score, soft_score, faint_found, estimator):
    """The hard scores: a copy is scored by one minus the hard Dice of the argmax of its mapped-back logits averaged
    with the untouched copy's (``"with-identity-hard"``, the pair's segmentation) or of its own (``"alone-hard"``,
    a one-op TTA's). Foreground at 0.6 (found) and a faint half (missed by the untouched copy, logit -0.06 at 0.48,
    -0.12 at 0.46): +0.05 lifts it to +0.09 / +0.03 / -0.15 at 0.48 / 0.46 / 0.40, so the pair's average finds it at
    0.48 (+0.015) and misses it at 0.46 (-0.045), the op alone finds it at 0.46 and misses it at 0.40. Where it is
    missed the loss is the untouched copy's, though the soft score of the same logits differs: a change that leaves
    the segmentation as it was scores nothing."""
    ops = [TEA_OPS[0], TEA_OPS[38], TEA_OPS[54]]
    policy = CategoricalPolicy([len(ops)]).double()
    for faint, found in faint_found:
        image, label, val = _faint_half(faint)
        updater = TEAPolicyUpdater(policy, _Threshold(), val, lr=0.1, num_copies=2, ops=ops, seed=0,
                                   estimator=estimator, op_score=score)  # fmt: skip
        losses = updater._mapped_back_dice(image, label, [ops[1], ops[2]]).numpy()
        np.testing.assert_allclose(losses, [_HALF_FOUND, _HALF_FOUND, 0.0 if found else _HALF_FOUND], atol=1e-7)
        soft = TEAPolicyUpdater(policy, _Threshold(), val, ops=ops, op_score=soft_score)
        soft_losses = soft._mapped_back_dice(image, label, [ops[1], ops[2]]).numpy()
        assert abs(soft_losses[2] - soft_losses[0]) > 1e-3  # the soft score rates the op either way
    assert updater.resume_settings()["op_score"] == score
    engine = Engine(lambda e, b: None)
    updater.attach(engine)
    engine.run([0], max_epochs=1)
    assert updater.updates == 1


@pytest.mark.parametrize("identity_weight", [None, 0.5, "equal"])
def test_tea_op_score_ensemble_is_the_first_order_change_of_the_ttas_loss(identity_weight):
    """``op_score="ensemble"``: the untouched copy scores its own soft Dice loss, and op k scores that loss plus
    the derivative of the soft Dice loss of the TTA the policy stands for now (``TEAInferer.from_policy`` with the
    same ``z`` and identity weight) along ``l_k - l_identity`` (the mapped-back logits as a one-op TTA forms them):
    a central finite difference on the ensemble by hand. The scored ops include a member of the ensemble, a zoom in
    (another shape) and a rotation."""
    from jcsaug.engine.tea_updater import soft_dice_loss
    from jcsaug.inference import TEAInferer
    from jcsaug.ops.tea import get_tea_op

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv3d(1, 4, 3, padding=1), nn.Tanh(), nn.Conv3d(4, 2, 1)).double()
    label = torch.zeros(1, 16, 16, 16)
    label[0, 5:11, 4:12, 6:10] = 1
    image = (label + 0.3 * torch.randn_like(label)).double()
    policy = CategoricalPolicy([len(TEA_OPS)]).double()
    names = [op.name for op in TEA_OPS]
    with torch.no_grad():
        for name, logit in (("identity", 2.0), ("mirror_sagittal", 1.5), ("scale_down_0.45", 1.0)):
            policy.logits[0, names.index(name)] = logit
    updater = TEAPolicyUpdater(policy, net, [], num_copies=3, op_score="ensemble", tta_z=3,
                               tta_identity_weight=identity_weight)  # fmt: skip
    scored = [get_tea_op(name) for name in ("scale_down_0.45", "scale_up_0.25", "rotate_frontal_acw_15")]
    scores = updater._mapped_back_dice(image, label, scored)

    def loss(logits: torch.Tensor) -> float:
        return float(soft_dice_loss(torch.softmax(logits, 0)[None], label[None])[0])

    with torch.no_grad():
        identity = TEAInferer([TEA_OPS[0]])(image[None], net)[0].double()
        ensemble = TEAInferer.from_policy(policy, 3, identity_weight=identity_weight)(image[None], net)[0].double()
        assert float(scores[0]) == pytest.approx(loss(identity), rel=1e-6)
        eps = 1e-3
        for op, score in zip(scored, scores[1:]):
            direction = TEAInferer([op])(image[None], net)[0].double() - identity
            change = (loss(ensemble + eps * direction) - loss(ensemble - eps * direction)) / (2 * eps)
            assert float(score - scores[0]) == pytest.approx(change, rel=1e-3, abs=1e-7), op.name
    assert updater.resume_settings()["op_score"] == "ensemble"  # a resume must keep it, and the TTA it rates for
    assert updater.resume_settings()["tta_z"] == 3
    assert updater.resume_settings()["tta_identity_weight"] == identity_weight
    for bad, match in (({"tta_z": 0}, "tta_z must be in"), ({"tta_z": 85}, r"tta_z must be in \[1, 84\]"),
                       ({"tta_identity_weight": 1.0}, "identity_weight")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            TEAPolicyUpdater(policy, net, [], op_score="ensemble", **{"tta_z": 3, **bad})
    assert "tta_z" not in TEAPolicyUpdater(policy, net, [], op_score="with-identity").resume_settings()


def test_tea_op_score_ensemble_moves_the_policy_toward_an_op_that_helps_the_ensemble():
    """On the threshold network a faint foreground is brought closer to the threshold by the +0.05 intensity op and
    by no other: with the ``ensemble`` score and the paired estimator that op's logit rises above the identity's and
    the mirror's (which maps back to the untouched prediction, so it scores as the identity)."""
    ops = [TEA_OPS[0], TEA_OPS[38], TEA_OPS[54]]
    label = torch.zeros(1, 8, 8, 8)
    label[0, 4:, 4:, 4:] = 1
    image = 0.3 + label * 0.17  # 0.47: just under the threshold at 0.5
    val = [{"image": image[None], "label": label[None]}]
    policy = CategoricalPolicy([len(ops)]).double()
    updater = TEAPolicyUpdater(policy, _Threshold(), val, lr=0.1, num_copies=2, ops=ops, seed=0,
                               estimator="paired", op_score="ensemble", tta_z=2)  # fmt: skip
    engine = Engine(lambda e, b: None)
    updater.attach(engine)
    engine.run(range(4), max_epochs=1)
    assert updater.updates == 4
    logits = policy.logits.detach()[0]
    assert logits[2] > 0.1 and logits[0] == logits[1] < -0.1, logits


def test_hard_dice_loss_counts_a_class_absent_from_label_and_segmentation_as_matched():
    from jcsaug.engine.tea_updater import hard_dice_loss

    label = torch.zeros(3, 1, 4, 4, 4)
    label[:, :, :2] = 1  # class 1 in the first half, class 2 absent
    logits = torch.zeros(3, 3, 4, 4, 4)
    logits[0, 1, :2] = 1  # perfect: class 2 absent from both
    logits[1, 1, :1] = 1  # half of class 1 (Dice 2/3), class 2 absent from both (1)
    logits[2, 1, :2] = 1
    logits[2, 2, 3:] = 1  # class 1 perfect, class 2 predicted where it is absent (0)
    torch.testing.assert_close(hard_dice_loss(logits, label), torch.tensor([0.0, (1 - 2 / 3) / 2, 0.5]))


# ---------------------------------------------------------------------------------------------------------------
# the collective step and the policy learning rate
class _GivenGradient(PolicyUpdater):
    """An updater whose surrogate has a given gradient: ``plan(iteration)`` gives ``(gradient, drawn mask or
    None)``, or ``None`` to skip that update."""

    def __init__(self, policy: CategoricalPolicy, plan, **kwargs) -> None:
        super().__init__(policy, nn.Identity(), **kwargs)
        self.plan = plan

    def update(self, engine: Engine) -> None:
        step = self.plan(engine.state.iteration)
        if step is None:
            raise SkipUpdate("nothing to learn this time")
        gradient, drawn = step
        surrogate = (torch.tensor(gradient, dtype=self.policy.logits.dtype) * self.policy.logits).sum()
        self.step(engine, surrogate, None if drawn is None else torch.tensor(drawn, dtype=torch.bool)[None])


def test_policy_learning_rate_decays_polynomially():
    """``beta_t = beta (1 - (t - 1) / T) ** 0.9`` over T = 2 epochs x 5 iterations, updates every 2nd iteration:
    0.1 * (0.9, 0.7, 0.5, 0.3, 0.1) ** 0.9. Adam's first step moves the logit by -beta_t * sign(gradient)."""
    policy = CategoricalPolicy([3])
    updater = _GivenGradient(policy, lambda t: ([0.0, 2.0, -1.0], None), lr=0.1, update_every=2, poly_power=0.9)
    engine = Engine(lambda e, b: None)
    updater.attach(engine)
    lrs, first_step = [], []

    @engine.on(Events.ITERATION_COMPLETED(every=2))
    def record(_):
        lrs.append(updater.optimizer.param_groups[0]["lr"])
        if not first_step:
            first_step.append(policy.logits.detach()[0].clone())

    engine.run([0] * 5, max_epochs=2)
    assert updater.updates == 5
    np.testing.assert_allclose(lrs, [0.0909533, 0.0725418, 0.0535887, 0.0338383, 0.0125893], rtol=5e-6)
    np.testing.assert_allclose(first_step[0].numpy(), [0.0, -0.0909533, 0.0909533], rtol=1e-5)


RANK_PLANS = {  # iteration -> (gradient, drawn mask) per rank; None: that rank skips the update
    0: {
        1: ([0.5, -1.0, 2.0, 0.0, 4.0], [1, 1, 0, 1, 0]),
        2: ([1.0, 0.0, 0.0, 0.0, -3.0], [0, 0, 0, 0, 1]),
        3: ([float("nan"), 0.0, 0.0, 0.0, 0.0], [1, 0, 0, 0, 0]),
    },
    1: {
        1: ([1.5, 3.0, -1.0, 0.25 + 1e-12, 0.0], None),  # no mask: every op takes part
        2: None,
        3: ([0.0, 1.0, 0.0, 0.0, 0.0], [0, 1, 0, 0, 0]),
    },
}
# the mean of the contributing ranks' gradients (summed in float64), masked by the union of their drawn ops; a
# non-finite mean is skipped by both ranks, and no rank joins a second all-reduce for it
EXPECTED_GRADIENTS = [[1.0, 1.0, 0.5, 0.125 + 5e-13, 2.0], [0.0, 0.0, 0.0, 0.0, -3.0]]


def _rank_updates(rank: int, dtype: torch.dtype = F64) -> dict:
    """Two policy updates on this rank of a two-rank run: the gradient applied after each, and the logits."""
    policy = CategoricalPolicy([3, 2]).to(dtype)
    plan = RANK_PLANS[rank]
    # a decaying lr: the rank that skips steps with the same lr as the others, read from its own engine
    updater = _GivenGradient(policy, lambda t: plan[t], lr=0.1, poly_power=0.9)
    engine = Engine(lambda e, b: None)
    updater.attach(engine)
    applied = []

    @engine.on(Events.ITERATION_COMPLETED)
    def record(engine):
        if engine.state.iteration < 3:
            applied.append(policy.logits.grad[0].tolist())

    engine.run([0, 0, 0], max_epochs=1)
    return {
        "applied": applied, "logits": policy.logits.detach()[0].tolist(), "updates": updater.updates,
        "skipped": updater.skipped,
    }  # fmt: skip


class _ThreadRanks:
    """An all-reduce (sum) between two threads of this process: the collective step traced in-process (the
    mutation run only sees calls made in the test's own process; the gloo test below checks the real thing)."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.barrier = threading.Barrier(2, timeout=60)
        self.slots: list[torch.Tensor | None] = [None, None]
        self.calls = [0, 0]

    def get_rank(self) -> int:
        return getattr(self.local, "rank", 0)

    def all_reduce(self, tensor: torch.Tensor, op: str = "SUM", group=None) -> torch.Tensor:
        assert op == "SUM"
        self.calls[self.get_rank()] += 1
        self.slots[self.get_rank()] = tensor.clone()
        self.barrier.wait()
        total = self.slots[0] + self.slots[1]
        self.barrier.wait()
        return total


@pytest.mark.filterwarnings("ignore:policy update skipped")
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_collective_step_applies_the_mean_of_two_ranks(monkeypatch, dtype):
    """The mean is summed in float64 and applied in the policy's own dtype (a float32 policy gets a float32
    gradient: a float64 one could not be assigned to its logits)."""
    import ignite.distributed as idist

    ranks = _ThreadRanks()
    monkeypatch.setattr(idist, "get_world_size", lambda: 2)
    monkeypatch.setattr(idist, "get_rank", ranks.get_rank)
    monkeypatch.setattr(idist, "all_reduce", ranks.all_reduce)
    results, errors = {}, []

    def run(rank: int) -> None:
        ranks.local.rank = rank
        try:
            results[rank] = _rank_updates(rank, dtype)
        except BaseException as error:  # noqa: BLE001 - re-raised in the main thread
            errors.append(error)
            ranks.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    _check_ranks(results, atol=1e-15 if dtype == F64 else 1e-7)
    assert ranks.calls == [3, 3]  # one all-reduce per update on each rank


def _check_ranks(results: dict, atol: float = 1e-15) -> None:
    for rank in range(2):
        np.testing.assert_allclose(results[rank]["applied"], EXPECTED_GRADIENTS, rtol=0, atol=atol)
        # rank 1 skipped its second update yet stepped with rank 0's gradient; both skipped the non-finite third
        assert results[rank]["updates"] == 2 and results[rank]["skipped"] == 1 + rank
    assert results[0]["logits"] == results[1]["logits"]


def _gloo_rank(rank: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=2)
    try:
        result = _rank_updates(rank)
    finally:
        shutdown_distributed()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.usefixtures("hide_gpus")  # CPU ranks also where CUDA is available
def test_collective_step_on_two_gloo_ranks_applies_the_mean(tmp_path):
    """Two processes, different local gradients and drawn ops: both apply the mean, masked by the union of the
    drawn ops; a rank that skips joins the all-reduce and applies the other rank's gradient alone. (The ranks are
    spawned: a forked rank could inherit a CUDA context the test process made.)"""
    torch.multiprocessing.start_processes(_gloo_rank, args=(str(tmp_path),), nprocs=2, start_method="spawn")
    _check_ranks({r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)})


def test_tea_op_score_reaches_the_post_hoc_learning(monkeypatch):
    """``tea_mode learned-posthoc``: the TEA learned after training scores its ops as ``tea_op_score`` says (the
    setting is not ignored where the TEA is learned on the frozen network)."""
    from helpers import spy_posthoc_tea_updater
    from jcsaug.engine import AugmentationSetup

    seen = spy_posthoc_tea_updater(monkeypatch)
    label = torch.zeros(1, 1, 8, 8, 8)
    label[0, 0, 4:, 4:, 4:] = 1
    setup = AugmentationSetup("heuristic", "learned-posthoc", tea_op_score="with-identity")
    policy = setup.test_tea_policy(_Threshold(), [{"image": label.clone(), "label": label}], posthoc_iterations=1,
                                   num_copies=2)  # fmt: skip
    assert policy is setup.tea_policy and seen["op_score"] == "with-identity"
    # the TTA an ensemble score rates ops for: the run's tea_z and tea_identity_weight, post hoc and in joint mode
    setup = AugmentationSetup("heuristic", "learned-posthoc", tea_op_score="ensemble", tea_z=3, tea_identity_weight=0.5)
    setup.test_tea_policy(_Threshold(), [{"image": label.clone(), "label": label}], posthoc_iterations=1,
                          num_copies=2)  # fmt: skip
    assert (seen["op_score"], seen["tta_z"], seen["tta_identity_weight"]) == ("ensemble", 3, 0.5)
    joint = AugmentationSetup("heuristic", "joint", tea_op_score="ensemble", tea_z=5, tea_identity_weight=0.25)
    tea = joint.updaters(_Threshold(), torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), []).tea
    assert (tea.op_score, tea.tta_z, tea.tta_identity_weight) == ("ensemble", 5, 0.25)
    # how the copies are predicted (the bundles' tea_sliding_window): post hoc and in joint mode, recorded for a resume
    from monai.inferers import SimpleInferer

    window = SimpleInferer()
    setup = AugmentationSetup("heuristic", "learned-posthoc")
    setup.test_tea_policy(_Threshold(), [{"image": label.clone(), "label": label}], posthoc_iterations=1, num_copies=2,
                          inferer=window)  # fmt: skip
    assert seen["inferer"] is window
    tea = joint.updaters(_Threshold(), torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), [],
                         tea_inferer=window).tea  # fmt: skip
    assert tea.inferer is window and tea.resume_settings()["inferer"] == "SimpleInferer"
    plain = joint.updaters(_Threshold(), torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), []).tea
    assert plain.inferer is None and plain.resume_settings()["inferer"] is None  # one pass, as runs before it
