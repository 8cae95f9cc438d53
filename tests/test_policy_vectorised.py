"""Policy bookkeeping on whole tensors: every series of every sample re-sampled in one call, padded series
(``-inf`` logits) behaving exactly as unpadded ones, and errors that name the series at fault."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jcsaug.policy import gumbel
from jcsaug.policy.categorical import NOT_APPLIED, CategoricalPolicy
from jcsaug.policy.factory import make_tra_policy

pytestmark = pytest.mark.method  # part of the mutation run's test set (tests/README.md)


def test_padded_choices_give_the_unpadded_conditional_softmax(monkeypatch):
    logits = torch.tensor([[0.3, -0.5, 1.1]], requires_grad=True)
    padded = torch.cat([logits, torch.full((1, 2), float("-inf"))], dim=1)
    u = torch.tensor([[0.2, 0.7, 0.4, 0.9, 0.6]], dtype=torch.float64)
    monkeypatch.setattr(gumbel, "_uniform", lambda shape, like, generator: u[..., : shape[-1]].clone())
    index = torch.tensor([2])
    s_pad = gumbel.conditional_gumbel_softmax(padded, index)
    s = gumbel.conditional_gumbel_softmax(logits, index)
    assert torch.equal(s_pad[:, 3:], torch.zeros(1, 2))
    torch.testing.assert_close(s_pad[:, :3], s)
    (g_pad,) = torch.autograd.grad(s_pad[0, 2], logits)
    (g,) = torch.autograd.grad(s[0, 2], logits)
    assert torch.isfinite(g_pad).all()
    torch.testing.assert_close(g_pad, g)


def test_gumbel_sample_never_draws_padding():
    policy = CategoricalPolicy([2, 5, 3], num_groups=2)
    choices, weights = policy.gumbel_sample(torch.tensor([0, 1] * 500), torch.Generator().manual_seed(0))
    assert (choices < torch.tensor([2, 5, 3])).all() and (choices >= 0).all()
    assert torch.equal(weights.detach(), torch.ones(1000, 3))
    assert {int(c) for c in choices[:, 1]} == set(range(5))


def test_series_weights_are_one_call_for_all_series(monkeypatch):
    calls = []
    real = gumbel.conditional_gumbel_softmax

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr("jcsaug.policy.categorical.conditional_gumbel_softmax", counting)
    policy = make_tra_policy("nnunet", num_groups=2)
    choices = torch.stack([torch.as_tensor(policy.sample_ops(i % 2, np.random.RandomState(i)))
                           for i in range(6)])  # fmt: skip
    choices[0, 3] = NOT_APPLIED
    w = policy.series_weights(choices, torch.tensor([0, 1] * 3), torch.Generator().manual_seed(0))
    assert calls == [torch.Size([6, 15, 7])]  # [batch, series, largest series]: no per-series loop
    assert torch.equal(w.detach(), torch.ones(6, 15))
    w.prod(1).sum().backward()
    grad = policy.logits.grad
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_out_of_range_choice_names_the_series():
    policy = make_tra_policy("nnunet")
    choices = torch.zeros(2, 15, dtype=torch.long)
    choices[1, 4] = 2  # mirror_sagittal has 2 choices
    with pytest.raises(ValueError, match=r"op index 2 of sample 1 out of range for series 'mirror_sagittal'"):
        policy.series_weights(choices)
    choices[1, 4] = -2
    with pytest.raises(ValueError, match="out of range"):
        policy.drawn_mask(choices)


def test_probabilities_per_series_sum_to_one():
    policy = make_tra_policy("nnunet", num_groups=3)
    probs = policy.probabilities()
    assert [p.shape for p in probs] == [(3, n) for n in policy.series_sizes]
    for p in probs:
        torch.testing.assert_close(p.sum(1), torch.ones(3))
