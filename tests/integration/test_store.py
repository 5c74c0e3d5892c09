"""Store against a real etcd: CRUD, txn, watches (also across an etcd restart), leases."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from mesh.errors import ConflictError, StoreError, StoreUnavailable
from mesh.etcd.ops import CreateRevision, Delete, ModRevision, Put, ValueEquals
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from mesh.etcd.watch import WatchEvent

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
HELPER = ROOT / "tests" / "helpers" / "lease_holder.py"


def spawn_holder(*args: str) -> subprocess.Popen[bytes]:
    """Start tests/helpers/lease_holder.py; the caller kills and waits for it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, str(HELPER), *args], stdout=subprocess.PIPE, env=env)


async def take(watch: AsyncIterator[WatchEvent], n: int, within: float = 10.0) -> list[WatchEvent]:
    out: list[WatchEvent] = []

    async def run() -> None:
        async for ev in watch:
            out.append(ev)
            if len(out) == n:
                return

    await asyncio.wait_for(run(), within)
    return out


async def test_put_get_delete_and_prefix(store: Store) -> None:
    r1 = await store.put("a/1", {"x": 1})
    r2 = await store.put("a/2", [1, 2, "three"])
    await store.put("b/1", "other")
    assert r2 > r1
    got = await store.get("a/1")
    assert got is not None and got.value == {"x": 1} and got.mod_revision == r1 == got.create_revision
    assert [kv.key for kv in await store.get_prefix("a/")] == ["a/1", "a/2"]
    assert await store.get("missing") is None
    assert await store.delete("a/1") is True
    assert await store.delete("a/1") is False
    assert await store.delete_prefix("") == 2
    assert await store.get_prefix("") == []
    assert await store.revision() >= r2


async def test_stale_write_refused_with_conflict(store: Store) -> None:
    rev = await store.put_if_mod_revision("cfg", {"v": 1}, expected=0)
    with pytest.raises(ConflictError):
        await store.put_if_mod_revision("cfg", {"v": "dup"}, expected=0)  # create-only on an existing key
    rev2 = await store.put_if_mod_revision("cfg", {"v": 2}, expected=rev)
    with pytest.raises(ConflictError) as info:
        await store.put_if_mod_revision("cfg", {"v": "stale"}, expected=rev)
    assert info.value.details["actual"] == rev2
    got = await store.get("cfg")
    assert got is not None and got.value == {"v": 2}


async def test_txn_compares_and_ops(store: Store) -> None:
    res = await store.txn([CreateRevision("k", "==", 0)], [Put("k", 1), Put("j", 2)])
    assert res.succeeded
    assert (await store.get("k")).mod_revision == res.revision  # type: ignore[union-attr]
    res = await store.txn([ValueEquals("k", 1), ModRevision("j", "==", res.revision)],
                          [Delete("k")], [Put("failed", True)])
    assert res.succeeded and await store.get("k") is None
    res = await store.txn([ValueEquals("j", 99)], [Put("ok", True)], [Put("failed", True)])
    assert not res.succeeded
    assert await store.get("ok") is None and (await store.get("failed")) is not None


async def test_watcher_sees_other_clients_changes_in_order(store: Store, etcd_server: EmbeddedEtcd) -> None:
    async with store.watch_prefix("sites/") as watch:
        async with await Store.connect(etcd_server.url, prefix=store.prefix) as other:
            r1 = await other.put("sites/a", {"n": 1})
            await other.put("elsewhere", 0)  # outside the watched prefix
            r2 = await other.put("sites/b", {"n": 2})
            r3 = await other.put("sites/a", {"n": 3})
            r4 = await other.delete("sites/b") and await other.revision()
        events = await take(watch, 4)
    assert [(e.kind, e.key, e.value, e.revision) for e in events] == [
        ("put", "sites/a", {"n": 1}, r1),
        ("put", "sites/b", {"n": 2}, r2),
        ("put", "sites/a", {"n": 3}, r3),
        ("delete", "sites/b", None, r4),
    ]
    assert watch.last_revision == r4


