"""Paired (counterfactual) scoring of ops: the policy gradient from measured op effects (SPEC §4, beyond the paper).

An op's *effect* ``D`` is the change of a sample's score when the op replaces its series' identity on the same
sample: for TRA the derivative of the validation loss with respect to the sample's weight (the paper's ``g``,
made scale-free), for TEA the soft Dice loss of the mapped-back prediction. Taking the difference on one and
the same patch removes the patch-to-patch noise that dominates the paper's estimator.

With the effects of a series' ops, the expected score under the policy is ``sum_k pi_k D_k`` (``D_0 = 0`` for
the identity), whose exact gradient with respect to the logits is ``pi_m (D_m - sum_k pi_k D_k)``. An update
measures only a few ops: those get ``D_m`` from this update's measurements (fresh, so that noise does not persist
from step to step; Adam averages over steps), the baseline ``sum_k pi_k D_k`` uses running estimates of every
op's effect (never-measured ops count as the identity), and only the measured ops and their series' identity take
an (Adam) step; every other op keeps its logit and optimiser state.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from jcsaug.policy.categorical import CategoricalPolicy

__all__ = ["OpEffects"]


class OpEffects:
    """Running estimates of every op's effect, per class group, and the policy gradient they give.

    Args:
        policy: the policy whose ops are scored (its ``[groups, logits]`` layout is used).
        smoothing: the running estimate of an op averages its first ``1 / smoothing`` measurements equally, then
            follows an exponential moving average with this weight on each new measurement.
        natural: :meth:`gradient` returns the natural gradient instead of the softmax gradient (the updaters'
            natural step rules, :attr:`~jcsaug.engine.base.StepRule.natural`).
    """

    def __init__(self, policy: CategoricalPolicy, smoothing: float = 0.1, natural: bool = False) -> None:
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.policy = policy
        self.smoothing = float(smoothing)
        self.natural = bool(natural)
        self.estimate = torch.zeros(policy.logits.shape, dtype=torch.float64)
        self.count = torch.zeros(policy.logits.shape, dtype=torch.float64)
        self._identity = torch.zeros(policy.logits.shape[1], dtype=torch.bool)
        self._identity[list(policy.offsets[:-1])] = True
        self._series_of = torch.repeat_interleave(
            torch.arange(policy.num_series), torch.tensor(policy.series_sizes)
        )  # logit index -> its series

    def accumulate(
        self, groups: torch.Tensor, series: torch.Tensor, ops: torch.Tensor, effects: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum and count measured effects per (group, logit): ``([G, N] sums, [G, N] counts)``.

        Args:
            groups, series, ops: ``[M]`` class group, series and op index of each measurement.
            effects: ``[M]`` the measured effects ``D`` (op minus identity on the same sample).
        """
        sums = torch.zeros(self.estimate.shape, dtype=torch.float64)
        counts = torch.zeros(self.estimate.shape, dtype=torch.float64)
        flat = torch.as_tensor(self.policy.offsets[:-1])[series.long()] + ops.long()
        keep = ops.long() != 0  # an identity "measurement" has effect 0 by definition
        sums.index_put_((groups.long()[keep], flat[keep]), effects.double()[keep], accumulate=True)
        counts.index_put_((groups.long()[keep], flat[keep]), torch.ones_like(effects, dtype=torch.float64)[keep],
                          accumulate=True)  # fmt: skip
        return sums, counts

    def gradient(self, sums: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fold this update's measurements into the running estimates and return ``(gradient, mask)``.

        ``gradient[g, m] = pi_m (D_m - b)`` for the ops measured in this update (``D_m`` their mean effect in this
        update) and ``pi_0 (0 - b)`` for the identity of each series with a measured op, with the baseline
        ``b = sum_k pi_k D~_k`` from the running estimates ``D~`` (this update's measurements included); ``mask``
        marks exactly those entries. With ``natural`` it returns the natural gradient instead, ``D_m - b`` and
        ``0 - b`` without the factor ``pi`` (the softmax's Fisher information is ``diag(pi) - pi pi^T``, so this is
        the gradient preconditioned by its inverse, up to a shift of a whole series, which the softmax ignores): an
        op's step then does not shrink with its probability.
        """
        measured = counts > 0
        mean = torch.where(measured, sums / counts.clamp(min=1), torch.zeros_like(sums))
        weight = torch.clamp(1.0 / (self.count + 1.0), min=self.smoothing)
        self.estimate = torch.where(measured, self.estimate + weight * (mean - self.estimate), self.estimate)
        self.count = self.count + measured.double()

        probs = torch.cat([p.double() for p in self.policy.probabilities()], dim=1)  # [G, N], per-series softmax
        baseline_terms = probs * self.estimate  # the identity's estimate stays 0
        baseline = torch.zeros(probs.shape[0], self.policy.num_series, dtype=torch.float64)
        baseline.index_add_(1, self._series_of, baseline_terms)
        b = baseline[:, self._series_of]  # [G, N]: each logit's series baseline
        series_touched = torch.zeros(probs.shape[0], self.policy.num_series, dtype=torch.float64)
        series_touched.index_add_(1, self._series_of, measured.double())
        identity_mask = (series_touched[:, self._series_of] > 0) & self._identity[None, :]
        mask = measured | identity_mask
        effect = torch.where(self._identity[None, :], torch.zeros_like(mean), mean)
        advantage = effect - b
        grad = torch.where(mask, advantage if self.natural else probs * advantage, torch.zeros_like(probs))
        return grad, mask

    def state_dict(self) -> dict:
        return {"estimate": self.estimate.clone(), "count": self.count.clone()}

    def load_state_dict(self, state: Mapping) -> None:
        for key in ("estimate", "count"):
            value = torch.as_tensor(state[key], dtype=torch.float64)
            if tuple(value.shape) != tuple(self.estimate.shape):
                raise ValueError(
                    f"op-effect {key} of shape {tuple(value.shape)}, expected {tuple(self.estimate.shape)}"
                )
        self.estimate = torch.as_tensor(state["estimate"], dtype=torch.float64).clone()
        self.count = torch.as_tensor(state["count"], dtype=torch.float64).clone()
