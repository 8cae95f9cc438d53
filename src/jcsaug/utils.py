"""Small helpers shared across the package: command-line flags and atomic file writes."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["as_flag", "atomic_write"]

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


def atomic_write(path: str | Path, write: Callable[[Path], object], suffix: str = ".tmp") -> Path:
    """Write ``path`` through ``write(temporary_path)`` and a rename, so it is never half-written.

    The temporary file sits in the same folder and ends in ``suffix`` (e.g. ``.nii.gz`` for nibabel, ``.npy``
    for ``np.save``, which pick the format from the name); it is removed if ``write`` fails.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
