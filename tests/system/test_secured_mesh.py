"""A secured local mesh (``tiermesh up``'s default, :mod:`tiermesh.secure`) holds every role to its own: etcd
speaks TLS with client certificates and RBAC, so an agent's certificate writes only its own live key and a tenant's
reads nothing; the variant store speaks HTTPS and hands a tenant-private variant only to its tenant (and the sites
placement asks to serve that tenant); agents fetch their blobs from it with their site certificates, or nothing
would be served. The edge's gRPC front answers unmodified ``tritonclient.grpc.aio`` with the tenant of its
certificate, and refuses a caller without one."""

from __future__ import annotations

import asyncio
import os
import ssl
import sys
import time

import aiohttp
import numpy as np
import pytest
import tritonclient.grpc as tgrpc_sync
import tritonclient.grpc.aio as tgrpc
from tritonclient.utils import InferenceServerException

from mesh.client import AsyncClient
from mesh.errors import MeshError
from mesh.etcd.channels import StorePermissionDenied
from mesh.etcd.keys import live_key, placement_key, tenant_key
from mesh.etcd.server import clear_record, write_record
from mesh.etcd.store import Store
from mesh.pki.identity import Identity
from tests.system.conftest import SMALL_TOPOLOGY, TASK, Holdout, mesh_running
from tiermesh.harness import LocalMesh
from tiermesh.secure import OPERATOR

pytestmark = [pytest.mark.system, pytest.mark.slow]
EDGE, CORE = "edge-fra-1", "core-eu"


def _context(mesh: LocalMesh, who: Identity | None) -> ssl.SSLContext:
    assert mesh.creds is not None
    ctx = ssl.create_default_context(cafile=str(mesh.creds.pki.paths.ca_cert))
    ctx.check_hostname = False
    if who is not None:
        ctx.load_cert_chain(mesh.creds.pki.paths.cert(who), mesh.creds.pki.paths.key(who))
    return ctx


async def _connect_as(mesh: LocalMesh, who: Identity) -> Store:
    assert mesh.creds is not None
    f = mesh.creds.files(who)
    return await Store.connect(mesh.etcd_url, mesh.opts.prefix, ca=f["ca"], cert=f["cert"], key=f["key"], timeout=5)


async def _status(session: aiohttp.ClientSession, url: str, ctx: ssl.SSLContext) -> int:
    async with session.get(url, ssl=ctx, timeout=aiohttp.ClientTimeout(total=15)) as resp:
        await resp.read()
        return resp.status


async def _catalog_ids(session: aiohttp.ClientSession, url: str, ctx: ssl.SSLContext) -> set[str]:
    async with session.get(f"{url}/catalog", ssl=ctx, timeout=aiohttp.ClientTimeout(total=15)) as resp:
        assert resp.status == 200, await resp.text()
        return {v["variant_id"] for v in (await resp.json())["variants"]}


async def _grpc_served(mesh: LocalMesh, x: np.ndarray) -> None:
    """A digits query over gRPC at the edge as acme, and a caller without a certificate refused."""
    url = mesh.sites[EDGE].grpc
    assert url is not None and url.startswith("grpcs://")
    files = {k: str(v) for k, v in mesh.tenant_files("acme").items()}
    inp = tgrpc.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x.astype(np.float32))
    client = tgrpc.InferenceServerClient(url.removeprefix("grpcs://"), ssl=True, root_certificates=files["ca"],
                                         private_key=files["key"], certificate_chain=files["cert"])
    try:
        assert await client.is_server_live()
        reply = (await client.infer(TASK, [inp], parameters={"latency_ms": 400, "min_accuracy": 0.9})).get_response()
        assert reply.parameters["tenant"].string_param == "acme" and reply.parameters["site"].string_param
        assert reply.outputs and reply.raw_output_contents
    finally:
        await client.close()

    def sync_query() -> str:  # the sync client too (it blocks its caller: in a thread)
        sync = tgrpc_sync.InferenceServerClient(url.removeprefix("grpcs://"), ssl=True, root_certificates=files["ca"],
                                                private_key=files["key"], certificate_chain=files["cert"])
        try:
            one = tgrpc_sync.InferInput("x", list(x.shape), "FP32")
            one.set_data_from_numpy(x.astype(np.float32))
            got = sync.infer(TASK, [one], parameters={"latency_ms": 400, "min_accuracy": 0.9})
            assert got.as_numpy("logits").shape == (len(x), 10)
            return str(got.get_response().parameters["tenant"].string_param)
        finally:
            sync.close()

    assert await asyncio.to_thread(sync_query) == "acme"
    anonymous = tgrpc.InferenceServerClient(url.removeprefix("grpcs://"), ssl=True, root_certificates=files["ca"])
    try:
        with pytest.raises(InferenceServerException):
            await anonymous.infer(TASK, [inp], parameters={"latency_ms": 400}, client_timeout=15)
    finally:
        await anonymous.close()


