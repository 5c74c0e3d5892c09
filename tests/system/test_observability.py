"""Metrics and decision traces on a real local mesh (etcd, variant store, scheduler, four agent processes
behind WAN delay proxies): /metrics parses, the request counters match a known workload exactly by tenant
and outcome, and a traced query forwarded inward comes back with every hop and the candidates rejected.

The agents trace nothing unasked (sample rate 0), except edge-par-1, which traces everything (rate 1)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from mesh.client import AsyncClient
from mesh.errors import MeshError
from tests.system.conftest import TASK, Holdout, mesh_running, wait_warm
from tiermesh.harness import LocalMesh

pytestmark = [pytest.mark.system, pytest.mark.asyncio(loop_scope="module")]

EDGE, SAMPLED_EDGE = "edge-fra-1", "edge-par-1"
REQUIRED = {"tiermesh_requests", "tiermesh_slo", "tiermesh_request_latency_seconds", "tiermesh_batch_size",
            "tiermesh_loaded_variants", "tiermesh_variant_memory_bytes", "tiermesh_cold_starts",
            "tiermesh_prewarms", "tiermesh_forwards", "tiermesh_peer_reachable", "tiermesh_etcd_connected",
            "tiermesh_quota_rejections", "tiermesh_queue_depth", "tiermesh_served",
            "nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count",
            "nv_inference_queue_duration_us", "nv_inference_compute_infer_duration_us",
            "nv_inference_request_duration_us"}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh(holdout: Holdout) -> AsyncIterator[LocalMesh]:
    async with mesh_running(agent_env={"TIERMESH_AGENT_TRACE_SAMPLE_RATE": "0"},
                            site_env={SAMPLED_EDGE: {"TIERMESH_AGENT_TRACE_SAMPLE_RATE": "1"}}) as m:
        await wait_warm(m, holdout.x)
        yield m


async def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s, \
            s.get(url, headers=headers) as resp:
        return resp.status, await resp.text()


async def _requests_by(url: str) -> Counter[tuple[str, str]]:
    """``tiermesh_requests_total`` of one agent summed by (tenant, outcome)."""
    status, text = await _get(f"{url}/metrics")
    assert status == 200, text
    out: Counter[tuple[str, str]] = Counter()
    for fam in text_string_to_metric_families(text):
        if fam.name == "tiermesh_requests":
            for s in fam.samples:
                out[(s.labels["tenant"], s.labels["outcome"])] += int(s.value)
    return out


async def test_metrics_parse_and_name_everything(mesh: LocalMesh) -> None:
    for site, sp in sorted(mesh.sites.items()):
        assert sp.http is not None
        status, text = await _get(f"{sp.http}/metrics")
        assert status == 200, (site, text)
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        assert REQUIRED <= set(fams), (site, sorted(REQUIRED - set(fams)))
        assert fams["tiermesh_etcd_connected"].samples[0].value == 1.0, site
        peers = {s.labels["peer"]: s.value for s in fams["tiermesh_peer_reachable"].samples}
        assert set(peers) == set(mesh.sites) - {site} and all(v == 1.0 for v in peers.values()), (site, peers)
        assert fams["tiermesh_loaded_variants"].samples[0].value >= 1, site  # the warm floor
        for fam in fams.values():  # bounded labels: no request ids anywhere
            assert all(len(v) < 64 for s in fam.samples for v in s.labels.values()), fam.name
    assert mesh.variant_server is not None
    status, text = await _get(f"{mesh.variant_server.url}/metrics")
    assert status == 200 and "tiermesh_store_requests" in {f.name for f in text_string_to_metric_families(text)}


async def test_request_counters_match_the_workload_exactly(mesh: LocalMesh, holdout: Holdout) -> None:
    """Two tenants send a known mix (served queries, bad tensors refused at the data plane's door, bad SLOs
    refused by the HTTP front) to one edge; each door counts each of its queries once, by what the caller
    got, and no other site counts them as requests."""
    urls = {name: sp.http for name, sp in mesh.sites.items() if sp.http}
    before = {name: await _requests_by(url) for name, url in urls.items()}
    sent: Counter[tuple[str, str]] = Counter()
    plan = {"acme": (12, 3, 2), "globex": (7, 2, 1)}  # (valid, bad tensor, bad SLO)
    x = holdout.x
    for tenant, (valid, bad_tensor, bad_slo) in plan.items():
        async with AsyncClient(urls[EDGE], tenant=tenant, timeout=10) as client:
            calls = ([(x[i % len(x)][None, :], 200.0, 0.9) for i in range(valid)]
                     + [(np.zeros((1, 63), np.float32), 200.0, 0.9)] * bad_tensor
                     + [(x[:1], -5.0, 0.9)] * bad_slo)
            for inputs, latency_ms, acc in calls:
                try:
                    await client.infer(TASK, {"x": inputs}, latency_ms=latency_ms, min_accuracy=acc)
                    sent[(tenant, "ok")] += 1
                except MeshError as exc:
                    sent[(tenant, exc.code)] += 1
    assert sent[("acme", "bad_tensor")] == 3 and sent[("globex", "bad_request")] == 1, sent
    after = {name: await _requests_by(url) for name, url in urls.items()}
    counted = after[EDGE] - before[EDGE]
    assert counted == sent, (counted, sent)
    for name in urls:
        if name != EDGE:
            assert after[name] - before[name] == Counter(), name


async def test_traced_query_across_two_sites(mesh: LocalMesh, holdout: Holdout) -> None:
    url = mesh.sites[EDGE].http
    assert url is not None
    async with AsyncClient(url, tenant="acme", timeout=10) as client:
        # accurate and patient: the edge's variants are below the floor, and least cost sends it inward
        res = await client.infer(TASK, holdout.x[:1], latency_ms=400, min_accuracy=0.985, trace=True)
        plain = await client.infer(TASK, holdout.x[:1], latency_ms=400, min_accuracy=0.985)
    assert res.site != EDGE and res.trace_id and len(res.trace_id) == 32, res
    assert plain.trace_id == ""  # sample rate 0: not traced unless asked
    status, text = await _get(f"{url}/v2/traces/{res.request_id}")
    assert status == 200, text
    trace = json.loads(text)
    assert (trace["request_id"], trace["trace_id"], trace["tenant"], trace["task"], trace["outcome"]) == (
        res.request_id, res.trace_id, "acme", TASK, "ok")
    # by the result's trace id too, as the README says
    status, by_trace_id = await _get(f"{url}/v2/traces/{res.trace_id}")
    assert status == 200 and json.loads(by_trace_id) == trace, by_trace_id
    hops = trace["hops"]
    assert [h["role"] for h in hops][:1] == ["edge"] and hops[0]["site"] == EDGE
    assert hops[-1]["role"] == "serve" and hops[-1]["site"] == res.site, hops
    edge = hops[0]
    assert edge["choice"]["site"] == res.site and edge["choice"]["variant"] == res.variant
    rejected = [c for c in edge["candidates"] if not c["feasible"]]
    assert rejected and all(c["why_not"] for c in rejected)
    assert any(c["site"] == EDGE and c["why_not"] == "accuracy" for c in rejected), edge["candidates"]
    assert all(set(c) == {"site", "variant", "network_ms", "queue_ms", "compute_ms", "load_ms", "latency_ms", "cost",
                          "feasible", "why_not", "estimated"} for c in edge["candidates"])
    # each candidate's real cost (dollars per query, millionths on these sites: once rounded to 0.0 for all)
    assert all(c["cost"] > 0 for c in edge["candidates"] if c["feasible"]), edge["candidates"]
    assert hops[-1]["timings_ms"]["compute"] > 0 and edge["timings_ms"]["total"] >= hops[-1]["timings_ms"]["total"]
    # on this --insecure mesh a caller naming a tenant in the header reads no trace, not even its own: traces need a
    # certificate (with TLS a tenant reads its own only: tests/integration/test_observe_tls.py)
    assert (await _get(f"{url}/v2/traces/{res.request_id}", {"X-Tiermesh-Tenant": "globex"}))[0] == 403
    assert (await _get(f"{url}/v2/traces/{res.request_id}", {"X-Tiermesh-Tenant": "acme"}))[0] == 403
    # nothing else was traced here (rate 0): the listing holds only asked-for traces
    status, text = await _get(f"{url}/v2/traces?limit=1000")
    listed = json.loads(text)["traces"]
    assert res.request_id in {t["request_id"] for t in listed} and plain.request_id not in {
        t["request_id"] for t in listed}


async def test_a_sampled_door_traces_unasked_queries(mesh: LocalMesh, holdout: Holdout) -> None:
    url = mesh.sites[SAMPLED_EDGE].http
    assert url is not None
    async with AsyncClient(url, tenant="globex", timeout=10) as client:
        results = await asyncio.gather(*(client.infer(TASK, holdout.x[i:i + 1], latency_ms=200, min_accuracy=0.9)
                                         for i in range(5)))
    assert all(r.trace_id for r in results)
    for r in results:
        status, _ = await _get(f"{url}/v2/traces/{r.request_id}")
        assert status == 200
