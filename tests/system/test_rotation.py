"""Issue 11: rotating every certificate of a secured mesh during a 30 s workload loses no query.

Every identity is re-issued in place at 10 s (sites with new CURVE keys, tenants, operator, scheduler, etcd),
as an operator rotating would; nothing restarts. Tenant clients re-read their files, edges reload theirs, each
agent takes its own new CURVE key (re-binding its listener, which drops every connection to it), peers dial the
key each site's live record publishes (the previous one stays admitted for a grace period) and re-send what was
in flight over the new connection (mesh.zmq.client, "Re-sent, not lost"). The workload's classes have budgets a healthy
mesh meets, forwarded ones included, so any error is the rotation's."""

from __future__ import annotations

import asyncio
import json

import pytest

from mesh.etcd.keys import live_key
from mesh.pki.identity import Identity
from tests.system.conftest import Holdout, mesh_running, wait_warm
from tiermesh.workload import SloClass, run_workload, summarise

pytestmark = [pytest.mark.system, pytest.mark.slow, pytest.mark.timeout(300)]

ROTATE_AT_S = 10.0
RUN_S = 30.0
# generous budgets: the edge's own small variant, the core's accurate one (forwarded over CURVE), and a
# second tenant's certificate
CLASSES = (
    SloClass("edge", latency_ms=500, min_accuracy=0.90, share=0.4),
    SloClass("forwarded", latency_ms=1000, min_accuracy=0.985, share=0.4),
    SloClass("acme", latency_ms=1000, min_accuracy=0.90, share=0.2, tenant="acme"),
)


async def test_rotating_every_certificate_under_load_loses_no_query(holdout: Holdout) -> None:
    async with mesh_running(tls=True) as mesh:
        assert mesh.creds is not None and mesh.store is not None
        await wait_warm(mesh, holdout.x)
        sites = sorted(mesh.sites)
        before = {s: mesh.creds.pki.curve(Identity("site", s)).public.decode() for s in sites}
        offered = [0]

        async def rotate_later() -> None:
            await asyncio.sleep(ROTATE_AT_S)
            await asyncio.to_thread(mesh.rotate_certificates)

        rotation = asyncio.create_task(rotate_later())
        try:
            result = await run_workload(mesh.edge_urls(), holdout.x, holdout.y, duration_s=RUN_S, qps=15,
                                        classes=CLASSES, seed=11, credentials=mesh.tenant_files,
                                        on_tick=lambda n, _t: offered.__setitem__(0, n))
            await rotation
        finally:
            rotation.cancel()
            await asyncio.gather(rotation, return_exceptions=True)
        recs = result.records
        tiers = {n: s.tier for n, s in mesh.topology.sites.items()}
        print(json.dumps(summarise(recs, tiers), default=str))  # the numbers, for whoever reads the log
        assert offered[0] > 300 and len(recs) == offered[0], "queries lost"
        failed = [(round(r.t, 1), r.slo_class, r.edge, r.error) for r in recs if not r.ok]
        assert not failed, f"{len(failed)} queries failed around the rotation: {failed[:10]}"
        after_rotation = [r for r in recs if r.t > ROTATE_AT_S + 2.0]
        assert sum(1 for r in after_rotation if r.site != r.edge) > 20, "nothing crossed sites after rotating"

        # the rotation really happened and took: every agent now serves with, and publishes, its new key
        for s in sites:
            new = mesh.creds.pki.curve(Identity("site", s)).public.decode()
            assert new != before[s]
            rec = await mesh.store.get(live_key(s))
            assert rec is not None and rec.value.get("curve_key") == new, (s, rec.value if rec else None)
