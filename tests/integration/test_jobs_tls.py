"""Offline jobs with mutual TLS everywhere (a real agent with edge TLS and CURVE, a variant store serving HTTPS):
the tenant is the one its client certificate names, the agent stores and reads job data with its site
certificate, and a tenant reaches neither another tenant's job at the edge nor its data at the store."""

from __future__ import annotations

import asyncio
import io
import ssl
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from edge_agent.agent import Agent
from edge_agent.agent_config import AgentConfig
from mesh.errors import RequestError
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from mesh.jobs import AsyncJobs
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from tests.helpers.mtls_edge import tenant_context
from tests.integration.test_quota_flood import TASK, _catalog
from topology.loader import load_topology_file
from topology.store_io import apply as apply_topology
from variant_store.access import StoreTls
from variant_store.blobs import BlobStore
from variant_store.catalog import Catalog
from variant_store.data_area import DataArea
from variant_store.families.datasets import load_validation_npz
from variant_store.server import VariantStoreServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

TOPOLOGY = Path(__file__).resolve().parents[1] / "data" / "topology_small.yaml"
SITE, STORE = Identity("site", "edge-fra-1"), Identity("store", "vs")
ACME, GLOBEX = Identity("tenant", "acme"), Identity("tenant", "globex")


async def test_a_job_over_mutual_tls_is_its_tenants_alone(store: Store, etcd_server: EmbeddedEtcd,
                                                          tmp_path: Path) -> None:
    pki = LocalPki.under(tmp_path)
    pki.init()
    pki.issue(SITE, addresses=["127.0.0.1"])
    pki.issue(STORE, addresses=["127.0.0.1"])
    for t in (ACME, GLOBEX):
        pki.issue(t)
    await apply_topology(store, load_topology_file(TOPOLOGY))
    blobs = BlobStore(tmp_path / "blobs")
    await _catalog(store, blobs)
    x = load_validation_npz().x[:500]
    cfg = AgentConfig(site=SITE.name, etcd=etcd_server.url, prefix=store.prefix, home=tmp_path, lease_ttl_s=2.0,
                      heartbeat_s=0.5, tls=True)
    area = DataArea(tmp_path / "data")
    async with VariantStoreServer(blobs, Catalog(store), host="127.0.0.1", tls=StoreTls(pki.paths, STORE),
                                  data=area) as server, Agent(cfg) as agent:
        for _ in range(200):  # bounded: the store's announcement reaches the agent's view
            if agent.host is not None and agent.host.blobs.store_url:
                break
            await asyncio.sleep(0.05)
        paths = pki.paths
        async with AsyncJobs(agent.http_url, cert=paths.cert(ACME), key=paths.key(ACME), ca=paths.ca_cert) as acme:
            job = await acme.submit(TASK, x, deadline_s=600, chunk_rows=100)
            assert (await job.wait(poll_s=0.1, timeout=60))["state"] == "done"
            assert (await job.result())["logits"].shape == (500, 10)
            digest = (await job.status())["input_digest"]
        async with AsyncJobs(agent.http_url, cert=paths.cert(GLOBEX), key=paths.key(GLOBEX),
                             ca=paths.ca_cert) as globex:
            with pytest.raises(RequestError) as other:
                await globex.show(TASK, job.id)
            assert "no job" in str(other.value)
            assert await globex.list() == []
        data_url = f"{server.url}/data/acme/{digest}"
        for who, want in ((ACME, 200), (GLOBEX, 403)):
            ctx: ssl.SSLContext = tenant_context(pki, who)
            async with aiohttp.ClientSession() as http, http.get(data_url, ssl=ctx) as r:
                assert r.status == want, who
                if want == 200:
                    with np.load(io.BytesIO(await r.read())) as npz:
                        assert np.array_equal(npz["x"], x)
        assert area.objects("acme") == 1 + 5  # the input and the five chunks' outputs
