"""Input checks for the data pipelines: readable files, finite images, consistent image/label pairs.

* :class:`SafeLoadImaged` is MONAI's ``LoadImaged`` whose reader errors (corrupted gzip, truncated or
  foreign file, missing file) become ``ValueError("cannot read <file>: <reason>")``.
* :class:`CheckFinited` refuses an image holding NaN/Inf (a ``ValueError`` naming the key, the case and
  the number of bad voxels), or with ``clean=True`` sets those voxels to ``fill`` (0) with a warning.
  Put it right after loading: a single NaN would otherwise reach the losses and the policies.
* :class:`CheckImageLabeld` refuses a case whose image and label do not go together: not 3D, another number of
  image channels, different shapes or affines, label values that are not integers in ``[0, num_classes)``. Put it
  after ``EnsureChannelFirstd`` and before any resampling or dtype cast (a uint8 cast turns 256 into 0).
* :func:`pair_problems` is the geometry part of those checks, shared with :func:`jcsaug.engine.preflight`, which
  runs it on the NIfTI headers of every split before training.
"""

from __future__ import annotations

import gzip
import warnings
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from monai.config import KeysCollection
from monai.data import MetaTensor
from monai.transforms import LoadImaged, MapTransform

UNKNOWN_CASE = "<unknown case>"


def case_name(data: Mapping, key: Hashable, case_key: str | None = None) -> str:
    """A name for the case of ``data[key]``: its source file (MetaTensor meta or ``<key>_meta_dict``),
    else ``data[case_key]``, else :data:`UNKNOWN_CASE`."""
    value = data.get(key)
    sources = []
    if isinstance(value, MetaTensor):
        sources.append(value.meta)
    meta_dict = data.get(f"{key}_meta_dict")
    if isinstance(meta_dict, Mapping):
        sources.append(meta_dict)
    for meta in sources:
        name = meta.get("filename_or_obj")
        if isinstance(name, (str, Path)) and str(name):
            return str(name)
    if case_key is not None and case_key in data:
        return str(data[case_key])
    return UNKNOWN_CASE


class CheckFinited(MapTransform):
    """Refuse (or clean) images with NaN/Inf voxels.

    Args:
        keys: the keys to check (integer arrays are always finite and pass).
        allow_missing_keys: skip absent keys.
        clean: instead of raising, set the non-finite voxels to ``fill`` and warn once per case.
        fill: the value of cleaned voxels (default 0: the background of a z-scored image). NaN and
            ±Inf are all replaced by it: no "nearest finite value" guess is made.
        case_key: entry naming the case when the image carries no file name (e.g. ``"case"``).

    Raises:
        ValueError: ``"<key> of case <case>: N NaN and M Inf voxels ..."`` when ``clean`` is false.
    """

    def __init__(
        self,
        keys: KeysCollection,
        allow_missing_keys: bool = False,
        clean: bool = False,
        fill: float = 0.0,
        case_key: str | None = "case",
    ) -> None:
        super().__init__(keys, allow_missing_keys)
        self.clean = clean
        self.fill = float(fill)
        self.case_key = case_key
        self._warned: set[str] = set()

    def __call__(self, data: Mapping) -> dict:
        d = dict(data)
        for key in self.key_iterator(d):
            value = d[key]
            if isinstance(value, np.ndarray):
                x = torch.from_numpy(value)
            elif isinstance(value, torch.Tensor):
                x = value.as_tensor() if isinstance(value, MetaTensor) else value
            else:
                x = torch.as_tensor(np.asarray(value))
            if not (x.is_floating_point() or x.is_complex()):
                continue
            finite = torch.isfinite(x)
            if bool(finite.all()):
                continue
            n_nan = int(torch.isnan(x).sum())
            n_inf = int(torch.isinf(x).sum())
            case = case_name(d, key, self.case_key)
            what = f"{n_nan} NaN and {n_inf} Inf voxels (of {x.numel()})"
            if not self.clean:
                raise ValueError(
                    f"{key!r} of case {case}: {what}; fix the file or use CheckFinited(clean=True) "
                    f"to set them to {self.fill:g}"
                )
            if case not in self._warned:
                self._warned.add(case)
                warnings.warn(f"{key!r} of case {case}: {what} set to {self.fill:g}", stacklevel=2)
            if isinstance(value, np.ndarray):
                d[key] = np.where(np.isfinite(value), value, np.asarray(self.fill, dtype=value.dtype))
            else:
                d[key] = torch.where(finite, value, torch.as_tensor(self.fill, dtype=value.dtype))
        return d


