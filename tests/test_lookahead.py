"""The TRA look-ahead beyond one step (issue 10): Hessian-vector products (twice differentiated and by finite
differences), the running Neumann series and its
fixed point, its scale-free step, its checkpointed state and its wiring into the TRA updater."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

from helpers import lesion_batch, paired_batch, tiny_unet
from jcsaug.engine import TRAPolicyUpdater
from jcsaug.engine.hypergradient import flat_norm
from jcsaug.engine.lookahead import NeumannLookAhead, hessian_vector_products
from jcsaug.policy import CategoricalPolicy, make_tra_policy

pytestmark = pytest.mark.usefixtures("single_thread")
method = pytest.mark.method


def squared_error(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).flatten(1).mean(1)


def flat(x: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in x.values()])


def as_params(model: nn.Module, vector: torch.Tensor) -> dict[str, torch.Tensor]:
    out, start = {}, 0
    for name, p in model.named_parameters():
        out[name] = vector[start : start + p.numel()].reshape(p.shape)
        start += p.numel()
    return out


@method
def test_hessian_vector_products_are_the_full_hessian_times_the_vectors():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, y = torch.randn(5, 3, dtype=torch.double), torch.randn(5, 2, dtype=torch.double)
    theta = flat(dict(model.named_parameters())).detach()

    def loss(vector):
        return squared_error(functional_call(model, as_params(model, vector), (x,)), y).mean()

    hessian = torch.autograd.functional.hessian(loss, theta)
    vectors = [as_params(model, torch.randn_like(theta)) for _ in range(2)]
    exact = hessian_vector_products(model, x, y, squared_error, vectors, exact=True)
    differences = hessian_vector_products(model, x, y, squared_error, vectors, r=1e-6)
    coarse = hessian_vector_products(model, x, y, squared_error, vectors, r=0.01)
    default = hessian_vector_products(model, x, y, squared_error, vectors)  # sqrt(eps) (1 + ||theta||)
    for vec, hv, fd, fd_coarse, fd_default in zip(vectors, exact, differences, coarse, default):
        torch.testing.assert_close(flat(hv), hessian @ flat(vec))
        torch.testing.assert_close(flat(fd), hessian @ flat(vec), rtol=1e-4, atol=1e-6)
        assert torch.nn.functional.cosine_similarity(flat(fd_coarse), hessian @ flat(vec), dim=0) > 0.999
        torch.testing.assert_close(flat(fd_default), hessian @ flat(vec), rtol=1e-5, atol=1e-7)  # float64 step


def quadratic_task(seed: int = 0):
    """A linear model with squared error: H = 2 X^T X / (n d_out), known exactly."""
    torch.manual_seed(seed)
    model = nn.Linear(4, 1, bias=False).double()
    x = torch.randn(16, 4, dtype=torch.double) * torch.tensor([3.0, 1.0, 0.3, 0.1], dtype=torch.double)
    y = torch.randn(16, 1, dtype=torch.double)
    hessian = 2 * x.T @ x / len(x)
    return model, x, y, hessian


@method
def test_the_running_series_converges_to_the_damped_inverse_with_a_scale_free_step():
    model, x, y, hessian = quadratic_task()
    v = {"weight": torch.tensor([[1.0, 1.0, 1.0, 1.0]], dtype=torch.double)}
    lam = float(torch.linalg.eigvalsh(hessian).max())
    for scale in (1.0, 100.0):  # the loss's scale does not change the series (alpha follows the curvature)
        lookahead = NeumannLookAhead(horizon=8, step=0.5)

        def scaled_loss(out, target, scale=scale):
            return scale * squared_error(out, target)

        for _ in range(200):
            u = lookahead(model, {"weight": v["weight"] * scale}, x, y, scaled_loss)
        assert lookahead.curvature == pytest.approx(scale * lam, rel=1e-6)
        rho, alpha = 1 - 1 / 8, 0.5 / (scale * lam)
        # fixed point of u = v + rho (I - alpha H) u
        expected = torch.linalg.solve(torch.eye(4, dtype=torch.double) - rho * (torch.eye(4) - alpha * scale * hessian),
                                      v["weight"].reshape(-1) * scale)  # fmt: skip
        torch.testing.assert_close(u["weight"].reshape(-1), expected)
    # flat directions are kept (x horizon), the sharpest damped: the direction differs from v's
    eigvals, eigvecs = torch.linalg.eigh(hessian)
    along = eigvecs.T @ u["weight"].reshape(-1) / (eigvecs.T @ v["weight"].reshape(-1) * 100)
    assert along[0] > 7 and along[-1] < 2, along


@method
def test_horizon_one_is_the_one_step_estimate_and_bad_settings_are_refused():
    model, x, y, _ = quadratic_task()
    v = {"weight": torch.ones(1, 4, dtype=torch.double)}
    lookahead = NeumannLookAhead(horizon=1)
    assert lookahead(model, v, x, y, squared_error)["weight"] is v["weight"] and lookahead.u is None
    for bad in ({"horizon": 0.5}, {"horizon": 4, "step": 0.0}, {"horizon": 4, "step": 2.0}):
        with pytest.raises(ValueError, match="horizon" if "step" not in bad else "step"):
            NeumannLookAhead(**bad)
    net = tiny_unet()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    assert TRAPolicyUpdater(make_tra_policy("nnunet", 2), net, [], opt).lookahead is None
    with pytest.raises(ValueError, match="lookahead must be >= 1"):
        TRAPolicyUpdater(make_tra_policy("nnunet", 2), net, [], opt, lookahead=0)


@method
def test_the_updater_builds_its_series_from_its_horizon_and_step():
    net = tiny_unet()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    two = TRAPolicyUpdater(make_tra_policy("nnunet", 2), net, [], opt, lookahead=2).lookahead
    assert two is not None and (two.horizon, two.step, two.rho) == (2.0, 0.5, 0.5)  # any horizon above 1; step 0.5
    custom = TRAPolicyUpdater(make_tra_policy("nnunet", 2), net, [], opt, lookahead=1.5, lookahead_step=0.25).lookahead
    assert custom.step == 0.25 and custom.rho == pytest.approx(1 / 3)


@method
def test_the_series_state_resumes_exactly():
    model, x, y, _ = quadratic_task()
    vs = [{"weight": torch.randn(1, 4, dtype=torch.double)} for _ in range(6)]
    straight, resumed = NeumannLookAhead(horizon=4), NeumannLookAhead(horizon=4)
    for v in vs[:3]:
        straight(model, v, x, y, squared_error)
    resumed.load_state_dict(straight.state_dict())
    for v in vs[3:]:
        torch.testing.assert_close(straight(model, v, x, y, squared_error), resumed(model, v, x, y, squared_error),
                                   rtol=0, atol=0)  # fmt: skip


@method
def test_the_updater_scores_ops_along_the_look_ahead_direction_and_checkpoints_it():
    torch.manual_seed(0)
    net = tiny_unet()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    val = [lesion_batch(4, seed=30)]
    updater = TRAPolicyUpdater(make_tra_policy("nnunet", 2), net, val, opt, lookahead=8)
    image, label = lesion_batch(4, seed=31)["image"], lesion_batch(4, seed=31)["label"]
    v = updater._validation_gradient()
    first = updater._look_ahead(v, image, label)
    assert flat(first).equal(flat(v))  # no series yet: the first update is the one-step estimate
    second = updater._look_ahead(updater._validation_gradient(), image, label)
    assert not torch.allclose(flat(second), flat(v)) and updater.lookahead.curvature > 0
    state = updater.state_dict()["lookahead"]
    assert state["u"].keys() == v.keys()
    restored = TRAPolicyUpdater(make_tra_policy("nnunet", 2), net, val, opt, lookahead=8)
    restored.load_state_dict(updater.state_dict())
    torch.testing.assert_close(flat(restored.lookahead.u), flat(updater.lookahead.u), rtol=0, atol=0)
    one_step = TRAPolicyUpdater(make_tra_policy("nnunet", 2), net, val, opt)  # lookahead 1: no series to restore
    one_step.load_state_dict(updater.state_dict())  # a look-ahead run's checkpoint continued one-step: series dropped
    assert one_step.lookahead is None


@method
def test_a_non_finite_product_skips_the_update_and_restarts_the_series():
    from jcsaug.engine.base import SkipUpdate

    torch.manual_seed(0)
    net = tiny_unet()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    updater = TRAPolicyUpdater(make_tra_policy("nnunet", 2), net, [lesion_batch(4, seed=30)], opt, lookahead=8)
    batch = lesion_batch(4, seed=31)
    v = updater._validation_gradient()
    updater._look_ahead(v, batch["image"], batch["label"])
    updater.lookahead.u = {k: torch.full_like(t, float("nan")) for k, t in updater.lookahead.u.items()}
    with pytest.raises(SkipUpdate, match="non-finite look-ahead"):
        updater._look_ahead(v, batch["image"], batch["label"])
    assert updater.lookahead.u is None and updater.lookahead.w is None  # the next update starts afresh
    assert flat(updater._look_ahead(v, batch["image"], batch["label"])).equal(flat(v))


class WithUnusedBranch(nn.Module):
    """A trainable layer the loss never reaches (a deep-supervision head left off, a frozen-out branch)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        self.unused = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@method
