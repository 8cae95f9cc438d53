"""Gumbel-softmax sampling, conditional re-sampling and the straight-through weight (SPEC §1)."""

import numpy as np
import pytest
import torch
from scipy import stats

from jcsaug.policy.gumbel import conditional_gumbel_softmax, gumbel_softmax, straight_through_weight

pytestmark = pytest.mark.method  # part of the mutation run's test set (tests/README.md)


def test_gumbel_argmax_frequencies_match_softmax():
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5, -2.0])
    gen = torch.Generator().manual_seed(0)
    n = 20000
    index, _ = gumbel_softmax(logits.expand(n, -1), gen)
    counts = np.bincount(index.numpy(), minlength=5)
    expected = torch.softmax(logits, 0).numpy() * n
    assert stats.chisquare(counts, expected).pvalue > 1e-3


def test_conditional_matches_filtered_unconditional():
    logits = torch.tensor([0.8, -0.3, 0.1, -1.2])
    gen = torch.Generator().manual_seed(1)
    n = 60000
    index, s = gumbel_softmax(logits.expand(n, -1), gen)
    for k in (0, 3):
        filtered = s[index == k].detach()
        cond = conditional_gumbel_softmax(logits.expand(len(filtered), -1), torch.full((len(filtered),), k), gen)
        assert (cond.argmax(-1) == k).all()
        for j in range(4):
            # two-sample KS on every coordinate of s
            assert stats.ks_2samp(filtered[:, j].numpy(), cond[:, j].detach().numpy()).pvalue > 1e-3


def test_conditional_rejects_bad_index():
    with pytest.raises(ValueError, match="out of range"):
        conditional_gumbel_softmax(torch.zeros(2, 3), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="does not match"):
        conditional_gumbel_softmax(torch.zeros(2, 3), torch.tensor([0]))


def test_weight_is_one_and_gradient_is_that_of_max_s():
    logits = torch.tensor([[0.3, -0.2, 1.1, 0.0], [2.0, 0.1, -1.0, 0.4]], requires_grad=True)
    gen = torch.Generator().manual_seed(2)
    index = torch.tensor([2, 1])
    s = conditional_gumbel_softmax(logits, index, gen)
    w = straight_through_weight(s, index)
    assert torch.equal(w.detach(), torch.ones(2))
    coeff = torch.tensor([0.7, -1.3])
    (coeff * w).sum().backward()
    s = s.detach()
    for b in range(2):
        k = int(index[b])
        analytic = s[b, k] * ((torch.arange(4) == k).float() - s[b])  # d s_k / d p_j = s_k (delta_kj - s_j)
        torch.testing.assert_close(logits.grad[b], coeff[b] * analytic)
