"""The edge agent's HTTP front: Open Inference Protocol (KServe V2) over a ``DataPlane``.

A thin adapter: it decodes a request (``mesh.v2.codec``), asks the data plane, and encodes the
reply. The task stands where V2 puts a model name; the SLO rides in request ``parameters`` and the
mesh's answer (site, variant, accuracy, reason, timing) in response ``parameters``, so unmodified
V2 clients such as ``tritonclient.http`` work.

Errors are JSON ``{"error": message, "code": code}`` with the status each ``MeshError`` class
declares (``http_status`` in ``mesh.errors`` is the one table); anything else is a logged 500;
paths and methods nothing serves are a JSON 404 / 405 from a catch-all route. No middleware does
this: with none, aiohttp builds no middleware chain per request.

Who calls: ``identify(request)`` names the tenant of a query (and of metadata requests);
``authenticate(request)`` (health and server metadata) only checks that the caller proves some
identity. With ``tls`` (:class:`edge_agent.mtls.EdgeTls`) the server speaks HTTPS with client
certificates and both come from the certificate; without it (``--insecure``, development only) the
tenant is the ``X-Tiermesh-Tenant`` header (once, one name: ``mesh.v2.body.tenant_claim``) and anyone may
call. A 401 closes the connection.

Against a hostile tenant (issue 29), before anything of a query's body is read:

- **A private task looks exactly like one that does not exist** to every other tenant: metadata, ready and
  infer answer the same 404 ``unknown_task`` with the same words (``visible``: whether a tenant may know of a
  task, :func:`task_visible` over its variants' owners), and no message names another task.
- **Over quota is refused before the body** (``quota_check``, which charges nothing; the data plane charges).
- **Connections** are held to a bound until their first request
  (:class:`~edge_agent.conn_guard.ConnectionGuard`: TLS handshakes included), so a flood of idle sockets cannot
  starve real callers of descriptors.

With ``observe`` (:class:`edge_agent.observe.Observe`) the app also serves ``/metrics`` and the decision
traces, and queries refused here, before the data plane, are counted too. ``parameters.trace: true``
asks for a query's decision trace (a W3C ``traceparent`` header supplies its trace id, if valid); the
reply's ``parameters.trace_id`` says the query was traced, and under which id.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from aiohttp import hdrs, web
from multidict import CIMultiDict

from edge_agent.conn_guard import FIRST_REQUEST_S, HANDSHAKE_TIMEOUT_S, MAX_PENDING, ConnectionGuard, GuardedSite
from edge_agent.dataplane import DataPlane
from edge_agent.front import server_version as _version
from edge_agent.front import task_signature, traceparent_for
from edge_agent.front import unknown_task as _unknown
from edge_agent.observe import Observe, Route, require_certificate
from edge_agent.stall_watch import StallWatch
from edge_agent.v2_extras import V2Extras, task_labels
from mesh.addresses import DEFAULT_BIND, advertised_host, http_url, normalise_host
from mesh.cache import BoundedCache
from mesh.errors import (
    BadTensor,
    EdgeStalled,
    MeshError,
    PayloadTooLarge,
    PermissionDenied,
    QuotaExceeded,
    RequestError,
    UnknownTask,
)
from mesh.lifecycle import Service
from mesh.log import get_logger, kv
from mesh.tracecontext import trace_id_of
from mesh.types import DEFAULT_TENANT, InferRequest, TaskSignature
from mesh.v2 import codec as codec
from mesh.v2.body import HEADER_LENGTH, TENANT_HEADER, tenant_claim
from mesh.v2.classify import classify
from mesh.v2.params import parse_slo, parse_version, response_parameters, signature_to_metadata

if TYPE_CHECKING:  # mutual TLS (cryptography) is loaded only by an agent that serves it
    from edge_agent.mtls import EdgeTls

__all__ = [
    "DEFAULT_MAX_BODY",
    "EXTENSIONS",
    "Authenticate",
    "EdgeHttpServer",
    "Identify",
    "QuotaCheck",
    "Visible",
    "identify",
    "make_app",
]

log = get_logger(__name__)

DEFAULT_MAX_BODY = 16 << 20
# the last four: edge_agent.v2_extras (the Triton routes) and mesh.v2.classify
EXTENSIONS = ["binary_tensor_data", "tiermesh_slo", "classification", "model_configuration", "model_repository",
              "statistics"]
# A connection is pending from its accept until its first request reaches a handler (TLS: through its handshake).
Identify = Callable[[web.Request], str]
Authenticate = Callable[[web.Request], object]
Visible = Callable[[str, str], bool]  # (task, tenant): may the tenant know the task exists
QuotaCheck = Callable[[str], None]    # raises QuotaExceeded for a tenant over quota now, and charges nothing
_NONE: list[str] = []  # getall's default: never mutated


def identify(request: web.Request) -> str:
    """Who is calling, without TLS (``--insecure``): whatever the header says, if it says one name once
    (``RequestError`` otherwise). With mutual TLS the client certificate's URI SAN decides (``EdgeTls.tenant``).
    Whether the tenant exists is the data plane's decision, not this function's."""
    return tenant_claim(request.headers.getall(TENANT_HEADER, _NONE)) or DEFAULT_TENANT


def _anyone(request: web.Request) -> object:
    return None


_JSON = "application/json"
_OCTETS = "application/octet-stream"
# A binary reply's headers differ only by the JSON header's length, which takes a few dozen values: each set
# is built once. aiohttp copies the headers it is given into the response (one fast multidict copy), so
# sharing them is safe; building them per reply from a dict costs a copy more, key by key.
_BINARY_HEADERS: BoundedCache[int, CIMultiDict[str]] = BoundedCache(256)


def _binary_headers(hlen: int) -> CIMultiDict[str]:
    found = _BINARY_HEADERS.get(hlen)
    if found is None:
        found = _BINARY_HEADERS.put(hlen, CIMultiDict({hdrs.CONTENT_TYPE: _OCTETS, HEADER_LENGTH: str(hlen)}))
    return found


def _error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message, "code": code}, status=status, headers=headers)


def _mesh_error(exc: MeshError) -> web.Response:
    # a 429 says when to come back (RFC 9110 Retry-After, whole seconds)
    headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, QuotaExceeded) else None
    resp = web.json_response(exc.to_dict(), status=exc.http_status, headers=headers)
    if exc.http_status == 401:
        resp.force_close()  # a caller whose credential no longer proves anything keeps no connection
    return resp


_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _guarded(handler: _Handler, guard: ConnectionGuard | None = None) -> _Handler:
    """Errors as JSON for a handler off the hot path. The app has no middleware on purpose:
    aiohttp then runs no middleware chain at all, which ``infer`` (which maps its own errors)
    would otherwise pay on every query. ``guard`` learns that the connection made a request."""
    async def guarded(request: web.Request) -> web.StreamResponse:
        if guard is not None:
            guard.seen(request.protocol)
        try:
            return await handler(request)
        except MeshError as exc:
            return _mesh_error(exc)
        except Exception:
            log.exception("unhandled error serving %s %s", request.method, request.path)
            return _error(500, "internal", "internal server error")
    return guarded


def _certificate_only(handler: _Handler) -> _Handler:
    """``handler`` (an extra route: ``/blobs``) on an edge without TLS: refused to callers the tenant header names
    (``edge_agent.observe.require_certificate``)."""
    async def gated(request: web.Request) -> web.StreamResponse:
        require_certificate(request, request.path.split("/", 2)[1] or "this path")
        return await handler(request)
    return gated


async def _unrouted(request: web.Request) -> web.Response:
    """The last route, matching every path: what aiohttp would answer as a text 404 or 405,
    answered in JSON, as V2 clients parse errors. Only requests nothing else matched get here."""
    allowed: set[str] = set()
    this = request.match_info.route.resource
    for resource in request.app.router.resources():
        if resource is not this:
            allowed |= (await resource.resolve(request))[1]
    if allowed:
        return _error(405, "bad_request", f"method {request.method} not allowed; use {sorted(allowed)}",
                      headers={"Allow": ",".join(sorted(allowed))})
    return _error(404, "not_found", f"no route for {request.path}")


def _header_length(raw: str | None) -> int | None:
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError as exc:
        raise RequestError(f"{HEADER_LENGTH} must be an integer, got {raw!r}") from exc


def _traceparent(request: web.Request, asked: object) -> str | None:
    """The ``traceparent`` of a query that asks for its trace (the caller's trace id if it sent a valid one)."""
    return traceparent_for(request.headers.get("traceparent"), asked)


class _Handlers:
    def __init__(self, dp: DataPlane, max_body: int, who: Identify, anyone: Authenticate,
                 rejected: Callable[[str, str, str], None] | None = None, *, visible: Visible | None = None,
                 quota_check: QuotaCheck | None = None, guard: ConnectionGuard | None = None,
                 arrival: Callable[[float], float] | None = None) -> None:
        self.dp, self.max_body, self.who, self.anyone = dp, max_body, who, anyone
        self.arrival = arrival  # when a query handled now is charged from (StallWatch.arrival); None: now
        self.rejected = rejected  # (task, tenant, code) of a query refused before the data plane
        self.visible, self.quota_check, self.guard = visible, quota_check, guard

    def signature(self, task: str, tenant: str) -> TaskSignature:
        """``task``'s signature if ``tenant`` may know of it; else the one 404 (:func:`_unknown`), whether the task
        is another tenant's or does not exist."""
        return task_signature(self.dp, self.visible, task, tenant)

    async def live(self, request: web.Request) -> web.Response:
        self.anyone(request)
        return web.json_response({"live": True})

    async def ready(self, request: web.Request) -> web.Response:
        self.anyone(request)
        ok = self.dp.ready()
        return web.json_response({"ready": ok}, status=200 if ok else 503)

    async def server_metadata(self, request: web.Request) -> web.Response:
        self.anyone(request)
        return web.json_response({"name": "tiermesh", "version": _version(), "extensions": EXTENSIONS})

    async def model_metadata(self, request: web.Request) -> web.Response:
        sig = self.signature(request.match_info["task"], self.who(request))
        return web.json_response(signature_to_metadata(sig))

    async def model_ready(self, request: web.Request) -> web.Response:
        task = request.match_info["task"]
        self.signature(task, self.who(request))
        if task not in self.dp.tasks():
            raise _unknown(task)
        ok = self.dp.ready()
        return web.json_response({"name": task, "ready": ok}, status=200 if ok else 503)

    async def infer(self, request: web.Request) -> web.Response:
        # One coroutine for the whole query, its errors mapped here: every frame and call on this
        # path costs each query a micro-second or more.
        started, handled = time.perf_counter(), time.monotonic()  # its budget runs from here, the body's read included
        # ... or from the start of a freeze of this process it may have waited through (StallWatch.arrival)
        arrived = handled if self.arrival is None else self.arrival(handled)
        task, tenant = request.match_info["task"], "?"
        req: InferRequest | None = None
        if self.guard is not None:
            self.guard.seen(request.protocol)
        try:
            tenant = self.who(request)
            sig = self.signature(task, tenant)
            if self.quota_check is not None:
                self.quota_check(tenant)  # before the body: an over-quota caller's is never buffered or decoded
            length = request.content_length
            if length is not None and length > self.max_body:
                raise PayloadTooLarge(f"body of {length} bytes exceeds the limit of {self.max_body}")
            try:
                body = await request.read()
            except web.HTTPRequestEntityTooLarge as exc:
                raise PayloadTooLarge(f"body exceeds the limit of {self.max_body} bytes") from exc
            # copy=False: the inputs are read-only views of the body, which they keep alive
            raw = request.headers.get(HEADER_LENGTH)
            dec = codec.decode_infer_request(body, int(raw) if raw is not None and raw.isdecimal()
                                             else _header_length(raw), max_bytes=self.max_body, copy=False)
            params = dec.parameters
            slo = dec.slo if dec.slo is not None else parse_slo(params)
            claimed = params.get("tenant")
            if claimed is not None and claimed != tenant:
                # The body must not choose the tenant: identity comes from the connection.
                raise PermissionDenied(f"parameter tenant {claimed!r} does not match the caller's "
                                   f"identity {tenant!r}")
            wanted = dec.outputs
            if wanted is not None and (unknown := sorted(set(wanted) - {s.name for s in sig.outputs})):
                raise BadTensor(f"task {task} has no output(s) {unknown}")
            # the query enters the mesh here: its id and deadline are set once; its inputs are
            # checked at the data plane's door
            traced = _traceparent(request, params.get("trace")) if "trace" in params else None
            req = InferRequest.entering(task, dec.inputs, slo, tenant, dec.request_id, now=arrived)
            if arrived < handled and req.deadline <= time.monotonic():
                # it waited out a freeze of this process longer than its budget: not run, ask another edge
                raise EdgeStalled(f"request {req.request_id}: this edge ({self.dp.site}) was stopped while the "
                                  "query waited at its door; not run")
            req.traceparent = traced
            req.version = parse_version(params)
            rid = req.request_id
            resp = await self.dp.infer(req)
            outputs = resp.outputs
            binary: bool | dict[str, bool] = dec.binary_default
            if wanted is not None:
                outputs, binary = {n: outputs[n] for n in wanted if n in outputs}, wanted
                if dec.classification is not None:  # Triton's classification extension (mesh.v2.classify)
                    outputs = {n: classify(a, dec.classification[n], task_labels(task), n)
                               if n in dec.classification else a for n, a in outputs.items()}
            if resp.timing.total_ms == 0.0:
                resp.timing.total_ms = (time.perf_counter() - started) * 1000.0
            rparams = response_parameters(resp)
            if req.traceparent is not None:  # asked for, or sampled at the door
                rparams["trace_id"] = trace_id_of(req.traceparent)
            out, hlen = codec.encode_infer_response(task, rid, outputs, rparams, binary)
        except MeshError as exc:
            if isinstance(exc, UnknownTask):  # the data plane's words may name tasks or owners
                exc = _unknown(task)
            log.info("infer rejected: %s", exc.message,
                     extra=kv(event="http_error", reason=exc.code, tenant=tenant, task=task))
            if req is None and self.rejected is not None:
                self.rejected(task, tenant, exc.code)
            return _mesh_error(exc)
        except Exception:
            log.exception("unhandled error serving %s %s", request.method, request.path)
            return _error(500, "internal", "internal server error")
        if hlen is None:
            return web.Response(body=out, content_type=_JSON)
        return web.Response(body=out, headers=_binary_headers(hlen))


def make_app(dp: DataPlane, *, max_body_bytes: int = DEFAULT_MAX_BODY,
             identify: Identify = identify, authenticate: Authenticate = _anyone,
             observe: Observe | None = None, routes: tuple[Route, ...] = (), certificates: bool = False,
             visible: Visible | None = None, quota_check: QuotaCheck | None = None,
             guard: ConnectionGuard | None = None,
             arrival: Callable[[float], float] | None = None,
             tenant_routes: tuple[Route, ...] = ()) -> web.Application:
    """The V2 application over ``dp``. ``max_body_bytes`` bounds every request body and each
    declared binary tensor; ``identify`` maps a request to its tenant; ``authenticate`` admits (or
    raises for) callers of the health and server-metadata endpoints; ``observe`` adds the metrics and
    trace endpoints (they authorise their callers themselves), ``routes`` more such (``edge_agent.blobs``),
    which, unless callers have ``certificates``, are refused to callers the tenant header names.
    ``visible`` says which tasks a tenant may know of (None: every task), ``quota_check`` refuses an
    over-quota tenant before its body is read (None: the data plane alone decides), ``guard`` learns which
    connections have made a request (:class:`ConnectionGuard`). ``tenant_routes``: routes for tenants (the job
    API, ``edge_agent.jobs_api``), which identify their callers as inference does, so open without TLS too."""
    h = _Handlers(dp, max_body_bytes, identify, authenticate, observe.rejected if observe is not None else None,
                  visible=visible, quota_check=quota_check, guard=guard, arrival=arrival)
    app = web.Application(client_max_size=max_body_bytes)
    prefixes = ("/v2/models/{task}", "/v2/models/{task}/versions/{version}")
    # Versions are accepted and ignored: the mesh, not the caller, picks the variant. The infer
    # routes go first: aiohttp tries the routes under /v2/models in the order they were added.
    for prefix in prefixes:
        app.router.add_post(prefix + "/infer", h.infer)
    extras = V2Extras(dp, h.who, h.signature, visible, observe.metrics if observe is not None else None)
    for method, path, handler in extras.routes():  # before /v2/models/{task}, which would take "stats" for a task
        app.router.add_route(method, path, _guarded(handler, guard))
    app.router.add_get("/v2/health/live", _guarded(h.live, guard))
    app.router.add_get("/v2/health/ready", _guarded(h.ready, guard))
    app.router.add_get("/v2", _guarded(h.server_metadata, guard))
    for prefix in prefixes:
        app.router.add_get(prefix, _guarded(h.model_metadata, guard))
        app.router.add_get(prefix + "/ready", _guarded(h.model_ready, guard))
    for method, path, handler in (observe.routes() if observe is not None else ()):
        app.router.add_route(method, path, _guarded(handler, guard))
    for method, path, handler in routes:
        app.router.add_route(method, path, _guarded(handler if certificates else _certificate_only(handler), guard))
    for method, path, handler in tenant_routes:
        app.router.add_route(method, path, _guarded(handler, guard))
    app.router.add_route("*", "/{path:.*}", _guarded(_unrouted, guard))
    return app


class EdgeHttpServer(Service):
    """Serves ``make_app(dp)`` on ``host:port`` (port 0 picks a free one; ``url`` says which).
    ``advertise``: the host callers dial, in ``url`` (default ``host``; a wildcard needs one).
    ``tls``: HTTPS with client certificates (identity from the certificate; ``identify`` is then
    ignored); this server starts and stops it. None: plain HTTP, tenant from the header.
    ``visible`` and ``quota_check``: see :func:`make_app`. Connections pass a :class:`ConnectionGuard`
    (``max_pending``, ``handshake_timeout_s``, ``first_request_s``). ``stall_watch``: this process's
    (:class:`edge_agent.stall_watch.StallWatch`, the agent's, which starts it), so that a query that waited through a
    freeze is charged from its start; None: one of this server's own, started and stopped with it."""

    def __init__(self, dp: DataPlane, host: str = DEFAULT_BIND, port: int = 0, *,
                 advertise: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY,
                 identify: Identify = identify, tls: EdgeTls | None = None,
                 observe: Observe | None = None, routes: tuple[Route, ...] = (),
                 visible: Visible | None = None, quota_check: QuotaCheck | None = None,
                 max_pending: int = MAX_PENDING, handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
                 first_request_s: float = FIRST_REQUEST_S, shutdown_timeout: float = 5.0,
                 stall_watch: StallWatch | None = None, tenant_routes: tuple[Route, ...] = ()) -> None:
        self.host, self.port = normalise_host(host, "bind address"), port
        self._own_watch = StallWatch() if stall_watch is None else None
        watch = stall_watch or self._own_watch
        assert watch is not None
        self.advertise = advertised_host(self.host, advertise)
        self.tls = tls
        self.guard = ConnectionGuard(tls.ssl_context if tls is not None else None, max_pending=max_pending,
                                     handshake_timeout_s=handshake_timeout_s, first_request_s=first_request_s)
        who, anyone = (tls.tenant, tls.peer) if tls is not None else (identify, _anyone)
        # Built here, not in start(), so a caller may add middlewares before the app freezes.
        self.app = make_app(dp, max_body_bytes=max_body_bytes, identify=who, authenticate=anyone, observe=observe,
                            routes=routes, certificates=tls is not None, visible=visible, quota_check=quota_check,
                            guard=self.guard, arrival=watch.arrival, tenant_routes=tenant_routes)
        self._runner = web.AppRunner(self.app, shutdown_timeout=shutdown_timeout)

    def _url(self, host: str) -> str:
        url = http_url(host, self.port)
        return "https" + url.removeprefix("http") if self.tls is not None else url

    @property
    def url(self) -> str:
        self._require_running("its URL")
        return self._url(self.advertise)

    async def _start(self) -> None:
        if self._own_watch is not None:
            await self._own_watch.start()
        if self.tls is not None:
            await self.tls.start()
        await self._runner.setup()
        await GuardedSite(self._runner, self.host, self.port, self.guard).start()
        self.port = int(self._runner.addresses[0][1])
        log.info("http api listening on %s (advertised %s)", self._url(self.host), self._url(self.advertise),
                 extra=kv(event="http_start"))

    async def _stop(self) -> None:
        try:
            await self.guard.close()  # first: a server that stops admits nobody new
            await self._runner.cleanup()
        finally:
            try:
                if self.tls is not None:
                    await self.tls.stop()
            finally:
                if self._own_watch is not None:
                    await self._own_watch.stop()

    def __repr__(self) -> str:
        return f"<EdgeHttpServer {self.host}:{self.port} {self.state.value}>"