@pytest.mark.parametrize("exact", [False, True])
def test_products_are_zero_for_parameters_the_loss_never_reaches(exact):
    torch.manual_seed(0)
    model = WithUnusedBranch().double()
    x, y = torch.randn(5, 3, dtype=torch.double), torch.randn(5, 2, dtype=torch.double)
    vectors = [{n: torch.randn_like(p) for n, p in model.named_parameters()} for _ in range(2)]
    products = hessian_vector_products(model, x, y, squared_error, vectors, exact=exact)
    body = [{n[len("body.") :]: t for n, t in vec.items() if n.startswith("body.")} for vec in vectors]
    reference = hessian_vector_products(model.body, x, y, squared_error, body, exact=True)
    for hx, ref in zip(products, reference):
        assert list(hx) == [n for n, _ in model.named_parameters()]
        for name in ("unused.weight", "unused.bias"):
            assert torch.equal(hx[name], torch.zeros_like(hx[name]))
        torch.testing.assert_close(flat({n: t for n, t in hx.items() if n.startswith("body.")}), flat(ref),
                                   rtol=1e-5, atol=1e-7)  # fmt: skip


@method
def test_a_zero_vector_gives_a_zero_product_and_the_next_vectors_are_still_computed():
    model, x, y, hessian = quadratic_task()
    vectors = [{"weight": torch.zeros(1, 4, dtype=torch.double)}, {"weight": torch.ones(1, 4, dtype=torch.double)}]
    products = hessian_vector_products(model, x, y, squared_error, vectors)
    assert len(products) == 2 and torch.equal(products[0]["weight"], torch.zeros(1, 4, dtype=torch.double))
    torch.testing.assert_close(products[1]["weight"].reshape(-1), hessian @ torch.ones(4, dtype=torch.double))


