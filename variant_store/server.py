"""HTTP face of the variant store (aiohttp): blobs by digest, the catalog as JSON, health.

    GET|HEAD /blobs/<digest>   the blob; ETag is the digest, If-None-Match -> 304, Range -> 206
    GET      /catalog[?task=]  {"variants": [VariantMeta JSON, ...]}
    GET      /healthz          {"ok": true, ...}
    GET      /metrics          Prometheus text (``variant_store.metrics``); with TLS only for admin or scheduler
    PUT|GET  /data/...         tenants' offline-job data, when given a ``data`` area (``variant_store.data_area``)

With a ``data`` area it also runs tenants' model builds (``variant_store.tenant_builds``: the inputs doors stored
there, the build requests in etcd), unless ``builds`` is False; ``build_options`` says how it builds.

A blob whose bytes no longer hash to its name is never served (502 with a JSON error body). Each
blob is verified on its first serve and the verdict cached by the file's (inode, mtime, size), so
a rewritten file is checked again while an untouched one is hashed only once.

Errors are ``MeshError`` JSON bodies (``{"code", "error"}``) with the error's ``http_status``.

With ``tls`` (a :class:`~variant_store.access.StoreTls`) it serves HTTPS with client certificates from the
mesh CA: the caller's identity is its certificate's (401 when it proves none; 403 for etcd's own), and a
tenant-private variant's catalog entry and blob, and a model's labelled validation set, are served only to the
identities :mod:`variant_store.access` admits (403 for a blob, left out of ``/catalog``): a site only the private
variants of tenants placement asks it to serve, read from etcd ``placement/<site>`` at the request
(:class:`~variant_store.placed.PlacedVariants`, which the server runs unless given one), and the variants of
the offline-job chunks the scheduler leader assigned it, from etcd ``jobassign/``
(:class:`~variant_store.job_grants.JobGrants`, likewise). A revoked caller is
refused on its next request and its open keep-alive connections are closed once ``tls`` holds a list naming it:
from its ``crl.pem``, or from etcd ``pki/crl``
through ``tls.load_crl`` (``tiermesh variants serve`` runs a :mod:`tiermesh.crl_follow` follower for that: the
store stands below the command line, so the command owns the follow task). Without ``tls`` (development only) it
is plain HTTP and anyone reads everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from mesh.addresses import DEFAULT_BIND, advertised_host, http_url, normalise_host
from mesh.backoff import Backoff
from mesh.errors import BlobError, MeshError, PermissionDenied, RequestError
from mesh.etcd.keys import blobs_key
from mesh.etcd.lease import Lease
from mesh.lifecycle import Service, cancel_and_wait
from mesh.log import get_logger, kv
from mesh.pki.identity import Identity
from variant_store.access import Serves, StoreTls, blob_readable, job_granted, may_read, no_site, site_tenants
from variant_store.blobs import CHUNK, BlobStore, is_digest
from variant_store.catalog import Catalog
from variant_store.data_area import DataArea, data_routes
from variant_store.job_grants import Granted, JobGrants
from variant_store.meta import VariantMeta
from variant_store.metrics import CONTENT_TYPE, StoreMetrics
from variant_store.placed import PlacedVariants
from variant_store.tenant_builds import BuildOptions, TenantBuilder

__all__ = ["IDENTITY", "TENANT_HEADER", "Authenticator", "VariantStoreServer", "header_identity"]

log = get_logger(__name__)
SHUTDOWN_S = 5.0  # how long a stopping store lets requests in flight finish
TENANT_HEADER = "X-Tiermesh-Tenant"
Authenticator = Callable[[web.Request], Awaitable[str]]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# request[IDENTITY] is who authenticate() said the caller is (RequestKey is aiohttp >= 3.12)
IDENTITY: Any = web.RequestKey("identity", str) if hasattr(web, "RequestKey") else "identity"
# request[PEER]: the caller's verified Identity (HTTPS only)
PEER: Any = web.RequestKey("peer", Identity) if hasattr(web, "RequestKey") else "peer"
_RANGE_RE = re.compile(r"^bytes=(\d*)-(\d*)$")


async def header_identity(request: web.Request) -> str:
    """The identity without TLS (development only): the tenant header, or "public"; it grants nothing.
    With ``tls`` the identity is the client certificate's (:class:`~variant_store.access.StoreTls`)."""
    return request.headers.get(TENANT_HEADER, "").strip() or "public"


