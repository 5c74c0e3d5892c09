"""The mesh on a 3-member etcd cluster: the etcd leader member is killed (SIGKILL) mid-workload.
Queries keep being answered within their SLOs (routing runs on each agent's cached view, and the
agents' stores fail over to the surviving members), none is lost or hangs, and the control plane
carries on: agents' watches catch up, and the scheduler writes placement again."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from mesh.etcd.cluster import EtcdCluster
from mesh.etcd.keys import live_key, placement_key
from tests.helpers.waiting import eventually
from tests.system.conftest import SMALL_TOPOLOGY, Holdout, wait_warm
from tiermesh.harness import LocalMesh
from tiermesh.mesh_options import MeshOptions
from tiermesh.workload import DEFAULT_CLASSES, run_workload, summarise

pytestmark = [pytest.mark.system, pytest.mark.slow]

EDGE = "edge-fra-1"
SITES = ["core-eu", EDGE]
DURATION_S, KILL_AT_S, QPS = 10.0, 3.0, 20.0


@pytest.fixture
async def mesh(tmp_path: Path, holdout: Holdout) -> AsyncIterator[LocalMesh]:
    m = LocalMesh(MeshOptions(topology=SMALL_TOPOLOGY, home=tmp_path / "home", sites=SITES, lease_ttl_s=3.0,
                              etcd_members=3))
    async with m:
        await m.wait_live(timeout=60)
        await wait_warm(m, holdout.x, timeout_s=60)
        yield m


async def test_etcd_leader_killed_mid_workload(mesh: LocalMesh, holdout: Holdout) -> None:
    cluster, store, sched = mesh.etcd, mesh.store, mesh.scheduler
    assert isinstance(cluster, EtcdCluster) and store is not None and sched is not None
    assert mesh.etcd_url.count(",") == 2  # agents and the scheduler were given every member
    tiers = {n: s.tier for n, s in mesh.topology.sites.items()}
    fired = 0

    def count(n: int, _t: float) -> None:
        nonlocal fired
        fired = n

    # the leader is the member every store here talks to (the first URL): the hard case
    await cluster.move_leader(0)
    assert store.member == cluster.urls[0].split("://")[1]
    work = asyncio.create_task(run_workload(mesh.edge_urls(), holdout.x, holdout.y, duration_s=DURATION_S, qps=QPS,
                                            classes=DEFAULT_CLASSES, max_queries=400, on_tick=count))
    try:
        await asyncio.sleep(KILL_AT_S)
        lead = await cluster.leader()
        assert lead == 0
        killed_at = time.monotonic()
        await cluster.kill(lead)
        result = await asyncio.wait_for(work, DURATION_S + 40)
    finally:
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)

    # nothing lost, nothing hung past its deadline + 1 s, and >= 95 % within SLO in every class
    assert len(result.records) == fired and fired >= 0.6 * QPS * DURATION_S
    hung = [r for r in result.records if r.client_ms > r.budget_ms + 1000]
    assert not hung, hung[:3]
    summary = summarise(result.records, tiers)
    assert set(summary) == {c.name for c in DEFAULT_CLASSES}
    for name, s in summary.items():
        assert s["slo_attainment"] >= 0.95, (name, s)

    # the control plane resumed on the two surviving members
    assert await cluster.leader() != lead and store.member != cluster.urls[lead].split("://")[1]
    marker = await store.put("ops/marker", {"after": "leader kill"})

    async def view_caught_up() -> dict[str, Any] | None:
        kv = await store.get(live_key(EDGE))
        return kv.value if kv and int(kv.value.get("view_revision", 0)) >= marker else None

    await eventually(view_caught_up, 20, f"{EDGE}'s view past a revision written after the kill")
    # the scheduler plans again: a placement removed now is written back by the leader's next rounds
    await eventually(lambda: asyncio.sleep(0, result=sched.is_leader), 20, "a scheduler leads")
    await store.delete(placement_key(EDGE))

    async def placement_rewritten() -> bool:
        kv = await store.get(placement_key(EDGE))
        return kv is not None and kv.mod_revision > marker

    await eventually(placement_rewritten, 20, "placement written again after the etcd leader died")
    assert time.monotonic() - killed_at < 60
