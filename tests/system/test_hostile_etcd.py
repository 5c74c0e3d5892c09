"""Issue 29, item 1, end to end: a compromised site writes random and hostile values to every key it may write
while a workload runs, and nothing stops.

A secured mesh (TLS, etcd with client certificates and RBAC) runs three of the small topology's sites. The fourth,
``edge-par-1``, is the attacker: its agent never starts, but its certificate is issued, so RBAC holds it to exactly
what a site may write, its ``live/edge-par-1`` and ``pki/sites/edge-par-1``. Through its own etcd client it writes a
few hundred values there (``tests.unit.test_hostile_values``: NaN and infinities, numbers past any range, nesting
100 000 deep, bytes that are not UTF-8, a megabyte of string, wrong types, random noise; and certificate records
holding garbage or another site's certificate) while a mixed workload runs from the edge, and ends on the values that
stopped the control plane before (an ``Infinity`` heartbeat, a 100 000-deep certificate record).

Then every class met its SLO for >= 95 % of its queries, every agent process and the scheduler still run, every view
(each agent's, as its heartbeat's ``view_revision`` says; the scheduler's; the console's) followed past the last
hostile write, and an agent started afterwards (reading the hostile values at its start) starts and serves. Before
the fix the first ``Infinity`` stopped every view's follow task and the restarted agent failed in ``view.start()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import Counter
from typing import Any

import pytest

from core_scheduler.state.view import MeshView
from mesh.client import AsyncClient
from mesh.errors import MeshError
from mesh.etcd import messages as rpc
from mesh.etcd.channels import StorePermissionDenied
from mesh.etcd.keys import live_key, site_cert_key
from mesh.etcd.store import Store
from mesh.pki.identity import Identity
from tests.helpers.waiting import eventually
from tests.system.conftest import TASK, Holdout, mesh_running, wait_warm
from tests.unit.test_hostile_values import HOSTILE, hostile_bytes
from tiermesh.harness import LocalMesh
from tiermesh.workload import DEFAULT_CLASSES, run_workload, summarise

pytestmark = [pytest.mark.system, pytest.mark.slow, pytest.mark.timeout(240)]

SITES = ["core-eu", "mid-eu", "edge-fra-1"]
ATTACKER = "edge-par-1"   # a site of the topology whose agent never runs: only its certificate, in hostile hands
EDGE = "edge-fra-1"
RUN_S, QPS = 15.0, 20.0
MAX_WRITES, WRITE_GAP_S = 400, 0.03


async def _put_raw(store: Store, key: str, raw: bytes) -> int:
    """``raw`` as it is (``Store.put`` writes JSON only), as the compromised site's own etcd client would."""
    req = rpc.PutRequest(key=store.prefix.encode() + key.encode(), value=raw)
    resp = await store.call(f"put {key!r}", lambda m, t: m.kv.Put(req, timeout=t))
    return int(resp.header.revision)


def _cert_records(mesh: LocalMesh, rng: random.Random) -> bytes:
    """A hostile ``pki/sites`` value: a record shaped right around a PEM no one signed, another site's real
    certificate, a record of the wrong schema, or any hostile heartbeat-ish bytes."""
    assert mesh.creds is not None
    other = mesh.creds.pki.paths.cert(Identity("site", rng.choice(SITES))).read_text()
    choice = rng.random()
    if choice < 0.25:
        return json.dumps({"schema": 1, "pem": other}).encode()  # a real certificate, of another site
    if choice < 0.45:
        body = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdef0123456789+/") for _ in range(rng.randint(4, 900)))
        return json.dumps({"schema": 1, "pem": f"-----BEGIN CERTIFICATE-----\n{body}\n-----END CERTIFICATE-----"}
                          ).encode()
    if choice < 0.55:
        return json.dumps({"schema": rng.choice([0, 2, "1", None, 1.5]), "pem": other}).encode()
    return hostile_bytes(rng)


async def _attack(mesh: LocalMesh, store: Store, stop: asyncio.Event) -> tuple[int, int]:
    """Write hostile values to the attacker's two keys until ``stop`` (at most MAX_WRITES); the last ones are those
    that stopped the control plane before. Returns (writes, the revision of the last)."""
    rng = random.Random(29)
    writes = rev = 0
    while not stop.is_set() and writes < MAX_WRITES:
        if writes % 2:
            rev = await _put_raw(store, site_cert_key(ATTACKER), _cert_records(mesh, rng))
        else:
            rev = await _put_raw(store, live_key(ATTACKER), hostile_bytes(rng))
        writes += 1
        await asyncio.sleep(WRITE_GAP_S)
    await _put_raw(store, site_cert_key(ATTACKER), HOSTILE["deep-list"])
    rev = await _put_raw(store, live_key(ATTACKER), HOSTILE["infinity"])
    return writes + 2, rev


