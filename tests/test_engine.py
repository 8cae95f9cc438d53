"""The TRA/TEA policy updaters (SPEC §4-5) on MONAI's trainer and on a plain Ignite engine."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from ignite.engine import Events
from monai.engines import SupervisedTrainer
from monai.handlers import CheckpointLoader, CheckpointSaver

from helpers import lesion_batch, tiny_unet, train_engine
from jcsaug.engine import (
    SegmentationLoss,
    TEAPolicyUpdater,
    TRAPolicyUpdater,
    finite_difference_hypergradient,
    get_loss,
    jvp_hypergradient,
    normalise_hypergradient,
)
from jcsaug.policy import make_tea_policy, make_tra_policy

# the mutation run's test set (tests/README.md): every test here but the DynUNet regression at the end (slow)
method = pytest.mark.method


def _val_gradient(net, batch):
    loss = get_loss("dice")(net(batch["image"]), batch["label"]).mean()
    return dict(zip([n for n, _ in net.named_parameters()], torch.autograd.grad(loss, list(net.parameters()))))


@method
def test_jvp_agrees_with_finite_difference():
    net = tiny_unet()
    train = lesion_batch(6, seed=1)
    v = _val_gradient(net, lesion_batch(4, seed=2))
    theta = {n: p.detach() for n, p in net.named_parameters()}
    fd = finite_difference_hypergradient(net, theta, v, train["image"], train["label"], get_loss("ce+dice"), 0.01)
    exact = jvp_hypergradient(net, theta, v, train["image"], train["label"], get_loss("ce+dice"), 0.01)
    assert torch.nn.functional.cosine_similarity(fd, exact, dim=0) > 0.99
    assert (fd != 0).all()


@method
def test_normalisation_centres_per_group_and_divides_by_frequency():
    g = torch.tensor([1.0, 3.0, 10.0, 20.0, 30.0])
    groups = torch.tensor([0, 0, 1, 1, 1])
    choices = torch.tensor([[0, 1], [0, 2], [1, 1], [1, 1], [2, 1]])
    h = normalise_hypergradient(g, groups, choices)
    # group 0: mean 2 -> h = [-1, 1]; op 0 of series 0 drawn twice in group 0
    torch.testing.assert_close(h[:2], torch.tensor([[-0.5, -1.0], [0.5, 1.0]], dtype=torch.float64))
    # group 1: mean 20 -> h = [-10, 0, 10]; series 0: op 1 twice, op 2 once; series 1: op 1 three times
    torch.testing.assert_close(h[2:], torch.tensor([[-5.0, -10 / 3], [0.0, 0.0], [10.0, 10 / 3]], dtype=torch.float64))


def _run_updates(engine_kind: str, iterations: int = 3, **tra_kwargs):
    net = tiny_unet()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    tra, tea = make_tra_policy("uniform", num_groups=2), make_tea_policy()
    data = [lesion_batch(4, seed=i, tra_policy=tra) for i in range(iterations)]
    val = [lesion_batch(4, seed=100 + i) for i in range(2)]
    tra_updater = TRAPolicyUpdater(tra, net, val, opt, lr=0.05, tea_policy=tea, seed=0, **tra_kwargs)
    tea_updater = TEAPolicyUpdater(tea, net, val, lr=0.05, num_copies=4, seed=0)
    if engine_kind == "monai":
        engine = SupervisedTrainer(
            device=torch.device("cpu"), max_epochs=1, train_data_loader=data, network=net, optimizer=opt,
            loss_function=SegmentationLoss("ce+dice"), train_handlers=[tra_updater, tea_updater],
        )  # fmt: skip
        engine.run()
    else:
        engine = train_engine(net, opt)
        tra_updater.attach(engine)
        tea_updater.attach(engine)
        engine.run(data, max_epochs=1)
    return tra_updater, tea_updater, engine


@method
def test_handlers_update_policies_alike_on_both_engines():
    """MONAI's SupervisedTrainer (which decollates its batches) and a plain Ignite engine running the same step on
    the same data give the same policies, and both learned something."""
    (ignite_tra, ignite_tea, _), (monai_tra, monai_tea, _) = _run_updates("ignite"), _run_updates("monai")
    for updater in (ignite_tra, ignite_tea, monai_tra, monai_tea):
        assert updater.updates == 3 and updater.skipped == 0
    torch.testing.assert_close(monai_tra.policy.logits, ignite_tra.policy.logits, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(monai_tea.policy.logits, ignite_tea.policy.logits, rtol=1e-4, atol=1e-6)
    initial_tra, initial_tea = make_tra_policy("uniform", 2).logits, make_tea_policy().logits
    assert not torch.allclose(ignite_tra.policy.logits, initial_tra)
    assert not torch.allclose(ignite_tea.policy.logits, initial_tea)


def _drawn_by_hand(choices: torch.Tensor, groups: torch.Tensor, offsets: tuple[int, ...]) -> torch.Tensor:
    mask = torch.zeros(int(groups.max()) + 1, offsets[-1], dtype=torch.bool)
    for ops, group in zip(choices.tolist(), groups.tolist()):
        for series, op in enumerate(ops):
            if op >= 0:
                mask[group, offsets[series] + op] = True
    return mask


@method
def test_ops_not_drawn_get_no_gradient_and_drawn_ones_one_adam_step():
    tra_updater, tea_updater, engine = _run_updates("ignite", iterations=1)
    batch = engine.state.batch
    policy = tra_updater.policy
    drawn = _drawn_by_hand(batch["tra_ops"], batch["class_group"], policy.offsets)
    assert 15 <= drawn.sum() < drawn.numel()
    grad = policy.logits.grad
    assert (grad[~drawn] == 0).all()
    assert (grad[drawn] != 0).all()  # every drawn op's weight got a gradient (identity ops included)
    # Adam's first step (bias-corrected): -lr * g / (|g| + eps), lr = 0.05, eps = 1e-8; nothing for undrawn ops
    step = policy.logits.detach() - make_tra_policy("uniform", 2).logits.detach()
    torch.testing.assert_close(step, -0.05 * grad / (grad.abs() + 1e-8), rtol=1e-4, atol=1e-8)
    tea_drawn = tea_updater.policy.logits.grad != 0
    assert 1 <= tea_drawn.sum() <= 4  # at most Z = 4 ops drawn


@method
def test_checkpoint_round_trip_restores_policies_and_optimisers(tmp_path):
    tra_updater, tea_updater, engine = _run_updates("ignite", iterations=2)
    save_dict = {"tra": tra_updater, "tea": tea_updater}
    CheckpointSaver(str(tmp_path), save_dict, save_final=True).attach(engine)
    engine.fire_event(Events.COMPLETED)
    ckpt = next(tmp_path.glob("*.pt"))
    fresh_tra, _, _ = _run_updates("ignite", iterations=1)
    fresh_tea = TEAPolicyUpdater(make_tea_policy(), tiny_unet(), None)
    CheckpointLoader(str(ckpt), {"tra": fresh_tra, "tea": fresh_tea}).attach(engine)
    engine.fire_event(Events.STARTED)
    assert torch.equal(fresh_tra.policy.logits, tra_updater.policy.logits)
    assert torch.equal(fresh_tea.policy.logits, tea_updater.policy.logits)
    for mine, theirs in ((fresh_tra, tra_updater), (fresh_tea, tea_updater)):
        a, b = mine.optimizer.state_dict()["state"][0], theirs.optimizer.state_dict()["state"][0]
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
        assert torch.equal(mine.generator.get_state(), theirs.generator.get_state())


def _zero_loss(logits, label):
    return (logits * 0).flatten(1).sum(1)  # L_val independent of the parameters: v = 0


@method
@pytest.mark.parametrize(
    "case, expected",
    [
        ("empty validation", "validation loader is empty"),
        ("one group", "one class group only"),
        ("zero gradient", "validation gradient norm is 0.0"),
        ("nan loss", "non-finite validation loss"),
    ],
)
def test_bad_updates_are_skipped_with_one_warning(case, expected):
    net = tiny_unet()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    tra = make_tra_policy("nnunet", num_groups=2)
    batch = lesion_batch(4, tra_policy=tra)
    val = [lesion_batch(4, seed=5)]
    val_loss = _zero_loss if case == "zero gradient" else "dice"
    if case == "empty validation":
        val = []
    elif case == "one group":
        batch["class_group"] = torch.ones(4, dtype=torch.long)
    elif case == "nan loss":
        val = [dict(val[0], image=torch.full_like(val[0]["image"], float("nan")))]
    updater = TRAPolicyUpdater(tra, net, val, opt, lr=0.05, val_loss=val_loss)
    engine = train_engine(net, opt)
    updater.attach(engine)
    before = tra.logits.detach().clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.run([batch] * 2, max_epochs=1)
    messages = [str(w.message) for w in caught if "update skipped" in str(w.message)]
    assert len(messages) == 1 and expected in messages[0]
    assert updater.skipped == 2 and updater.updates == 0
    assert torch.equal(tra.logits.detach(), before)
    assert all(torch.isfinite(p).all() for p in net.parameters())


@method
def test_tea_update_skips_without_foreground():
    net = tiny_unet()
    tea = make_tea_policy()
    val = [dict(lesion_batch(2), label=torch.zeros(2, 1, 16, 16, 16))]
    updater = TEAPolicyUpdater(tea, net, val, lr=0.05, num_copies=3)
    engine = train_engine(net, torch.optim.SGD(net.parameters(), lr=0.01))
    updater.attach(engine)
    with pytest.warns(UserWarning, match="no validation patch with foreground"):
        engine.run([lesion_batch(2)], max_epochs=1)
    assert updater.updates == 0


@method
def test_bad_arguments():
    net, tra = tiny_unet(), make_tra_policy()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    with pytest.raises(KeyError, match="unknown loss 'focal'"):
        TRAPolicyUpdater(tra, net, [], opt, val_loss="focal")
    with pytest.raises(KeyError, match="unknown hypergradient"):
        TRAPolicyUpdater(tra, net, [], opt, hypergradient="exact")
    with pytest.raises(ValueError, match="update_every must be >= 1"):
        TRAPolicyUpdater(tra, net, [], opt, update_every=0)
    for power in (-0.5, float("nan")):  # a negative power would grow the lr without bound at the run's end
        with pytest.raises(ValueError, match=f"poly_power must be finite and >= 0 .*got {power}"):
            TEAPolicyUpdater(make_tea_policy(), net, [], poly_power=power)
    with pytest.raises(ValueError, match="one series of 84 ops"):
        TEAPolicyUpdater(tra, net, [])
    updater = TRAPolicyUpdater(tra, net, [lesion_batch(2)], opt)
    engine = train_engine(net, opt)
    updater.attach(engine)
    with pytest.raises(KeyError, match="no recorded TRA choices 'tra_ops'"):
        engine.run([lesion_batch(2)], max_epochs=1)


@method
def test_same_seed_same_policy_trajectory():
    first, _, _ = _run_updates("ignite", iterations=2)
    second, _, _ = _run_updates("ignite", iterations=2)
    assert torch.equal(first.policy.logits, second.policy.logits)
    np.testing.assert_array_equal(first.generator.get_state().numpy(), second.generator.get_state().numpy())


@pytest.mark.parametrize("hypergradient", ["finite-difference", "jvp", "equal-norm"])
def test_tra_update_keeps_training_a_network_with_shared_modules(hypergradient):
    """MONAI's DynUNet reaches its encoder blocks by two module paths; torch.func.functional_call alone leaves
    detached tensors in one of them, after which SGD no longer trains the network (regression)."""
    from jcsaug.networks import make_network

    torch.manual_seed(0)
    net = make_network("unet3d", 1, 2, [16, 16, 16])
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    tra = make_tra_policy("uniform", num_groups=2)
    data = [lesion_batch(4, seed=i, tra_policy=tra) for i in range(2)]
    val = [lesion_batch(4, seed=100)]
    updater = TRAPolicyUpdater(tra, net, val, opt, lr=0.05, seed=0, hypergradient=hypergradient)
    engine = SupervisedTrainer(
        device=torch.device("cpu"), max_epochs=1, train_data_loader=data, network=net, optimizer=opt,
        loss_function=SegmentationLoss("ce+dice"), train_handlers=[updater],
    )  # fmt: skip
    engine.run()
    assert updater.updates == 2
    in_optimizer = {id(p) for group in opt.param_groups for p in group["params"]}
    params = list(net.parameters())
    assert all(isinstance(p, torch.nn.Parameter) and p.requires_grad for p in params)
    assert all(id(p) in in_optimizer for p in params)
