"""Blobs from peers, two real agents in process on the session etcd: an edge that never held a variant
loads it from the neighbour that does (with the variant store gone), a neighbour serving bad bytes is
caught by the digest check and the store used instead, and only sites may read an agent's blobs. A peer
fetch over HTTPS takes the blob only from the site it asked (its certificate's URI SAN) and no more of it than
the catalog's size, against real TLS servers that answer otherwise."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from edge_agent.agent import SITE_KIND, Agent
from edge_agent.agent_config import AgentConfig
from edge_agent.blob_cache import BlobCache
from edge_agent.blobs import PeerSource
from mesh.errors import BlobError, PeerUnavailable, RuntimeLoadError
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from mesh.pki.reload import ReloadingCredentials
from mesh.pki.site_names import server_site
from mesh.pki.trust import TrustStore
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

    def cfg(site: str) -> AgentConfig:  # plain ZeroMQ and HTTP: peers' URLs as their live records say
        return AgentConfig(site=site, etcd=etcd_server.url, prefix=store.prefix, home=tmp_path / site,
                           lease_ttl_s=2.0, heartbeat_s=0.5, insecure=True)

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
                assert [src.url for src in par.host.blobs.peer_sources(DIGEST)] == [fra.http_url]
                resp = await zmq.request(par.zmq_endpoint, _served_here("edge-par-1"))
                assert resp.site == "edge-par-1"
                assert hashlib.sha256(cached.read_bytes()).hexdigest() == DIGEST
                fra_copy.write_bytes(good)
            # the store is gone: mid has never held it, and gets it from the nearest holder
            await _live_holds(mid, "edge-par-1")
            assert mid.host is not None and mid.host.blobs.peer_sources is not None
            assert {src.url for src in mid.host.blobs.peer_sources(DIGEST)} == {fra.http_url, par.http_url}
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
        as_site = tenant_context(pki, Identity("site", "edge-par-1"))
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{fra.http_url}/blobs/{DIGEST}", ssl=acme) as r:
                assert r.status == 403 and (await r.json())["code"] == "forbidden"
            async with http.get(f"{fra.http_url}/blobs/{DIGEST}", ssl=as_site) as r:
                assert r.status == 200 and hashlib.sha256(await r.read()).hexdigest() == DIGEST
            # streamed from its file, not read whole per request: a range of it is served as one
            async with http.get(f"{fra.http_url}/blobs/{DIGEST}", ssl=as_site, headers={"Range": "bytes=4-11"}) as r:
                assert r.status == 206 and await r.read() == MODEL.read_bytes()[4:12]
        # a tenant's private variant: fra holds its blob, yet serves it to no peer, and no peer is asked for it
        # (the variant store gives it only to the sites placement asks to serve acme)
        private = (MODEL.read_bytes() + b"acme")
        p_digest = hashlib.sha256(private).hexdigest()
        (cache / f"{p_digest}.onnx").write_bytes(private)
        await Catalog(store).put_variant(dataclasses.replace(meta, variant_id="mlp-tiny.acme", owner="acme",
                                                             blob_digest=p_digest, size_bytes=len(private)))
        await _until(lambda: par.view is not None and par.view.variant(TASK, "mlp-tiny.acme") is not None)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{fra.http_url}/blobs/{p_digest}", ssl=as_site) as r:
                assert r.status == 403 and (await r.json())["code"] == "forbidden"
        assert par._blob_peers(DIGEST) and not par._blob_peers(p_digest)


async def _until(cond: Callable[[], bool]) -> None:
    for _ in range(100):  # bounded: the view follows etcd within a watch round trip
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the view never saw it")


@dataclass
class Served:
    """What a hostile blob server did: how many requests it answered, and how many body bytes it wrote."""

    requests: int = 0
    written: int = 0


Body = Callable[[web.Request, Served], Awaitable[web.StreamResponse]]
FLOOD = 64 << 20  # what a hostile peer offers for a blob of some kilobytes: far past any socket's buffers


@contextlib.asynccontextmanager
async def _blob_server(pki: LocalPki, who: Identity, body: Body) -> AsyncIterator[tuple[str, Served]]:
    """An HTTPS server with ``who``'s certificate (client certificates required), answering /blobs/ with ``body``."""
    served = Served()

    async def handler(request: web.Request) -> web.StreamResponse:
        served.requests += 1
        return await body(request, served)

    app = web.Application()
    app.router.add_get("/blobs/{digest}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    ctx = ReloadingCredentials.for_identity(pki.paths, who).server_context()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"https://127.0.0.1:{port}", served
    finally:
        await runner.cleanup()


def _fetching_site(pki: LocalPki, tmp: Path, source: PeerSource) -> BlobCache:
    """edge-par-1's blob cache, as its agent sets it up with TLS, whose only source is ``source``."""
    me = Identity("site", "edge-par-1")
    trust = TrustStore.under(pki.paths)
    cache = BlobCache(me.name, tmp / "cache")
    cache.ssl = ReloadingCredentials.for_identity(pki.paths, me).client_context()
    cache.verify_server = lambda ssl_object: server_site(
        ssl_object, lambda cert: trust.verify(cert, use="server", kinds=SITE_KIND))
    cache.peer_sources = lambda digest: [source] if digest == DIGEST else []
    return cache


async def _the_model(request: web.Request, served: Served) -> web.StreamResponse:
    data = MODEL.read_bytes()
    served.written += len(data)
    return web.Response(body=data)


async def _flood(request: web.Request, served: Served, resp: web.StreamResponse) -> web.StreamResponse:
    await resp.prepare(request)
    chunk = b"\0" * (1 << 20)
    with contextlib.suppress(ConnectionError):
        while served.written < FLOOD:
            await resp.write(chunk)
            served.written += len(chunk)
    return resp


async def _a_flood(request: web.Request, served: Served) -> web.StreamResponse:
    """FLOOD bytes, chunked (no Content-Length to refuse them by), written as long as they are read."""
    return await _flood(request, served, web.StreamResponse())


async def _a_big_length(request: web.Request, served: Served) -> web.StreamResponse:
    """FLOOD bytes announced in the Content-Length: refused before the body is read."""
    return await _flood(request, served, web.StreamResponse(headers={"Content-Length": str(FLOOD)}))


@pytest.fixture
def sites_pki(tmp_path: Path) -> LocalPki:
    pki = LocalPki.under(tmp_path / "pki-home")
    pki.init()
    for site in ("edge-fra-1", "edge-par-1", "core-eu"):
        pki.issue(Identity("site", site), addresses=["127.0.0.1"])
    return pki


async def test_a_peer_blob_is_taken_only_from_the_site_asked(sites_pki: LocalPki, tmp_path: Path) -> None:
    size = MODEL.stat().st_size
    async with _blob_server(sites_pki, Identity("site", "edge-fra-1"), _the_model) as (url, _):
        cache = _fetching_site(sites_pki, tmp_path, PeerSource("edge-fra-1", url, size))
        path = await cache.fetch(DIGEST, "onnx")  # the site itself: served
        assert hashlib.sha256(path.read_bytes()).hexdigest() == DIGEST
    # the same URL served by another site (a CA-signed certificate, naming the same address): not that site
    async with _blob_server(sites_pki, Identity("site", "core-eu"), _the_model) as (url, served):
        cache = _fetching_site(sites_pki, tmp_path / "second", PeerSource("edge-fra-1", url, size))
        with pytest.raises(RuntimeLoadError, match="no peer holds"):  # and no store to fall back on
            await cache.fetch(DIGEST, "onnx")
        assert served.requests == 1 and not list((tmp_path / "second" / "cache").glob("*"))


@pytest.mark.parametrize("body", [_a_flood, _a_big_length])
async def test_a_peer_sends_no_more_than_the_catalogs_size(sites_pki: LocalPki, tmp_path: Path, body: Body) -> None:
    size = MODEL.stat().st_size
    async with _blob_server(sites_pki, Identity("site", "edge-fra-1"), body) as (url, served):
        cache = _fetching_site(sites_pki, tmp_path, PeerSource("edge-fra-1", url, size))
        with pytest.raises(RuntimeLoadError, match="no peer holds"):
            await cache.fetch(DIGEST, "onnx")
        await asyncio.sleep(0.2)  # the server notices the connection closed
    # nothing kept, and the fetch stopped reading at the cap: what the server wrote past it went into socket
    # buffers (a few megabytes), not to this site's disk
    assert not list((tmp_path / "cache").glob("*"))
    assert served.written < FLOOD // 4, served.written
