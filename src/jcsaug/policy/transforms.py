"""MONAI dictionary transforms driven by learnable policies.

* :class:`ClassGroupd` stores the class group of a (cropped) patch: the class of its centre voxel.
* :class:`LearnableOneOfd` makes any list of MONAI transforms a learnable series (index 0 = identity).
* :class:`TRACascaded` (in :mod:`jcsaug.policy.cascade`) applies the 15 TRA series of SPEC §2.

None of them pushes entries onto the caller's ``applied_operations`` (MONAI's ``OneOf`` does): the
chosen op indices are recorded in a plain key that collates into a ``[B, L]`` integer tensor.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import numpy as np
import torch
from monai.config import KeysCollection
from monai.data import MetaTensor
from monai.transforms import MapTransform, Randomizable
from monai.transforms.transform import Transform, apply_transform

from jcsaug.policy.categorical import NOT_APPLIED, CategoricalPolicy

DEFAULT_GROUP_KEY = "class_group"


def centre_class(label: torch.Tensor | np.ndarray) -> int:
    """Class of the centre voxel of a channel-first label (one channel of values, or one-hot channels)."""
    lab = label.as_tensor() if isinstance(label, MetaTensor) else torch.as_tensor(np.asarray(label))
    if lab.ndim < 2:
        raise ValueError(f"label must be channel-first [C, *spatial], got shape {tuple(lab.shape)}")
    centre = tuple(s // 2 for s in lab.shape[1:])
    voxel = lab[(slice(None), *centre)]
    if lab.shape[0] == 1:
        value = float(voxel[0])
        if value != int(value):
            raise ValueError(f"label centre voxel has non-integer value {value}")
        return int(value)
    return int(torch.argmax(voxel))


class ClassGroupd(MapTransform):
    """Store the class group of a patch, read from the centre voxel of its (cropped) label.

    Args:
        keys: the label key (one key).
        mapping: label value -> class group. Default: ``0 -> 0`` (background), any other value -> 1
            (foreground), as in the paper. Give e.g. ``{0: 0, 1: 1, 2: 2}`` for one group per class.
        group_key: where the group is stored (an int; collates into a ``[B]`` tensor).
        num_groups: optional check that every mapped group is below it.

    Example::

        >>> import torch
        >>> label = torch.zeros(1, 5, 5, 5)
        >>> label[0, 2, 2, 2] = 2  # the centre voxel is class 2
        >>> ClassGroupd("label")({"label": label})["class_group"]  # background / foreground
        1
        >>> ClassGroupd("label", mapping={0: 0, 1: 1, 2: 2})({"label": label})["class_group"]  # one group per class
        2
    """

    def __init__(
        self,
        keys: KeysCollection = "label",
        mapping: Mapping[int, int] | None = None,
        group_key: str = DEFAULT_GROUP_KEY,
        num_groups: int | None = None,
        allow_missing_keys: bool = False,
    ) -> None:
        super().__init__(keys, allow_missing_keys)
        if len(self.keys) != 1:
            raise ValueError(f"ClassGroupd reads one label key, got {self.keys}")
        self.mapping = None if mapping is None else {int(k): int(v) for k, v in mapping.items()}
        if self.mapping is not None and num_groups is not None:
            bad = sorted(v for v in self.mapping.values() if not 0 <= v < num_groups)
            if bad:
                raise ValueError(f"class groups {bad} in mapping out of range [0, {num_groups})")
        self.group_key = group_key

    def group_of(self, value: int) -> int:
        if self.mapping is None:
            if value < 0:
                raise ValueError(f"label value {value} is negative")
            return int(value != 0)
        if value not in self.mapping:
            raise ValueError(
                f"label value {value} at the patch centre is not in the class-group mapping {self.mapping}"
            )
        return self.mapping[value]

    def __call__(self, data: Mapping[Hashable, torch.Tensor]) -> dict:
        d = dict(data)
        for key in self.key_iterator(d):
            try:
                d[self.group_key] = self.group_of(centre_class(d[key]))
            except ValueError as err:
                raise ValueError(f"ClassGroupd, key {key!r}: {err}") from None
        return d


def _record_choice(d: dict, op_key: str, policy: CategoricalPolicy, series: int, index: int) -> None:
    ops = d.get(op_key)
    if ops is None:
        ops = torch.full((policy.num_series,), NOT_APPLIED, dtype=torch.long)
    else:
        ops = torch.as_tensor(ops, dtype=torch.long).clone()  # never mutate a caller's tensor
    ops[series] = index
    d[op_key] = ops


def _group_of(d: Mapping, group_key: str | None, policy: CategoricalPolicy) -> int:
    if policy.num_groups == 1 or group_key is None:
        return 0
    if group_key not in d:
        raise KeyError(f"class group key {group_key!r} missing; put ClassGroupd before the learnable transform")
    return int(d[group_key])


class LearnableOneOfd(Randomizable, Transform):
    """Apply one of ``transforms`` (or nothing), chosen by a learnable policy series.

    Choice 0 is the identity and choice ``j >= 1`` applies ``transforms[j - 1]``, so the series must have
    ``len(transforms) + 1`` choices. The chosen index is written to ``d[op_key][series]``, a length-L
    integer tensor shared by all learnable transforms over the same policy (``-1`` for series not
    visited), which the engine handlers use to compute the sample weights.

    Args:
        transforms: MONAI (dictionary) transforms, one per non-identity op.
        policy: the :class:`CategoricalPolicy` holding the logits.
        series: which series of ``policy`` this chooser samples.
        group_key: key of the class group (from :class:`ClassGroupd`); ignored by 1-group policies.
        op_key: key of the recorded choices.

    Like MONAI's ``OneOf`` it takes no ``keys`` of its own: the wrapped dictionary transforms carry
    their ``keys`` / ``allow_missing_keys``.

    Example: any MONAI transform as a learnable series (here it is nearly always chosen)::

        >>> import torch
        >>> from monai.transforms import Flipd
        >>> policy = CategoricalPolicy([2])  # identity or flip
        >>> policy.set_probabilities([[0.0, 1.0]])
        >>> chooser = LearnableOneOfd([Flipd("image", spatial_axis=0)], policy, group_key=None).set_random_state(0)
        >>> out = chooser({"image": torch.arange(3.0).reshape(1, 3, 1, 1)})
        >>> out["image"].flatten().tolist(), out["learnable_ops"].tolist()  # flipped; choice 1 recorded
        ([2.0, 1.0, 0.0], [1])
    """

    def __init__(
        self,
        transforms: Sequence[Transform],
        policy: CategoricalPolicy,
        series: int = 0,
        group_key: str | None = DEFAULT_GROUP_KEY,
        op_key: str = "learnable_ops",
    ) -> None:
        if not 0 <= series < policy.num_series:
            raise ValueError(f"series {series} out of range for a policy with {policy.num_series} series")
        if policy.series_sizes[series] != len(transforms) + 1:
            raise ValueError(
                f"policy series {series} has {policy.series_sizes[series]} choices but {len(transforms)} "
                "transforms were given (+1 identity expected)"
            )
        self.transforms = list(transforms)
        self.policy = policy
        self.series = series
        self.group_key = group_key
        self.op_key = op_key

    def set_random_state(self, seed: int | None = None, state: np.random.RandomState | None = None):
        super().set_random_state(seed, state)
        for t in self.transforms:
            if isinstance(t, Randomizable):
                t.set_random_state(seed=int(self.R.randint(0, 2**31 - 1)))
        return self

    def randomize(self, data: Mapping) -> int:
        group = _group_of(data, self.group_key, self.policy)
        logits = self.policy.sampling_logits()[group, self.policy.series_slice(self.series)]
        probs = torch.softmax(logits.double(), 0).numpy()
        cdf = np.cumsum(probs)
        return min(int(np.searchsorted(cdf, self.R.random_sample() * cdf[-1], side="right")), len(probs) - 1)

    def __call__(self, data: Mapping) -> dict:
        d = dict(data)
        index = self.randomize(d)
        if index > 0:
            d = dict(apply_transform(self.transforms[index - 1], d))
        _record_choice(d, self.op_key, self.policy, self.series, index)
        return d