async def test_a_secured_mesh_holds_every_role_to_its_own(holdout: Holdout) -> None:
    async with mesh_running(tls=True) as mesh:
        assert mesh.etcd_url.startswith("https://") and (mesh.store_url or "").startswith("https://")

        # served through a tenant certificate: the agents fetched their blobs over HTTPS
        x = holdout.x[:1]
        http = mesh.sites[EDGE].http
        assert http is not None
        async with AsyncClient(http, **mesh.tenant_files("acme")) as client:
            deadline, last = time.monotonic() + 90, ""
            while True:
                try:
                    reply = await client.infer(TASK, x, latency_ms=400, min_accuracy=0.9)
                    break
                except MeshError as exc:
                    last = f"{exc.code}: {exc}"
                if time.monotonic() > deadline:
                    pytest.fail(f"nothing served in 90 s on the secured mesh: {last}")
                await asyncio.sleep(0.5)
        assert reply.outputs
        await _grpc_served(mesh, x)

        # etcd: a site reads the mesh and writes only its own live key
        site = await _connect_as(mesh, Identity("site", EDGE))
        try:
            assert await site.get(live_key(EDGE)) is not None
            for key in (live_key(CORE), placement_key(EDGE), tenant_key("acme")):
                with pytest.raises(StorePermissionDenied):
                    await site.put(key, {"forged": True})
        finally:
            await site.close()
        # ... and a tenant has no etcd user at all
        with pytest.raises(StorePermissionDenied):
            await _connect_as(mesh, Identity("tenant", "acme"))

        # the variant store: a tenant-private variant goes to its tenant and to the sites placement asks to serve
        # that tenant (etcd placement/<site>), not to another tenant nor to any other site
        assert mesh.catalog is not None and mesh.store_url is not None and mesh.store is not None
        metas = await mesh.catalog.list_variants()
        private = [m for m in metas if m.owner == "acme"]
        assert private, "the digits family registers acme's private head"
        blob = f"{mesh.store_url}/blobs/{private[0].blob_digest}"
        acme, globex = Identity("tenant", "acme"), Identity("tenant", "globex")
        acme_variants = {(m.task, m.variant_id) for m in private}
        async with aiohttp.ClientSession() as s:
            assert await _status(s, blob, _context(mesh, acme)) == 200
            for site in mesh.sites:
                held = await mesh.store.get(placement_key(site))
                asked = {(v["task"], v["variant_id"]) for v in (held.value["variants"] if held else [])}
                # the store reads placement when asked; a placement moved away since keeps its grace (5 min)
                if asked & acme_variants:
                    assert await _status(s, blob, _context(mesh, Identity("site", site))) == 200, site
            assert await _status(s, blob, _context(mesh, globex)) == 403
            assert private[0].variant_id in await _catalog_ids(s, mesh.store_url, _context(mesh, acme))
            assert private[0].variant_id not in await _catalog_ids(s, mesh.store_url, _context(mesh, globex))
            # no client certificate: refused at the handshake or with 401, never served
            try:
                status = await _status(s, blob, _context(mesh, None))
            except (aiohttp.ClientError, ssl.SSLError, ConnectionError):
                status = None
            assert status in (None, 401)

        # other commands on this home find the secured etcd through `tiermesh up`'s record, as the operator
        assert mesh.creds is not None
        write_record(mesh.opts.home, os.getpid(), mesh.etcd_url, **mesh.creds.files(OPERATOR))
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tiermesh", "topology", "diff", str(SMALL_TOPOLOGY), "--home",
                str(mesh.opts.home), "--prefix", mesh.opts.prefix, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
            out, _ = await asyncio.wait_for(proc.communicate(), 60)
        finally:
            clear_record(mesh.opts.home)
        assert proc.returncode == 0 and b"no changes" in out, out.decode(errors="replace")[-2000:]

