"""Small helpers for bundle configs."""

from __future__ import annotations

__all__ = ["as_flag"]

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
