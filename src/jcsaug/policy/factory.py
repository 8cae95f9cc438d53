"""Factories: the TRA policy (15 series x class groups) and the TEA policy (84 ops)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from jcsaug.ops.tra import tra_catalogue
from jcsaug.policy.categorical import CategoricalPolicy
from jcsaug.policy.presets import series_probs, tea_probs


def make_tra_policy(
    preset: str | Mapping[str, float | Sequence[float]] = "nnunet", num_groups: int = 2, catalogue: str = "spec"
) -> CategoricalPolicy:
    """A TRA policy over the 15 series of SPEC §2, the same initial probabilities for every group.

    ``preset``: a name (:func:`~jcsaug.policy.list_tra_presets`) or a mapping series -> probability of applying
    an op (or a full probability vector). ``catalogue``: a name of :data:`jcsaug.ops.tra.TRA_CATALOGUES`: ``spec``
    (a signed op draws its sign) or ``split-signs`` (its two signs are two ops, so the policy learns the sign).

    Example::

        >>> policy = make_tra_policy("nnunet", num_groups=2)  # background- and foreground-centred patches
        >>> policy.num_series, policy.num_groups, tuple(policy.logits.shape)
        (15, 2, (2, 62))
        >>> gamma = policy.series_names.index("gamma")
        >>> [round(float(p), 3) for p in policy.probabilities()[gamma][1]]  # identity 1 - q, q = 0.3 shared
        [0.7, 0.1, 0.1, 0.1]
    """
    series = tra_catalogue(catalogue)
    return CategoricalPolicy(
        [s.size for s in series],
        num_groups=num_groups,
        init_probs=series_probs(preset, series),
        series_names=[s.name for s in series],
        op_names=[s.op_names for s in series],
    )


def make_tea_policy(preset: str | Sequence[float] = "nnunet") -> CategoricalPolicy:
    """A TEA policy: one series of the 84 ops of SPEC §3, one group (not class-specific)."""
    from jcsaug.ops.tea import TEA_OPS  # noqa: PLC0415  (TEA catalogue builds MONAI transforms: import on use)

    return CategoricalPolicy(
        [len(TEA_OPS)],
        num_groups=1,
        init_probs=[tea_probs(preset, len(TEA_OPS))],
        series_names=["tea"],
        op_names=[[op.name for op in TEA_OPS]],
    )