@method
def test_by_default_finite_differences_with_the_documented_step(monkeypatch):
    """The default is the finite-difference product (no double backward) with ``r = sqrt(eps) (1 + ||theta||)``."""
    import jcsaug.engine.lookahead as lookahead_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))  # float32: the step matters
    x, y = torch.randn(5, 3), torch.randn(5, 2)
    vectors = [{n: torch.randn_like(p) for n, p in model.named_parameters()}]
    theta = {n: p.detach() for n, p in model.named_parameters()}
    r = torch.finfo(torch.float32).eps ** 0.5 * (1.0 + float(flat_norm(theta)))
    explicit = hessian_vector_products(model, x, y, squared_error, vectors, r=r)

    def no_double_backward(*args, **kwargs):
        raise AssertionError("the default differentiated twice")

    monkeypatch.setattr(lookahead_module, "_exact_products", no_double_backward)
    default = hessian_vector_products(model, x, y, squared_error, vectors)
    torch.testing.assert_close(default, explicit, rtol=0, atol=0)
    assert NeumannLookAhead(horizon=4).step == 0.5  # the documented default Neumann step


@method
def test_the_series_is_the_same_for_a_loss_scaled_down_below_unit_curvature():
    """Scale-free below 1 too: a loss x 1e-3 (curvature and ``v`` far under 1) gives 1e-3 x the same series."""
    model, x, y, _ = quadratic_task()
    vs = [{"weight": torch.randn(1, 4, dtype=torch.double)} for _ in range(5)]
    plain, small = NeumannLookAhead(horizon=4), NeumannLookAhead(horizon=4)

    def small_loss(out, target):
        return 1e-3 * squared_error(out, target)

    for v in vs:
        u = plain(model, v, x, y, squared_error)
        u_small = small(model, {"weight": v["weight"] * 1e-3}, x, y, small_loss)
        torch.testing.assert_close(u_small["weight"], u["weight"] * 1e-3)
    assert small.curvature < 1 and small.curvature == pytest.approx(plain.curvature * 1e-3, rel=1e-6)


@method
def test_the_state_round_trips_with_its_curvature_and_loads_onto_a_device():
    model, x, y, _ = quadratic_task()
    lookahead = NeumannLookAhead(horizon=4)
    for _ in range(3):
        lookahead(model, {"weight": torch.randn(1, 4, dtype=torch.double)}, x, y, squared_error)
    state = lookahead.state_dict()
    assert {t.device.type for key in ("u", "w") for t in state[key].values()} == {"cpu"}
    restored = NeumannLookAhead(horizon=4)
    restored.load_state_dict(state)
    assert restored.curvature == lookahead.curvature > 0
    on_meta = NeumannLookAhead(horizon=4)
    on_meta.load_state_dict(state, device="meta")  # the device the run trains on
    assert {t.device.type for vec in (on_meta.u, on_meta.w) for t in vec.values()} == {"meta"}
    empty = NeumannLookAhead(horizon=4)
    empty.load_state_dict({})
    assert empty.u is None and empty.w is None and empty.curvature != empty.curvature  # nan: nothing to resume