class _NamingLoader:
    """Wraps a ``LoadImage``: any error of one call becomes ``ValueError("cannot read <file>: ...")``."""

    def __init__(self, loader) -> None:
        self._inner = loader

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __call__(self, filename, reader=None):
        try:
            for name in _paths(filename):
                _verify_gzip(name)
            return self._inner(filename, reader)
        except Exception as err:  # noqa: BLE001 - readers raise anything (OSError, EOFError, gzip, nibabel...)
            raise ValueError(f"cannot read {filename}: {describe_error(err)}") from err


def _paths(filename) -> list[str]:
    return [str(f) for f in filename] if isinstance(filename, (list, tuple)) else [str(filename)]


def _verify_gzip(path: str, chunk: int = 1 << 22) -> None:
    """Read a ``.gz`` file to its end: gzip then checks the stream end, CRC and length.

    nibabel stops reading once it has the voxels, so a file that lost only its gzip trailer would load
    unnoticed; this costs one extra streamed decompression per load (use a ``CacheDataset``)."""
    if path.endswith(".gz"):
        with gzip.open(path, "rb") as f:
            while f.read(chunk):
                pass


def describe_error(err: BaseException) -> str:
    """The innermost, most specific cause of a reader error, in one line."""
    while err.__cause__ is not None or (err.__context__ is not None and not err.__suppress_context__):
        err = err.__cause__ or err.__context__
    text = " ".join(str(err).split())
    if len(text) > 300:
        text = text[:300] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


