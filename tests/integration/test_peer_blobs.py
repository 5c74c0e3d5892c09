"""Blobs from peers, two real agents in process on the session etcd: an edge that never held a variant
loads it from the neighbour that does (with the variant store gone), a neighbour serving bad bytes is
caught by the digest check and the store used instead, and only sites may read an agent's blobs."""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from edge_agent.agent import Agent
from edge_agent.agent_config import AgentConfig
from mesh.errors import BlobError, PeerUnavailable, RuntimeLoadError
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from mesh.types import SLO, InferRequest
from mesh.zmq.client import ZmqClient
from tests.helpers.mtls_edge import tenant_context
from tests.integration.test_quota_flood import MODEL, TASK, _catalog, _topology
from topology.loader import load_topology_file
from topology.store_io import apply as apply_topology
from variant_store.blobs import BlobStore
from variant_store.catalog import Catalog
from variant_store.server import VariantStoreServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

VID = "mlp-tiny.onnx.fp32"
DIGEST = hashlib.sha256(MODEL.read_bytes()).hexdigest()


def _served_here(site: str) -> InferRequest:
    """A query another site decided ``site`` serves with the tiny MLP: ``site`` must load it itself."""
    return InferRequest(task=TASK, inputs={"x": np.full((1, 64), 0.25, np.float32)}, slo=SLO(10_000.0),
                        deadline=time.monotonic() + 10.0, hops=["core-eu"], target_site=site, target_variant=VID)


async def _live_holds(agent: Agent, site: str) -> None:
    assert agent.view is not None
    for _ in range(100):  # bounded: heartbeats every 0.5 s
        hb = agent.view.live.get(site)
        if hb is not None and VID in hb.loaded:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{agent.site} never saw {site} holding {VID}")


async def test_an_edge_loads_a_variant_from_the_neighbour_that_holds_it(
        store: Store, etcd_server: EmbeddedEtcd, tmp_path: Path) -> None:
    await apply_topology(store, load_topology_file(_topology(tmp_path)))
    blobs = BlobStore(tmp_path / "blobs")
    await _catalog(store, blobs)

    def cfg(site: str) -> AgentConfig:
        return AgentConfig(site=site, etcd=etcd_server.url, prefix=store.prefix, home=tmp_path / site,
                           lease_ttl_s=2.0, heartbeat_s=0.5)

    zmq = ZmqClient()
    try:
        async with Agent(cfg("edge-fra-1")) as fra, Agent(cfg("edge-par-1")) as par, \
                Agent(cfg("mid-eu")) as mid:
            cached = tmp_path / "edge-par-1" / "sites" / "edge-par-1" / "blobs" / f"{DIGEST}.onnx"
            async with VariantStoreServer(blobs, Catalog(store), host="127.0.0.1"):
                for _ in range(100):  # bounded: the store's announcement reaches the agents' views
                    if all(a.host is not None and a.host.blobs.store_url for a in (fra, par)):
                        break
                    await asyncio.sleep(0.05)
                resp = await zmq.request(fra.zmq_endpoint, _served_here("edge-fra-1"))
                assert resp.site == "edge-fra-1"
                # fra's copy is bad now: par's digest check refuses it and takes the store's
                fra_copy = tmp_path / "edge-fra-1" / "sites" / "edge-fra-1" / "blobs" / f"{DIGEST}.onnx"
                good = fra_copy.read_bytes()
                fra_copy.write_bytes(bytes([good[0] ^ 0xFF]) + good[1:])
                await _live_holds(par, "edge-fra-1")
                assert par.host is not None and par.host.blobs.peer_sources is not None
                assert par.host.blobs.peer_sources(DIGEST) == [fra.http_url]
                resp = await zmq.request(par.zmq_endpoint, _served_here("edge-par-1"))
                assert resp.site == "edge-par-1"
                assert hashlib.sha256(cached.read_bytes()).hexdigest() == DIGEST
                fra_copy.write_bytes(good)
            # the store is gone: mid has never held it, and gets it from the nearest holder
            await _live_holds(mid, "edge-par-1")
            assert mid.host is not None and mid.host.blobs.peer_sources is not None
            assert set(mid.host.blobs.peer_sources(DIGEST)) == {fra.http_url, par.http_url}
            resp = await zmq.request(mid.zmq_endpoint, _served_here("mid-eu"))
            assert resp.site == "mid-eu" and resp.outputs["logits"].shape == (1, 10)
            mid_copy = tmp_path / "mid-eu" / "sites" / "mid-eu" / "blobs" / f"{DIGEST}.onnx"
            assert hashlib.sha256(mid_copy.read_bytes()).hexdigest() == DIGEST
            # a blob nobody holds, with the store gone: a clear load error (PeerUnavailable naming the store while
            # the store's withdrawal has not reached mid's view yet: seen once in a fresh-clone CI run)
            assert mid.host is not None
            with pytest.raises((RuntimeLoadError, BlobError, PeerUnavailable)):
                await mid.host.blobs.fetch("0" * 64, "onnx")
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{fra.http_url}/blobs/{DIGEST}") as r:
                    assert r.status == 200 and hashlib.sha256(await r.read()).hexdigest() == DIGEST
                async with http.get(f"{fra.http_url}/blobs/not-a-digest") as r:
                    assert r.status == 400
                async with http.get(f"{fra.http_url}/blobs/{'1' * 64}") as r:
                    assert r.status == 404
    finally:
        await zmq.close()


