"""Issue 29, item 1, on a real etcd: hostile bytes at the keys a site may write never stop a reader.

The store reads any bytes without raising (a value that is not strict JSON reads as something no reader takes for
a record); the watch pump hands any failure to its reader instead of dying silently; a view follows past a bad
value keeping that key's last good one, a reload that meets one keeps the view whole, a view started later starts,
and a follow that fails is restarted and catches up while the last good view stays in force.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import pytest

from core_scheduler.state.heartbeat import Heartbeat, LoadedVariant
from core_scheduler.state.scope import Scope
from core_scheduler.state.view import MeshView
from mesh.errors import StoreError
from mesh.etcd import messages as rpc
from mesh.etcd.keys import LIVE, PKI_SITES, catalog_key, live_key, site_cert_key
from mesh.etcd.ops import Put, chunk_ops
from mesh.etcd.store import Store
from tests.helpers.waiting import eventually
from tests.unit.test_hostile_values import HOSTILE, STRICT_JSON
from topology.schema import Hardware, Link, Site, Topology
from topology.store_io import desired_state
from variant_store.meta import LatencyStats, Profile, VariantMeta

pytestmark = pytest.mark.integration

_PEM = "-----BEGIN CERTIFICATE-----\nMIIBfake\n-----END CERTIFICATE-----"
_JSON = (dict, list, str, int, float, bool, type(None))


async def put_raw(store: Store, key: str, raw: bytes) -> int:
    """Write ``raw`` as it is (``Store.put`` writes JSON), as a site's own etcd client could."""
    req = rpc.PutRequest(key=store.prefix.encode() + key.encode(), value=raw)
    resp = await store.call(f"put {key!r}", lambda m, t: m.kv.Put(req, timeout=t))
    return int(resp.header.revision)


def _line(n: int) -> Topology:
    """A core ``c`` and a line of edges ``e000..``, each 1 ms further out."""
    hw = Hardware(cpu_cores=4, memory_mb=8192, price_per_hour=0.3)
    sites = {"c": Site("c", "core", "r", 0.0, 0.0, Hardware(cpu_cores=16, memory_mb=65536, price_per_hour=2.0))}
    sites.update({f"e{i:03d}": Site(f"e{i:03d}", "edge", "r", 0.0, 0.0, hw) for i in range(n)})
    links = [Link("c", "e000", 1.0, 100.0)] + [Link(f"e{i:03d}", f"e{i + 1:03d}", 1.0, 100.0) for i in range(n - 1)]
    return Topology(sites=sites, links=tuple(links))


def _meta() -> VariantMeta:
    prof = Profile(hardware_class="cpu", load_ms=5.0, latency={1: LatencyStats(1.0, 2.0)}, peak_memory_bytes=1 << 20)
    return VariantMeta(task="t", family="f", variant_id="t.v1", format="onnx", precision="fp32",
                       runtime="onnxruntime", blob_digest="ab" * 32, size_bytes=1 << 20, accuracy=0.97,
                       profiles={"cpu": prof})


def _beat(site: str, queue_ms: float = 1.0) -> dict[str, Any]:
    return Heartbeat(site=site, endpoint=f"tcp://{site}:1", capacity=4,
                     loaded={"t.v1": LoadedVariant(task="t", queue_ms=queue_ms)}).to_json()


async def _seed(store: Store, topo: Topology) -> None:
    ops = [Put(k, v) for k, v in desired_state(topo).items()] + [Put(catalog_key("t", "t.v1"), _meta().to_json())]
    for part in chunk_ops(ops):
        await store.txn([], part)


def _tasks_alive(view: MeshView) -> bool:
    tasks = [view._follow_task, *view._tasks]
    return all(t is not None and not t.done() for t in tasks)


def _held_at(view: MeshView, key: str) -> Any:
    return view.live.get("e001") if key.startswith("live/") else view.site_certs.get("e001")


# -- the store ------------------------------------------------------------------------------------------------------

