"""Gumbel-softmax sampling (SPEC §1), unconditional and conditioned on a recorded choice.

The straight-through weight ``w = max s + (1 - max s).detach()`` is exactly 1 in value; only its
gradient with respect to the logits matters.
"""

from __future__ import annotations

import torch

_TINY = 1e-20


def _uniform(shape: torch.Size, like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    u = torch.rand(shape, generator=generator, dtype=torch.float64, device=like.device)
    return u.clamp_(_TINY, 1.0 - 1e-16)


def gumbel_noise(shape: torch.Size, like: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Standard Gumbel noise ``-log(-log U)`` (float64 for the extreme tails)."""
    return -torch.log(-torch.log(_uniform(shape, like, generator)))


def gumbel_softmax(logits: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``j* = argmax_j softmax(p + g)``; returns ``(index [...], s [..., n])`` (s differentiable).

    ``-inf`` logits mark choices that do not exist (never drawn, probability 0)."""
    g = gumbel_noise(logits.shape, logits, generator).to(logits.dtype)
    s = torch.softmax(logits + g, dim=-1)
    return s.detach().argmax(dim=-1), s


def conditional_gumbel_softmax(
    logits: torch.Tensor, index: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """``s = softmax(p + g)`` with the Gumbel noise ``g`` drawn *given* ``argmax(p + g) == index``.

    Exact top-down sampling (no rejection loop): the maximum of the perturbed logits is a Gumbel
    located at ``logsumexp(p)`` and sits at ``index``; every other perturbed logit is a Gumbel located
    at ``p_j`` truncated above at that maximum. The noise ``g = z - p`` is then held fixed, so the
    gradient of ``s`` with respect to ``p`` is that of ordinary Gumbel-softmax.

    Args:
        logits: ``[..., n]``; ``-inf`` marks choices that do not exist (padding of series of different sizes).
        index: ``[...]`` integer choices in ``[0, n)``.
    """
    if index.shape != logits.shape[:-1]:
        raise ValueError(f"index shape {tuple(index.shape)} does not match logits {tuple(logits.shape)}")
    n = logits.shape[-1]
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= n):
        raise ValueError(f"op index out of range [0, {n}): {index.tolist()}")
    with torch.no_grad():
        a = logits.detach().double()
        u = _uniform(a.shape, a, generator)
        k = index.long().unsqueeze(-1)
        top = torch.logsumexp(a, dim=-1, keepdim=True) - torch.log(-torch.log(u.gather(-1, k)))
        # z_j = -log(exp(-top) + exp(-a_j) * E_j), E_j = -log U_j ~ Exp(1), in log-space for stability
        z = -torch.logaddexp(-top.expand_as(a), -a + torch.log(-torch.log(u)))
        z = z.scatter(-1, k, top)
        g = torch.where(torch.isfinite(a), z - a, 0.0).to(logits.dtype)
    return torch.softmax(logits + g, dim=-1)


def straight_through_weight(s: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``w = s[index] + (1 - s[index]).detach()``: value exactly 1, gradient that of ``s[index]``.

    Written as ``s - s.detach() + 1`` so the value is 1 to the last bit (``s + (1 - s)`` can round).
    """
    s_max = s.gather(-1, index.long().unsqueeze(-1)).squeeze(-1)
    return s_max - s_max.detach() + 1.0
