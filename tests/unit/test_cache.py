"""mesh.cache.BoundedCache: bounded, starts over when full, never holds more than its bound."""

from __future__ import annotations

import pytest

from mesh.cache import BoundedCache

pytestmark = pytest.mark.unit


def test_hits_and_misses() -> None:
    c: BoundedCache[str, int] = BoundedCache(4)
    assert c.get("a") is None
    assert c.put("a", 1) == 1 and c.get("a") == 1 and "a" in c
    calls: list[str] = []
    assert c.get_or_make("b", lambda: calls.append("b") or 2) == 2
    assert c.get_or_make("b", lambda: calls.append("b") or 3) == 2
    assert calls == ["b"]


def test_a_flood_of_keys_never_grows_it_past_the_bound() -> None:
    c: BoundedCache[int, int] = BoundedCache(8)
    for i in range(1000):
        c.put(i, i)
        assert len(c) <= 8
    assert c.resets == 124 and c.get(999) == 999


def test_overwriting_a_key_when_full_keeps_the_rest() -> None:
    c: BoundedCache[int, int] = BoundedCache(2)
    c.put(1, 1)
    c.put(2, 2)
    c.put(2, 20)
    assert (c.get(1), c.get(2), c.resets) == (1, 20, 0)


def test_bound_must_be_positive() -> None:
    with pytest.raises(ValueError, match="maxsize"):
        BoundedCache(0)
