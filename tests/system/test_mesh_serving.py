"""Issue 4, Done-when on a real local mesh (small topology: core with a GPU declared, a middle and
two edges, WAN delays between them): mixed-SLO serving, explicit answers to impossible SLOs,
malformed requests against a real agent, and tenant admission.

The first test runs ``tiermesh up`` as a subprocess (its Ctrl-C) before the shared mesh of the other tests
starts, so the two never compete for this machine's two cores; ``make demo``'s command and the README tour after it
are ``test_readme_tour``'s.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from mesh.client import AsyncClient
from mesh.errors import ImpossibleSLO, UnknownTenant
from mesh.v2 import codec as codec
from mesh.v2.body import HEADER_LENGTH, TENANT_HEADER
from tests.system.conftest import REPO_ROOT, SMALL_TOPOLOGY, TASK, Holdout, catalog_variants
from tiermesh.harness import LocalMesh
from tiermesh.workload import DEFAULT_CLASSES, QueryRecord, SloClass, run_workload, summarise, warm_up
from topology.paths import topology_paths
from variant_store.meta import VariantMeta

pytestmark = [pytest.mark.system, pytest.mark.asyncio(loop_scope="module")]

ACCURATE_FAMILY = "cnn-large"
SMALL_SHARE = 0.1  # a "small" variant: at most this share of the task's largest variant's bytes


def _binomial_floor(p: float, n: int) -> float:
    """Delivered accuracy below this on ``n`` labelled samples is not sampling noise (3 sigma)."""
    return p - 3.0 * math.sqrt(p * (1.0 - p) / max(n, 1))


def _no_silent_downgrade(records: list[QueryRecord], min_accuracy: dict[str, float]) -> None:
    """A reply either keeps the accuracy asked for or says it is best effort, never neither."""
    silent = [r for r in records if r.ok and not r.best_effort and r.accuracy < min_accuracy[r.slo_class]]
    assert not silent, f"served below the asked accuracy without best_effort: {silent[:3]}"
    flagged = [r for r in records if r.ok and r.best_effort and not r.reason.startswith("best_effort_")]
    assert not flagged, f"best_effort replies without a best_effort_* reason: {flagged[:3]}"


@pytest.mark.slow
async def test_tiermesh_up_ctrl_c_mid_workload_exits_130_and_stops_everything() -> None:
    """Ctrl-C while the workload runs: exit code 130, no traceback, no report, etcd and the agents stopped."""
    with tempfile.TemporaryDirectory(prefix="tiermesh-up-", ignore_cleanup_errors=True) as tmp:
        report = Path(tmp) / "report.json"
        out_path = Path(tmp) / "out.txt"
        with out_path.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tiermesh", "up", "--topology", str(SMALL_TOPOLOGY), "--home",
                str(Path(tmp) / "home"), "--duration", "60", "--qps", "20", "--report", str(report), "--no-caps",
                "--no-text", cwd=REPO_ROOT, stdin=asyncio.subprocess.DEVNULL, stdout=out,
                stderr=asyncio.subprocess.STDOUT, env={**os.environ, "COLUMNS": "160"})
            try:
                for _ in range(240):  # until the measured run has begun (bounded: 120 s)
                    if b"workload:" in out_path.read_bytes() or proc.returncode is not None:
                        break
                    await asyncio.sleep(0.5)
                assert b"workload:" in out_path.read_bytes(), out_path.read_text(errors="replace")[-3000:]
                await asyncio.sleep(2.0)
                proc.send_signal(signal.SIGINT)
                rc = await asyncio.wait_for(proc.wait(), 60)
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
        text = out_path.read_text(errors="replace")
        assert rc == 130, text[-3000:]
        assert "Traceback" not in text and not report.exists(), text[-3000:]
        # what it started is gone: no etcd or agent process still runs from this home
        ps = await asyncio.create_subprocess_exec("pgrep", "-f", tmp, stdout=asyncio.subprocess.PIPE)
        left, _ = await ps.communicate()
        assert not left.strip(), left


def _mixed_violations(records: list[QueryRecord], summary: dict[str, Any], metas: dict[str, VariantMeta],
                      tiers: Mapping[str, str]) -> list[str]:
    """Which Done-when properties one mixed-workload run broke (empty: all held)."""
    bad: list[str] = []

    def need(ok: bool, what: str) -> None:
        if not ok:
            bad.append(what)

    classes = {c.name: c for c in DEFAULT_CLASSES}
    need(set(summary) == set(classes), f"classes {sorted(summary)}")
    tight = [r for r in records if r.slo_class == "tight"]
    tight_ok = [r for r in tight if r.ok]
    need(len(tight) >= 60, f"only {len(tight)} tight queries")
    # tight: served where it arrived (an uplink round trip alone eats most of 10 ms), by a small
    # INT8 variant: mlp-tiny's FP16, FP32 and INT8 variants profile within the router's compute
    # resolution of each other, and such ties go to the smallest file, an INT8 one.
    at_edge = [r for r in tight_ok if r.site == r.edge]
    need(len(at_edge) >= 0.95 * len(tight), f"tight served at its edge: {len(at_edge)}/{len(tight)}")
    small_bytes = SMALL_SHARE * max(m.size_bytes for m in metas.values())
    small = [r for r in at_edge if metas[r.variant].size_bytes <= small_bytes]
    need(len(small) == len(at_edge), f"tight by a small variant: {len(small)}/{len(at_edge)}")
    int8 = [r for r in at_edge if metas[r.variant].precision == "int8"]
    need(len(int8) == len(at_edge), f"tight by an INT8 variant: {len(int8)}/{len(at_edge)}")
    need(summary.get("tight", {}).get("slo_attainment", 0) >= 0.95, "tight SLO attainment < 95 %")

    # accurate: a large CNN, mostly at the core (the cheapest slot; the middle is a fallback)
    acc = [r for r in records if r.slo_class == "accurate"]
    acc_ok = [r for r in acc if r.ok]
    need(len(acc) >= 50, f"only {len(acc)} accurate queries")
    need(all(metas[r.variant].family == ACCURATE_FAMILY for r in acc_ok), "accurate not all by cnn-large")
    need(all(tiers[r.site] in ("core", "middle") for r in acc_ok), "accurate served at an edge")
    at_core = sum(1 for r in acc_ok if tiers[r.site] == "core")
    need(at_core > 0.5 * len(acc_ok), f"accurate at the core: {at_core}/{len(acc_ok)}")
    need(summary.get("accurate", {}).get("slo_attainment", 0) >= 0.95, "accurate SLO attainment < 95 %")

    # delivered accuracy, measured against the digits' labels, keeps what each class asked for
    for name in ("tight", "accurate"):
        n = sum(1 for r in records if r.slo_class == name and r.ok)
        floor = _binomial_floor(classes[name].min_accuracy, n)
        got = summary.get(name, {}).get("accuracy", 0.0)
        need(got >= floor, f"{name} delivered accuracy {got:.3f} < {floor:.3f}")
    return bad


@pytest.mark.slow
async def test_mixed_workload_serves_tight_at_edge_and_accurate_at_core(
        small_mesh: LocalMesh, holdout: Holdout) -> None:
    """The SLO shares are timing properties on a 2-core machine that other jobs may be loading too:
    a run may be repeated (at most three, each bounded) and the best one must hold every property.
    Silent downgrades are checked on every run: no amount of load excuses one."""
    edges = small_mesh.edge_urls()
    assert sorted(edges) == ["edge-fra-1", "edge-par-1"]
    tiers = {n: s.tier for n, s in small_mesh.topology.sites.items()}
    metas = await catalog_variants(small_mesh)
    runs: list[tuple[list[str], str]] = []
    for attempt in range(3):
        result = await run_workload(edges, holdout.x, holdout.y, duration_s=12, qps=30, seed=11 + attempt,
                                    max_queries=600)
        _no_silent_downgrade(result.records, {c.name: c.min_accuracy for c in DEFAULT_CLASSES})
        summary = summarise(result.records, tiers)
        bad = _mixed_violations(result.records, summary, metas, tiers)
        detail = json.dumps(summary, indent=1)
        print(f"run {attempt + 1}: {bad or 'all properties hold'}\n{detail}")  # shown with -s or on failure
        runs.append((bad, f"load average {os.getloadavg()[0]:.1f}: {bad}"))
        if not bad:
            return
    pytest.fail("no run met every property:\n" + "\n".join(r[1] for r in runs) + "\nlast run:\n" + detail)


async def test_promised_accuracy_is_delivered_on_the_whole_holdout(
        small_mesh: LocalMesh, holdout: Holdout) -> None:
    """Every labelled holdout digit in one query: the share the mesh gets right is the accuracy it
    promised (the catalog measured that variant on these same rows), and meets the ask."""
    async with AsyncClient(small_mesh.edge_urls()["edge-par-1"], timeout=30) as client:
        for min_accuracy in (0.9, 0.985):
            res = await client.infer(TASK, holdout.x, latency_ms=3000, min_accuracy=min_accuracy)
            delivered = float((res.output().argmax(axis=1) == holdout.y).mean())
            assert not res.best_effort and res.accuracy >= min_accuracy, res
            assert delivered == pytest.approx(res.accuracy, abs=2 / len(holdout.y)), (res.variant, delivered)


async def test_impossible_slo_gets_an_explicit_answer(small_mesh: LocalMesh, holdout: Holdout) -> None:
    metas = await catalog_variants(small_mesh)
    best = max(m.accuracy for m in metas.values() if m.owner == "public")
    assert best < 0.999  # the premise: no variant anywhere reaches it
    x = holdout.x[:1]
    for edge, url in sorted(small_mesh.edge_urls().items()):
        async with AsyncClient(url, timeout=10) as client:
            started = time.perf_counter()
            with pytest.raises(ImpossibleSLO) as refused:
                await client.infer(TASK, x, latency_ms=200, min_accuracy=0.999, prefer="refuse")
            assert time.perf_counter() - started < 2.0, edge
            assert "0.999" in refused.value.message
            for prefer in ("latency", "accuracy"):
                started = time.perf_counter()
                res = await client.infer(TASK, x, latency_ms=200, min_accuracy=0.999, prefer=prefer)
                assert time.perf_counter() - started < 2.0, (edge, prefer)
                assert res.best_effort and res.reason == f"best_effort_{prefer}", (edge, prefer, res)
                assert res.accuracy < 0.999 and res.variant in metas, res
                assert res.output().shape == (1, 10)
                if prefer == "accuracy":
                    assert res.accuracy == pytest.approx(best), res

    # the same over a workload: every reply to an impossible ask is flagged, none are silent
    impossible = (SloClass("impossible", latency_ms=100, min_accuracy=0.999, share=1.0),)
    result = await run_workload(small_mesh.edge_urls(), holdout.x, holdout.y, duration_s=2, qps=20,
                                classes=impossible, seed=5, max_queries=40)
    assert len(result.records) >= 15
    assert all(r.ok and r.best_effort and r.reason == "best_effort_latency" for r in result.records), \
        [r for r in result.records if not (r.ok and r.best_effort)][:3]
    _no_silent_downgrade(result.records, {"impossible": 0.999})
    # a warm-up (what `tiermesh up` sends before it measures) waits for answers within the SLO, not for answers:
    # the impossible class is never ready, and its queries stop at the timeout, one per edge a round
    edges = small_mesh.edge_urls()
    warm = await warm_up(edges, holdout.x, holdout.y, classes=(DEFAULT_CLASSES[0], *impossible), timeout_s=1.5)
    assert warm["tight"].ready and warm["tight"].queries >= len(edges) and not warm["tight"].errors, warm
    assert not warm["impossible"].ready and warm["impossible"].seconds >= 1.5, warm
    assert 2 * len(edges) <= warm["impossible"].queries <= len(edges) * (1.5 / 0.25 + 2), warm

    # accuracy first with a budget the most accurate variant cannot meet (the core is over 30 ms away from
    # an edge): served by the most accurate variant that can answer in time, flagged, never 504 (issue 15:
    # best effort chose the most accurate variant anywhere, and most such queries died at their deadline)
    hurried = (SloClass("hurried", latency_ms=20, min_accuracy=0.999, share=1.0, prefer="accuracy"),)
    result = await run_workload(small_mesh.edge_urls(), holdout.x, holdout.y, duration_s=2, qps=20,
                                classes=hurried, seed=6, max_queries=40)
    assert len(result.records) >= 15
    failed = [r.error for r in result.records if not r.ok]
    assert not failed, failed
    assert all(r.best_effort and r.reason.startswith("best_effort_accuracy") for r in result.records)
    assert all(tiers != "core" for tiers in (small_mesh.topology.sites[r.site].tier for r in result.records))


# -- malformed requests against a real agent ---------------------------------------------------

def _json_infer(x: np.ndarray, **params: Any) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}],
            "parameters": {"latency_ms": 1000, **params}}


def _tensor(shape: list[int], datatype: str, n: int, name: str = "x") -> tuple[bytes, dict[str, str]]:
    t = {"name": name, "shape": shape, "datatype": datatype, "data": [0.0] * n}
    return json.dumps({"inputs": [t], "parameters": {"latency_ms": 1000}}).encode(), {}


def _bin(x: np.ndarray, *, declared: int | None = None, cut: int = 0) -> tuple[bytes, dict[str, str]]:
    raw = x.astype(np.float32).tobytes()
    head = json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                   "parameters": {"binary_data_size": declared or len(raw)}}],
                       "parameters": {"latency_ms": 1000}}).encode()
    return head + raw[:len(raw) - cut], {HEADER_LENGTH: str(len(head))}


def _params(**params: Any) -> Callable[[], tuple[bytes, dict[str, str]]]:
    return lambda: (json.dumps(_json_infer(X2, **params)).encode(), {})


X2 = np.linspace(0, 1, 128, dtype=np.float32).reshape(2, 64)
OVER_LIMIT = (16 << 20) + 1024  # the agent's default body limit is 16 MiB
MALFORMED: list[tuple[str, str, Callable[[], tuple[bytes, dict[str, str]]], int, str]] = [
    ("not json", TASK, lambda: (b'{"inputs": [', {}), 400, "bad_request"),
    ("wrong width", TASK, lambda: _tensor([1, 63], "FP32", 63), 400, "bad_tensor"),
    ("wrong rank", TASK, lambda: _tensor([64], "FP32", 64), 400, "bad_tensor"),
    ("shape vs data", TASK, lambda: _tensor([2, 64], "FP32", 127), 400, "bad_tensor"),
    ("dtype FP64", TASK, lambda: _tensor([1, 64], "FP64", 64), 400, "bad_tensor"),
    ("dtype INT32", TASK, lambda: _tensor([1, 64], "INT32", 64), 400, "bad_tensor"),
    ("unknown input", TASK, lambda: _tensor([1, 64], "FP32", 64, name="pixels"), 400, "bad_tensor"),
    ("unknown task", "no-such-task", _params(), 404, "unknown_task"),
    ("negative latency", TASK, _params(latency_ms=-5), 400, "bad_request"),
    ("latency not a number", TASK, _params(latency_ms="fast"), 400, "bad_request"),
    ("accuracy above 1", TASK, _params(min_accuracy=1.5), 400, "bad_request"),
    ("unknown prefer", TASK, _params(prefer="cheap"), 400, "bad_request"),
    ("tenant in body", TASK, _params(tenant="acme"), 403, "forbidden"),  # another tenant than the caller's
    ("oversized body", TASK, lambda: (b" " * OVER_LIMIT, {}), 413, "too_large"),
    ("declared binary too large", TASK, lambda: _bin(X2, declared=OVER_LIMIT), 413, "too_large"),
    ("truncated binary", TASK, lambda: _bin(X2, cut=8), 400, "bad_tensor"),
    ("bytes after tensors", TASK, lambda: (_bin(X2)[0] + b"\0" * 4, _bin(X2)[1]), 400, "bad_tensor"),
    ("bad header length", TASK, lambda: (b"{}", {HEADER_LENGTH: "ten"}), 400, "bad_request"),
    ("unknown tenant", TASK, lambda: (json.dumps(_json_infer(X2)).encode(), {TENANT_HEADER: "mallory"}),
     403, "unknown_tenant"),
]


async def _good_request(http: aiohttp.ClientSession, x: np.ndarray, y: np.ndarray) -> None:
    """The agent still serves, correctly: asserted after every rejection."""
    async with http.post(f"/v2/models/{TASK}/infer", json=_json_infer(x, min_accuracy=0.95)) as resp:
        body = await resp.json()
        assert resp.status == 200, body
    logits = np.array(body["outputs"][0]["data"], np.float32).reshape(body["outputs"][0]["shape"])
    assert logits.shape == (len(x), 10)
    assert body["parameters"]["accuracy"] >= 0.95 or body["parameters"]["best_effort"]
    assert (logits.argmax(axis=1) == y).mean() >= 0.5  # real predictions, not zeros


@pytest.mark.parametrize("task, make, status, code", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
async def test_malformed_request_is_4xx_and_the_agent_keeps_serving(
        small_mesh: LocalMesh, holdout: Holdout, task: str, make: Callable[[], tuple[bytes, dict[str, str]]],
        status: int, code: str) -> None:
    url = small_mesh.edge_urls()["edge-fra-1"]
    body, headers = make()
    async with aiohttp.ClientSession(url, timeout=aiohttp.ClientTimeout(total=20)) as http:
        async with http.post(f"/v2/models/{task}/infer", data=body,
                             headers={"Content-Type": "application/json", **headers}) as resp:
            err = await resp.json()
            assert resp.status == status, err
        assert err["code"] == code and isinstance(err["error"], str) and err["error"], err
        await _good_request(http, holdout.x[:4], holdout.y[:4])


async def test_unknown_tenant_is_refused_and_a_known_tenant_is_served(
        small_mesh: LocalMesh, holdout: Holdout) -> None:
    url = small_mesh.edge_urls()["edge-par-1"]
    x = holdout.x[:3]
    async with AsyncClient(url, tenant="mallory", timeout=10) as stranger:
        with pytest.raises(UnknownTenant) as refused:
            await stranger.infer(TASK, x, latency_ms=200, min_accuracy=0.9)
    assert refused.value.http_status == 403 and "mallory" in refused.value.message
    async with AsyncClient(url, tenant="acme", timeout=10) as acme:
        res = await acme.infer(TASK, x, latency_ms=200, min_accuracy=0.9)
    assert res.tenant == "acme" and res.output().shape == (3, 10)
    assert res.accuracy >= 0.9 and not res.best_effort
    assert (res.output().argmax(axis=1) == holdout.y[:3]).sum() >= 2


async def test_blob_fetches_travel_each_sites_path_to_the_variant_store(small_mesh: LocalMesh) -> None:
    """The variant store lives at the core: every other site fetched the blobs it loaded through
    its own delay proxy, so a cold start there paid at least one round trip of that path."""
    from edge_agent.agent_config import BLOB_PEER
    from mesh.etcd.keys import live_key

    store = small_mesh.store
    assert store is not None
    paths = topology_paths(small_mesh.topology)
    proxies = small_mesh.proxies.proxies
    assert ("core-eu", BLOB_PEER) not in proxies  # the store's own site fetches locally
    through_path = []
    for site in ("edge-fra-1", "edge-par-1", "mid-eu"):
        peers = json.loads((small_mesh.opts.home / "sites" / site / "peers.json").read_text())
        proxy = proxies[(site, BLOB_PEER)]
        assert peers[BLOB_PEER] == f"http://127.0.0.1:{proxy.port}"
        kv = await store.get(live_key(site))
        assert kv is not None and kv.value["loaded"], site
        if proxy.bytes_forwarded == 0:
            # it fetched every blob from a peer that already held it (edge_agent.blobs), before the store
            continue
        through_path.append(site)
        rtt = paths.rtt(site, "core-eu")
        # every load fetched at least one blob over the path (a shared backbone is fetched once,
        # so a head may load without a fetch of its own): the slowest load paid a round trip
        slowest = max(float(v["load_ms"]) for v in kv.value["loaded"].values())
        assert slowest >= rtt, (site, rtt, kv.value["loaded"])
    # the first site to need a blob has no peer holding it: at least one fetched over its path to the store
    assert through_path, "no site fetched through its path to the variant store"
