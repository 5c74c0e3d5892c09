"""Issue 11, item 3 on a real local mesh: with ``curve=True`` every site gets a certificate binding its CURVE
key, agents publish the key in their heartbeats, and queries forwarded between sites are served end to end;
a plain ZeroMQ peer dialling a site's port is served nothing; a site re-issued (new CURVE key) and restarted
is dialled with its new key."""

from __future__ import annotations

import time

import numpy as np
import pytest

from mesh.errors import DeadlineExceeded, PeerUnavailable
from mesh.etcd.keys import live_key
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from mesh.types import SLO, InferRequest
from mesh.zmq.client import ZmqClient
from tests.system.conftest import TASK, Holdout, mesh_running, wait_warm
from tiermesh.workload import run_workload, summarise

pytestmark = [pytest.mark.system, pytest.mark.slow, pytest.mark.timeout(300)]

SITES = ["core-eu", "edge-fra-1"]


async def test_forwarded_queries_are_served_over_curve(holdout: Holdout) -> None:
    async with mesh_running(curve=True, sites=SITES) as mesh:
        await wait_warm(mesh, holdout.x)
        assert mesh.store is not None
        pki = LocalPki.under(mesh.opts.home)
        for site in SITES:
            live = await mesh.store.get(live_key(site))
            assert live is not None
            assert live.value["curve_key"] == pki.curve(Identity("site", site)).public.decode(), site
        result = await run_workload(mesh.edge_urls(), holdout.x, holdout.y, duration_s=5.0, qps=20, seed=3,
                                    max_queries=150)
        # a plain ZeroMQ peer on the core's port: no handshake, nothing served
        core = mesh.sites["core-eu"].zmq
        assert core is not None
        async with ZmqClient() as plain:
            req = InferRequest(task=TASK, inputs={"x": holdout.x[:1].astype(np.float32)}, slo=SLO(1000.0),
                               request_id="plain-1", deadline=time.monotonic() + 2.0, hops=["edge-fra-1"],
                               target_site="core-eu")
            with pytest.raises((PeerUnavailable, DeadlineExceeded)):
                await plain.request(core, req)
        # rotate the core's certificate and CURVE key, restart it: the edge must dial it with the new key
        old_key = pki.curve(Identity("site", "core-eu")).public
        pki.issue(Identity("site", "core-eu"))
        assert pki.curve(Identity("site", "core-eu")).public != old_key
        await mesh.kill_site("core-eu")  # SIGKILL: its live record stays, then changes key
        await mesh.start_site("core-eu")
        await mesh.wait_live(["core-eu"])
        await wait_warm(mesh, holdout.x)
        after = await run_workload(mesh.edge_urls(), holdout.x, holdout.y, duration_s=4.0, qps=20, seed=4,
                                   max_queries=100)
    recs = result.records
    detail = str(summarise(recs, {n: s.tier for n, s in mesh.topology.sites.items()}))
    ok = [r for r in recs if r.ok]
    assert len(ok) >= 0.8 * len(recs) and len(recs) >= 50, detail
    forwarded = [r for r in ok if r.site != r.edge]
    assert forwarded, f"no query was forwarded between sites: {detail}"
    rotated = [r for r in after.records if r.ok and r.site == "core-eu" and r.edge != "core-eu"]
    assert rotated, f"nothing forwarded to the rotated core: {summarise(after.records, {})}"
