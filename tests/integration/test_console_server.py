"""The console server on a real etcd: the token gate of insecure mode, the snapshot it builds from etcd and
from an agent's /metrics and traces, and the record of the last topology apply.

The agent here is a small aiohttp server answering with sample text and JSON in the format of issue 12 items
1-2 (the agents' /metrics and traces are built on another branch): it stands for the interface the console
consumes, so these tests pin the console's side of that contract.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from console import ConsoleConfig, ConsoleServer
from core_scheduler.state.heartbeat import Heartbeat
from mesh.etcd.keys import EVENTS_PLACEMENT, TOPOLOGY_LAST_APPLY, live_key
from mesh.etcd.store import Store
from tests.helpers.http_stub import serve_app
from topology.loader import parse_topology
from topology.store_io import apply

pytestmark = pytest.mark.integration

DATA = Path(__file__).resolve().parents[1] / "data"
METRICS = (DATA / "agent_metrics_sample.txt").read_text()
TRACE = json.loads((DATA / "agent_trace_sample.json").read_text())
TOPOLOGY = """
schema: 1
sites:
  - {name: core, tier: core, region: r1, coordinates: {lat: 50.1, lon: 8.7},
     hardware: {cpu_cores: 8, memory_mb: 16384, price_per_hour: 2.0}}
  - {name: mid, tier: middle, region: r1, coordinates: {lat: 52.4, lon: 4.9},
     hardware: {cpu_cores: 4, memory_mb: 8192, price_per_hour: 1.0}}
  - {name: edge-a, tier: edge, region: r1, coordinates: {lat: 48.9, lon: 2.3},
     hardware: {cpu_cores: 2, memory_mb: 4096, price_per_hour: 0.5}}
links:
  - {a: edge-a, b: mid, latency_ms: 5, bandwidth_mbps: 500}
  - {a: mid, b: core, latency_ms: 10, bandwidth_mbps: 1000}
tenants:
  - {name: acme, isolation: shared, quotas: {qps: 100}}
  - {name: globex, isolation: strict, quotas: {qps: 50}}