async def _views_past(mesh: LocalMesh) -> dict[str, int]:
    """How far each view has followed: agents by their heartbeat's ``view_revision``, the scheduler's and the
    console's views directly."""
    assert mesh.store is not None and mesh.scheduler is not None and mesh.console is not None
    out: dict[str, int] = {"scheduler": mesh.scheduler.view.revision, "console": mesh.console.model.view.revision}
    for name in SITES:
        kv = await mesh.store.get(live_key(name))
        out[name] = int(kv.value.get("view_revision", 0)) if kv is not None and isinstance(kv.value, dict) else -1
    return out


def _alive(mesh: LocalMesh) -> dict[str, bool]:
    assert mesh.scheduler is not None and mesh.console is not None
    views: dict[str, MeshView] = {"scheduler": mesh.scheduler.view, "console": mesh.console.model.view}
    out = {name: sp.proc is not None and sp.proc.returncode is None
           for name, sp in mesh.sites.items() if name in SITES}
    for name, view in views.items():
        out[f"{name} view"] = all(t is not None and not t.done() for t in (view._follow_task, *view._tasks))
    out["scheduler loop"] = mesh.scheduler._task is not None and not mesh.scheduler._task.done()
    return out


async def test_a_compromised_site_writing_hostile_values_stops_nothing(holdout: Holdout) -> None:
    started = time.monotonic()
    async with mesh_running(tls=True, sites=SITES, console=True) as mesh:
        assert mesh.creds is not None and mesh.store is not None and mesh.scheduler is not None
        await wait_warm(mesh, holdout.x)
        mesh.creds.pki.issue(Identity("site", ATTACKER), addresses=["127.0.0.1"])  # as `tiermesh pki issue` would
        f = mesh.creds.files(Identity("site", ATTACKER))
        attacker = await Store.connect(mesh.etcd_url, mesh.opts.prefix, ca=f["ca"], cert=f["cert"], key=f["key"])
        try:
            with pytest.raises(StorePermissionDenied):  # RBAC holds it to its own keys
                await _put_raw(attacker, live_key(EDGE), HOSTILE["infinity"])
            warm_s = time.monotonic() - started
            stop = asyncio.Event()
            attack = asyncio.create_task(_attack(mesh, attacker, stop))
            try:
                edges = {EDGE: mesh.edge_urls()[EDGE]}
                result = await run_workload(edges, holdout.x, holdout.y, duration_s=RUN_S, qps=QPS, seed=29,
                                            credentials=mesh.tenant_files)
            finally:
                stop.set()
                writes, last = await attack
        finally:
            await attacker.close()

        past: dict[str, int] = {}

        async def caught_up() -> bool:
            past.update(await _views_past(mesh))
            return min(past.values()) >= last

        with contextlib.suppress(AssertionError):  # asserted below, with the numbers
            await eventually(caught_up, 20, "every view past the last hostile write", interval=0.5)
        alive = _alive(mesh)
        print(json.dumps({"writes": writes, "last_revision": last, "views_at": past, "alive": alive,
                          "warm_s": round(warm_s, 1)}))
        assert writes >= 100, f"only {writes} hostile writes"
        assert all(alive.values()), f"a process or a view's task stopped: {alive}"
        assert all(at >= last for at in past.values()), f"a view stopped following before revision {last}: {past}"
        refused = {"scheduler": mesh.scheduler.view.refused, "console": mesh.console.model.view.refused}  # type: ignore[union-attr]
        assert all(n > 0 for n in refused.values()), refused

        # an agent started now reads both hostile values at its start
        await mesh.kill_site(EDGE, graceful=True)
        await mesh.start_site(EDGE)
        url = mesh.sites[EDGE].http
        assert url is not None
        tf = mesh.tenant_files("public")
        async with AsyncClient(url, timeout=10.0, cert=tf["cert"], key=tf["key"], ca=tf["ca"]) as client:
            reply: Any = None
            for _ in range(40):
                try:
                    reply = await client.infer(TASK, holdout.x[:1], latency_ms=400, min_accuracy=0.9)
                    break
                except MeshError:  # the restarted agent may still be reading its placement
                    await asyncio.sleep(0.25)
        assert reply is not None and reply.outputs, "the agent started after the attack serves nothing"
        total_s = time.monotonic() - started

    recs = result.records
    summary = summarise(recs, {n: mesh.topology.sites[n].tier for n in mesh.topology.sites})
    print(json.dumps({"refused": refused, "total_s": round(total_s, 1),
                      "attainment": {c: s["slo_attainment"] for c, s in summary.items()}, "summary": summary}))
    assert len(recs) > 0.8 * RUN_S * QPS
    for cls in DEFAULT_CLASSES:
        mine = [r for r in recs if r.slo_class == cls.name]
        met = sum(r.met for r in mine)
        assert met >= 0.95 * len(mine), f"{cls.name}: {met}/{len(mine)} met ({Counter(r.error for r in mine)})"
