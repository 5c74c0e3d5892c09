"""``mesh.heap.settle``: what survives is frozen (the collector's full passes skip it), and what a later
settle finds dead among frozen objects, cycles included, is freed rather than held for ever."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from mesh.heap import settle

pytestmark = pytest.mark.unit


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


@pytest.fixture(autouse=True)
def _thawed() -> Iterator[None]:
    yield
    gc.unfreeze()  # leave the test process's heap as it found it


def test_settle_freezes_what_is_alive_and_frees_frozen_cycles_on_the_next_settle() -> None:
    node = _Node()
    ref = weakref.ref(node)
    frozen = settle("a test")
    assert frozen > 0 and gc.get_freeze_count() == frozen
    del node
    gc.collect()
    assert ref() is not None  # frozen: a full collection does not walk it
    settle("an unload")
    assert ref() is None  # the next settle thaws, collects and freezes again: the dead cycle is gone


def test_garbage_made_before_settle_is_collected_not_frozen() -> None:
    node = _Node()
    ref = weakref.ref(node)
    del node
    settle("a test")
    assert ref() is None
