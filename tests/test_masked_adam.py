"""MaskedAdam (true masking: undrawn ops keep logits *and* Adam state), frequency scaling, and the logit budget."""

from __future__ import annotations

import math

import pytest
import torch
from ignite.engine import Engine, Events

from helpers import lesion_batch, tiny_unet, train_engine
from jcsaug.engine import TEAPolicyUpdater, TRAPolicyUpdater
from jcsaug.engine.base import PolicyUpdater
from jcsaug.engine.optim import MaskedAdam
from jcsaug.policy import CategoricalPolicy, make_tea_policy, make_tra_policy

pytestmark = pytest.mark.method  # all fast; part of the mutation run's test set (tests/README.md)


def test_full_mask_is_torch_adam():
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(3, 7))
    b = torch.nn.Parameter(a.detach().clone())
    reference, masked = torch.optim.Adam([a], lr=0.05), MaskedAdam([b], lr=0.05)
    for _ in range(30):
        grad = torch.randn(3, 7)
        a.grad, b.grad = grad.clone(), grad.clone()
        reference.step()
        masked.step(mask=torch.ones(3, 7, dtype=torch.bool) if _ % 2 else None)
    torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


def test_masked_entries_keep_value_moments_and_step_count():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(2, 5))
    opt = MaskedAdam([p], lr=0.1)
    for _ in range(3):  # give every entry some state first
        p.grad = torch.randn(2, 5)
        opt.step()
    state = {k: v.clone() for k, v in opt.state[p].items()}
    before = p.detach().clone()
    mask = torch.tensor([[True, False, False, True, False], [False, False, True, False, False]])
    p.grad = torch.randn(2, 5)
    opt.step(mask=mask)
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(opt.state[p][key][~mask], state[key][~mask]), key
        assert not torch.equal(opt.state[p][key][mask], state[key][mask]), key
    assert torch.equal(p.detach()[~mask], before[~mask])
    assert (p.detach()[mask] != before[mask]).all()


