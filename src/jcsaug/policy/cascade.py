"""The learnable TRA cascade as MONAI dictionary transforms: per sample (DataLoader workers) or per batch (device)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from monai.config import KeysCollection
from monai.data import MetaTensor
from monai.transforms import MapTransform, Randomizable

from jcsaug.ops.tra import TRA_SERIES, TRAParams, apply_tra, apply_tra_batch, sample_tra_params
from jcsaug.policy.categorical import CategoricalPolicy
from jcsaug.policy.transforms import DEFAULT_GROUP_KEY, _group_of

DEFAULT_OP_KEY = "tra_ops"


def _rewrap(out: torch.Tensor, src: object) -> torch.Tensor:
    """Give ``out`` the metadata of ``src`` (a copy: the caller's MetaTensor is never touched)."""
    if isinstance(src, MetaTensor):
        # as_subclass + attribute copies: ~10x cheaper than the MetaTensor constructor, same result
        wrapped = out.as_subclass(MetaTensor)
        wrapped.meta = dict(src.meta)
        wrapped.applied_operations = list(src.applied_operations)
        wrapped.is_batch = src.is_batch
        return wrapped
    return out


def _check_tra_policy(policy: CategoricalPolicy, name: str) -> None:
    if policy.series_sizes != tuple(s.size for s in TRA_SERIES):
        raise ValueError(
            f"{name} needs a policy over the 15 TRA series (sizes {[s.size for s in TRA_SERIES]}), "
            f"got sizes {list(policy.series_sizes)}"
        )


class TRACascaded(Randomizable, MapTransform):
    """The 15 TRA series of SPEC §2, one op each, sampled from the class group's policy.

    For every sample: read the class group (``group_key``, from :class:`~jcsaug.policy.ClassGroupd`),
    draw one op per series from the policy's *current* probabilities, draw the ops' magnitudes, apply
    them in the reference order (affine -> rot90 -> noise -> blur/sharpen -> shift/scale -> contrast ->
    low-res -> inverted gamma -> gamma -> mirror), and record the 15 chosen indices under ``op_key``
    (collates into ``[B, 15]``). Scaling and small rotations are combined into one resampling.

    Images must be channel-first 3D ``[C, X, Y, Z]`` in RAS orientation (see :mod:`jcsaug.ops.axes`).
    The outputs keep the inputs' metadata (affine unchanged: TRA is training-only and not inverted).

    Args:
        keys: image keys (spatial and intensity ops).
        policy: a :class:`CategoricalPolicy` with the 15 TRA series (see :func:`make_tra_policy`).
        label_keys: label keys (spatial ops only, nearest neighbour; values preserved).
        group_key: key of the class group; ignored by a 1-group policy.
        op_key: where the chosen op indices are stored.
        padding_mode: padding of the affine resampling for images (labels pad with 0).
    """

    def __init__(
        self,
        keys: KeysCollection,
        policy: CategoricalPolicy,
        label_keys: KeysCollection = (),
        group_key: str | None = DEFAULT_GROUP_KEY,
        op_key: str = DEFAULT_OP_KEY,
        padding_mode: str = "zeros",
        allow_missing_keys: bool = False,
    ) -> None:
        MapTransform.__init__(self, keys, allow_missing_keys)
        _check_tra_policy(policy, type(self).__name__)
        self.policy = policy
        self.label_keys = [label_keys] if isinstance(label_keys, str) else list(label_keys)
        self.group_key = group_key
        self.op_key = op_key
        self.padding_mode = padding_mode

    def randomize(self, data: Mapping) -> tuple[np.ndarray, TRAParams]:
        choices = self.policy.sample_ops(_group_of(data, self.group_key, self.policy), self.R)
        return choices, sample_tra_params(choices, self.R)

    def __call__(self, data: Mapping) -> dict:
        d = dict(data)
        choices, params = self.randomize(d)
        images = {k: d[k] for k in self.key_iterator(d)}
        labels = {k: d[k] for k in self.label_keys if k in d or not self.allow_missing_keys}
        missing = [k for k in labels if k not in d]
        if missing:
            raise KeyError(f"TRACascaded: label key(s) {missing} not in data (keys: {list(d)})")
        out_images, out_labels = apply_tra(images, labels, params, padding_mode=self.padding_mode)
        for k, v in {**out_images, **out_labels}.items():
            d[k] = _rewrap(v, d[k])
        d[self.op_key] = torch.as_tensor(choices, dtype=torch.long)
        return d


class BatchTRACascaded(TRACascaded):
    """:class:`TRACascaded` on a collated batch ``[B, C, X, Y, Z]``, on the device its tensors are on.

    Put it after the DataLoader (e.g. :class:`jcsaug.engine.DeviceAugmentation` runs it on every training
    batch of an Ignite engine, or call it on the batch in your own loop). Each sample's 15 ops are drawn from
    the shared policy for its class group exactly as :class:`TRACascaded` draws them (same calls on the same
    kind of seeded stream, in sample order), so ``op_key`` holds the same ``[B, 15]`` record and the policy
    updaters need no change. All samples' scalings and small rotations are resampled by one ``grid_sample``
    call per key (image bilinear, label nearest), 90-degree rotations and mirrors are index ops, and the
    intensity ops run vectorised over the samples that drew them; a sample that drew identities only is
    returned bit for bit.

    Args:
        keys: image keys.
        policy: a :class:`CategoricalPolicy` with the 15 TRA series (kept on the CPU).
        label_keys: label keys (spatial ops only, nearest neighbour; values preserved).
        group_key: key of the class groups ``[B]`` (from :class:`~jcsaug.policy.ClassGroupd` in the workers);
            ignored by a 1-group policy.
        op_key: where the chosen op indices ``[B, 15]`` are stored.
        padding_mode: padding of the affine resampling for images (labels pad with 0).
        device: move the image and label tensors there first (``None``: leave them where they are).
    """

    def __init__(
        self,
        keys: KeysCollection,
        policy: CategoricalPolicy,
        label_keys: KeysCollection = (),
        group_key: str | None = DEFAULT_GROUP_KEY,
        op_key: str = DEFAULT_OP_KEY,
        padding_mode: str = "zeros",
        device: torch.device | str | None = None,
        allow_missing_keys: bool = False,
    ) -> None:
        super().__init__(keys, policy, label_keys, group_key, op_key, padding_mode, allow_missing_keys)
        self.device = None if device is None else torch.device(device)

    def _groups(self, d: Mapping, batch: int) -> list[int]:
        if self.policy.num_groups == 1 or self.group_key is None:
            return [0] * batch
        if self.group_key not in d:
            raise KeyError(
                f"class group key {self.group_key!r} missing from the batch; put ClassGroupd in the worker pipeline"
            )
        groups = torch.as_tensor(d[self.group_key]).reshape(-1).tolist()
        if len(groups) != batch:
            raise ValueError(f"{len(groups)} class groups in {self.group_key!r} for a batch of {batch}")
        return [int(g) for g in groups]

    def randomize(self, groups: list[int]) -> tuple[np.ndarray, list[TRAParams]]:
        choices, params = [], []
        for g in groups:  # the per-sample cascade's calls, sample by sample
            c = self.policy.sample_ops(g, self.R)
            choices.append(c)
            params.append(sample_tra_params(c, self.R))
        return np.stack(choices) if choices else np.zeros((0, len(TRA_SERIES)), np.int64), params

    def __call__(self, data: Mapping) -> dict:
        d = dict(data)
        if self.op_key in d:
            raise ValueError(
                f"the batch already holds TRA choices {self.op_key!r}: augment in the workers (TRACascaded) or on "
                "the device (BatchTRACascaded), not both"
            )
        image_keys = list(self.key_iterator(d))
        labels = [k for k in self.label_keys if k in d or not self.allow_missing_keys]
        missing = [k for k in labels if k not in d]
        if missing:
            raise KeyError(f"BatchTRACascaded: label key(s) {missing} not in data (keys: {list(d)})")
        if not image_keys and not labels:
            raise KeyError(f"BatchTRACascaded: none of the keys {list(self.keys)} is in the batch (keys: {list(d)})")
        batch = int(d[(image_keys + labels)[0]].shape[0])
        choices, params = self.randomize(self._groups(d, batch))

        def to_device(x: torch.Tensor) -> torch.Tensor:
            return x if self.device is None else x.to(self.device, non_blocking=True)

        out_images, out_labels = apply_tra_batch(
            {k: to_device(d[k]) for k in image_keys}, {k: to_device(d[k]) for k in labels}, params, self.padding_mode
        )
        for k, v in {**out_images, **out_labels}.items():
            d[k] = _rewrap(v, d[k])
        d[self.op_key] = torch.as_tensor(choices, dtype=torch.long)
        return d