class VariantStoreServer(Service):
    """Serves ``blob_store`` and ``catalog`` on ``host:port`` (0: any free port; see ``url``) and,
    when ``announce`` is set, publishes its URL at ``blobs_key()`` under an etcd lease, with the
    topology ``site`` it runs at when given (routing then charges cold starts elsewhere the fetch).
    ``advertise``: the host peers dial, in ``url`` and the announcement (default ``host``; a
    wildcard ``host`` needs one). ``placement``: which variants each site may fetch (with ``tls``; default: one
    following ``catalog``'s etcd, started and stopped with the server); ``job_grants``: which each may fetch for
    the job chunks assigned to it (the same way)."""

    def __init__(self, blob_store: BlobStore, catalog: Catalog, host: str = DEFAULT_BIND, port: int = 0, *,
                 advertise: str | None = None, authenticate: Authenticator = header_identity,
                 announce: bool = True, lease_ttl: int = 10, site: str | None = None,
                 tls: StoreTls | None = None, placement: PlacedVariants | None = None,
                 data: DataArea | None = None, job_grants: JobGrants | None = None, builds: bool = True,
                 build_options: BuildOptions | None = None) -> None:
        self.blobs = blob_store
        self.data = data
        self.site = site
        self.catalog = catalog
        self.host, self.port = normalise_host(host, "bind address"), port
        self.advertise = advertised_host(self.host, advertise)
        self.authenticate = authenticate
        self.tls = tls
        self._own_placement = placement is None and tls is not None
        self.placement = PlacedVariants(catalog.store) if self._own_placement else placement
        self._own_grants = job_grants is None and tls is not None
        self.job_grants = JobGrants(catalog.store) if self._own_grants else job_grants
        self.builder = TenantBuilder(catalog, blob_store, data, options=build_options) \
            if data is not None and builds else None
        self.announce = announce
        self.lease_ttl = lease_ttl
        self._runner: web.AppRunner | None = None
        self._verified: dict[str, tuple[tuple[int, int, int], str | None]] = {}
        self._lease: Lease | None = None
        self._announcer: asyncio.Task[None] | None = None
        self._url: str | None = None
        self.metrics = StoreMetrics()

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("VariantStoreServer is not started")
        return self._url

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware])
        app.router.add_get("/blobs/{digest}", self._blob)  # aiohttp adds HEAD for GET routes
        app.router.add_get("/catalog", self._catalog)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/metrics", self._metrics)
        for method, path, handler in data_routes(self.data, lambda r: r.get(PEER)) if self.data is not None else ():
            app.router.add_route(method, path, handler)
        return app

    async def _start(self) -> None:
        # a stop waits at most SHUTDOWN_S for requests in flight (aiohttp's default is 60 s: a Ctrl-C'd store kept
        # its port and its etcd lease that long whenever one connection lingered)
        self._runner = runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=SHUTDOWN_S)
        await runner.setup()
        if self.tls is not None:
            await self.tls.start()
        if self._own_placement and self.placement is not None:
            await self.placement.start()
        if self._own_grants and self.job_grants is not None:
            await self.job_grants.start()
        await web.TCPSite(runner, self.host, self.port,
                          ssl_context=self.tls.ssl_context if self.tls else None).start()
        self.port = int(runner.addresses[0][1])
        url = http_url(self.advertise, self.port)
        self._url = "https://" + url.removeprefix("http://") if self.tls else url
        if self.announce:
            await self._announce()
            self._announcer = asyncio.get_running_loop().create_task(
                self._keep_announced(), name="variant-store-announce")
        if self.builder is not None:
            await self.builder.start()
        log.info("variant store serving at %s", self._url, extra=kv(event="blob_server_up"))

    async def _stop(self) -> None:
        if self.builder is not None:
            await self.builder.stop()
        runner, self._runner = self._runner, None
        task, self._announcer = self._announcer, None
        await cancel_and_wait(task)
        if self._lease is not None:
            lease, self._lease = self._lease, None
            with contextlib.suppress(MeshError):
                await lease.revoke()  # drop the announcement now rather than at lease expiry
        if runner is not None:
            await runner.cleanup()
        if self._own_grants and self.job_grants is not None:
            await self.job_grants.stop()
        if self._own_placement and self.placement is not None:
            await self.placement.stop()
        if self.tls is not None:
            await self.tls.stop()

    async def _announce(self) -> None:
        store = self.catalog.store
        lease = await store.lease(self.lease_ttl)
        try:
            record: dict[str, object] = {"url": self.url, "pid": os.getpid()}
            if self.site:
                record["site"] = self.site
            await store.put(blobs_key(), record, lease=lease)
        except BaseException:
            with contextlib.suppress(MeshError):
                await lease.revoke()
            raise
        self._lease = lease

    async def _keep_announced(self) -> None:
        """A lease lost to an etcd restart or partition takes the announcement with it: re-announce
        until it sticks, with jittered back-off, for as long as the server runs."""
        backoff = Backoff(0.5, 10.0)
        while True:
            if self._lease is not None:
                await self._lease.lost.wait()
                self._lease = None
                log.warning("variant store announcement lost; re-announcing", extra=kv(event="reannounce"))
            try:
                await self._announce()
                backoff.reset()
            except MeshError as exc:
                log.warning("re-announce failed: %s", exc, extra=kv(event="reannounce_failed"))
                await asyncio.sleep(backoff.next())

    # handlers ---------------------------------------------------------------------------------
    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            if self.tls is not None:
                peer = request[PEER] = self.tls.peer(request)
                request[IDENTITY] = str(peer)
            else:
                request[IDENTITY] = await self.authenticate(request)
            resp = await handler(request)
        except MeshError as exc:
            log.warning("%s %s -> %s: %s", request.method, request.path, exc.http_status, exc,
                        extra=kv(tenant=request.get(IDENTITY, "?"), event="blob_request_failed", reason=exc.code))
            resp = web.json_response(exc.to_dict(), status=exc.http_status)
        self.metrics.answered(request.path, resp.status)
        return resp

    async def _metrics(self, request: web.Request) -> web.Response:
        peer = request.get(PEER)
        if peer is not None and peer.kind not in ("admin", "scheduler"):
            raise PermissionDenied(f"{peer} may not read metrics: an admin or scheduler identity may",
                                   reason="wrong_kind")
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "url": self._url})

    async def _catalog(self, request: web.Request) -> web.Response:
        task = request.query.get("task") or None
        metas = await self.catalog.list_variants(task)
        peer = request.get(PEER)
        if peer is not None:
            serves = await self._serves(peer, metas if task is None else await self.catalog.list_variants())
            granted = await self._granted(peer)
            metas = [m for m in metas if may_read(peer, m.owner, serves) or job_granted(peer, m, granted)]
        return web.json_response({"variants": [m.to_json() for m in metas]})

    async def _serves(self, peer: Identity, metas: list[VariantMeta]) -> Serves:
        """Which tenants a site caller serves, from placement now (a read of etcd) and its recent past."""
        if peer.kind != "site" or self.placement is None:
            return no_site
        tenants = site_tenants(await self.placement.placed(peer.name), metas)
        return lambda site, tenant: site == peer.name and tenant in tenants

    async def _granted(self, peer: Identity) -> frozenset[Granted]:
        """The variants a site caller's job assignments let it fetch (a read of etcd) or did until recently."""
        if peer.kind != "site" or self.job_grants is None:
            return frozenset()
        return await self.job_grants.granted(peer.name)

    async def _blob(self, request: web.Request) -> web.StreamResponse:
        digest = request.match_info["digest"]
        if not is_digest(digest):
            raise RequestError(f"not a sha256 digest: {digest!r}")
        peer = request.get(PEER)
        if peer is not None:
            metas = await self.catalog.list_variants()
            readable = blob_readable(peer, digest, metas, await self.catalog.list_models(),
                                     await self._serves(peer, metas), await self._granted(peer))
            if not readable:
                raise PermissionDenied(f"{peer} may not read blob {digest}", reason="private_variant")
        if not self.blobs.has(digest):
            raise _NotFound(f"blob not found: {digest}", digest=digest)
        path = self.blobs.path(digest)
        st = path.stat()
        await self._check(digest, (st.st_ino, st.st_mtime_ns, st.st_size))
        etag = f'"{digest}"'
        headers = {"ETag": etag, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream",
                   "Cache-Control": "public, max-age=31536000, immutable"}
        log.debug("serve blob %s", digest[:12], extra=kv(tenant=request[IDENTITY], event="blob_serve"))
        if _etags(request.headers.get("If-None-Match", "")) & {etag, "*"}:
            return web.Response(status=304, headers=headers)
        size = st.st_size
        start, end, status = 0, size - 1, 200
        rng = request.headers.get("Range")
        if_range = request.headers.get("If-Range")
        if rng and (if_range is None or if_range == etag):
            parsed = _parse_range(rng, size)
            if parsed is None:
                return web.Response(status=416, headers={**headers, "Content-Range": f"bytes */{size}"})
            start, end = parsed
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        length = max(0, end - start + 1)
        headers["Content-Length"] = str(length)
        resp = web.StreamResponse(status=status, headers=headers)
        await resp.prepare(request)
        try:
            if request.method != "HEAD" and length:
                await self._send(resp, path, start, length)
            await resp.write_eof()
        # the client went away mid-blob (a fetch given up, a site stopped): not an error. aiohttp says so with a
        # ConnectionResetError from the socket or, when it notices while draining, a bare ConnectionError
        except ConnectionError:
            log.info("blob %s: the client left after part of it", digest[:12],
                     extra=kv(tenant=request[IDENTITY], event="blob_client_gone"))
        return resp

    async def _send(self, resp: web.StreamResponse, path: os.PathLike[str], start: int, length: int) -> None:
        loop = asyncio.get_running_loop()
        f = await loop.run_in_executor(None, open, path, "rb")
        try:
            await loop.run_in_executor(None, f.seek, start)
            left = length
            while left > 0:
                chunk = await loop.run_in_executor(None, f.read, min(CHUNK, left))
                if not chunk:
                    break
                await resp.write(chunk)
                left -= len(chunk)
                self.metrics.blob_bytes.inc(len(chunk))
        finally:
            await loop.run_in_executor(None, f.close)

    async def _check(self, digest: str, stamp: tuple[int, int, int]) -> None:
        cached = self._verified.get(digest)
        if cached is None or cached[0] != stamp:
            try:
                await asyncio.get_running_loop().run_in_executor(None, self.blobs.verify, digest)
                verdict: str | None = None
            except BlobError as exc:
                verdict = exc.message
                self.metrics.corrupt.inc()
                log.error("refusing corrupt blob: %s", exc, extra=kv(event="blob_corrupt"))
            self._verified[digest] = (stamp, verdict)
            cached = self._verified[digest]
        if cached[1] is not None:
            raise BlobError(cached[1], digest=digest)


class _NotFound(BlobError):
    """A missing blob is a 404, not the 502 of a corrupt one; the code stays ``blob``."""

    http_status = 404


def _etags(header: str) -> set[str]:
    if header.strip() == "*":
        return {"*"}
    return {t.strip().removeprefix("W/") for t in header.split(",") if t.strip()}


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    """One byte range (``bytes=a-b``, ``bytes=a-``, ``bytes=-n``) -> inclusive (start, end), or None."""
    m = _RANGE_RE.match(header.strip())
    if not m or size == 0:
        return None
    a, b = m.groups()
    if a == "" and b == "":
        return None
    if a == "":
        n = int(b)
        return (max(0, size - n), size - 1) if n > 0 else None
    start = int(a)
    end = min(int(b), size - 1) if b else size - 1
    if start >= size or end < start:
        return None
    return start, end