def test_torch_adam_would_move_a_masked_entry():
    """The defect MaskedAdam fixes: Adam's first moment moves an entry whose gradient is zero."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([p], lr=0.1)
    p.grad = torch.tensor([1.0, 1.0])
    opt.step()
    p.grad = torch.tensor([1.0, 0.0])  # entry 1 "masked" by a zero gradient
    before = float(p.detach()[1])
    opt.step()
    assert float(p.detach()[1]) != before


def test_first_step_of_a_late_entry_is_a_plain_adam_step():
    """Each entry counts its own steps: no oversized first step (torch.optim.SparseAdam's global count)."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = MaskedAdam([p], lr=0.1)
    for _ in range(50):
        p.grad = torch.tensor([1.0, 1.0])
        opt.step(mask=torch.tensor([True, False]))
    p.grad = torch.tensor([1.0, 1.0])
    opt.step(mask=torch.tensor([False, True]))
    assert float(p[1].detach()) == pytest.approx(-0.1, rel=1e-5)


def test_frequency_scaling_moves_rare_entries_as_far():
    """An entry stepped in every other call moves (almost) as far in total as one stepped every call."""
    p = torch.nn.Parameter(torch.zeros(3))
    opt = MaskedAdam([p], lr=0.1, frequency_scaling=True, max_scale=25)
    for t in range(40):
        p.grad = torch.ones(3)
        opt.step(mask=torch.tensor([True, t % 2 == 0, t % 10 == 9]))
    moved = -p.detach()
    assert moved[0] == pytest.approx(4.0, rel=1e-4)
    assert 0.85 * moved[0] < moved[1] < 1.0 * moved[0]
    assert 0.85 * moved[0] < moved[2] <= 1.05 * moved[0]
    plain = torch.nn.Parameter(torch.zeros(1))
    opt = MaskedAdam([plain], lr=0.1)
    for t in range(40):
        plain.grad = torch.ones(1)
        opt.step(mask=torch.tensor([t % 10 == 9]))
    assert float(-plain.detach()) == pytest.approx(0.4, rel=1e-4)  # without scaling: a tenth


def test_loads_a_torch_adam_checkpoint():
    p = torch.nn.Parameter(torch.zeros(4))
    adam = torch.optim.Adam([p], lr=0.1)
    p.grad = torch.ones(4)
    adam.step()
    q = torch.nn.Parameter(p.detach().clone())
    masked = MaskedAdam([q], lr=0.1)
    masked.load_state_dict(adam.state_dict())
    q.grad = torch.ones(4)
    masked.step(mask=torch.tensor([True, True, False, False]))
    assert masked.state[q]["step"].tolist() == [2.0, 2.0, 1.0, 1.0]


def test_row_second_moment_steps_in_proportion_to_the_gradients():
    """``second_moment="row"``: one second moment per row (its stepped entries' mean square), so a row's entries
    move in proportion to their gradients; per-entry Adam moves every entry with a steady sign alike."""
    p, q = torch.nn.Parameter(torch.zeros(2, 4)), torch.nn.Parameter(torch.zeros(2, 4))
    by_row, by_entry = MaskedAdam([p], lr=0.1, second_moment="row"), MaskedAdam([q], lr=0.1)
    mask = torch.tensor([[True, True, True, False], [False, False, False, False]])
    grad = torch.tensor([[2.0, 0.5, -1.0, 3.0], [1.0, 1.0, 1.0, 1.0]])
    for _ in range(5):
        p.grad, q.grad = grad.clone(), grad.clone()
        by_row.step(mask=mask)
        by_entry.step(mask=mask)
    rms = math.sqrt((4.0 + 0.25 + 1.0) / 3)  # the row's RMS over its stepped entries (constant gradients)
    torch.testing.assert_close(p.detach()[0, :3], -0.5 * grad[0, :3] / rms, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(q.detach()[0, :3], torch.tensor([-0.5, -0.5, 0.5]), rtol=1e-5, atol=1e-7)
    state = by_row.state[p]
    assert state["row_step"].flatten().tolist() == [5.0, 0.0]  # a row with no entry selected takes no step
    assert (p.detach()[0, 3] == 0) and (p.detach()[1] == 0).all()  # unselected entries keep their value...
    assert state["step"][0, 3] == 0 and state["exp_avg"][0, 3] == 0 and (state["exp_avg_sq"][1] == 0).all()
    assert torch.allclose(state["exp_avg_sq"][0], state["exp_avg_sq"][0, 0].expand(4))  # ...and share the row's
    with pytest.raises(ValueError, match=r"second_moment must be 'entry' or 'row', got 'col'"):
        MaskedAdam([p], second_moment="col")


def test_convexity_correction_keeps_a_rare_op_as_likely_under_noise():
    """Gradients of pure noise on a rare op's logit (p = 0.05 against a dominant identity) make it likelier in
    expectation (exp(logit) is convex); ``convexity_correction`` subtracts half the square of each step's measured
    part, so that its mean probability stays at the start."""
    start = math.log(0.05 / 0.95)
    mask = torch.zeros(500, 2, dtype=torch.bool)
    mask[:, 1] = True  # 500 independent two-op series: the identity (never stepped) and a rare op
    means = {}
    for correction in (False, True):
        generator = torch.Generator().manual_seed(0)
        logits = torch.nn.Parameter(torch.tensor([[0.0, start]]).repeat(500, 1))
        opt = MaskedAdam([logits], lr=0.05, betas=(0.9, 0.98), second_moment="row", convexity_correction=correction)
        for _ in range(200):
            logits.grad = torch.zeros(500, 2)
            logits.grad[:, 1] = torch.randn(500, generator=generator)
            opt.step(mask=mask)
        assert (logits.detach()[:, 0] == 0).all()  # unselected entries keep their value with the correction too
        means[correction] = float(torch.softmax(logits.detach(), dim=1)[:, 1].mean())
    assert means[False] > 0.06  # noise alone: 0.064
    assert 0.047 < means[True] < 0.054  # corrected: 0.051


def test_convexity_correction_subtracts_half_the_square_of_the_measured_step():
    """An entry's first step is Adam's ``lr * scale * sign(g)``; the correction moves it ``(lr * scale)**2 / 2``
    further down (``scale``: the frequency scaling's, 2 for an entry first stepped at the second call); entries
    outside the mask are not corrected."""
    for frequency_scaling, scale in ((False, 1.0), (True, 2.0)):
        plain, corrected = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
        adam = MaskedAdam([plain], lr=0.1, frequency_scaling=frequency_scaling)
        adam_corrected = MaskedAdam([corrected], lr=0.1, frequency_scaling=frequency_scaling, convexity_correction=True)
        for mask in (torch.tensor([True, False, True]), torch.tensor([False, True, False])):
            plain.grad, corrected.grad = torch.tensor([2.0, -1.0, 0.5]), torch.tensor([2.0, -1.0, 0.5])
            adam.step(mask=mask)
            adam_corrected.step(mask=mask)
        torch.testing.assert_close(plain.detach(), torch.tensor([-0.1, 0.1 * scale, -0.1]))
        expected = -torch.tensor([0.1**2, (0.1 * scale) ** 2, 0.1**2]) / 2
        torch.testing.assert_close(corrected.detach() - plain.detach(), expected)


def test_convexity_correction_clips_a_large_measured_step():
    """The correction's second-order expansion holds for small steps: a measured share ``|s| > correction_clip``
    is clipped first, so one step takes at most ``correction_clip**2 / 2`` off an entry (unclipped, a first step
    of lr 2 would take ``2**2 / 2 = 2`` logits)."""
    for clip, expected in ((1.0, 0.5), (1.5, 1.125), (4.0, 2.0)):
        plain, corrected = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
        plain.grad, corrected.grad = torch.tensor([3.0, -0.5]), torch.tensor([3.0, -0.5])
        MaskedAdam([plain], lr=2.0).step()
        MaskedAdam([corrected], lr=2.0, convexity_correction=True, correction_clip=clip).step()
        torch.testing.assert_close(corrected.detach() - plain.detach(), torch.tensor([-expected, -expected]))
    with pytest.raises(ValueError, match="correction_clip must be > 0, got 0"):
        MaskedAdam([plain], convexity_correction=True, correction_clip=0)


def test_a_state_saved_before_the_correction_existed_keeps_it_on():
    """Loading a state dict whose groups lack ``convexity_correction`` (saved before the setting) keeps the
    optimiser's own value; a saved value wins where there is one."""
    p = torch.nn.Parameter(torch.zeros(3))
    saved = MaskedAdam([p], lr=0.1).state_dict()
    del saved["param_groups"][0]["convexity_correction"], saved["param_groups"][0]["correction_clip"]
    corrected = MaskedAdam([p], lr=0.1, convexity_correction=True, correction_clip=0.5)
    corrected.load_state_dict(saved)
    assert corrected.param_groups[0]["convexity_correction"] is True
    assert corrected.param_groups[0]["correction_clip"] == 0.5
    corrected.load_state_dict(MaskedAdam([p], lr=0.1).state_dict())
    assert corrected.param_groups[0]["convexity_correction"] is False


def test_row_blocks_give_each_block_of_a_row_its_own_second_moment():
    """``row_blocks`` (a policy's series offsets): entries move in proportion to their gradients within their
    block, and a block of small gradients as far as one of large gradients (each at about the learning rate)."""
    p = torch.nn.Parameter(torch.zeros(2, 5))
    opt = MaskedAdam([p], lr=0.1, second_moment="row", row_blocks=(0, 2, 5))
    mask = torch.tensor([[True, True, True, True, False], [False, False, True, True, True]])
    grad = torch.tensor([[4.0, -2.0, 0.02, 0.01, 9.0], [1.0, 1.0, 0.3, -0.3, 0.6]])
    for _ in range(5):
        p.grad = grad.clone()
        opt.step(mask=mask)
    rms = torch.tensor([[math.sqrt(10.0), math.sqrt(2.5e-4)], [1.0, math.sqrt(0.18)]])  # [row, block] (stepped)
    block_rms = rms[:, [0, 0, 1, 1, 1]]
    torch.testing.assert_close(p.detach()[mask], (-0.5 * grad / block_rms)[mask], rtol=1e-4, atol=1e-6)
    assert p.detach()[0, 4] == 0 and (p.detach()[1, :2] == 0).all()  # unselected entries keep their value
    assert opt.state[p]["row_step"].tolist() == [[5.0, 5.0], [0.0, 5.0]]  # a block with nothing selected: no step
    # one block spanning the row is the plain row moment, bit for bit
    row, block = torch.nn.Parameter(torch.zeros(2, 5)), torch.nn.Parameter(torch.zeros(2, 5))
    by_row = MaskedAdam([row], lr=0.1, second_moment="row")
    by_block = MaskedAdam([block], lr=0.1, second_moment="row", row_blocks=(0, 5))
    for _ in range(3):
        row.grad, block.grad = grad.clone(), grad.clone()
        by_row.step(mask=mask)
        by_block.step(mask=mask)
    assert torch.equal(row.detach(), block.detach())
    with pytest.raises(ValueError, match=r"row_blocks \(0, 5\) needs second_moment='row', got 'entry'"):
        MaskedAdam([p], row_blocks=(0, 5))
    with pytest.raises(ValueError, match=r"rise strictly from 0 to the row's length, got \(0, 3, 3, 5\)"):
        MaskedAdam([p], second_moment="row", row_blocks=(0, 3, 3, 5))
    short = MaskedAdam([p], second_moment="row", row_blocks=(0, 2, 4))
    p.grad = grad.clone()
    with pytest.raises(ValueError, match=r"row_blocks \(0, 2, 4\) end at 4, the rows have 5 entries"):
        short.step()


@pytest.mark.parametrize("row_blocks", [None, (0, 1, 3)])
def test_row_second_moment_is_remembered_across_a_checkpoint(row_blocks):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(2, 3))
    opt = MaskedAdam([p], lr=0.1, second_moment="row", row_blocks=row_blocks)
    for _ in range(3):
        p.grad = torch.randn(2, 3)
        opt.step(mask=torch.tensor([[True, False, True], [False, True, False]]))
    q = torch.nn.Parameter(p.detach().clone())
    restored = MaskedAdam([q], lr=0.1, second_moment="row", row_blocks=row_blocks)
    restored.load_state_dict(opt.state_dict())
    grad = torch.randn(2, 3)
    p.grad, q.grad = grad.clone(), grad.clone()
    opt.step()
    restored.step()
    assert torch.equal(p.detach(), q.detach())
    assert restored.state[q]["row_step"].shape == (2, 1 if row_blocks is None else 2)  # a count per row (block)


@pytest.mark.parametrize("estimator", ["gumbel", "paired"])
def test_tea_update_leaves_unmeasured_ops_bit_identical(estimator):
    policy = make_tea_policy()
    net = tiny_unet()
    updater = TEAPolicyUpdater(policy, net, [lesion_batch(4, seed=1)], lr=0.05, num_copies=4, estimator=estimator)
    engine = Engine(lambda e, b: None)
    before = {}

    @engine.on(Events.ITERATION_COMPLETED(once=3))  # registered first: runs before the third update
    def keep(_):
        before["logits"] = policy.logits.detach().clone()
        before["state"] = {k: v.clone() for k, v in updater.optimizer.state[policy.logits].items()}

    updater.attach(engine)
    engine.run(range(3), max_epochs=1)
    logits, state = before["logits"], before["state"]
    stepped = updater.optimizer.state[policy.logits]["step"] != state["step"]
    assert 1 <= int(stepped.sum()) <= 5  # at most Z ops and the identity
    assert torch.equal(policy.logits.detach()[~stepped], logits[~stepped])
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(updater.optimizer.state[policy.logits][key][~stepped], state[key][~stepped])


def test_tra_gumbel_update_leaves_undrawn_ops_bit_identical():
    policy = make_tra_policy("nnunet", num_groups=2)
    net = tiny_unet()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    batches = [lesion_batch(4, seed=i, tra_policy=policy) for i in range(3)]
    updater = TRAPolicyUpdater(policy, net, [lesion_batch(4, seed=9)], opt, lr=0.05, val_loss="ce")
    engine = train_engine(net, opt)
    updater.attach(engine)
    engine.run(batches[:2], max_epochs=1)
    logits = policy.logits.detach().clone()
    state = {k: v.clone() for k, v in updater.optimizer.state[policy.logits].items()}
    engine.run(batches[2:], max_epochs=1)
    drawn = torch.zeros_like(logits, dtype=torch.bool)  # by hand: (group, offset + op) of each sample's ops
    for ops, group in zip(batches[2]["tra_ops"], batches[2]["class_group"]):
        for s, op in enumerate(ops.tolist()):
            drawn[int(group), policy.offsets[s] + op] = True
    assert torch.equal(policy.logits.detach()[~drawn], logits[~drawn])
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(updater.optimizer.state[policy.logits][key][~drawn], state[key][~drawn])
    assert (updater.optimizer.state[policy.logits]["step"][drawn] == state["step"][drawn] + 1).all()


def test_logit_budget_sets_the_learning_rate_from_the_planned_updates():
    policy = make_tea_policy()
    updater = TEAPolicyUpdater(policy, tiny_unet(), [lesion_batch(4)], lr=1.0, update_every=2, logit_budget=3.0)
    engine = Engine(lambda e, b: None)
    updater.attach(engine)
    engine.run(range(10), max_epochs=4)  # 40 iterations, updates at 2, 4, ..., 40
    decay = [(1 - (t - 1) / 40) ** 0.9 for t in range(2, 41, 2)]
    assert updater.base_lr == pytest.approx(3.0 / sum(decay))
    assert sum(updater.base_lr * d for d in decay) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="logit_budget"):
        TEAPolicyUpdater(policy, tiny_unet(), [], logit_budget=0.0)


