"""``Readiness.wait_quiet`` (what ``tiermesh up`` waits for after placement, and after its warm-up): it returns
once no site's live record says it is loading, owes a heap thaw (``settling``) or has variants left to profile,
and names the sites still busy when its bound runs out. Against a real etcd, with the records an agent writes."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from core_scheduler.state.heartbeat import Heartbeat, LoadedVariant
from mesh.etcd.keys import live_key
from mesh.etcd.store import Store
from tiermesh.readiness import Readiness

pytestmark = pytest.mark.integration


class _Mesh(Readiness):
    def __init__(self, store: Store, names: list[str]) -> None:
        self.store, self.catalog, self.sites, self._names = store, None, {}, names

    def running_sites(self) -> list[str]:
        return list(self._names)


async def _live(store: Store, site: str, **kw: Any) -> None:
    await store.put(live_key(site), Heartbeat(site=site, **kw).to_json())


async def test_wait_quiet_returns_when_every_site_is_quiet(store: Store) -> None:
    await _live(store, "edge-a")
    await _live(store, "edge-b")
    assert await _Mesh(store, ["edge-a", "edge-b"]).wait_quiet(timeout=5) == []


async def test_wait_quiet_waits_for_a_thaw_and_a_profile_then_returns(store: Store) -> None:
    await _live(store, "edge-a", settling=True)
    await _live(store, "edge-b", profiling_pending=2)
    mesh = _Mesh(store, ["edge-a", "edge-b"])

    async def settle_later() -> None:
        await asyncio.sleep(0.6)
        await _live(store, "edge-a")
        await _live(store, "edge-b")

    later = asyncio.create_task(settle_later())
    t0 = time.monotonic()
    try:
        assert await mesh.wait_quiet(timeout=10) == []
        assert time.monotonic() - t0 >= 0.5  # it waited for both records to say quiet
    finally:
        await later


async def test_wait_quiet_names_the_sites_still_busy_when_its_bound_runs_out(store: Store) -> None:
    await _live(store, "edge-a", settling=True)
    await _live(store, "edge-b")
    # a site with no live record is not quiet either: it has not said what it is doing
    assert await _Mesh(store, ["edge-a", "edge-b", "edge-gone"]).wait_quiet(timeout=0.5) == ["edge-a", "edge-gone"]


@pytest.mark.parametrize("bad", [{"settling": "false"}, {"profiling_pending": "x"}, {"profiling_pending": -3},
                                 {"settling": {"a": {"b": [1]}}}, {"profiling_pending": 10**40},
                                 ["not", "an", "object"]])
async def test_a_record_that_does_not_parse_is_not_quiet_and_does_not_crash_the_wait(store: Store, bad: Any) -> None:
    value = {**Heartbeat(site="edge-a").to_json(), **bad} if isinstance(bad, dict) else bad
    await store.put(live_key("edge-a"), value)
    assert await _Mesh(store, ["edge-a"]).wait_quiet(timeout=0.4) == ["edge-a"]
    assert await _Mesh(store, ["edge-a"]).wait_profiled(timeout=0.4) == {"edge-a": -1}


@pytest.mark.parametrize("bad", [{"variants": "x"}, {"variants": [{"task": 1}]}, [1, 2], {"variants": None}])
async def test_a_placement_that_does_not_decode_is_waited_on_not_a_crash(store: Store, bad: Any) -> None:
    await _live(store, "edge-a")
    await store.put("placement/edge-a", bad)
    mesh = _Mesh(store, ["edge-a"])
    t0 = time.monotonic()
    await mesh.wait_placed(timeout=0.4)  # counted as pending until its bound, as a missing placement is
    assert time.monotonic() - t0 >= 0.35
    await store.put("placement/edge-a", {"variants": [{"task": "t", "variant_id": "v"}]})
    await _live(store, "edge-a", loaded={"v": LoadedVariant(task="t")})
    t0 = time.monotonic()
    await mesh.wait_placed(timeout=5)
    assert time.monotonic() - t0 < 4  # and a good one is seen at once
