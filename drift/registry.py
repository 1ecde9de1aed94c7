"""One registry per deployment axis: a name -> entry table that is the only place an entry's facts
live (store dtypes, layouts, profiles, flows, verify kernels, checks).

A :class:`Registry` keeps insertion order (the order tables and ``--help`` list them), rejects a
second entry under a taken name, and answers an unknown name with a :class:`ConfigError` that lists
the choices. :meth:`Registry.temporary` adds entries for the length of a ``with`` block -- how a
test (or a user's extension) registers a toy entry from outside the package without leaving it
behind (docs/extending.md).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Generic, Iterator, TypeVar

from .errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """Named entries of one axis (``what`` names the axis in messages: "profile", "flow" ...)."""

    def __init__(self, what: str):
        self.what = what
        self._entries: Dict[str, T] = {}

    def register(self, name: str, entry: T) -> T:
        """Add ``entry`` under ``name``; a taken name is a programming error (ValueError)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.what} needs a non-empty string name, got {name!r}")
        if name in self._entries:
            raise ValueError(f"{self.what} {name!r} is already registered")
        self._entries[name] = entry
        return entry

    def unregister(self, name: str) -> None:
        self._entries.pop(name, None)

    def __getitem__(self, name: str) -> T:
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise ConfigError(f"{self.what} {name!r} is not known; allowed: {', '.join(self._entries)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def items(self):
        return list(self._entries.items())

    def values(self):
        return list(self._entries.values())

    @contextmanager
    def temporary(self, name: str, entry: T) -> Iterator[T]:
        """``entry`` registered under ``name`` inside the block, removed after it."""
        self.register(name, entry)
        try:
            yield entry
        finally:
            self.unregister(name)
