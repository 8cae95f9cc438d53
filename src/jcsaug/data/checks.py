"""Input checks for the data pipelines: readable files, finite images.

* :class:`SafeLoadImaged` is MONAI's ``LoadImaged`` whose reader errors (corrupted gzip, truncated or
  foreign file, missing file) become ``ValueError("cannot read <file>: <reason>")``.
* :class:`CheckFinited` refuses an image holding NaN/Inf (a ``ValueError`` naming the key, the case and
  the number of bad voxels), or with ``clean=True`` sets those voxels to ``fill`` (0) with a warning.
  Put it right after loading: a single NaN would otherwise reach the losses and the policies.
"""

from __future__ import annotations

import gzip
import warnings
from collections.abc import Hashable, Mapping
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
            raise ValueError(f"cannot read {filename}: {_reason(err)}") from err


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


def _reason(err: BaseException) -> str:
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
