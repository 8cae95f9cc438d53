"""The learnable TRA cascade as MONAI dictionary transforms: per sample (DataLoader workers) or per batch (device)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import numpy as np
import torch
from monai.config import KeysCollection
from monai.data import MetaTensor
from monai.transforms import MapTransform, Randomizable

from jcsaug.ops.catalogue import Series
from jcsaug.ops.resample import PADDING_MODES
from jcsaug.ops.tra import (
    TRAParams,
    apply_tra,
    apply_tra_batch,
    as_context,
    replace_series_op,
    sample_tra_params,
    tra_catalogue,
    tra_catalogue_name,
)
from jcsaug.policy.categorical import CategoricalPolicy
from jcsaug.policy.transforms import DEFAULT_GROUP_KEY, _group_of
from jcsaug.registry import Registry

DEFAULT_OP_KEY = "tra_ops"
DEFAULT_CF_OP_KEY = "tra_cf_ops"
COUNTERFACTUAL_SUFFIX = "_cf"

#: how the counterfactual copies of the paired TRA estimator choose what they change (``TRACascaded(exploration=)``)
CF_EXPLORATIONS: Registry[str] = Registry(
    "counterfactual exploration",
    {
        "drawn": "each copy changes one series: the sample's own op there becomes the identity (it scores that op), "
        "or, where the sample drew the identity, a uniformly drawn op (it explores); ops are explored as often as "
        "the identity is drawn",
        "uniform": "copies in pairs on one series: one explores a uniformly drawn op, the other has the identity "
        "there (or, where the sample drew the identity, explores a second op); every op is explored at a rate that "
        "does not depend on the policy",
    },
)


# whether TRACascaded makes the counterfactual copies it draws when its caller does not say (making_counterfactuals);
# a context variable, since the DataLoader's dataset and MONAI's Compose call the transform with the sample only
_MAKE_COUNTERFACTUALS: ContextVar[bool] = ContextVar("jcsaug_make_counterfactuals", default=True)


@contextmanager
def making_counterfactuals(make: bool) -> Iterator[None]:
    """Within the block, a :class:`TRACascaded` called without ``make_counterfactuals`` makes its counterfactual
    copies only if ``make`` (they are drawn either way, so the random stream is the same). Outside any such block
    it makes them. :class:`jcsaug.engine.CounterfactualDataset` sets it per sample in the DataLoader workers."""
    token = _MAKE_COUNTERFACTUALS.set(bool(make))
    try:
        yield
    finally:
        _MAKE_COUNTERFACTUALS.reset(token)


def _plain(x: torch.Tensor) -> torch.Tensor:
    return x.as_tensor() if isinstance(x, MetaTensor) else x


def _rewrap(out: torch.Tensor, src: object) -> torch.Tensor:
    """Give ``out`` the metadata of ``src`` (a copy: the caller's MetaTensor is never touched)."""
    if isinstance(src, MetaTensor):
        # as_subclass + attribute copies: ~10x cheaper than the MetaTensor constructor, same result
        wrapped = out.as_subclass(MetaTensor)
        wrapped.meta = dict(src.meta)
        wrapped.applied_operations = list(src.applied_operations)
        wrapped.is_batch = src.is_batch
        return wrapped
    return _plain(out)  # plain in, plain out (MONAI's intensity transforms may return MetaTensors)


def _tra_series_of(policy: CategoricalPolicy, name: str) -> tuple[Series, ...]:
    """The TRA catalogue the policy's ops are of (by their names), else an error naming the transform."""
    try:
        return tra_catalogue(tra_catalogue_name(policy.op_names))
    except ValueError as err:
        raise ValueError(f"{name} needs a policy over the 15 TRA series of a TRA catalogue: {err}") from None


class TRACascaded(Randomizable, MapTransform):
    """The 15 TRA series of SPEC §2, one op each, sampled from the class group's policy.

    For every sample: read the class group (``group_key``, from :class:`~jcsaug.policy.ClassGroupd`),
    draw one op per series from the policy's *current* probabilities (in a DataLoader worker behind a
    :class:`~jcsaug.policy.PolicySnapshotSampler`: as they were when the sample's index was dispatched,
    so the draws do not depend on the worker's timing), draw the ops' magnitudes, apply
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
        context: voxels per side (one number or one per axis) by which the input patches extend beyond the patch
            (from :class:`jcsaug.data.ContextCropd`; see :func:`jcsaug.ops.tra.tra_context`): the scalings and
            rotations read them, and every output is the centred patch, ``context`` smaller on each side. 0
            (default): the patch as given, zero-filled where a rotation or zoom-out brings its outside into view.
        counterfactuals: K, for the paired TRA estimator (``TRAPolicyUpdater(estimator="paired")``): the number of
            *counterfactual* copies of the sample to make, each differing from it in one series only. A copy
            draws a non-identity op uniformly over all ops of all series; if the sample's own op in that series
            is not the identity, the copy has the identity there instead (it scores the drawn op), else the copy
            applies the drawn op (it explores). The other series keep their exact magnitudes. Stored as
            ``key + "_cf"`` (``[K, C, X, Y, Z]``) for every image and label key and ``cf_op_key`` (``[K, 2]``:
            series, op of the copy). 0 (default) makes none and adds nothing to the sample.
        cf_op_key: where the counterfactual (series, op) pairs are stored.
        exploration: how the copies choose what they change (:data:`CF_EXPLORATIONS`): ``"drawn"`` (default) as
            above, where an op is explored only when the sample drew its series' identity, so an op the policy has
            made rare is measured less and less once other ops take its series over; ``"uniform"`` (K even) makes
            the copies in pairs on one series (drawn as above): one copy applies a uniformly drawn op other than
            the sample's own, the other has the identity there (it scores the sample's own op, and the explored
            op is scored against it on the same patch) or, where the sample drew the identity, a second explored
            op. Every op is then explored at a rate of its own, whatever the policy (beyond the paper).

    Example::

        >>> import torch
        >>> from jcsaug.policy import make_tra_policy
        >>> tra = TRACascaded("image", make_tra_policy("nnunet", num_groups=2), label_keys="label").set_random_state(0)
        >>> sample = {"image": torch.rand(1, 16, 16, 16), "label": torch.zeros(1, 16, 16, 16), "class_group": 1}
        >>> out = tra(sample)  # one op per series, drawn from group 1's probabilities
        >>> out["image"].shape, out["label"].shape, out["tra_ops"].shape
        (torch.Size([1, 16, 16, 16]), torch.Size([1, 16, 16, 16]), torch.Size([15]))
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
        counterfactuals: int = 0,
        cf_op_key: str = DEFAULT_CF_OP_KEY,
        exploration: str = "drawn",
        context: Sequence[int] | int = 0,
    ) -> None:
        MapTransform.__init__(self, keys, allow_missing_keys)
        try:
            self.context = as_context(context)
        except ValueError as err:
            raise ValueError(f"{type(self).__name__}: {err}") from None
        #: the catalogue of the policy's ops (``spec`` or ``split-signs``): what a drawn op index means
        self.series = _tra_series_of(policy, type(self).__name__)
        if int(counterfactuals) < 0:
            raise ValueError(f"counterfactuals must be >= 0, got {counterfactuals}")
        self.counterfactuals = int(counterfactuals)
        self.exploration = CF_EXPLORATIONS.key(exploration)  # an unknown name: an error listing the valid ones
        if self.exploration == "uniform" and self.counterfactuals % 2:
            raise ValueError(
                f"exploration 'uniform' makes the counterfactual copies in pairs: counterfactuals must be even, "
                f"got {counterfactuals}"
            )
        self.cf_op_key = cf_op_key
        # every non-identity op of every series as (series, op): the copies draw uniformly from this list
        self._explorable = [(s, j) for s, series in enumerate(self.series) for j in range(1, series.size)]
        self.policy = policy
        self.label_keys = [label_keys] if isinstance(label_keys, str) else list(label_keys)
        self.group_key = group_key
        self.op_key = op_key
        if padding_mode not in PADDING_MODES:
            raise ValueError(
                f"{type(self).__name__}: padding_mode must be one of {PADDING_MODES}, got {padding_mode!r}"
            )
        self.padding_mode = padding_mode

    def randomize(self, data: Mapping) -> tuple[np.ndarray, TRAParams]:
        choices = self.policy.sample_ops(_group_of(data, self.group_key, self.policy), self.R)
        return choices, sample_tra_params(choices, self.R, self.series)

    def randomize_counterfactuals(self, choices: np.ndarray, params: TRAParams) -> list[tuple[int, int, TRAParams]]:
        """The K counterfactual copies: ``(series, op of the copy, its params)`` (see ``counterfactuals`` and
        ``exploration``)."""
        if self.exploration == "uniform":
            pairs = [self._uniform_pair(choices) for _ in range(self.counterfactuals // 2)]
            return [(s, j, replace_series_op(params, s, j, self.R, self.series)) for pair in pairs for s, j in pair]
        out = []
        for _ in range(self.counterfactuals):
            series, op = self._explorable[int(self.R.randint(len(self._explorable)))]
            if int(choices[series]) != 0:
                op = 0
            out.append((series, op, replace_series_op(params, series, op, self.R, self.series)))
        return out

    def _uniform_pair(self, choices: np.ndarray) -> list[tuple[int, int]]:
        """Two copies on one series (``exploration="uniform"``): an explored op other than the sample's own, and
        the identity there, or a second explored op where the sample drew the identity."""
        series, op = self._explorable[int(self.R.randint(len(self._explorable)))]
        own = int(choices[series])
        others = [j for j in range(1, self.series[series].size) if j not in (op, own)]
        if own != 0:
            if op == own and others:  # explore an op the sample did not draw
                op = others[int(self.R.randint(len(others)))]
            return [(series, 0), (series, op)]
        second = others[int(self.R.randint(len(others)))] if others else op
        return [(series, op), (series, second)]

    def __call__(self, data: Mapping, make_counterfactuals: bool | None = None) -> dict:
        """Augment one sample; ``make_counterfactuals=False`` draws its counterfactual copies (so the random stream
        goes on as with them) without making them or adding their keys: for samples no TRA update will score.
        ``None`` (default): as the enclosing :func:`making_counterfactuals` says, else make them."""
        if make_counterfactuals is None:
            make_counterfactuals = _MAKE_COUNTERFACTUALS.get()
        d = dict(data)
        choices, params = self.randomize(d)
        images = {k: d[k] for k in self.key_iterator(d)}
        label_keys = [k for k in self.label_keys if k in d or not self.allow_missing_keys]
        missing = [k for k in label_keys if k not in d]
        if missing:
            raise KeyError(f"TRACascaded: label key(s) {missing} not in data (keys: {list(d)})")
        labels = {k: d[k] for k in label_keys}
        counterfactuals = self.randomize_counterfactuals(choices, params) if self.counterfactuals else []
        out_images, out_labels = apply_tra(images, labels, params, self.padding_mode, self.context)
        if counterfactuals and make_counterfactuals:
            copies = [apply_tra(images, labels, p, self.padding_mode, self.context) for _, _, p in counterfactuals]
            for k in (*out_images, *out_labels):
                # plain tensors: some intensity ops return MetaTensors, and a batch must not mix the two types
                d[k + COUNTERFACTUAL_SUFFIX] = torch.stack([_plain({**ci, **cl}[k]) for ci, cl in copies])
            d[self.cf_op_key] = torch.tensor([[s, j] for s, j, _ in counterfactuals], dtype=torch.long)
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
        context: voxels per side by which the batch's patches extend beyond the patch (as :class:`TRACascaded`'s):
            the outputs are the centred patches.
        counterfactuals: K copies of every sample for the paired TRA estimator, as :class:`TRACascaded` makes
            them (``key + "_cf"``: ``[B, K, C, X, Y, Z]``; ``cf_op_key``: ``[B, K, 2]``); all B x K copies are
            augmented by the same batched calls, drawn after the B samples' own ops.
        cf_op_key: where the counterfactual (series, op) pairs are stored.
        exploration: how the copies choose what they change (as :class:`TRACascaded`'s).
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
        counterfactuals: int = 0,
        cf_op_key: str = DEFAULT_CF_OP_KEY,
        exploration: str = "drawn",
        context: Sequence[int] | int = 0,
    ) -> None:
        super().__init__(
            keys, policy, label_keys, group_key, op_key, padding_mode, allow_missing_keys, counterfactuals, cf_op_key,
            exploration, context,
        )  # fmt: skip
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
            params.append(sample_tra_params(c, self.R, self.series))
        return np.stack(choices) if choices else np.zeros((0, len(self.series)), np.int64), params

    def __call__(self, data: Mapping, make_counterfactuals: bool | None = None) -> dict:
        """Augment a batch; ``make_counterfactuals=False`` draws the copies without making them (see
        :meth:`TRACascaded.__call__`): :class:`jcsaug.engine.DeviceAugmentation` passes it for the batches of
        iterations without a TRA update."""
        if make_counterfactuals is None:
            make_counterfactuals = _MAKE_COUNTERFACTUALS.get()
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
            if self.allow_missing_keys:
                return d
            raise KeyError(f"BatchTRACascaded: none of the keys {list(self.keys)} is in the batch (keys: {list(d)})")
        batch = int(d[(image_keys + labels)[0]].shape[0])
        choices, params = self.randomize(self._groups(d, batch))

        def to_device(x: torch.Tensor) -> torch.Tensor:
            return x if self.device is None else x.to(self.device, non_blocking=True)

        images, label_tensors = {k: to_device(d[k]) for k in image_keys}, {k: to_device(d[k]) for k in labels}
        # drawn after all samples' own draws (the samples are drawn as without copies), and drawn even when not made
        # (the random stream goes on as with them)
        copies = [self.randomize_counterfactuals(c, p) for c, p in zip(choices, params)] if self.counterfactuals else []
        if self.counterfactuals and make_counterfactuals:
            k = self.counterfactuals
            cf_images, cf_labels = apply_tra_batch(
                {key: x.repeat_interleave(k, dim=0) for key, x in images.items()},
                {key: x.repeat_interleave(k, dim=0) for key, x in label_tensors.items()},
                [p for sample in copies for _, _, p in sample], self.padding_mode, self.context,
            )  # fmt: skip
            for key, x in {**cf_images, **cf_labels}.items():
                d[key + COUNTERFACTUAL_SUFFIX] = _plain(x).reshape(batch, k, *x.shape[1:])
            d[self.cf_op_key] = torch.tensor([[[s, j] for s, j, _ in sample] for sample in copies], dtype=torch.long)
        out_images, out_labels = apply_tra_batch(images, label_tensors, params, self.padding_mode, self.context)
        for key, v in {**out_images, **out_labels}.items():
            d[key] = _rewrap(v, d[key])
        d[self.op_key] = torch.as_tensor(choices, dtype=torch.long)
        return d
