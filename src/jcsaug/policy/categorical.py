"""Learnable categorical policies: logits per series and class group, in shared memory."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import numpy as np
import torch
from torch import nn

from jcsaug.policy.gumbel import conditional_gumbel_softmax, gumbel_softmax, straight_through_weight

NOT_APPLIED = -1  # recorded op index of a series that a sample did not pass through

# logits that policies draw from within sampling_from (policy -> [num_groups, num_logits] copy); a context variable,
# since the DataLoader's dataset and MONAI's Compose call the transforms with the sample only
_SNAPSHOTS: ContextVar[Mapping[CategoricalPolicy, torch.Tensor] | None] = ContextVar("jcsaug_snapshots", default=None)


@contextmanager
def sampling_from(snapshots: Mapping[CategoricalPolicy, np.ndarray | torch.Tensor]) -> Iterator[None]:
    """Within the block, each policy of ``snapshots`` draws its ops (:meth:`CategoricalPolicy.sample_ops`,
    :class:`jcsaug.policy.LearnableOneOfd`) from the logits given for it (a :meth:`CategoricalPolicy.snapshot`),
    not from its live logits. :class:`jcsaug.policy.PolicySnapshotDataset` sets it per sample in the DataLoader
    workers."""
    frozen = {}
    for policy, logits in snapshots.items():
        logits = torch.as_tensor(logits)
        if tuple(logits.shape) != tuple(policy.logits.shape):
            raise ValueError(
                f"a snapshot of shape {tuple(logits.shape)} for a policy with logits {tuple(policy.logits.shape)}"
            )
        frozen[policy] = logits.to(policy.logits.dtype)
    token = _SNAPSHOTS.set(frozen)
    try:
        yield
    finally:
        _SNAPSHOTS.reset(token)


class CategoricalPolicy(nn.Module):
    """Categorical distributions over ops: one per *series* and *class group*.

    The logits of all series are concatenated into one parameter ``logits`` of shape
    ``[num_groups, sum(series_sizes)]``; index 0 of every series is the identity. The parameter lives
    in shared memory and is only ever updated in place (optimiser steps, ``load_state_dict``), so
    transforms running in DataLoader worker processes sample from the current probabilities. Keep
    a policy on the CPU: it is tiny, and a copy on a GPU would not be seen by the workers. Which
    probabilities a sample sees then depends on when its worker makes it; for runs that repeat on a busy
    machine, load through :class:`jcsaug.policy.PolicySnapshotSampler` and
    :class:`jcsaug.policy.PolicySnapshotDataset`, which fix them when the sample's index is dispatched (with MONAI's
    ``ThreadDataLoader``: :class:`jcsaug.policy.LockstepThreadDataLoader`).

    Args:
        series_sizes: number of choices (identity included) of each series.
        num_groups: number of class groups (1 = not class-specific).
        init_probs: optional initial probabilities, one array per series (shape ``[n]`` for all
            groups or ``[num_groups, n]``).
        series_names: names of the series (for logs and exports).
        op_names: names of the ops of each series (identity included).

    Example: two series (3 and 2 ops) and two class groups; a worker draws ops, the updater weights them::

        >>> import numpy as np, torch
        >>> policy = CategoricalPolicy([3, 2], num_groups=2, series_names=["flip", "noise"])
        >>> [p.shape for p in policy.probabilities()]  # one [groups, ops] tensor per series
        [torch.Size([2, 3]), torch.Size([2, 2])]
        >>> policy.set_probabilities([[0.5, 0.25, 0.25], [0.9, 0.1]])
        >>> policy.probabilities()[1][0]
        tensor([0.9000, 0.1000])
        >>> choices = policy.sample_ops(1, np.random.RandomState(0))  # one op per series for a group-1 patch
        >>> choices
        array([1, 0])
        >>> weight = policy.weights(torch.tensor(np.array([choices])), torch.tensor([1]), torch.Generator())
        >>> weight  # exactly 1 in value; its gradient reaches group 1's logits only
        tensor([1.], grad_fn=<ProdBackward1>)
    """

    def __init__(
        self,
        series_sizes: Sequence[int],
        num_groups: int = 1,
        init_probs: Sequence[Sequence[float] | np.ndarray] | None = None,
        series_names: Sequence[str] | None = None,
        op_names: Sequence[Sequence[str]] | None = None,
    ) -> None:
        super().__init__()
        sizes = [int(n) for n in series_sizes]
        if not sizes or any(n < 1 for n in sizes):
            raise ValueError(f"series_sizes must be a non-empty list of positive ints, got {list(series_sizes)}")
        if int(num_groups) < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        self.series_sizes = tuple(sizes)
        self.num_groups = int(num_groups)
        self.offsets = tuple(int(o) for o in np.concatenate([[0], np.cumsum(sizes)]))
        self.series_names = list(series_names) if series_names else [f"series{i}" for i in range(len(sizes))]
        self.op_names = [list(n) for n in op_names] if op_names else [[f"op{j}" for j in range(n)] for n in sizes]
        if len(self.series_names) != len(sizes) or [len(n) for n in self.op_names] != sizes:
            raise ValueError("series_names/op_names do not match series_sizes")
        self.logits = nn.Parameter(torch.zeros(self.num_groups, self.offsets[-1]))
        if init_probs is not None:
            self.set_probabilities(init_probs)
        self.logits.share_memory_()

    # ------------------------------------------------------------------ structure
    @property
    def num_series(self) -> int:
        return len(self.series_sizes)

    def series_slice(self, series: int) -> slice:
        return slice(self.offsets[series], self.offsets[series + 1])

    def series_logits(self, series: int) -> torch.Tensor:
        """Logits ``[num_groups, n]`` of one series (a differentiable view)."""
        return self.logits[:, self.series_slice(series)]

    def probabilities(self) -> list[torch.Tensor]:
        """Current probabilities, one ``[num_groups, n]`` tensor per series (detached)."""
        # numpy: tiny arrays, and no wake-up of torch's intra-op thread pool on a busy machine
        idx, valid, sizes = self._padded_index()
        z = np.where(valid, self.logits.detach().double().numpy()[:, idx], -np.inf)  # [G, L, max_n], all series
        e = np.exp(z - z.max(axis=2, keepdims=True))
        p = torch.from_numpy(e / e.sum(axis=2, keepdims=True)).to(self.logits.dtype)
        return [p[:, s, :n] for s, n in enumerate(sizes.tolist())]

    def set_probabilities(self, probs: Sequence[Sequence[float] | np.ndarray], floor: float = 1e-6) -> None:
        """Set logits to ``log(probs)`` in place (probabilities floored at ``floor`` and renormalised)."""
        if len(probs) != self.num_series:
            raise ValueError(f"expected probabilities for {self.num_series} series, got {len(probs)}")
        new = torch.empty_like(self.logits.data)
        for s, p in enumerate(probs):
            p = torch.as_tensor(np.asarray(p, dtype=np.float64))
            n = self.series_sizes[s]
            if p.shape[-1] != n or p.ndim not in (1, 2) or (p.ndim == 2 and p.shape[0] != self.num_groups):
                raise ValueError(
                    f"series {self.series_names[s]!r}: probabilities of shape {tuple(p.shape)}, "
                    f"expected [{n}] or [{self.num_groups}, {n}]"
                )
            if not torch.isfinite(p).all() or (p < 0).any():
                raise ValueError(f"series {self.series_names[s]!r}: probabilities must be finite and >= 0")
            p = p.clamp(min=floor)
            p = p / p.sum(-1, keepdim=True)
            new[:, self.series_slice(s)] = torch.log(p).to(new.dtype).expand(self.num_groups, n)
        with torch.no_grad():
            self.logits.copy_(new)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # noqa: ANN001
        key = prefix + "logits"
        if key in state_dict and tuple(state_dict[key].shape) != tuple(self.logits.shape):
            raise ValueError(
                f"policy logits of shape {tuple(state_dict[key].shape)} do not match this policy "
                f"({self.num_groups} groups x {self.offsets[-1]} logits over {self.num_series} series)"
            )
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # ------------------------------------------------------------------ sampling in workers
    def snapshot(self) -> np.ndarray:
        """A copy of the logits (numpy: sent to a DataLoader worker by value, not as a shared-memory tensor)."""
        return self.logits.detach().numpy().copy()

    def sampling_logits(self) -> torch.Tensor:
        """The logits ops are drawn from: the snapshot an enclosing :func:`sampling_from` gives, else the live ones
        (detached)."""
        frozen = _SNAPSHOTS.get()
        if frozen is not None and self in frozen:
            return frozen[self]
        return self.logits.detach()

    def sample_ops(self, group: int, rng: np.random.RandomState) -> np.ndarray:
        """Draw one op per series for a sample of class group ``group`` (no gradient; worker side).

        Equivalent in distribution to the argmax of Gumbel-perturbed logits; uses the caller's seeded
        ``RandomState`` (MONAI's ``Randomizable.R``) so that ``set_determinism`` reproduces the draws. Draws from
        :meth:`sampling_logits`: a snapshot within :func:`sampling_from`, else the current logits.
        """
        if not 0 <= int(group) < self.num_groups:
            raise ValueError(f"class group {group} out of range for a policy with {self.num_groups} group(s)")
        idx, valid, sizes = self._padded_index()
        z = np.where(valid, self.sampling_logits()[int(group)].double().numpy()[idx], -np.inf)
        cdf = np.cumsum(np.exp(z - z.max(axis=1, keepdims=True)), axis=1)  # [L, max_n], all series at once
        u = rng.random_sample(len(sizes)) * cdf[np.arange(len(sizes)), sizes - 1]
        cdf[~valid] = np.inf
        return np.minimum((cdf <= u[:, None]).sum(axis=1), sizes - 1).astype(np.int64)

    def _padded_index(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``[L, max_n]`` indices into the flat logits, their validity mask, and the series sizes."""
        cache = self.__dict__.get("_padded_index_cache")
        if cache is None:
            offsets, sizes = np.asarray(self.offsets[:-1]), np.asarray(self.series_sizes)
            columns = np.arange(sizes.max())
            valid = columns[None, :] < sizes[:, None]
            cache = (np.where(valid, offsets[:, None] + columns[None, :], 0), valid, sizes)
            self.__dict__["_padded_index_cache"] = cache
        return cache

    # ------------------------------------------------------------------ differentiable weights
    def _check_batch(self, choices: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        choices = torch.as_tensor(choices, dtype=torch.long).cpu()
        groups = torch.as_tensor(groups, dtype=torch.long).cpu().reshape(-1)
        if choices.ndim != 2 or choices.shape[1] != self.num_series:
            raise ValueError(f"choices must be [batch, {self.num_series}], got {tuple(choices.shape)}")
        if groups.shape[0] != choices.shape[0]:
            raise ValueError(f"{groups.shape[0]} class groups for a batch of {choices.shape[0]} choices")
        if groups.numel() and (int(groups.min()) < 0 or int(groups.max()) >= self.num_groups):
            raise ValueError(f"class groups {groups.unique().tolist()} out of range [0, {self.num_groups})")
        bad = (choices < NOT_APPLIED) | (choices >= torch.tensor(self.series_sizes))
        if bad.any():
            i, s = (int(v) for v in bad.nonzero()[0])
            raise ValueError(
                f"op index {int(choices[i, s])} of sample {i} out of range for series {self.series_names[s]!r} "
                f"({self.series_sizes[s]} choices; {NOT_APPLIED} = not applied)"
            )
        return choices, groups

    def _padded_logits(self, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Differentiable logits ``[B, L, max_n]`` of the samples' groups (``-inf`` past each series' size), and
        the validity mask ``[L, max_n]``: every series at once."""
        idx, valid, _ = self._padded_index()
        valid_t = torch.from_numpy(valid)
        return self.logits[groups][:, torch.from_numpy(idx)].masked_fill(~valid_t, float("-inf")), valid_t

    def series_weights(
        self,
        choices: torch.Tensor,
        groups: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Per-series straight-through weights ``[B, L]`` for recorded choices (conditional Gumbel).

        Each entry is exactly 1 in value; its gradient reaches the logits of the sample's class group.
        A recorded index of ``NOT_APPLIED`` (-1) gives a constant weight 1. All series of all samples are
        re-sampled in one vectorised call.
        """
        if groups is None:
            groups = torch.zeros(len(choices), dtype=torch.long)
        choices, groups = self._check_batch(choices, groups)
        logits, _ = self._padded_logits(groups)
        index = choices.clamp(min=0)
        w = straight_through_weight(conditional_gumbel_softmax(logits, index, generator), index)
        return torch.where(choices != NOT_APPLIED, w, torch.ones_like(w).detach())

    def drawn_mask(self, choices: torch.Tensor, groups: torch.Tensor | None = None) -> torch.Tensor:
        """``[num_groups, num_logits]`` bool: which (group, op) pairs were drawn by some sample."""
        if groups is None:
            groups = torch.zeros(len(choices), dtype=torch.long)
        choices, groups = self._check_batch(choices, groups)
        mask = torch.zeros(self.logits.shape, dtype=torch.bool)
        offsets = torch.tensor(self.offsets[:-1])
        applied = choices != NOT_APPLIED
        rows = groups[:, None].expand_as(choices)[applied]
        cols = (choices + offsets[None, :])[applied]
        mask[rows, cols] = True
        return mask

    def weights(
        self,
        choices: torch.Tensor,
        groups: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample weights ``[B]``: the product over series of :meth:`series_weights`."""
        return self.series_weights(choices, groups, generator).prod(dim=1)

    def gumbel_sample(
        self, groups: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw ops in the main process: returns ``(choices [B, L], series_weights [B, L])``."""
        groups = torch.as_tensor(groups, dtype=torch.long).reshape(-1)
        index, soft = gumbel_softmax(self._padded_logits(groups)[0], generator)
        return index, straight_through_weight(soft, index)

    # ------------------------------------------------------------------ export
    def to_dict(self) -> dict:  # pragma: no mutate block (the JSON export: tests/test_export.py)
        """Plain, JSON-ready view: probabilities per group, series and op, with names."""
        probs = self.probabilities()
        logits = self.logits.detach()
        return {
            "num_groups": self.num_groups,
            "groups": [
                {
                    "group": g,
                    "series": [
                        {
                            "series": self.series_names[s],
                            "ops": [
                                {
                                    "name": self.op_names[s][j],
                                    "probability": float(probs[s][g, j]),
                                    "logit": float(logits[g, self.offsets[s] + j]),
                                }
                                for j in range(self.series_sizes[s])
                            ],
                        }
                        for s in range(self.num_series)
                    ],
                }
                for g in range(self.num_groups)
            ],
        }

    def extra_repr(self) -> str:  # pragma: no mutate block (display)
        return f"series={self.num_series}, groups={self.num_groups}, logits={self.offsets[-1]}"
