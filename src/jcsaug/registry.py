"""One registry pattern for everything chosen by name: networks, losses, hypergradient estimators, test-time
inferers, presets, tasks, modes and CLI commands.

Each domain keeps one :class:`Registry` and exposes the same three functions, as timm does for its models:
``register_<thing> = REGISTRY.register`` (also a decorator), ``get_<thing> = REGISTRY.get`` and
``list_<things> = REGISTRY.names``. An unknown name raises :class:`UnknownNameError` (a ``KeyError``) with one
message for every registry: what was asked for and the valid names.

>>> colours = Registry("colour")
>>> colours.register("red", (255, 0, 0))
(255, 0, 0)
>>> @colours.register("green")
... def green():
...     return (0, 255, 0)
>>> colours.names()
['green', 'red']
>>> colours.get("blue")
Traceback (most recent call last):
...
jcsaug.registry.UnknownNameError: unknown colour 'blue'; valid names: green, red
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar, overload

__all__ = ["Registry", "UnknownNameError"]

T = TypeVar("T")


class UnknownNameError(KeyError):
    """A name that is not in a registry; the message lists the valid names."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class Registry(Generic[T]):
    """Name -> object, in registration order.

    Args:
        kind: what the objects are, for error messages (``"network"``, ``"loss"`` ...).
        entries: initial entries.
        normalise: maps a name to its key (e.g. ``str.lower``), both when it is registered and when it is looked
            up, so that every spelling the registry lists is found; two names with the same key are one name. The
            names are listed (and ``key`` returns them) as they were registered.
    """

    def __init__(
        self, kind: str, entries: Mapping[str, T] | None = None, normalise: Callable[[str], str] | None = None
    ) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}  # normalised key -> object
        # normalised key -> the name as registered (listed, in error messages); read for the keys of _entries only
        self._names: dict[str, str] = {}
        self._normalise = normalise
        for name, obj in (entries or {}).items():
            self.register(name, obj)

    @overload
    def register(self, name: str, obj: T, *, overwrite: bool = False) -> T: ...

    @overload
    def register(self, name: str, obj: None = None, *, overwrite: bool = False) -> Callable[[T], T]: ...

    @overload
    def register(self, name: T, obj: None = None, *, overwrite: bool = False) -> T: ...

    def register(self, name, obj=None, *, overwrite=False):
        """Add ``obj`` under ``name`` and return it. Three forms: ``register("name", obj)``; ``register(obj)`` for an
        object that carries its ``name`` (a spec); ``@register("name")`` as a decorator.

        Registering a taken name is an error unless ``overwrite=True``.
        """
        if obj is None and not isinstance(name, str):
            name, obj = getattr(name, "name", None), name
        elif obj is None:
            return lambda target: self.register(name, target, overwrite=overwrite)
        key = self._normalised(name)
        if not isinstance(name, str) or not name or not key:
            raise ValueError(f"a {self.kind} name must be a non-empty string, got {name!r}")
        if key in self._entries and not overwrite:
            taken = self._names[key]
            also = "" if taken == name else f" (as {taken!r}, the same name once normalised)"
            raise ValueError(f"{self.kind} {name!r} is already registered{also} (pass overwrite=True to replace it)")
        self._entries[key] = obj
        self._names[key] = name
        return obj

    def _normalised(self, name: object) -> object:
        """The key ``name`` is stored under (``name`` itself for a non-string or a registry without ``normalise``)."""
        return self._normalise(name) if self._normalise is not None and isinstance(name, str) else name

    def _lookup(self, name: object) -> str:
        """The normalised key of ``name``; :class:`UnknownNameError` listing the valid names if none."""
        key = self._normalised(name)
        if not isinstance(key, str) or key not in self._entries:
            raise UnknownNameError(f"unknown {self.kind} {name!r}; valid names: {', '.join(self.names())}")
        return key

    def key(self, name: object) -> str:
        """The registered name ``name`` stands for (as it was registered); :class:`UnknownNameError` if none."""
        return self._names[self._lookup(name)]

    def get(self, name: object) -> T:
        """The object registered as ``name``; :class:`UnknownNameError` listing the valid names if none."""
        return self._entries[self._lookup(name)]

    def names(self) -> list[str]:
        """The registered names (as registered), sorted."""
        return sorted(self._names[key] for key in self._entries)

    def items(self) -> list[tuple[str, T]]:
        """``(registered name, object)`` in registration order."""
        return [(self._names[key], obj) for key, obj in self._entries.items()]

    def __contains__(self, name: object) -> bool:
        try:
            self._lookup(name)
        except UnknownNameError:
            return False
        return True

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __iter__(self) -> Iterator[str]:
        return iter([self._names[key] for key in self._entries])  # the registered names, in registration order

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