@method
def test_a_zero_first_direction_does_not_stall_the_power_iteration():
    """A first ``v`` of zeros (nothing to learn yet) is returned as it is; the curvature is still found after it."""
    model, x, y, hessian = quadratic_task()
    lookahead = NeumannLookAhead(horizon=8)
    zero = {"weight": torch.zeros(1, 4, dtype=torch.double)}
    u = lookahead(model, zero, x, y, squared_error)
    assert torch.equal(u["weight"], zero["weight"])
    for _ in range(100):
        lookahead(model, {"weight": torch.ones(1, 4, dtype=torch.double)}, x, y, squared_error)
    assert lookahead.curvature == pytest.approx(float(torch.linalg.eigvalsh(hessian).max()), rel=1e-6)


@method
def test_an_update_scores_along_the_look_ahead_of_its_validation_gradient_on_the_training_batch(monkeypatch):
    """``update()`` with ``lookahead`` > 1: the validation gradient goes through the series with the training batch
    (the samples, not their paired copies), and the hypergradient scores along the series' direction."""
    from ignite.engine import Engine

    torch.manual_seed(0)
    net = nn.Conv3d(1, 2, 1)
    x = torch.randn(2, 1, 4, 4, 4)
    y = (x > 0).float()

    def make_updater():
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        return TRAPolicyUpdater(CategoricalPolicy([3, 2], num_groups=2), net, [{"image": x, "label": y}], opt,
                                estimator="paired", lookahead=8)  # fmt: skip

    updater, reference = make_updater(), make_updater()
    series, seen = reference.lookahead, []

    class Recording:
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, model, v, image, label, loss_fn):
            u = self.inner(model, v, image, label, loss_fn)
            seen.append({"v": v, "image": image, "label": label, "u": u})
            return u

        def load_state_dict(self, state, device="cpu"):
            self.inner.load_state_dict(state, device)

    updater.lookahead = Recording(updater.lookahead)
    scored = []
    monkeypatch.setattr(updater, "hypergradient", lambda model, theta, v, *a, **k: scored.append(v) or torch.ones(6))
    monkeypatch.setattr(updater, "_paired_step", lambda *args: None)
    engine = Engine(lambda e, b: None)
    engine.state.batch = paired_batch(x, y)
    for _ in range(2):
        updater._theta, updater._alpha = {n: p.detach().clone() for n, p in net.named_parameters()}, 0.05
        updater.update(engine)
    assert len(seen) == len(scored) == 2
    for call, v_scored in zip(seen, scored):
        assert call["image"].shape[0] == 2 and torch.equal(call["image"], x) and torch.equal(call["label"], y)
        assert v_scored is call["u"]  # scored along the look-ahead direction
        expected_u = series(net, reference._validation_gradient(), x, y, reference.train_loss)
        torch.testing.assert_close(flat(call["u"]), flat(expected_u), rtol=0, atol=0)
    assert not torch.allclose(flat(seen[1]["u"]), flat(seen[1]["v"]))  # the second update is not the one-step one


@pytest.mark.parametrize("training", [False, True])
def test_the_look_ahead_hands_out_the_training_batchs_gradient_it_computed(training):
    """After a call, ``gradient`` is the training batch's mean-loss gradient at the call's parameters (the base of
    the finite differences, which ``beyond-training`` reuses instead of a pass of its own): equal to a plain
    ``training_gradient`` in eval mode, and in training mode (dropout) with the look-ahead's own masks; ``None``
    with horizon 1. The model's parameters and buffers are left as they were."""
    from monai.networks.nets import UNet

    from jcsaug.engine.hypergradient import training_gradient
    from jcsaug.engine.losses import get_loss

    torch.manual_seed(0)
    net = UNet(3, 1, 2, channels=(4, 8), strides=(2,), num_res_units=0, norm="batch", dropout=0.3)
    net.train(training)
    batch = lesion_batch(2)
    x, y = batch["image"], batch["label"]
    loss_fn = get_loss("ce+dice")
    before = {k: t.clone() for k, t in net.state_dict().items()}
    v = {n: torch.randn_like(p) for n, p in net.named_parameters()}
    lookahead = NeumannLookAhead(horizon=4)
    for _ in range(2):
        state = torch.get_rng_state()
        lookahead(net, v, x, y, loss_fn)
        assert all(torch.equal(t, before[k]) for k, t in net.state_dict().items())  # BatchNorm's buffers too
        torch.set_rng_state(state)  # the same dropout masks as the look-ahead's passes
        expected = training_gradient(net, x, y, loss_fn)
        net.load_state_dict(before)  # a plain pass in training mode moved the running statistics
        assert lookahead.gradient.keys() == expected.keys()
        torch.testing.assert_close(flat(lookahead.gradient), flat(expected), rtol=1e-5, atol=1e-7)
    one_step = NeumannLookAhead(horizon=1)
    one_step(net, v, x, y, loss_fn)
    assert one_step.gradient is None
