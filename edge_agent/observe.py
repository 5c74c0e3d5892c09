"""What an agent shows of itself over its edge HTTP API: Prometheus metrics and decision traces.

    GET /metrics                              Prometheus text (``edge_agent.metrics``)
    GET /v2/traces/{id}[?tenant=T]            one trace this door answered, by its request id or its trace id
                                              (a result's ``trace_id``; shape in ``edge_agent.traces``)
    GET /v2/traces?limit=N                    the newest N trace summaries {request_id, tenant, task, outcome, at_unix}

A request id names a trace within its tenant (the id is the caller's choice: two tenants may use the same one).

Who may read, with edge TLS on (the identity from the client certificate, ``edge_agent.mtls``):

    caller                 /metrics   traces
    admin, scheduler       200        every tenant's (an id of several tenants: the newest, or ``?tenant=``'s)
    tenant                 403        its own only (another tenant's request id is a 404, as an unknown one)
    site                   403        403

Without TLS (``--insecure``, ``--no-edge-tls``) there is no certificate to tell an operator from a tenant. A
request that names a tenant in the ``X-Tiermesh-Tenant`` header is a tenant's (behind ``--no-edge-tls`` the
proxy sets it on every request it forwards): it is refused these endpoints (403 ``certificate_required``, and
``/blobs`` too, :func:`require_certificate`), which need a certificate. One without the header, from whoever
reaches the port, reads everything, as before: development, or an operator on the agent's own network.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from aiohttp import web

from edge_agent.exposition import CONTENT_TYPE
from edge_agent.metrics import AgentMetrics
from edge_agent.traces import TraceStore
from mesh.errors import MeshError, PermissionDenied, RequestError
from mesh.v2.body import TENANT_HEADER

if TYPE_CHECKING:  # mutual TLS (cryptography) is loaded only by an agent that serves it
    from edge_agent.mtls import EdgeTls

__all__ = ["MAX_LIST", "Observe", "Route", "require_certificate"]

MAX_LIST = 1000
_READERS = ("admin", "scheduler")
Route = tuple[str, str, Callable[[web.Request], Awaitable[web.StreamResponse]]]


class _NotFound(MeshError):
    code = "not_found"
    http_status = 404


def require_certificate(request: web.Request, what: str) -> None:
    """Refuse ``what`` to a caller the tenant header names on an edge without TLS (see the module docstring)."""
    if TENANT_HEADER in request.headers:
        raise PermissionDenied(f"{what} need a client certificate: this edge serves without TLS, and a request naming "
                               f"a tenant in {TENANT_HEADER} is a tenant's, not an operator's",
                               reason="certificate_required")


class Observe:
    """The handlers of :mod:`edge_agent.observe` over one agent's metrics and traces."""

    def __init__(self, metrics: AgentMetrics, traces: TraceStore, tls: EdgeTls | None = None) -> None:
        self.metrics, self.traces, self.tls = metrics, traces, tls

    def routes(self) -> list[Route]:
        return [("GET", "/metrics", self.metrics_page), ("GET", "/v2/traces", self.trace_list),
                ("GET", "/v2/traces/{trace_key}", self.trace)]

    def rejected(self, task: str, tenant: str, code: str) -> None:
        """A query the HTTP front refused before it reached the data plane (counted like any other)."""
        self.metrics.door_error(task, tenant, code)

    def _trace_reader(self, request: web.Request) -> str | None:
        """None: may read every trace; a tenant: only its own."""
        if self.tls is None:
            require_certificate(request, "traces")
            return None
        who = self.tls.peer(request)
        if who.kind in _READERS:
            return None
        if who.kind == "tenant":
            return who.name
        raise PermissionDenied(f"{who} may not read traces", reason="wrong_kind")

    async def metrics_page(self, request: web.Request) -> web.Response:
        if self.tls is None:
            require_certificate(request, "metrics")
        else:
            who = self.tls.peer(request)
            if who.kind not in _READERS:
                raise PermissionDenied(f"{who} may not read metrics: an admin or scheduler identity may",
                                       reason="wrong_kind")
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def trace(self, request: web.Request) -> web.Response:
        reader = self._trace_reader(request)
        key = request.match_info["trace_key"]  # a request id or a trace id
        # a tenant reads under its own name only; a reader of every tenant's may pick one
        found = self.traces.get(key, reader if reader is not None else request.query.get("tenant"))
        if found is None:
            raise _NotFound(f"no trace of request or trace id {key!r} here")
        return web.json_response(found)

    async def trace_list(self, request: web.Request) -> web.Response:
        reader = self._trace_reader(request)
        raw = request.query.get("limit", "50")
        try:
            limit = int(raw)
        except ValueError as exc:
            raise RequestError(f"limit must be an integer, got {raw!r}") from exc
        if not 1 <= limit <= MAX_LIST:
            raise RequestError(f"limit must be 1 to {MAX_LIST}, got {limit}")
        return web.json_response({"traces": self.traces.recent(limit, reader)})
