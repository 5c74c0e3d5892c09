"""topology.store_io against a real etcd: apply / load round trip, idempotence, minimal writes,
removals, concurrent applies."""

from __future__ import annotations

import asyncio

import pytest

from mesh.etcd.keys import TOPOLOGY_LAST_APPLY, link_key, site_key, tenant_key
from mesh.etcd.store import Store
from tests.helpers.topologies import EXAMPLE
from topology.loader import parse_topology
from topology.paths import topology_paths
from topology.schema import Topology
from topology.store_io import META_KEY, apply, desired_state, load_topology

pytestmark = pytest.mark.integration

MID_US_CORE = "{a: mid-us, b: core-eu, latency_ms: 70,"


def _example(text_edit: tuple[str, str] | None = None) -> Topology:
    text = EXAMPLE.read_text()
    if text_edit:
        assert text.count(text_edit[0]) == 1
        text = text.replace(*text_edit)
    return parse_topology(text)


async def _revisions(store: Store) -> dict[str, int]:
    kvs = [*await store.get_prefix("topology/"), *await store.get_prefix("tenants/")]
    return {kv.key: kv.mod_revision for kv in kvs}


async def test_load_from_empty_store_is_none(store: Store) -> None:
    assert await load_topology(store) is None


async def test_apply_then_load_round_trips(store: Store) -> None:
    topo = _example()
    d = await apply(store, topo)
    assert set(d.added) == set(desired_state(topo)) and not d.changed and not d.removed
    loaded = await load_topology(store)
    assert loaded == topo
    assert loaded is not None and loaded.digest() == topo.digest()
    meta = await store.get(META_KEY)
    assert meta is not None and meta.value == {"schema": 1, "digest": topo.digest()}


async def test_reapply_changes_nothing(store: Store) -> None:
    topo = _example()
    await apply(store, topo)
    rev_before, mods_before = await store.revision(), await _revisions(store)
    again = await apply(store, _example())
    assert again.empty
    assert await store.revision() == rev_before
    assert await _revisions(store) == mods_before


async def test_edit_one_link_rewrites_only_that_key(store: Store) -> None:
    await apply(store, _example())
    before = await _revisions(store)
    edited = _example((MID_US_CORE, "{a: mid-us, b: core-eu, latency_ms: 80,"))
    d = await apply(store, edited)
    key = link_key("mid-us", "core-eu")
    assert not d.added and not d.removed and list(d.changed) == [key]
    old, new = d.changed[key]
    assert (old["latency_ms"], new["latency_ms"]) == (70.0, 80.0)
    after = await _revisions(store)
    assert set(after) == set(before)
    moved = {k for k in after if after[k] != before[k]}
    assert moved == {key, META_KEY, TOPOLOGY_LAST_APPLY}  # meta carries the new digest; the record, this diff
    assert after[key] > before[key]
    loaded = await load_topology(store)
    assert loaded is not None and loaded == edited
    link = loaded.link("mid-us", "core-eu")
    assert link is not None and link.latency_ms == 80.0
    # at 80 ms the detour through mid-eu (65 + 12) is now the shorter path
    assert topology_paths(loaded).path("mid-us", "core-eu") == ["mid-us", "mid-eu", "core-eu"]


async def test_removed_site_deletes_its_keys(store: Store) -> None:
    await apply(store, _example())
    text = EXAMPLE.read_text()
    # drop tenant globex and the Singapore edge with both of its links
    start = text.index("  - name: edge-sin-1\n")
    end = text.index("\nlinks:")
    text = text[:start] + text[end:]
    kept = [ln for ln in text.splitlines() if "edge-sin-1" not in ln and "globex" not in ln]
    smaller = parse_topology("\n".join(kept) + "\n")
    assert set(smaller.sites) == set(_example().sites) - {"edge-sin-1"}
    d = await apply(store, smaller)
    assert set(d.removed) == {site_key("edge-sin-1"), link_key("edge-sin-1", "core-eu"),
                              link_key("edge-sin-1", "mid-us"), tenant_key("globex")}
    assert not d.added and not d.changed
    assert await store.get(site_key("edge-sin-1")) is None
    assert await load_topology(store) == smaller


async def test_concurrent_applies_never_mix(store: Store) -> None:
    a = _example()
    b = _example((MID_US_CORE, "{a: mid-us, b: core-eu, latency_ms: 99,"))
    # Both must succeed (the loser retries on the meta guard); the end state is one of them whole.
    await asyncio.gather(apply(store, a), apply(store, b), apply(store, a))
    final = await load_topology(store)
    assert final in (a, b)
    meta = await store.get(META_KEY)
    assert final is not None and meta is not None and meta.value["digest"] == final.digest()
