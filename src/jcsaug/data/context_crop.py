"""Training patches with a context around them, for the TRA's scalings and rotations (the reference's enlarged crop).

A rotation or a zoom-out of a patch as cropped brings into view what lies outside it, and the patch has nothing
there: it fills with zeros (a 25 degree rotation empties 14 % of a 32³ patch, a zoom-out by 1.45 68 %). The
reference code transforms an enlarged crop instead. :class:`ContextCropd` takes the patches of any MONAI random
crop at the same centres with ``context`` voxels more on each side; :class:`jcsaug.policy.TRACascaded` (given the
same ``context``) resamples from the enlarged patch and returns the patch itself.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from copy import deepcopy

import numpy as np
import torch
import torch.nn.functional as F
from monai.data import MetaTensor
from monai.transforms import (
    Crop,
    MapTransform,
    Pad,
    RandCropByLabelClassesd,
    RandCropByPosNegLabeld,
    Randomizable,
    SpatialCrop,
)
from monai.utils import fall_back_tuple

from jcsaug.ops.tra import as_context


def crop_with_context(img: torch.Tensor, centre: Sequence[int], size: Sequence[int], fill: float = 0) -> torch.Tensor:
    """The ``size`` region of a channel-first ``img`` whose centre voxel (index ``size // 2``) is ``centre``, as
    MONAI's ``SpatialCrop(roi_center, roi_size)`` places it, with ``fill`` where it reaches beyond the volume.

    A ``MetaTensor`` goes through MONAI's ``SpatialCrop`` and ``Pad``, which track both steps in its metadata; a plain
    tensor (the bundles cache their volumes without metadata) stays plain: a slice, padded by ``torch``'s ``pad``.
    That skips MONAI's conversion of it to a ``MetaTensor`` and the bookkeeping of two steps no one reads, which
    took about half a bundle worker's time (3.7 ms of crop and pad per 68³ patch of a 48³ synthetic case)."""
    shape = img.shape[1:]
    start = [int(c) - int(s) // 2 for c, s in zip(centre, size)]
    end = [b + int(s) for b, s in zip(start, size)]
    inside_start = [max(0, b) for b in start]
    inside_end = [min(int(n), e) for n, e in zip(shape, end)]
    pads = [(i - b, e - j) for b, e, i, j in zip(start, end, inside_start, inside_end)]
    padded = any(lo or hi for lo, hi in pads)
    if not isinstance(img, MetaTensor):
        region = img[(slice(None), *(slice(i, j) for i, j in zip(inside_start, inside_end)))]
        if not padded:
            return region
        # F.pad takes the last axis first: (z_lo, z_hi, y_lo, y_hi, x_lo, x_hi)
        return F.pad(region, [p for lo_hi in reversed(pads) for p in lo_hi], mode="constant", value=fill)
    cropped = SpatialCrop(roi_start=inside_start, roi_end=inside_end)(img)
    if not padded:
        return cropped
    return Pad(to_pad=[(0, 0), *pads], mode="constant", value=fill)(cropped)


def _draw_by_label_classes(crop: RandCropByLabelClassesd, data: dict) -> None:
    crop.randomize(data.get(crop.label_key), data.pop(crop.indices_key, None), data.get(crop.image_key))


def _draw_by_pos_neg(crop: RandCropByPosNegLabeld, data: dict) -> None:
    fg_indices, bg_indices = data.pop(crop.fg_indices_key, None), data.pop(crop.bg_indices_key, None)
    crop.randomize(data.get(crop.label_key), fg_indices, bg_indices, data.get(crop.image_key))


# How each MONAI crop draws its centres alone: the same call, on the same entries of the data (an indices entry popped
# from it), as the crop's own __call__ makes before it cuts every key. MONAI has no public "draw only" step common to
# its crops, and the patches it would cut are cut again here with the context, so for plain tensors ContextCropd asks
# the crop only to draw: its cuts convert each volume to a MetaTensor and record the crop, a fifth of a worker's time.
CENTRE_DRAWERS: dict[type, Callable[[MapTransform, dict], None]] = {
    RandCropByLabelClassesd: _draw_by_label_classes,
    RandCropByPosNegLabeld: _draw_by_pos_neg,
}


def _patch_shape(spatial_shape: Sequence[int], centre: Sequence[int], size: Sequence[int] | int) -> list[int]:
    """The spatial shape of MONAI's ``SpatialCrop(roi_center=centre, roi_size=size)`` cut of a volume of that shape
    (``size`` falls back to the volume's where it is not positive, as the random crops' own cut does)."""
    size = fall_back_tuple(size, default=tuple(int(n) for n in spatial_shape))
    slices = Crop.compute_slices(roi_center=centre, roi_size=size)
    return [len(range(int(n))[cut]) for n, cut in zip(spatial_shape, slices)]


class ContextCropd(Randomizable, MapTransform):
    """The patches of a MONAI random crop, each with ``context`` voxels more on every side.

    ``crop`` draws the patch centres as it always does (e.g. ``RandCropByLabelClassesd``, ``RandCropByPosNegLabeld``:
    any dictionary crop whose ``cropper.centers`` holds the centres of its last call, moved as it moves them so the
    *patch* fits); each patch is then cut around the same centre voxel at ``spatial_size + 2 * context``, filled with
    ``fill`` where it reaches beyond the volume. The centre voxel, and so the class group read from it, is the
    patch's; the centred ``spatial_size`` region is the patch ``crop`` gives. ``context`` 0 returns ``crop``'s patches.

    For plain tensors and a crop of :data:`CENTRE_DRAWERS` (``RandCropByLabelClassesd``, ``RandCropByPosNegLabeld``)
    the crop only draws the centres, with the same draws, and each key is cut once; otherwise (a ``MetaTensor``, whose
    patches carry MONAI's record of the crop, or another crop) the crop cuts its patches and each is cut again.

    Args:
        crop: the MONAI dictionary random crop (its ``keys`` are cropped).
        context: voxels per side (one number, or one per axis), e.g. :func:`jcsaug.ops.tra.tra_context`.
        fill: value beyond the volume: one number, or a mapping key -> number (keys not in it: 0).

    Example::

        >>> import torch
        >>> from monai.transforms import RandCropByPosNegLabeld
        >>> crop = RandCropByPosNegLabeld(["image", "label"], "label", spatial_size=(8, 8, 8), num_samples=2)
        >>> label = torch.zeros(1, 20, 20, 20)
        >>> label[0, 8:12, 8:12, 8:12] = 1
        >>> enlarged = ContextCropd(crop, context=4).set_random_state(0)
        >>> patches = enlarged({"image": torch.rand(1, 20, 20, 20), "label": label})
        >>> [tuple(p["image"].shape) for p in patches]
        [(1, 16, 16, 16), (1, 16, 16, 16)]
    """

    def __init__(
        self,
        crop: MapTransform,
        context: Sequence[int] | int,
        fill: float | Mapping[Hashable, float] = 0,
    ) -> None:
        if not hasattr(getattr(crop, "cropper", None), "centers"):
            raise TypeError(
                f"ContextCropd needs a MONAI random crop that draws patch centres (cropper.centers, e.g. "
                f"RandCropByLabelClassesd or RandCropByPosNegLabeld), got {type(crop).__name__}"
            )
        MapTransform.__init__(self, crop.keys, crop.allow_missing_keys)
        self.crop = crop
        self.context = as_context(context)
        self.fill = fill

    def set_random_state(self, seed: int | None = None, state: np.random.RandomState | None = None):
        """Seed the wrapped crop (it makes every random draw): the same seed gives the same centres as without a
        context."""
        super().set_random_state(seed, state)
        self.crop.set_random_state(seed, state)
        return self

    def randomize(self, data: object = None) -> None:  # the wrapped crop draws
        pass

    def _fill(self, key: Hashable) -> float:
        return float(self.fill.get(key, 0)) if isinstance(self.fill, Mapping) else float(self.fill)

    def __call__(self, data: Mapping[Hashable, torch.Tensor]) -> list[dict]:
        if not any(self.context):
            return self.crop(data)
        drawer = CENTRE_DRAWERS.get(type(self.crop))
        if drawer is not None and not any(isinstance(data[key], MetaTensor) for key in self.key_iterator(data)):
            return self._cut_around_drawn_centres(drawer, data)
        # the wrapped crop's own patches give the centres as it corrects them and each patch's size; every key is then
        # cut again around the same centre: no MONAI crop cuts one size around centres corrected for another
        patches = self.crop(data)
        centres = self.crop.cropper.centers
        if centres is None or len(centres) != len(patches):
            raise RuntimeError(
                f"ContextCropd: {type(self.crop).__name__} gave {len(patches)} patches but "
                f"{0 if centres is None else len(centres)} centres"
            )
        centres = [[int(c) for c in centre] for centre in centres]
        for key in self.key_iterator(dict(data)):
            for patch, centre in zip(patches, centres):
                enlarged = [s + 2 * c for s, c in zip(patch[key].shape[1:], self.context)]  # the patch as cut
                patch[key] = crop_with_context(data[key], centre, enlarged, self._fill(key))
        return patches

    def _cut_around_drawn_centres(self, drawer: Callable[[MapTransform, dict], None], data: Mapping) -> list[dict]:
        """The patches of ``__call__`` for plain tensors and a crop of :data:`CENTRE_DRAWERS`, without the crop's cuts:
        it draws the centres (the same draws), and each key is cut once, around them. Entries that are not keys are
        deep-copied into every patch, as MONAI's crops do."""
        d = dict(data)
        drawer(self.crop, d)
        centres = self.crop.cropper.centers
        if centres is None:
            raise RuntimeError(f"ContextCropd: {type(self.crop).__name__} drew no patch centres")
        centres = [[int(c) for c in centre] for centre in centres]
        patches = [dict(d) for _ in centres]
        for key in set(d).difference(self.crop.keys):
            for patch in patches:
                patch[key] = deepcopy(d[key])
        for key in self.key_iterator(d):
            img, fill = d[key], self._fill(key)
            for patch, centre in zip(patches, centres):
                cut = _patch_shape(img.shape[1:], centre, self.crop.cropper.spatial_size)
                patch[key] = crop_with_context(img, centre, [s + 2 * c for s, c in zip(cut, self.context)], fill)
        return patches
