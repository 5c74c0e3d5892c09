"""The console's versions view on a real etcd, through a real console server (issue 34 item 3): ``/api/versions``
lists each tenant task's versions from the record the variant store keeps (``versions/<task>``): state, family,
accuracy and traffic share, with the queries each version served summed over two live agents (aiohttp servers
answering ``/metrics`` with a real ``AgentMetrics`` exposition); a malformed record is listed as broken, not fatal;
the tenant filter; the admin gate."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from console import ConsoleServer
from edge_agent.metrics import AgentMetrics
from mesh.etcd.keys import version_key
from mesh.etcd.store import Store
from tests.helpers.console_stub import console_with_agents
from tests.integration.test_console_builds_cascades import AUTH, _get
from tests.integration.test_console_server import TOKEN, TOPOLOGY
from variant_store.versions import VersionInfo, VersionRecord

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
TASK = "acme-digits"
SERVED = {"edge-a": ((1, 3), (2, 5)), "core": ((2, 2),)}  # site -> (version, queries it ran)


def _metrics_text(site: str) -> bytes:
    m = AgentMetrics(site)
    m.known(tasks=[TASK], tenants=["acme"], variants=["v1.onnx.fp32", "v2.onnx.fp32"], sites=list(SERVED))
    for version, n in SERVED[site]:
        for _ in range(n):
            m.served_ok(TASK, "acme", f"v{version}.onnx.fp32", "local", 1.0, 2.0, 4.0, rows=1, version=version)
    return m.render()


@pytest.fixture
async def console(store: Store) -> AsyncIterator[ConsoleServer]:
    agents = {site: (tier, _metrics_text(site)) for site, tier in (("edge-a", "edge"), ("core", "core"))}
    async with console_with_agents(store, TOPOLOGY, TOKEN, agents) as server:
        yield server


async def _versions(console: ConsoleServer, **params: str) -> tuple[int, Any]:
    return await _get(console.url + "/api/versions", params=params, headers=AUTH)


async def test_the_versions_view_shows_state_share_and_queries_per_version(store: Store,
                                                                          console: ConsoleServer) -> None:
    status, body = await _versions(console)
    assert status == 200 and body["broken"] == []
    rec = VersionRecord(task=TASK, owner="acme", active=2, weights={2: 0.9, 1: 0.1},
                        versions={1: VersionInfo("mlp-old", "retiring", 0.91, retire_at=2e9),
                                  2: VersionInfo("mlp-new", "active", 0.96), 3: VersionInfo("mlp-next", "building")})
    await store.put(version_key(TASK), rec.to_json())
    await store.put(version_key("broken-task"), {"task": "broken-task", "owner": "acme", "active": 7})
    await store.put(version_key("elsewhere"), {**rec.to_json(), "task": "not-elsewhere"})
    deadline = asyncio.get_running_loop().time() + 10.0
    while True:  # the console's view learns both agents' live records within a tick or two
        status, body = await _versions(console)
        assert status == 200
        if not body["tasks"] or body["tasks"][0]["queries"] < 10:
            assert asyncio.get_running_loop().time() < deadline, body
            await asyncio.sleep(0.2)
            continue
        break
    (task,) = body["tasks"]
    assert (task["task"], task["owner"], task["active"], task["queries"]) == (TASK, "acme", 2, 10)
    rows = {v["version"]: v for v in task["versions"]}
    assert {v: (r["state"], r["family"], r["accuracy"], r["share"], r["queries"]) for v, r in rows.items()} == {
        1: ("retiring", "mlp-old", 0.91, 0.1, 3), 2: ("active", "mlp-new", 0.96, 0.9, 7),
        3: ("building", "mlp-next", 0.0, 0.0, 0)}
    assert rows[2]["sites"] == {"core": 2, "edge-a": 5} and rows[1]["sites"] == {"edge-a": 3}
    broken = {b["task"]: b["reason"] for b in body["broken"]}
    assert set(broken) == {"broken-task", "elsewhere"}
    assert "active" in broken["broken-task"] and "not its key" in broken["elsewhere"]
    assert body["scrape_errors"] == {}

    status, mine = await _versions(console, tenant="acme")
    assert status == 200 and [t["task"] for t in mine["tasks"]] == [TASK]
    status, none = await _versions(console, tenant="globex")  # a tenant of the topology with no versioned task
    assert status == 200 and none["tasks"] == []
    status, missing = await _versions(console, tenant="initech")
    assert status == 404 and "initech" in missing["error"]


async def test_the_admin_gate_holds(console: ConsoleServer) -> None:
    for headers in ({}, {"Authorization": "Bearer " + "x" * 32}):
        async with aiohttp.ClientSession() as s, s.get(console.url + "/api/versions", headers=headers) as resp:
            assert resp.status == 401, headers