def test_planned_epochs_replace_the_engines_max_epochs_in_the_plan():
    """A run in pieces (MONAI FL's rounds: ``max_epochs`` is the end of this piece) plans the budget and the decay
    over ``planned_epochs`` x ``epoch_length``, however far this piece goes, and the same base lr every piece."""
    policy = make_tea_policy()
    updater = TEAPolicyUpdater(policy, tiny_unet(), [lesion_batch(4)], lr=1.0, update_every=2, logit_budget=3.0,
                               planned_epochs=4)  # fmt: skip
    engine = Engine(lambda e, b: None)
    updater.attach(engine)
    engine.run(range(10), max_epochs=1)  # the first piece: 10 of the 40 planned iterations
    decay = [(1 - (t - 1) / 40) ** 0.9 for t in range(2, 41, 2)]
    assert updater.base_lr == pytest.approx(3.0 / sum(decay))
    engine.state.max_epochs = 2  # the next piece, as MonaiAlgo continues a trainer
    engine.run(range(10))
    assert updater.base_lr == pytest.approx(3.0 / sum(decay)) and engine.state.iteration == 20
    assert updater.current_lr(engine) == pytest.approx(updater.base_lr * (1 - 19 / 40) ** 0.9)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="planned_epochs"):
            TEAPolicyUpdater(policy, tiny_unet(), [], planned_epochs=bad)