async def test_watch_from_start_revision_replays_history(store: Store) -> None:
    r1 = await store.put("h/x", 1)
    await store.put("h/x", 2)
    async with store.watch_prefix("h/", start_revision=r1) as watch:
        events = await take(watch, 2)
    assert [e.value for e in events] == [1, 2]


async def test_watch_resumes_after_etcd_restart_without_gaps_or_duplicates(fresh_etcd: EmbeddedEtcd) -> None:
    async with await Store.connect(fresh_etcd.url, prefix="/w/") as store:
        watch = store.watch_prefix("k/")
        async with watch:
            before = [await store.put(f"k/{i}", i) for i in range(5)]
            seen = await take(watch, 5)
            await fresh_etcd.restart()
            after = [await store.put(f"k/{i}", i * 10) for i in range(5)]
            after.append(await store.delete("k/0") and await store.revision())
            seen += await take(watch, 6, within=20.0)
            # nothing more may arrive: a duplicate would show up here
            with pytest.raises(TimeoutError):
                await take(watch, 1, within=0.5)
        assert watch.reconnects >= 1
    assert [e.revision for e in seen] == before + after
    assert [e.value for e in seen[5:10]] == [0, 10, 20, 30, 40]
    assert seen[-1].kind == "delete"


async def test_watch_past_compaction_raises_store_error(fresh_etcd: EmbeddedEtcd) -> None:
    async with await Store.connect(fresh_etcd.url, prefix="/c/") as store:
        r1 = await store.put("x", 1)
        r2 = await store.put("x", 2)
        await store.compact(r2)
        with pytest.raises(StoreError, match="compacted"):
            async with store.watch_prefix("", start_revision=r1) as w:
                await take(w, 1)


async def test_connect_to_closed_port_is_store_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await Store.connect(f"http://127.0.0.1:{port}", timeout=2.0)
        assert time.monotonic() - t0 < 5.0


async def test_lease_keeps_key_alive_and_revoke_removes_it(store: Store) -> None:
    lease = await store.lease(2)
    await store.put("live/me", {"ok": True}, lease=lease)
    await asyncio.sleep(lease.ttl + 1.0)  # past the TTL: only the keep-alive holds it
    got = await store.get("live/me")
    assert lease.alive and got is not None and got.lease == lease.id
    await lease.revoke()
    assert not lease.alive and await store.get("live/me") is None


async def test_leased_key_disappears_within_ttl_after_owner_is_killed(store: Store,
                                                                     etcd_server: EmbeddedEtcd) -> None:
    ttl = 2.0
    proc = spawn_holder(etcd_server.url, store.prefix, "key", "live/site-x", str(ttl))
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)  # type: ignore[union-attr]
        lease_id = json.loads(line)["lease"]
        got = await store.get("live/site-x")
        assert got is not None and got.lease == lease_id
        async with store.watch_prefix("live/") as watch:
            await asyncio.sleep(ttl + 0.5)  # the helper's keep-alive must hold it past one TTL
            assert await store.get("live/site-x") is not None
            proc.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            (ev,) = await take(watch, 1, within=ttl + 5)
        gone_after = time.monotonic() - killed
        assert ev.kind == "delete" and ev.key == "live/site-x"
        # etcd checks expiry every 500 ms; allow that plus scheduling slack on a busy machine
        assert gone_after <= ttl + 1.5
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if proc.stdout:
            proc.stdout.close()


async def test_lease_lost_when_etcd_stays_down(fresh_etcd: EmbeddedEtcd) -> None:
    async with await Store.connect(fresh_etcd.url, prefix="/l/", timeout=1.0) as store:
        lease = await store.lease(2)
        await fresh_etcd.stop(keep_data=True)
        await asyncio.wait_for(lease.lost.wait(), lease.ttl + 5)
        assert not lease.alive
        with pytest.raises(StoreUnavailable):
            await store.get("x")
        await fresh_etcd.start()
