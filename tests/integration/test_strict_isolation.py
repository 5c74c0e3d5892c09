"""Isolation through the real site data plane (etcd view, catalog, ONNX Runtime): queries of shared
tenants on heads of one backbone are batched together and their replies say so; a ``strict`` tenant's
queries, sent at the same time to the same head, never appear in a batch with anyone else's (checked
from every batcher's recorded membership) and run on a backbone instance of their own."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from core_scheduler.state.view import MeshView
from edge_agent.batching import Batcher
from edge_agent.demand import DemandMeter
from edge_agent.site_dataplane import SiteDataPlane
from mesh.etcd.store import Store
from mesh.types import SLO, InferRequest, TaskSignature, TensorSpec
from mesh.zmq.client import ZmqClient
from tests.helpers.waiting import eventually
from tests.helpers_backbone import head_meta, seeded_host
from topology.loader import load_topology_file
from topology.schema import Tenant
from topology.store_io import apply as apply_topology
from variant_store.catalog import Catalog

pytestmark = pytest.mark.integration

TOPOLOGY = Path(__file__).resolve().parents[1] / "data" / "topology_small.yaml"
SITE = "edge-fra-1"
X_SPEC = (TensorSpec("x", "float32", (-1, 64)),)


async def test_strict_tenant_never_shares_a_batch_or_backbone(store: Store, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # the digits backbone and heads take ~0.1 ms a row: a request finding nothing queued would run inline,
    # alone (edge_agent.batching); this is about what batches hold, so every request queues
    monkeypatch.setattr(Batcher, "_inline_ok", lambda self, *args: False)
    topo = load_topology_file(TOPOLOGY)
    tenants = {t.name: t for t in (Tenant("acme"), Tenant("initech"), Tenant("globex", isolation="strict"))}
    await apply_topology(store, dataclasses.replace(topo, tenants=tenants))
    digits = head_meta("head-digits.onnx.fp32")
    parity = head_meta("head-parity.onnx.fp32", "head-parity.onnx", task="digit-parity")
    catalog = Catalog(store)
    for meta, classes in ((digits, 10), (parity, 2)):
        await catalog.put_task(TaskSignature(meta.task, X_SPEC, (TensorSpec("logits", "float32", (-1, classes)),)))
        await catalog.put_variant(meta)
    host = seeded_host(tmp_path, site=SITE)
    zmq = ZmqClient()
    async with MeshView(store, SITE) as view:
        async def ready() -> bool:
            return (view.variant(parity.task, parity.variant_id) is not None and view.topology is not None
                    and "globex" in view.topology.tenants)

        await eventually(ready, 10, "the view holds the tenants and the heads")
        dp = SiteDataPlane(SITE, view, host, zmq, table=lambda: None, peer_endpoint=lambda s: None,
                           demand=DemandMeter())
        rng = np.random.default_rng(3)

        def query(tenant: str, meta: object) -> InferRequest:
            assert isinstance(meta, type(digits))
            req = InferRequest.entering(meta.task, {"x": rng.random((1, 64), dtype=np.float32)},
                                        SLO(latency_ms=5000), tenant)
            req.target_site, req.target_variant = SITE, meta.variant_id
            return req

        try:
            replies = []
            for _ in range(6):  # rounds of concurrent queries from all three tenants to both heads
                reqs = [query(t, m) for t in ("acme", "initech", "globex", "acme", "initech", "globex")
                        for m in (digits, parity)]
                replies += await asyncio.gather(*(dp.infer(r) for r in reqs))
        finally:
            await zmq.close()
            batchers = {id(lv.batcher): lv.batcher for lv in host.instances.values()}
            bases = host.backbone_holders()
            await host.close()
    # membership: every batch holding a globex query holds only globex queries
    batches = [m for b in batchers.values() for m in b.membership]
    assert sum(len(m) for m in batches) == len(replies)
    strict = [m for m in batches if "globex" in m]
    assert strict and all(set(m) == {"globex"} for m in strict), strict
    assert any({"acme", "initech"} <= set(m) for m in batches), "shared tenants were never batched together"
    # a backbone instance of its own, holding only its own heads
    assert {k[1] for k in bases} == {"", "globex"}
    for (_, iso), holders in bases.items():
        assert {h[1] for h in holders} == {iso}
    # what the replies say
    for r in replies:
        if r.tenant == "globex":
            assert r.backbone_tenants == 0, "a strict tenant's backbone is its own, not shared"
        else:
            assert r.backbone_tenants >= 1
    assert max(r.backbone_tenants for r in replies) >= 2
