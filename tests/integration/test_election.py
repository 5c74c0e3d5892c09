"""Leader election on a real etcd: one leader at a time, takeover when the leader's lease ends."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mesh.etcd.election import Election
from mesh.etcd.ops import CreateRevision, Put
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
HELPER = ROOT / "tests" / "helpers" / "lease_holder.py"


def spawn_holder(*args: str) -> subprocess.Popen[bytes]:
    """Start tests/helpers/lease_holder.py; the caller kills and waits for it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, str(HELPER), *args], stdout=subprocess.PIPE, env=env)


async def test_exactly_one_leads_and_the_other_takes_over_on_revoke(store: Store,
                                                                   etcd_server: EmbeddedEtcd) -> None:
    async with await Store.connect(etcd_server.url, prefix=store.prefix) as other:
        a = Election(store, "sched", "a", ttl=2)
        b = Election(other, "sched", "b", ttl=2)
        await asyncio.wait_for(a.campaign(), 10)
        b_task = asyncio.create_task(b.campaign())
        try:
            await asyncio.sleep(1.0)
            assert a.is_leader and not b.is_leader and not b_task.done()
            assert await a.leader() == await b.leader() == "a"
            # the lease ends without a's cooperation (as if etcd expired it)
            assert a._lease is not None
            assert await other.revoke_lease(a._lease.id)
            await asyncio.wait_for(b_task, 10)
            await asyncio.wait_for(a.lost.wait(), 10)
            assert b.is_leader and not a.is_leader
            assert b.leader_revision > a.leader_revision
            assert await b.leader() == "b"
        finally:
            b_task.cancel()
            await asyncio.gather(b_task, return_exceptions=True)
            await a.resign()
            await b.resign()
    assert await store.get_prefix("election/") == []


async def test_resign_hands_over_and_fencing_token_guards_writes(store: Store) -> None:
    a = Election(store, "s", "a", ttl=2)
    b = Election(store, "s", "b", ttl=2)
    await a.campaign()
    b_task = asyncio.create_task(b.campaign())
    await asyncio.sleep(0.3)
    assert not b_task.done()
    assert a.key is not None
    fenced = await store.txn([CreateRevision(a.key, "==", a.leader_revision)], [Put("placement/x", 1)])
    assert fenced.succeeded
    await a.resign()
    await asyncio.wait_for(b_task, 10)
    assert b.is_leader and not a.lost.is_set()  # resigning is not losing
    stale = await store.txn([CreateRevision(a.key, "==", a.leader_revision)], [Put("placement/x", 2)])
    assert not stale.succeeded
    await b.resign()
    assert await b.leader() is None


async def test_killed_leader_process_is_replaced_within_ttl(store: Store, etcd_server: EmbeddedEtcd) -> None:
    ttl = 2
    proc = spawn_holder(etcd_server.url, store.prefix, "elect", "sched", "remote", str(ttl))
    local = Election(store, "sched", "local", ttl=ttl)
    task: asyncio.Task[None] | None = None
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)  # type: ignore[union-attr]
        assert json.loads(line)["leader"] == "remote"
        task = asyncio.create_task(local.campaign())
        await asyncio.sleep(ttl + 0.5)  # the remote's keep-alive holds leadership past one TTL
        assert not task.done() and await local.leader() == "remote"
        proc.send_signal(signal.SIGKILL)
        await asyncio.wait_for(task, ttl + 5)
        assert local.is_leader and await local.leader() == "local"
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await local.resign()
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if proc.stdout:
            proc.stdout.close()