async def test_hostile_bytes_are_read_without_raising_and_never_as_a_json_value(store: Store) -> None:
    async with store.watch_prefix("k/") as watch:
        for name, raw in HOSTILE.items():
            await put_raw(store, f"k/{name}", raw)
        seen: dict[str, Any] = {}
        async with asyncio.timeout(10):
            while len(seen) < len(HOSTILE):
                ev = await watch.__anext__()
                seen[ev.key] = ev.value
    read = {kv.key: kv.value for kv in await store.get_prefix("k/")}
    one = {name: kv.value for name in HOSTILE if (kv := await store.get(f"k/{name}")) is not None}
    for name in HOSTILE:
        for how, value in (("watch", seen[f"k/{name}"]), ("get_prefix", read[f"k/{name}"]), ("get", one[name])):
            if name in STRICT_JSON:
                assert value == json.loads(HOSTILE[name]), f"{name} read by {how}"
            else:
                assert not isinstance(value, _JSON), f"{name} read by {how} as a JSON value: {str(value)[:80]}"


async def test_a_key_a_site_writes_is_refused_unread_past_its_limit(store: Store) -> None:
    """A heartbeat or a certificate is a few KiB: a bigger value there would only cost every reader time."""
    from mesh.etcd.store import SITE_VALUE_LIMITS, Undecodable  # here: the rest of this file runs on a tree without

    limits = dict(SITE_VALUE_LIMITS)
    for prefix, key in ((LIVE, live_key("x")), (PKI_SITES, site_cert_key("x"))):
        fits = json.dumps({"gpu_note": "x" * (limits[prefix] - 20)}).encode()
        assert len(fits) <= limits[prefix]
        await put_raw(store, key, fits)
        assert isinstance((await store.get(key)).value, dict)  # type: ignore[union-attr]
        await put_raw(store, key, fits + b" " * (limits[prefix] - len(fits) + 1))
        value = (await store.get(key)).value  # type: ignore[union-attr]
        assert isinstance(value, Undecodable) and "over the" in value.reason
    big = json.dumps({"x": "y" * 1_000_000}).encode()
    await put_raw(store, "services/big", big)  # elsewhere, etcd's own limit is the only one
    assert isinstance((await store.get("services/big")).value, dict)  # type: ignore[union-attr]