async def test_with_tls_blobs_go_over_the_sites_mtls_identity_and_only_to_sites(
        store: Store, etcd_server: EmbeddedEtcd, tmp_path: Path) -> None:
    await apply_topology(store, load_topology_file(_topology(tmp_path)))
    await _catalog(store, BlobStore(tmp_path / "blobs"))  # in the catalog; no variant store runs at all
    pki = LocalPki.under(tmp_path / "pki-home")
    pki.init()
    for site in ("edge-fra-1", "edge-par-1"):
        pki.issue(Identity("site", site), addresses=["127.0.0.1"])
    pki.issue(Identity("tenant", "acme"))

    def cfg(site: str) -> AgentConfig:
        return AgentConfig(site=site, etcd=etcd_server.url, prefix=store.prefix, home=tmp_path / site,
                           lease_ttl_s=2.0, heartbeat_s=0.5, tls=True, pki_dir=pki.paths.root)

    async with Agent(cfg("edge-fra-1")) as fra, Agent(cfg("edge-par-1")) as par:
        assert fra.http_url.startswith("https://") and fra.host is not None and par.host is not None
        assert fra.view is not None and par.view is not None
        meta = fra.view.variant(TASK, VID)
        assert meta is not None
        # fra has the blob on disk already (as if fetched earlier): it loads without any network
        cache = tmp_path / "edge-fra-1" / "sites" / "edge-fra-1" / "blobs"
        cache.mkdir(parents=True, exist_ok=True)
        (cache / f"{DIGEST}.onnx").write_bytes(MODEL.read_bytes())
        await fra.host.ensure(meta)
        await _live_holds(par, "edge-fra-1")
        lv = await par.host.ensure(meta)  # over HTTPS with par's site certificate
        assert lv.meta.variant_id == VID
        # a tenant's certificate is refused the blob route; a site's is served
        acme = tenant_context(pki, Identity("tenant", "acme"))
        site = tenant_context(pki, Identity("site", "edge-par-1"))
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{fra.http_url}/blobs/{DIGEST}", ssl=acme) as r:
                assert r.status == 403 and (await r.json())["code"] == "forbidden"
            async with http.get(f"{fra.http_url}/blobs/{DIGEST}", ssl=site) as r:
                assert r.status == 200 and hashlib.sha256(await r.read()).hexdigest() == DIGEST
