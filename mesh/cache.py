"""The one bounded cache the hot paths use: a dict that starts over when it is full.

Why this shape and not an LRU: every cache on a hot path here is keyed by a handful of values that
repeat for the life of a process (an SLO, a tensor layout, a request plan, a tenant's accuracy
floor, a topology). A flood of distinct keys means a misbehaving caller, not a working set to
keep: starting over costs one miss per key, while an LRU's bookkeeping would cost something on
every hit. The bound is what keeps such a caller from growing the process's memory without limit.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["BoundedCache"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class BoundedCache(Generic[K, V]):
    __slots__ = ("_data", "get", "maxsize", "resets")

    get: Callable[[K], V | None]
    """The value kept for ``key``, or None. It is the dict's own ``get``, bound once: a lookup on a hot
    path costs no Python call. The dict is emptied in place, never replaced, so the binding stays true."""

    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be at least 1, not {maxsize}")
        self.maxsize = maxsize
        self.resets = 0  # how often it started over: a number to watch, not to tune by
        self._data: dict[K, V] = {}
        self.get = self._data.get

    def put(self, key: K, value: V) -> V:
        data = self._data
        if len(data) >= self.maxsize and key not in data:
            data.clear()
            self.resets += 1
        data[key] = value
        return value

    def get_or_make(self, key: K, make: Callable[[], V]) -> V:
        found = self._data.get(key)
        if found is None:
            found = self.put(key, make())
        return found

    def clear(self) -> None:
        self._data.clear()

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data