"""
TOKEN = "t" * 32


async def _agent_app() -> web.Application:
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=METRICS, content_type="text/plain")

    async def trace(request: web.Request) -> web.Response:
        if request.match_info["rid"] != TRACE["request_id"]:
            return web.json_response({"error": "no such trace"}, status=404)
        return web.json_response(TRACE)

    async def traces(request: web.Request) -> web.Response:
        return web.json_response({"traces": [{"request_id": TRACE["request_id"], "tenant": "acme",
                                              "task": TRACE["task"], "outcome": "ok", "at_unix": 1700000000.5}]})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v2/traces/{rid}", trace)
    app.router.add_get("/v2/traces", traces)
    return app


@pytest.fixture
async def agent() -> AsyncIterator[str]:
    async with serve_app(await _agent_app()) as url:
        yield url


@pytest.fixture
async def console(store: Store, agent: str) -> AsyncIterator[ConsoleServer]:
    await apply(store, parse_topology(TOPOLOGY), source=TOPOLOGY)
    await store.put(live_key("edge-a"), Heartbeat(site="edge-a", http=agent, tier="edge", capacity=8).to_json())
    await store.put(EVENTS_PLACEMENT, {"schema": 1, "events": [
        {"site": "edge-a", "variant_id": "mlp-tiny.onnx.int8", "action": "load", "reason": "warm floor", "ts": 1.0}]})
    server = ConsoleServer(store, ConsoleConfig(token=TOKEN, tick_s=0.2))
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def _get(url: str, **kw: Any) -> tuple[int, Any, aiohttp.ClientResponse]:
    async with aiohttp.ClientSession() as s, s.get(url, allow_redirects=False, **kw) as resp:
        body = await resp.json() if resp.content_type == "application/json" else await resp.text()
        return resp.status, body, resp


async def test_insecure_console_wants_its_token(console: ConsoleServer) -> None:
    assert console.login_url == f"{console.url}/?token={TOKEN}"
    for path in ("/", "/api/state", "/static/console.js"):
        status, _, _ = await _get(console.url + path)
        assert status == 401, path
    status, _, _ = await _get(console.url + "/api/state", headers={"Authorization": "Bearer " + "x" * 32})
    assert status == 401
    status, _, resp = await _get(f"{console.url}/?token=wrong")
    assert status == 401
    status, _, resp = await _get(console.login_url)
    assert status == 302 and resp.headers["Location"] == "/"
    cookie = resp.cookies["tiermesh_console"]
    assert cookie.value == TOKEN and cookie["httponly"] and cookie["samesite"] == "Strict"
    status, page, _ = await _get(console.url + "/", cookies={"tiermesh_console": TOKEN})
    assert status == 200 and "tiermesh" in page
    status, body, _ = await _get(console.url + "/api/whoami", headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 200 and body == {"admin": "token"}


async def _snapshot(console: ConsoleServer, want: Any, timeout: float = 10.0) -> dict[str, Any]:  # noqa: ASYNC109
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        status, snap, _ = await _get(console.url + "/api/state", headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 200
        if want(snap) or asyncio.get_running_loop().time() > deadline:
            return snap
        await asyncio.sleep(0.2)


async def test_snapshot_joins_etcd_and_the_agents_metrics(console: ConsoleServer, store: Store) -> None:
    snap = await _snapshot(console, lambda s: s.get("metrics") and s["tenants"])
    sites = {s["name"]: s for s in snap["sites"]}
    assert set(sites) == {"core", "mid", "edge-a"}
    assert sites["core"]["health"] == "down" and sites["mid"]["health"] == "down"
    edge = sites["edge-a"]
    # the agent reports its peer 'mid' unreachable, but 'mid' is down itself (shown so on its own marker):
    # that does not make edge-a degraded
    assert edge["health"] == "up", edge["why"]
    assert edge["p99_ms"] == {"digit-classification": pytest.approx(75.0)}
    tenants = {t["name"]: t for t in snap["tenants"]}
    assert tenants["acme"]["classes"]["interactive"]["attainment"] == pytest.approx(0.9)
    assert tenants["globex"]["classes"]["batch"]["attainment"] == 0.0
    assert tenants["globex"]["rejections"] == 3.0 and tenants["acme"]["quota_qps"] == 100
    assert [e["action"] for e in snap["events"]] == ["load"]
    links = {(lk["a"], lk["b"]): lk for lk in snap["links"]}
    assert links[("edge-a", "mid")]["declared_rtt_ms"] == 10
    # its lease ends (the record goes): down at the next tick
    await store.delete(live_key("edge-a"))
    snap = await _snapshot(console, lambda s: {x["name"]: x["health"] for x in s["sites"]}["edge-a"] == "down")
    assert {x["name"]: x["health"] for x in snap["sites"]}["edge-a"] == "down"


async def test_event_stream_pushes_snapshots(console: ConsoleServer) -> None:
    async with aiohttp.ClientSession() as s, \
            s.get(console.url + "/api/stream", headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        versions = []
        async with asyncio.timeout(10):
            async for line in resp.content:
                if line.startswith(b"data: "):
                    versions.append(json.loads(line[6:])["version"])
                    if len(versions) == 2:
                        break
    assert versions[1] > versions[0]


async def test_traces_come_from_the_agent_that_answered(console: ConsoleServer) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    await _snapshot(console, lambda s: s.get("metrics"))  # the live record is in the view
    status, body, _ = await _get(f"{console.url}/api/traces/req-1", headers=auth)
    assert status == 200 and body["answered_by"] == "edge-a" and len(body["hops"]) == 2
    rejected = [c for c in body["hops"][0]["candidates"] if not c["feasible"]]
    assert rejected and rejected[0]["why_not"].startswith("accuracy")
    status, body, _ = await _get(f"{console.url}/api/traces/req-unknown", headers=auth)
    assert status == 404 and body["code"] == "not_found"
    status, body, _ = await _get(f"{console.url}/api/traces/bad%20id%3Cscript%3E", headers=auth)
    assert status == 400
    status, body, _ = await _get(f"{console.url}/api/traces?limit=5", headers=auth)
    assert status == 200 and [t["request_id"] for t in body["traces"]] == ["req-1"]
    assert body["traces"][0]["site"] == "edge-a"


async def test_last_apply_is_recorded_with_its_diff_and_source(console: ConsoleServer, store: Store) -> None:
    first = await store.get(TOPOLOGY_LAST_APPLY)
    assert first is not None and first.value["source"] == TOPOLOGY
    changed = TOPOLOGY.replace("latency_ms: 5,", "latency_ms: 7,")
    await apply(store, parse_topology(changed), source=changed)
    rec = await store.get(TOPOLOGY_LAST_APPLY)
    assert rec is not None and rec.value["summary"] == "0 added, 1 changed, 0 removed"
    (key, change), = rec.value["changed"].items()
    assert key.endswith("links/edge-a/mid") and (change["old"]["latency_ms"], change["new"]["latency_ms"]) == (5, 7)
    again = await apply(store, parse_topology(changed), source=changed)  # a no-op writes nothing, this neither
    assert again.empty
    assert (await store.get(TOPOLOGY_LAST_APPLY)).mod_revision == rec.mod_revision  # type: ignore[union-attr]
    async with asyncio.timeout(10):  # the console reads the record at its next tick
        while True:
            status, body, _ = await _get(f"{console.url}/api/topology", headers={"Authorization": f"Bearer {TOKEN}"})
            assert status == 200 and "edge-a" in body["yaml"]
            if body["last_apply"]["summary"] == "0 added, 1 changed, 0 removed":
                break
            await asyncio.sleep(0.1)


async def test_a_scheduler_replica_serves_the_console(etcd_server: Any, store: Store, tmp_path: Path) -> None:
    """``tiermesh scheduler --console-port 0 --insecure`` (a replica, as deployed): prints the address with its
    token and serves the page; stopped with SIGTERM. Under the test store's prefix, removed after."""
    env = {**os.environ, "TIERMESH_CONSOLE_TOKEN": TOKEN, "TIERMESH_LOG_LEVEL": "WARNING"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tiermesh", "scheduler", "--etcd", etcd_server.url, "--prefix", store.prefix, "--home",
        str(tmp_path), "--console-port", "0", "--insecure", "--id", "replica-1",
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, env=env)
    try:
        assert proc.stderr is not None
        url = ""
        async with asyncio.timeout(60):
            while not url:
                line = (await proc.stderr.readline()).decode()
                assert line, "the scheduler exited before serving the console"
                if line.startswith("console "):
                    url = line.split()[1]
        assert url.startswith("http://127.0.0.1:") and url.endswith(f"/?token={TOKEN}")
        status, _, resp = await _get(url)
        assert status == 302 and resp.cookies["tiermesh_console"].value == TOKEN
        base = url.split("/?", 1)[0]
        status, snap, _ = await _get(base + "/api/state", headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 200 and "version" in snap
        # the scheduler's own Prometheus metrics, behind the same gate
        status, text, _ = await _get(base + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 200, text
        names = {f.name for f in text_string_to_metric_families(text)}
        assert {"tiermesh_scheduler_rounds", "tiermesh_etcd_connected"} <= names, names
        status, _, _ = await _get(base + "/metrics")
        assert status == 401
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 20)
            except TimeoutError:
                proc.kill()
                await proc.wait()
    assert proc.returncode == 0
