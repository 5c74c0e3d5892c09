"""``mesh.heap.settle``: what survives is frozen (the collector's full passes skip it), and what a later
settle finds dead among frozen objects, cycles included, is freed rather than held for ever."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator

import pytest

from mesh.heap import Settler, settle

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
    settle("a load")
    assert ref() is not None  # a plain settle walks only what is not frozen yet
    settle("an unload", thaw=True)
    assert ref() is None  # a thawing settle collects everything and freezes again: the dead cycle is gone


def test_garbage_made_before_settle_is_collected_not_frozen() -> None:
    node = _Node()
    ref = weakref.ref(node)
    del node
    settle("a test")
    assert ref() is None


async def test_a_burst_of_unloads_is_one_thaw_after_quiet() -> None:
    settler = Settler(quiet_s=0.2)
    node = _Node()
    ref = weakref.ref(node)
    settler.loaded("a load")
    del node
    for _ in range(3):  # unload, load, unload, ...: one burst
        settler.unloaded()
        settler.loaded("the next load")
        await asyncio.sleep(0.05)
    assert settler.owed and settler.thaws == 0 and ref() is not None
    await asyncio.sleep(0.4)
    assert not settler.owed and settler.thaws == 1 and ref() is None


async def test_closing_a_settler_cancels_the_thaw_it_owes() -> None:
    settler = Settler(quiet_s=0.05)
    settler.unloaded()
    settler.close()
    await asyncio.sleep(0.15)
    assert settler.thaws == 0 and not settler.owed


async def test_a_thaw_waits_for_a_moment_without_queries() -> None:
    busy = [True]
    settler = Settler(quiet_s=0.05, idle_s=lambda: 0.0 if busy[0] else 5.0, idle_need_s=0.1)
    settler.unloaded()
    await asyncio.sleep(0.4)
    assert settler.owed and settler.thaws == 0 and settler.deferred >= 1  # queries served: not paid yet
    busy[0] = False
    await asyncio.sleep(0.3)
    assert not settler.owed and settler.thaws == 1
    settler.close()


async def test_a_thaw_is_deferred_at_most_max_defer_s() -> None:
    settler = Settler(quiet_s=0.05, idle_s=lambda: 0.0, idle_need_s=0.1, max_defer_s=0.2)
    settler.unloaded()
    await asyncio.sleep(0.6)  # a host that never goes quiet still pays it, once
    assert not settler.owed and settler.thaws == 1
    settler.close()
