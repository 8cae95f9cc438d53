"""``meta_mode="train"``: the TRA update's extra passes on a network in training mode (dropout, BatchNorm batch
statistics). The two finite-difference passes must draw the same dropout masks, the trainer's BatchNorm running
statistics must come out of an update as they went in, and the exact (JVP) estimator must run on BatchNorm."""

from __future__ import annotations

import pytest
import torch
from ignite.engine import Engine
from torch import nn

from jcsaug.engine import TRAPolicyUpdater, finite_difference_hypergradient, get_loss, jvp_hypergradient
from jcsaug.engine.hypergradient import equal_norm_hypergradient
from jcsaug.engine.lookahead import hessian_vector_products
from jcsaug.policy import make_tra_policy

pytestmark = [pytest.mark.method, pytest.mark.usefixtures("single_thread")]


class _Net(nn.Module):
    """conv -> (BatchNorm) -> ReLU -> dropout -> conv: a network whose training mode differs from its eval mode."""

    def __init__(self, batch_norm: bool = True, dropout: float = 0.5) -> None:
        super().__init__()
        self.c1 = nn.Conv3d(1, 8, 3, padding=1)
        self.bn = nn.BatchNorm3d(8) if batch_norm else nn.Identity()
        self.drop = nn.Dropout(dropout)
        self.c2 = nn.Conv3d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(self.drop(torch.relu(self.bn(self.c1(x)))))


def _setting(batch_norm: bool, seed: int = 0) -> tuple[nn.Module, dict, dict, torch.Tensor, torch.Tensor]:
    """A float64 network in training mode (the finite difference's rounding error well below its tolerance)."""
    torch.manual_seed(seed)
    net = _Net(batch_norm).double().train()
    x = torch.randn(4, 1, 8, 8, 8, dtype=torch.float64)
    theta = {n: p.detach().clone() for n, p in net.named_parameters()}
    v = {n: torch.randn_like(p) for n, p in net.named_parameters()}
    return net, theta, v, x, (x > 0.5).float()


def _buffers(net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: b.clone() for k, b in net.named_buffers()}


@pytest.mark.parametrize("batch_norm", [False, True])
def test_finite_difference_in_training_mode_pairs_the_dropout_masks_of_its_two_passes(batch_norm):
    """With the same generator state, the finite difference at ``theta ± eps v`` in training mode is the exact JVP
    of the losses under one dropout mask (to the finite difference's O(eps^2), small at r = 1e-4 in float64); two
    masks would differ by O(1) in the losses, divided by 2 eps. The generators end as after one forward pass."""
    net, theta, v, x, y = _setting(batch_norm)
    loss = get_loss("ce")
    torch.manual_seed(5)
    fd = finite_difference_hypergradient(net, theta, v, x, y, loss, 0.01, r=1e-4)
    after_fd = torch.rand(3)
    torch.manual_seed(5)
    exact = jvp_hypergradient(net, theta, v, x, y, loss, 0.01)
    torch.testing.assert_close(fd, exact, rtol=1e-6, atol=0)
    torch.manual_seed(5)
    net(x)
    assert torch.equal(after_fd, torch.rand(3))  # one pass's worth of draws: reproducible, and no seed of its own
    torch.manual_seed(6)
    other = finite_difference_hypergradient(net, theta, v, x, y, loss, 0.01, r=1e-4)
    assert not torch.allclose(fd, other, rtol=1e-2)  # the masks do matter: the agreement above is no accident


@pytest.mark.parametrize("estimator", [finite_difference_hypergradient, jvp_hypergradient, equal_norm_hypergradient])
def test_hypergradients_in_training_mode_leave_batchnorm_buffers_as_they_were(estimator):
    """BatchNorm in training mode updates its running statistics at every pass: the estimators run on copies (the
    JVP crashed on them, ``torch.func`` refusing to mutate the network's own), and agree with each other."""
    net, theta, v, x, y = _setting(batch_norm=True)
    before = _buffers(net)
    g = estimator(net, theta, v, x, y, get_loss("ce"), 0.01)
    assert torch.isfinite(g).all()
    for name, value in net.named_buffers():
        assert torch.equal(value, before[name]), name


@pytest.mark.parametrize("hypergradient", ["finite-difference", "jvp", "equal-norm"])
@pytest.mark.parametrize("lookahead", [1, 4])
def test_train_meta_mode_update_leaves_the_trainers_batchnorm_statistics(hypergradient, lookahead):
    """A ``meta_mode="train"`` update (validation pass, look-ahead, theta ± eps v) leaves the running statistics the
    trainer's own step left; the trainer's next step updates them as usual."""
    torch.manual_seed(0)
    net = _Net(dropout=0.2)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    image = torch.randn(4, 1, 8, 8, 8)
    label = (image > 1).float()
    val = [{"image": torch.randn(4, 1, 8, 8, 8) * 5 + 3, "label": label}]
    batch = {"image": image, "label": label, "class_group": torch.tensor([0, 1, 0, 1]),
             "tra_ops": torch.randint(0, 2, (4, 15))}  # fmt: skip
    after_step: list[dict[str, torch.Tensor]] = []

    def step(engine: Engine, b: dict) -> None:
        if after_step:  # the update of the previous iteration left the buffers of its step
            for name, value in net.named_buffers():
                assert torch.equal(value, after_step[-1][name]), name
        net.train()
        opt.zero_grad()
        nn.functional.cross_entropy(net(b["image"]), b["label"][:, 0].long()).backward()
        opt.step()
        after_step.append(_buffers(net))

    trainer = Engine(step)
    updater = TRAPolicyUpdater(make_tra_policy("nnunet", num_groups=2), net, val, opt, lr=0.01, meta_mode="train",
                               poly_power=0, hypergradient=hypergradient, lookahead=lookahead)  # fmt: skip
    updater.attach(trainer)
    trainer.run([batch] * 2, max_epochs=1)
    assert (updater.updates, updater.skipped) == (2, 0)
    assert int(net.bn.num_batches_tracked) == 2  # the trainer's two steps, none of the updates' passes
    for name, value in net.named_buffers():
        assert torch.equal(value, after_step[-1][name]), name
    assert net.training  # the trainer's mode is back


@pytest.mark.parametrize("batch_norm", [False, True])
def test_look_ahead_hessian_products_in_training_mode_pair_dropout_masks_and_keep_buffers(batch_norm):
    """The look-ahead's finite-difference Hessian-vector products (two gradients) in training mode: the same dropout
    mask in both gradients (so they agree with the exact double backward under that mask) and BatchNorm's running
    statistics untouched by either path."""
    net, _, v, x, y = _setting(batch_norm)
    loss = get_loss("ce")
    before = _buffers(net)
    torch.manual_seed(5)
    fd = hessian_vector_products(net, x, y, loss, [v])[0]
    torch.manual_seed(5)
    exact = hessian_vector_products(net, x, y, loss, [v], exact=True)[0]
    for name in v:
        torch.testing.assert_close(fd[name], exact[name], rtol=1e-4, atol=1e-6)
    for name, value in _buffers(net).items():
        assert torch.equal(value, before[name]), name