def test_start_holds_the_policy_until_its_share_of_the_run_and_spreads_the_budget_after_it():
    """``start=0.5`` of 20 iterations: the TRA's first update is at iteration 12 (update_every 2 after 10), the
    policy and its Adam state are untouched until then, no parameters are snapshotted, and the budget is spread
    over the 5 updates from 12 to 20 only."""
    torch.manual_seed(0)
    policy = make_tra_policy("nnunet", num_groups=2)
    net = tiny_unet()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    batches = [lesion_batch(4, seed=i, tra_policy=policy) for i in range(4)]
    updater = TRAPolicyUpdater(policy, net, [lesion_batch(4, seed=9)], opt, update_every=2, val_loss="ce",
                               logit_budget=2.0, start=0.5)  # fmt: skip
    engine = train_engine(net, opt)
    updater.attach(engine)
    initial = policy.logits.detach().clone()
    seen = []

    @engine.on(Events.ITERATION_COMPLETED)
    def _record(e):
        seen.append((e.state.iteration, updater.updates, torch.equal(policy.logits.detach(), initial)))

    engine.run(batches, max_epochs=5)  # 20 iterations
    assert [u for _, u, _ in seen] == [0] * 11 + [1, 1, 2, 2, 3, 3, 4, 4, 5]
    assert all(same for i, _, same in seen if i < 12) and not seen[-1][2]
    decay = [(1 - (t - 1) / 20) ** 0.9 for t in (12, 14, 16, 18, 20)]
    assert updater.base_lr == pytest.approx(2.0 / sum(decay))
    assert updater.resume_settings()["start"] == 0.5
    assert TRAPolicyUpdater(policy, net, [], opt).resume_settings()["start"] == 0.0
    for bad in (-0.1, 1.0, float("nan")):
        with pytest.raises(ValueError, match="start must be a share of the run"):
            TRAPolicyUpdater(policy, net, [], opt, start=bad)


