"""Small helpers shared across the package: command-line flags, the one atomic file write, a wrapper's length."""

from __future__ import annotations

import os
import sys
import tempfile
import warnings
from collections.abc import Callable, Sized
from pathlib import Path
from typing import TYPE_CHECKING

import ignite
import monai
import torch
from torch.utils.data import DistributedSampler

if TYPE_CHECKING:
    from ignite.engine import Engine

__all__ = [
    "WrappedSamplerEpoch",
    "as_flag",
    "as_share",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_text",
    "file_mode",
    "wrapped_len",
]

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0", "", "none"}


def as_flag(value: object) -> bool:
    """A command-line flag as a bool: ``--resume false`` reaches a bundle as the *string* ``'false'`` (fire only
    parses ``True``/``False``), which Python would read as true. Accepts bools, numbers and true/false/yes/no/
    on/off/1/0 in any case; anything else is an error naming the value."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    if value is None:
        return False
    raise ValueError(f"expected a true/false flag, got {value!r}")


def as_share(value: object) -> float:
    """A flag or a share as a number in ``[0, 1]``: true is 1, false 0 (as :func:`as_flag` reads them), a number or
    a numeric string in ``[0, 1]`` itself; anything else is an error naming the value."""
    try:
        return float(as_flag(value))
    except ValueError:
        pass
    try:
        share = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        share = float("nan")
    if not 0.0 <= share <= 1.0:  # NaN fails too
        raise ValueError(f"expected true, false or a share in [0, 1], got {value!r}")
    return share


def wrapped_len(wrapped: object) -> int:
    """The length of what a sampler wrapper wraps, for its ``__len__``; a clear error when it has none."""
    if not isinstance(wrapped, Sized):
        raise TypeError(f"{type(wrapped).__name__} has no len()")
    return len(wrapped)


# The packages a loop over a loader runs through before it reaches the user's code: a warning raised while the
# loader draws its indices is shown at the first frame outside them.
_LIBRARY_FOLDERS = tuple(
    str(Path(file).parent) + os.sep for file in (ignite.__file__, monai.__file__, torch.__file__, __file__)
)


def stacklevel_outside_libraries() -> int:
    """The ``stacklevel`` that makes ``warnings.warn``, called by the caller of this function, point at the first
    frame outside jcsaug, torch, MONAI and Ignite (the user's loop or ``trainer.run()``). Written by hand: Python
    3.12's ``skip_file_prefixes`` does this, and jcsaug supports 3.10. On a thread with no such frame (a loader's
    buffer thread), the outermost frame."""
    frame = sys._getframe(1)  # the function that will call warnings.warn: stacklevel 1
    level = 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_LIBRARY_FOLDERS):
        frame = frame.f_back
        level += 1
    return level


class WrappedSamplerEpoch:
    """The epoch of a sampler inside a sampler wrapper, called with it at the start of each iteration over it.

    MONAI's trainer sets the epoch only of a ``DistributedSampler`` it finds as the loader's ``sampler``, not of one a
    wrapper hides. Attached to an engine, the wrapper passes the engine's epoch on (to a sampler with ``set_epoch``).
    Not attached, a shuffling ``DistributedSampler`` iterated again at the epoch of its last iteration is warned of:
    nothing gave it the next epoch, so the order repeats."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._last: int | None = None

    def __call__(self, sampler: object, engine: Engine | None) -> None:
        if engine is not None:
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(engine.state.epoch)
            return
        if not isinstance(sampler, DistributedSampler) or not sampler.shuffle:
            return
        if self._last == sampler.epoch:
            warnings.warn(
                f"{self.owner}: the wrapped DistributedSampler is iterated again at epoch {sampler.epoch}, so this "
                f"epoch repeats the last one's order; attach the {self.owner} to the trainer (MONAI's trainer sets "
                "the epoch only of a DistributedSampler it sees) or call its set_epoch before each epoch",
                RuntimeWarning,
                stacklevel=stacklevel_outside_libraries(),
            )
        self._last = sampler.epoch


def file_mode() -> int:
    """The mode a new file gets from the process umask (``0o666 & ~umask``, e.g. 0o644), as ``open`` would give it.

    ``tempfile.mkstemp`` creates files with 0o600 whatever the umask; files written through it are given this mode.
    """
    umask = os.umask(0o022)  # the only portable way to read the umask is to set it; restored at once
    os.umask(umask)
    return 0o666 & ~umask


def _fsync_directory(folder: Path) -> None:
    """Make a rename in ``folder`` durable (not possible on every platform: then a no-op)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write: Callable[[Path], object], suffix: str = ".tmp") -> Path:
    """Write ``path`` through ``write(temporary_path)``, ``fsync`` and a rename, so it is never half-written.

    The one way jcsaug writes a file: the temporary file sits in the same folder and ends in ``suffix`` (e.g.
    ``.nii.gz`` for nibabel, ``.npy`` for ``np.save``, which pick the format from the name); it is flushed to disk,
    given the umask's usual mode (:func:`file_mode`), renamed over ``path`` and the rename made durable. If
    ``write`` (or anything after it) fails, the temporary file is removed and ``path`` keeps its previous content.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(fd)
    try:
        write(Path(tmp))
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, file_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` with :func:`atomic_write`."""
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` with :func:`atomic_write`."""
    return atomic_write(path, lambda tmp: tmp.write_bytes(data))