async def test_the_watch_pump_hands_an_unexpected_error_to_its_reader(store: Store,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    real = store._events

    def failing(raw: Any) -> Any:
        monkeypatch.setattr(store, "_events", real)
        raise RuntimeError("a bug decoding events")

    monkeypatch.setattr(store, "_events", failing)
    async with store.watch_prefix("k/") as watch:
        await store.put("k/1", {"a": 1})
        with pytest.raises(StoreError, match="a bug decoding events"):
            async with asyncio.timeout(5):  # a pump that died silently leaves its reader waiting forever
                await watch.__anext__()


# -- the view ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key", [live_key("e001"), site_cert_key("e001")])
@pytest.mark.parametrize("name", sorted(HOSTILE))
async def test_a_view_follows_past_a_hostile_value_and_a_later_view_starts(store: Store, key: str,
                                                                           name: str) -> None:
    await _seed(store, _line(3))
    await store.put(live_key("e001"), _beat("e001"))
    await store.put(site_cert_key("e001"), {"schema": 1, "pem": _PEM})
    async with MeshView(store, "e000", debounce_s=0.01) as view:
        good = _held_at(view, key)
        assert good is not None
        await put_raw(store, key, HOSTILE[name])
        marker = await store.put(live_key("e002"), _beat("e002"))  # what comes after must still arrive
        await eventually(lambda: asyncio.sleep(0, "e002" in view.live and view.revision >= marker), 5,
                         f"the view following past {name} at {key}")
        assert _held_at(view, key) == good, "the key's last good value was not kept"
        assert view.topology is not None and len(view.topology.sites) == 4
        await asyncio.sleep(0.05)
        assert _tasks_alive(view)
    async with MeshView(store, "e002", debounce_s=0.01) as later:  # a start that meets the value in etcd
        assert _held_at(later, key) is None and "e002" in later.live and later.topology is not None


async def test_a_reload_that_meets_a_hostile_value_keeps_the_view_whole(store: Store) -> None:
    """An agent's view re-reads when its route set changes; the newly followed heartbeat is hostile."""
    topo = _line(10)
    await _seed(store, topo)
    await store.put(live_key("e001"), _beat("e001"))
    await put_raw(store, live_key("e007"), HOSTILE["infinity"])  # too far to be followed yet
    view = MeshView(store, "e000", debounce_s=0.01, scope=Scope("e000", peers=3, per_tier=0))
    async with view:
        assert set(view.live) == {"e001"} and view.generation == 1
        closer = Topology(sites=topo.sites, links=(*topo.links, Link("e000", "e007", 0.1, 100.0)))
        await _seed(store, closer)  # e007 is now among the three nearest: the view re-reads with its key
        await eventually(lambda: asyncio.sleep(0, view.generation >= 2), 5, "the view re-read its new route set")
        assert "e001" in view.live and view.topology is not None and len(view.topology.links) == 11
        assert "e007" not in view.live  # never had a good value
        await store.put(live_key("e007"), _beat("e007"))  # and the view still follows
        await eventually(lambda: asyncio.sleep(0, "e007" in view.live), 5, "e007's good heartbeat in the view")
        assert _tasks_alive(view)


async def test_a_follow_that_fails_is_restarted_and_the_last_good_view_stays_meanwhile(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    await _seed(store, _line(3))
    await store.put(live_key("e001"), _beat("e001"))
    async with MeshView(store, "e000", debounce_s=0.01) as view:
        real_events, real_read = store._events, store.get_prefix
        during: list[bool] = []  # whether the last good view was in force at each failed re-read
        left = {"events": 1, "reads": 2}

        def events(raw: Any) -> Any:
            if left["events"]:
                left["events"] -= 1
                raise RuntimeError("a bug decoding events")
            return real_events(raw)

        async def read(prefix: str) -> Any:
            if left["reads"]:
                left["reads"] -= 1
                during.append("e001" in view.live and view.topology is not None)
                raise RuntimeError("a bug reading")
            return await real_read(prefix)

        monkeypatch.setattr(store, "_events", events)
        monkeypatch.setattr(store, "get_prefix", read)
        await store.put(live_key("e002"), _beat("e002"))
        await eventually(lambda: asyncio.sleep(0, "e002" in view.live), 15, "the view caught up after failing")
        assert during == [True, True] and view.live["e001"] == Heartbeat.from_json(_beat("e001"), site="e001")
        await store.put(live_key("e002"), _beat("e002", queue_ms=7.0))
        await eventually(lambda: asyncio.sleep(0, view.live["e002"].loaded["t.v1"].queue_ms == 7.0), 5,
                         "the restarted follow following")
        assert _tasks_alive(view)


async def test_a_bad_value_at_a_key_an_admin_writes_is_ignored_too(store: Store) -> None:
    """Sites cannot write these, but a reader does not trust a writer: the same rule at every kind."""
    await _seed(store, _line(3))
    async with MeshView(store, "e000", debounce_s=0.01) as view:
        await put_raw(store, "topology/sites/e002", json.dumps({"name": "e002", "tier": "edge"}).encode())
        await store.put("topology/links/e000/e001", {"a": "e000", "b": "e001", "latency_ms": -1.0,
                                                      "bandwidth_mbps": 1.0})
        await put_raw(store, catalog_key("t", "t.v1"), b'{"accuracy": Infinity}')
        await store.put("placement/e000", {"variants": [{"task": ["t"]}]})
        marker = await store.put(live_key("e002"), _beat("e002"))
        await eventually(lambda: asyncio.sleep(0, view.revision >= marker and "e002" in view.live), 5, "marker")
        assert view.topology is not None and len(view.topology.sites) == 4
        assert math.isclose(view.topology.link("e000", "e001").latency_ms, 1.0)  # type: ignore[union-attr]
        assert view.variant("t", "t.v1") == _meta() and "e000" not in view.placement