def test_no_snapshot_during_the_warm_up():
    policy = make_tra_policy("nnunet", num_groups=2)
    net = tiny_unet()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    updater = TRAPolicyUpdater(policy, net, [lesion_batch(4, seed=9)], opt, lr=0.01, val_loss="ce", start=0.75)
    engine = train_engine(net, opt)
    updater.attach(engine)
    snapshots = []

    @engine.on(Events.ITERATION_STARTED)
    def _after_snapshot(e):  # added after the updater's handler: runs after its snapshot
        snapshots.append(updater._theta is not None)

    engine.run([lesion_batch(4, seed=i, tra_policy=policy) for i in range(4)], max_epochs=1)
    assert snapshots == [False, False, False, True]
    assert updater.updates == 1


def test_pull_decays_each_selected_entry_towards_its_anchor_by_the_steps_since_its_last_pull():
    """``pull`` 0.5 with lr 0 (no Adam move): an entry displaced from its value at the first step (its anchor) keeps
    ``0.5 ** k`` of the displacement, ``k`` the steps since it was last pulled, applied only when it is selected;
    entries outside the mask keep their value bit for bit."""
    p = torch.nn.Parameter(torch.tensor([2.0, 2.0, 2.0]))
    opt = MaskedAdam([p], lr=0.0, pull=0.5)
    p.grad = torch.zeros(3)
    opt.step()  # the anchor: the value at the first step
    with torch.no_grad():
        p.add_(1.0)  # displaced by 1 from the anchor 2
    opt.step(mask=torch.tensor([True, False, False]))
    assert p.tolist() == [2.5, 3.0, 3.0]
    opt.step(mask=torch.tensor([True, True, False]))
    assert p.tolist() == [2.25, 2.25, 3.0]  # entry 1: two steps since its last pull at the first one
    for _ in range(2):
        opt.step(mask=torch.tensor([False, False, False]))
    assert p.tolist() == [2.25, 2.25, 3.0]
    opt.step()  # entry 2: five steps since the first; entries 0 and 1: three since the last
    assert p.tolist() == pytest.approx([2.0 + 0.25 / 8, 2.0 + 0.25 / 8, 2.0 + 1 / 32])
    with pytest.raises(ValueError, match="pull"):
        MaskedAdam([p], pull=1.0)