class SafeLoadImaged(LoadImaged):
    """MONAI's ``LoadImaged`` (same arguments) naming the file in every reading error.

    A missing file, a corrupted gzip, a truncated NIfTI or a file no reader understands raises
    ``ValueError("cannot read <file>: <reason>")`` (the original error is chained).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._loader = _NamingLoader(self._loader)


def pair_problems(
    shapes: Mapping[str, Sequence[int]],
    affines: Mapping[str, np.ndarray | None],
    channels: Mapping[str, int],
    image_key: str = "image",
    spatial_dims: int = 3,
    image_channels: int | None = 1,
    affine_atol: float = 1e-3,
) -> list[str]:
    """What is wrong with the geometry of one case (``[]``: nothing), each problem naming the values found.

    Args:
        shapes: key -> spatial shape; affines: key -> 4x4 affine (``None``: unknown); channels: key -> channels.
        image_key: the key whose geometry the others must match (must be in ``shapes``).
        spatial_dims: the spatial dimensions every key must have.
        image_channels: channels of the image (``None``: any); every other key must have one channel.
        affine_atol: tolerance of the affine comparison, in mm.
    """
    problems = []
    for key, shape in shapes.items():
        if len(shape) != spatial_dims:
            problems.append(f"{key} is {len(shape)}D (spatial shape {tuple(shape)}), {spatial_dims}D is needed")
    for key, n in channels.items():
        expected = image_channels if key == image_key else 1
        if expected is not None and n != expected:
            problems.append(f"{key} has {n} channels (a 4D file?), {expected} expected")
    if problems:
        return problems
    reference = tuple(shapes[image_key])
    for key, shape in shapes.items():
        if key != image_key and tuple(shape) != reference:
            problems.append(f"{image_key} shape {reference} and {key} shape {tuple(shape)} differ")
    ref_affine = affines.get(image_key)
    for key, affine in affines.items():
        if key == image_key or affine is None or ref_affine is None:
            continue
        a, b = np.asarray(ref_affine, dtype=np.float64), np.asarray(affine, dtype=np.float64)
        if a.shape != b.shape or not np.allclose(a, b, rtol=1e-5, atol=affine_atol):
            problems.append(
                f"{image_key} and {key} affines differ (tolerance {affine_atol:g} mm): {image_key} "
                f"{np.round(a, 4).tolist()}, {key} {np.round(b, 4).tolist()}"
            )
    return problems


def label_value_problems(label: np.ndarray | torch.Tensor, num_classes: int, key: str = "label") -> list[str]:
    """What is wrong with the values of the label map ``key`` (``[]``: nothing): NaN/Inf, non-integers, or outside
    ``[0, num_classes)``."""
    x = (
        label.as_tensor()
        if isinstance(label, MetaTensor)
        else torch.as_tensor(np.asarray(label) if isinstance(label, np.ndarray) else label)
    )
    if x.is_floating_point():
        bad = int((~torch.isfinite(x)).sum())
        if bad:  # NaN compares false with everything below, and a later cast to uint8 would make it background
            return [f"{key} has {bad} NaN/Inf voxels"]
        off = x[(x - x.round()).abs() > 1e-3]
        if off.numel():
            return [f"{key} has non-integer values, e.g. {sorted(set(off.flatten()[:1000].tolist()))[:5]}"]
    if x.numel() == 0:
        return []
    lo, hi = x.min(), x.max()
    if lo < 0 or hi >= num_classes:
        bad = torch.unique(x[(x < 0) | (x >= num_classes)])
        values = [int(v) if float(v).is_integer() else float(v) for v in bad[:10].tolist()]
        return [f"{key} values {values} are not classes 0..{num_classes - 1} (num_classes {num_classes})"]
    return []


class CheckImageLabeld(MapTransform):
    """Refuse a case whose image and label do not go together (a ``ValueError`` naming the case and the values).

    Checks, on channel-first arrays (after ``EnsureChannelFirstd``): every key is ``spatial_dims``-D; the image has
    ``image_channels`` channels and the others one; all keys have the image's spatial shape and (MetaTensors) its
    affine within ``affine_atol`` mm; with ``num_classes``, the label values are integers in ``[0, num_classes)``.

    Args:
        keys: the keys to check together; the first is the image (default ``("image", "label")``).
        label_key: the key of the label map (its values are checked); ``None``: no value check.
        num_classes: number of classes including background (``None``: label values not checked).
        spatial_dims: spatial dimensions of every key.
        image_channels: channels of the image (``None``: any number).
        affine_atol: tolerance of the affine comparison, in mm.
        allow_missing_keys: skip absent keys (a case without label passes the label checks).
    """

    def __init__(
        self,
        keys: KeysCollection = ("image", "label"),
        label_key: str | None = "label",
        num_classes: int | None = None,
        spatial_dims: int = 3,
        image_channels: int | None = 1,
        affine_atol: float = 1e-3,
        allow_missing_keys: bool = False,
    ) -> None:
        super().__init__(keys, allow_missing_keys)
        self.label_key = label_key
        self.num_classes = None if num_classes is None else int(num_classes)
        self.spatial_dims = int(spatial_dims)
        self.image_channels = image_channels
        self.affine_atol = float(affine_atol)

    def __call__(self, data: Mapping) -> Mapping:
        keys = list(self.key_iterator(data))
        if not keys:
            return data
        image_key = self.keys[0] if self.keys[0] in keys else keys[0]
        shapes, affines, channels = {}, {}, {}
        for key in keys:
            value = data[key]
            shape = tuple(value.shape)
            channels[key], shapes[key] = (shape[0], shape[1:]) if len(shape) > 1 else (1, shape)
            affine = getattr(value, "affine", None) if isinstance(value, MetaTensor) else None
            affines[key] = None if affine is None else np.asarray(affine)
        case = case_name(data, image_key)
        problems = pair_problems(
            shapes, affines, channels, image_key, self.spatial_dims, self.image_channels, self.affine_atol
        )
        if not problems and self.num_classes is not None and self.label_key in keys:
            problems = label_value_problems(data[self.label_key], self.num_classes, str(self.label_key))
        if problems:
            files = {case_name(data, k) for k in keys} - {UNKNOWN_CASE}
            others = sorted(files - {case})
            also = f" (with {', '.join(others)})" if others else ""
            raise ValueError(f"case {case}{also}: " + "; ".join(problems))
        return data
