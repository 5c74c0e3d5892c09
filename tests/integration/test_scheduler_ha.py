"""Scheduler high availability on a real etcd: three replicas as subprocesses, one leads; SIGKILL
the leader and another leads within the election TTL and keeps writing placement; a stale leader's
fenced write is refused by etcd."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from core_scheduler.scheduler import Scheduler, SchedulerConfig
from mesh.etcd.election import Election
from mesh.etcd.keys import live_key
from mesh.etcd.lease import Lease
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from tests.helpers.waiting import eventually
from topology.loader import load_topology_file
from topology.store_io import apply as apply_topology
from variant_store.blobs import BlobStore
from variant_store.build import ensure_digits_family
from variant_store.catalog import Catalog
from variant_store.hardware import local_hardware_class

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGY = ROOT / "tests" / "data" / "topology_small.yaml"
TTL = 2.0          # election lease TTL given to the replicas (etcd's minimum)
MARGIN = 3.0       # process scheduling on a loaded 2-core machine, etcd's 0.5 s expiry sweep
REPLICAS = ("sched-a", "sched-b", "sched-c")


def _live_record(site: str) -> dict[str, Any]:
    """What an idle agent's heartbeat says about itself (the fields placement reads)."""
    return {"schema": 1, "site": site, "hardware_class": local_hardware_class(), "gpu": False,
            "loaded": {}, "inflight": 0, "capacity": 8, "memory_used_bytes": 0,
            "model_memory_budget_bytes": 1 << 30, "demand": []}


@pytest.fixture
async def mesh_state(store: Store, tmp_path: Path) -> AsyncIterator[Lease]:
    """Topology, a small real catalog (FP32 digits variants, profiled here) and a heartbeat per site."""
    topo = load_topology_file(TOPOLOGY)
    await apply_topology(store, topo)
    await ensure_digits_family(Catalog(store), BlobStore(tmp_path / "blobs"), repeats=3,
                               kinds=["onnx.fp32"], progress=False)
    lease = await store.lease(10)
    for site in topo.sites:
        await store.put(live_key(site), _live_record(site), lease=lease)
    yield lease  # revoked when the store fixture closes


@pytest.fixture
def replicas(store: Store, etcd_server: EmbeddedEtcd, tmp_path: Path) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """Three scheduler replicas (``python -m tiermesh scheduler``), stopped even if the test fails."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TIERMESH_LOG_LEVEL": "INFO"}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for rid in REPLICAS:
            with open(tmp_path / f"{rid}.log", "wb") as logf:
                procs[rid] = subprocess.Popen(
                    [sys.executable, "-m", "tiermesh", "scheduler", "--etcd", etcd_server.url,
                     "--prefix", store.prefix, "--id", rid, "--election-ttl", str(TTL), "--interval", "0.3"],
                    stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        yield procs
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


async def _placements(store: Store) -> dict[str, dict[str, Any]]:
    return {kv.key.rsplit("/", 1)[-1]: kv.value for kv in await store.get_prefix("placement/")}


async def test_killed_leader_is_replaced_within_ttl_and_stale_leader_is_fenced(
        store: Store, mesh_state: Lease, replicas: dict[str, subprocess.Popen[bytes]]) -> None:
    sites = sorted(load_topology_file(TOPOLOGY).sites)
    observer = Election(store, "scheduler", "observer")

    # startup imports onnxruntime & co. in each replica: generous
    first = await eventually(observer.leader, 60, "a first leader")
    assert first in REPLICAS

    async def all_placed_by(leader: str) -> bool:
        p = await _placements(store)
        return set(p) == set(sites) and all(v.get("leader") == leader for v in p.values())

    await eventually(lambda: all_placed_by(first), 30, f"placement of every site by {first}")
    before = await _placements(store)
    assert any(v["variants"] for v in before.values()), "the warm floor placed nothing"
    old_key = min(await store.get_prefix("election/scheduler/"), key=lambda kv: kv.create_revision)
    assert old_key.value == {"candidate": first}
    assert old_key.create_revision == before[sites[0]]["leader_revision"]

    replicas[first].send_signal(signal.SIGKILL)
    replicas[first].wait(10)
    killed_at = time.monotonic()

    async def new_leader() -> str | None:
        who = await observer.leader()
        return who if who not in (None, first) else None

    second = await eventually(new_leader, TTL + MARGIN + 5, "a new leader")
    took = time.monotonic() - killed_at
    assert took <= TTL + MARGIN, f"new leader after {took:.1f} s (TTL {TTL} s)"
    assert second in REPLICAS and second != first
    assert all(p.poll() is None for rid, p in replicas.items() if rid != first)

    # placement goes on under the new leader: wipe it, the new leader writes it again, fenced by
    # its own (newer) election revision
    await store.delete_prefix("placement/")
    await eventually(lambda: all_placed_by(second), 20, f"placement rewritten by {second}")
    after = await _placements(store)
    assert {s: v["variants"] for s, v in after.items()} == {s: v["variants"] for s, v in before.items()}
    assert all(v["leader_revision"] > old_key.create_revision for v in after.values())

    # the dead leader, were it only paused, comes back believing it leads: its write is refused
    stale = Scheduler(store, SchedulerConfig(candidate_id="stale", election_ttl_s=TTL))
    await stale.view.start()
    try:
        election = stale.election = Election(store, "scheduler", "stale", ttl=TTL)
        election.key, election.leader_revision, election.is_leader = old_key.key, old_key.create_revision, True
        await eventually(lambda: asyncio.sleep(0, result=bool(stale.view.placement)), 10, "stale view loaded")
        stale.view.placement.clear()  # its cache is behind: it thinks every site needs a write
        changed = await stale.plan_once()
        assert changed == 0 and stale.refused == 1 and stale.writes == 0
        assert election.lost.is_set()
    finally:
        await stale.view.stop()
    final = await _placements(store)
    assert set(final) == set(sites)
    assert all(v["leader"] == second for v in final.values())
    assert await observer.leader() == second