def test_pull_keeps_the_anchor_across_a_checkpoint():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(4))
    opt = MaskedAdam([p], lr=0.1, pull=0.2)
    for _ in range(3):
        p.grad = torch.randn(4)
        opt.step()
    q = torch.nn.Parameter(p.detach().clone())
    restored = MaskedAdam([q], lr=0.1, pull=0.2)
    restored.load_state_dict(opt.state_dict())
    p.grad, q.grad = torch.ones(4), torch.ones(4)
    opt.step()
    restored.step()
    assert torch.equal(q, p) and torch.equal(restored.state[q]["anchor"], torch.zeros(4))


def test_a_pull_fades_early_credit_back_to_the_preset_over_the_planned_run():
    """``pull`` in e-folds over the planned run: the optimiser's rate per update is ``r = 1 - exp(-pull / updates)``,
    and, Adam's steps not depending on the logit, the pulled logit ends at ``sum_k step_k (1 - r) ** (N - k)``: a step
    taken at the run's share ``t`` counts ``exp(-pull (1 - t))``. Credit given in the first half only (a gradient
    of one sign, then of alternating signs) fades back towards the initial logit; without the pull it stays."""
    from test_method_equations import _GivenGradient

    def gradient(t: int) -> tuple[list[float], list[bool]]:
        return [0.0, -1.0 if t <= 20 else (-1.0) ** t], [False, True]

    def run(pull: float) -> tuple[list[float], PolicyUpdater]:
        policy = CategoricalPolicy([2])
        updater = _GivenGradient(policy, gradient, lr=0.1, update_every=1, poly_power=0.0, pull=pull)
        engine = Engine(lambda e, b: None)
        trajectory = [0.0]
        engine.add_event_handler(Events.ITERATION_COMPLETED, lambda e: trajectory.append(policy.logits[0, 1].item()))
        updater.attach(engine)
        engine.run(range(10), max_epochs=4)  # 40 updates
        return trajectory, updater

    free, updater = run(0.0)
    assert free[20] > 1.5 and free[-1] > 0.8 * free[20] and "pull" not in updater.resume_settings()
    pulled, updater = run(2.0)
    rate = -math.expm1(-2.0 / 40)
    assert updater.optimizer.param_groups[0]["pull"] == pytest.approx(rate)
    steps = [b - a for a, b in zip(free, free[1:])]
    expected = sum(step * (1 - rate) ** (40 - k) for k, step in enumerate(steps, start=1))
    assert pulled[-1] == pytest.approx(expected, rel=1e-4) and pulled[-1] < 0.5 * free[-1]
    assert updater.resume_settings()["pull"] == 2.0
    with pytest.raises(ValueError, match="pull"):
        _GivenGradient(CategoricalPolicy([2]), gradient, lr=0.1, pull=-1.0)
