"""The edge agent's gRPC front: the Open Inference Protocol's ``inference.GRPCInferenceService`` (KServe V2, as
Triton serves it) over a ``DataPlane``, beside the REST front (:mod:`edge_agent.http_api`) and with its semantics,
so unmodified ``tritonclient.grpc`` (sync and ``aio``) works.

A thin adapter on grpclib (gRPC over ``h2`` on asyncio, already in the agent for etcd; grpcio's C core and the
protobuf runtime would cost an idle edge some 14 MiB): messages are :mod:`mesh.v2.grpc_messages`, tensors
:mod:`mesh.v2.grpc_codec`. The task stands where V2 puts a model name; the SLO rides in request ``parameters``
and the mesh's answer (site, variant, accuracy, reason, timing: ``mesh.v2.params.response_parameters``) in
response ``parameters``. A gRPC deadline (``grpc-timeout``) shorter than the SLO's ``latency_ms`` caps the query's
budget: routing sees what is left of the shorter one (the SLO itself, and so ``late``, stay the caller's).

Served: ServerLive, ServerReady, ServerMetadata, ModelReady, ModelMetadata, ModelInfer, and Triton's ModelConfig
(what ``get_model_config`` and ``perf_analyzer`` ask) and ModelStatistics (``get_inference_statistics``: the
caller's own queries, as REST's ``/stats``, :func:`edge_agent.v2_extras.model_stats`), with Triton's classification
extension on requested outputs (``class_count``, as REST's), and RepositoryModelLoad (``load_model``: a tenant
registers a model, REST's rules, :mod:`edge_agent.model_register`; with ``models``, else UNIMPLEMENTED); everything
else (ModelStreamInfer, the other repository calls, unload included, and shared-memory calls) answers UNIMPLEMENTED.

Who calls, as REST: with ``tls`` (:class:`edge_agent.mtls.EdgeTls`, the same credentials in an ``h2`` context) the
tenant is the client certificate's, and a ``x-tiermesh-tenant`` metadata naming another is refused; without it
(``--insecure``) the tenant is that metadata. No certificate or another CA: refused at the handshake; revoked and
the like: UNAUTHENTICATED and the connection closed; another tenant's private task: NOT_FOUND, word for word as a
task that does not exist; over quota: RESOURCE_EXHAUSTED before the message is read; a message over
``max_body_bytes``: RESOURCE_EXHAUSTED when its length prefix arrives, before its bytes are buffered. Errors carry
the status of their code (:mod:`mesh.v2.grpc_status`) and the code itself in the ``tiermesh-code`` trailer.

Connections pass the REST front's guard (:class:`~edge_agent.conn_guard.ConnectionGuard`, one of its own): at most
``max_pending`` before their first call, each for at most ``first_request_s``, a TLS handshake for at most
``handshake_timeout_s``. grpclib alone left a handshake to asyncio's 60 s and an idle connection open for good, so a
flood of idle sockets could take every descriptor. TLS is started by the guard, not by ``Server.start(ssl=)``.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from grpclib.const import Cardinality, Handler, Status
from grpclib.encoding.proto import ProtoCodec
from grpclib.protocol import H2Protocol
from grpclib.server import Handler as ConnectionHandler
from grpclib.server import Server, Stream

from edge_agent.conn_guard import FIRST_REQUEST_S, HANDSHAKE_TIMEOUT_S, MAX_PENDING, ConnectionGuard
from edge_agent.dataplane import DataPlane, require_servable
from edge_agent.front import (
    Visible,
    check_claim,
    check_outputs,
    server_version,
    task_signature,
    traceparent_for,
    unknown_task,
)
from edge_agent.model_register import BUILD_ID_KEY, Registrar, load_request
from edge_agent.v2_extras import model_stats, task_labels, usable_tasks
from mesh import clock
from mesh.addresses import DEFAULT_BIND, advertised_host, normalise_host, tcp_endpoint
from mesh.errors import (
    EdgeStalled,
    MeshError,
    PayloadTooLarge,
    QuotaExceeded,
    RequestError,
    Unauthenticated,
    UnknownTask,
)
from mesh.lifecycle import Service
from mesh.log import get_logger, kv
from mesh.tracecontext import trace_id_of
from mesh.types import DEFAULT_TENANT, InferRequest, TaskSignature
from mesh.v2 import grpc_messages as oip
from mesh.v2.body import TENANT_HEADER, tenant_claim
from mesh.v2.classify import classify
from mesh.v2.grpc_codec import (
    decode_infer_request,
    encode_infer_response,
    model_config,
    model_metadata,
    model_statistics,
)
from mesh.v2.grpc_status import status_of
from mesh.v2.params import parse_slo, parse_version, response_parameters

if TYPE_CHECKING:
    from edge_agent.metrics import AgentMetrics
    from edge_agent.mtls import EdgeTls

__all__ = ["CODE_TRAILER", "DEFAULT_MAX_MESSAGE", "EXTENSIONS", "EdgeGrpcServer", "GrpcFront"]

log = get_logger(__name__)

DEFAULT_MAX_MESSAGE = 16 << 20  # the REST front's body limit (edge_agent.http_api.DEFAULT_MAX_BODY)
EXTENSIONS = ["tiermesh_slo"]
CODE_TRAILER = "tiermesh-code"
_TENANT_KEY = TENANT_HEADER.lower()  # gRPC metadata keys are lower case
_NONE: list[str] = []  # getall's default: never mutated
_Call = Callable[[Stream[Any, Any]], Awaitable[None]]


async def _receive(stream: Stream[Any, Any], cls: type[Any], limit: int) -> Any:
    """The request message of a unary call, its length checked before its bytes are read. grpclib's own
    ``recv_message`` has no size limit (it would buffer whatever length the prefix declares): the prefix is read
    here from its HTTP/2 stream, and the codec's message type decodes the rest (``DecodeError``, a 400 code)."""
    h2 = stream._stream  # grpclib's HTTP/2 stream: the same buffer recv_message reads
    head = await h2.recv_data(5)
    if len(head) < 5:
        raise RequestError("the call carries no request message")
    if head[0]:
        raise RequestError("compressed messages are not accepted (send without grpc-encoding)")
    n = int.from_bytes(head[1:5], "big")
    if n > limit:
        raise PayloadTooLarge(f"message of {n} bytes exceeds the limit of {limit}")
    data = await h2.recv_data(n)
    if len(data) != n:
        raise RequestError(f"request message truncated: {len(data)} of {n} bytes")
    return cls.FromString(data)


class GrpcFront:
    """The handlers of ``inference.GRPCInferenceService`` over ``dp`` (grpclib's ``IServable``). ``tls``: identity
    from the client certificate (None: from the tenant metadata); ``visible``, ``quota_check`` and ``rejected`` as
    for :func:`edge_agent.http_api.make_app`; ``guard`` learns which connections have made a call; ``metrics``:
    where statistics come from (None: zero counts, as REST's); ``arrival``: when a query handled now is charged from
    (the agent's :meth:`edge_agent.stall_watch.StallWatch.arrival`, as REST's; None: now)."""

    def __init__(self, dp: DataPlane, *, tls: EdgeTls | None = None, max_message_bytes: int = DEFAULT_MAX_MESSAGE,
                 visible: Visible | None = None, quota_check: Callable[[str], None] | None = None,
                 rejected: Callable[[str, str, str], None] | None = None,
                 guard: ConnectionGuard | None = None, metrics: AgentMetrics | None = None,
                 arrival: Callable[[float], float] | None = None, models: Registrar | None = None) -> None:
        self.dp, self.tls, self.max_message, self.models = dp, tls, max_message_bytes, models
        self.visible, self.quota_check, self.rejected = visible, quota_check, rejected
        self.guard, self.metrics, self.arrival = guard, metrics, arrival

    def __mapping__(self) -> dict[str, Handler]:
        calls: dict[str, _Call] = {"ServerLive": self.server_live, "ServerReady": self.server_ready,
                                   "ServerMetadata": self.server_metadata, "ModelReady": self.model_ready,
                                   "ModelMetadata": self.model_metadata, "ModelConfig": self.model_config,
                                   "ModelStatistics": self.model_statistics, "ModelInfer": self.model_infer,
                                   "RepositoryModelLoad": self.repository_model_load}
        return {f"/{oip.PACKAGE}.{oip.SERVICE}/{name}":
                Handler(self._answering(name, call), Cardinality.UNARY_UNARY, *oip.METHODS[name])
                for name, call in calls.items()}

    # -- who calls -----------------------------------------------------------------------------
    def _claims(self, stream: Stream[Any, Any]) -> list[str]:
        md = stream.metadata
        return [v for v in md.getall(_TENANT_KEY, _NONE) if isinstance(v, str)] if md is not None else []

    def tenant(self, stream: Stream[Any, Any]) -> str:
        if self.tls is not None:
            return self.tls.tenant_of(stream.peer._transport, self._claims(stream))
        return tenant_claim(self._claims(stream)) or DEFAULT_TENANT

    def anyone(self, stream: Stream[Any, Any]) -> None:
        """Health and server metadata admit any caller that proves an identity (with TLS), as REST's."""
        if self.tls is not None:
            self.tls.identify(stream.peer._transport)

    def signature(self, task: str, tenant: str) -> TaskSignature:
        return task_signature(self.dp, self.visible, task, tenant)

    # -- errors --------------------------------------------------------------------------------
    def _answering(self, name: str, call: _Call) -> _Call:
        async def answer(stream: Stream[Any, Any]) -> None:
            guard = self.guard
            if guard is not None and guard.pending:  # the connection made a call: no longer pending
                guard.seen(stream.peer._transport.get_protocol())
            try:
                await call(stream)
            except MeshError as exc:
                await self._refuse(stream, exc)
            except Exception:
                log.exception("unhandled error serving gRPC %s", name, extra=kv(event="grpc_error", reason="internal"))
                await stream.send_trailing_metadata(status=Status.INTERNAL, status_message="internal server error",
                                                    metadata={CODE_TRAILER: "internal"})
        return answer

    async def _refuse(self, stream: Stream[Any, Any], exc: MeshError) -> None:
        trailers = {CODE_TRAILER: exc.code}
        if isinstance(exc, QuotaExceeded):  # when to come back, whole seconds (REST's Retry-After)
            trailers["retry-after"] = str(exc.retry_after_s)
        await stream.send_trailing_metadata(status=Status(status_of(exc.code)), status_message=exc.message,
                                            metadata=trailers)
        if isinstance(exc, Unauthenticated):  # a caller whose credential proves nothing keeps no connection
            stream.peer._transport.close()

    # -- health and metadata -------------------------------------------------------------------
    async def server_live(self, stream: Stream[Any, Any]) -> None:
        await _receive(stream, oip.ServerLiveRequest, self.max_message)
        self.anyone(stream)
        await stream.send_message(oip.ServerLiveResponse(live=True))

    async def server_ready(self, stream: Stream[Any, Any]) -> None:
        await _receive(stream, oip.ServerReadyRequest, self.max_message)
        self.anyone(stream)
        await stream.send_message(oip.ServerReadyResponse(ready=self.dp.ready()))

    async def server_metadata(self, stream: Stream[Any, Any]) -> None:
        await _receive(stream, oip.ServerMetadataRequest, self.max_message)
        self.anyone(stream)
        await stream.send_message(oip.ServerMetadataResponse(name="tiermesh", version=server_version(),
                                                             extensions=EXTENSIONS))

    async def model_ready(self, stream: Stream[Any, Any]) -> None:
        tenant = self.tenant(stream)
        req = await _receive(stream, oip.ModelReadyRequest, self.max_message)
        self.signature(req.name, tenant)
        if req.name not in self.dp.tasks():
            raise unknown_task(req.name)
        await stream.send_message(oip.ModelReadyResponse(ready=self.dp.ready()))

    async def model_metadata(self, stream: Stream[Any, Any]) -> None:
        tenant = self.tenant(stream)
        req = await _receive(stream, oip.ModelMetadataRequest, self.max_message)
        await stream.send_message(model_metadata(self.signature(req.name, tenant)))

    async def model_config(self, stream: Stream[Any, Any]) -> None:
        tenant = self.tenant(stream)
        req = await _receive(stream, oip.ModelConfigRequest, self.max_message)
        await stream.send_message(model_config(self.signature(req.name, tenant)))

    async def model_statistics(self, stream: Stream[Any, Any]) -> None:
        """One task's (``name``; its version's, if given), else every task the caller may use, as Triton's."""
        tenant = self.tenant(stream)
        req = await _receive(stream, oip.ModelStatisticsRequest, self.max_message)
        if req.name:
            self.signature(req.name, tenant)  # the one NOT_FOUND for a task the tenant may not know of
            tasks = [req.name]
        else:
            tasks = usable_tasks(self.dp, self.visible, tenant)
        await stream.send_message(model_statistics(model_stats(self.metrics, tenant, tasks, req.version or None)))

    # -- a tenant's registration ----------------------------------------------------------------
    async def repository_model_load(self, stream: Stream[Any, Any]) -> None:
        """``load_model(task, config=json.dumps({"family": F}), files=...)``: REST's registration, its rules
        (:mod:`edge_agent.model_register`); the whole message within ``max_message_bytes``. The build's id in the
        reply's metadata (``BUILD_ID_KEY``), initial and trailing: the response message has no field for it.
        ``load_model(task)`` alone (no parameters) means what REST's repository load means: OK when the caller may
        use the task and it can be served here now (``NoRoute`` otherwise); nothing is loaded, the mesh places."""
        msg = await _receive(stream, oip.RepositoryModelLoadRequest, self.max_message)
        if not msg.parameters:
            tenant = self.tenant(stream)
            self.signature(msg.model_name, tenant)  # unknown to this caller: as for inference
            require_servable(self.dp, msg.model_name)
            await stream.send_message(oip.RepositoryModelLoadResponse())
            return
        if self.models is None:
            await stream.send_trailing_metadata(status=Status.UNIMPLEMENTED,
                                                status_message="model registration is not served at this door")
            return
        tenant = self.tenant(stream)
        load = load_request(msg)
        admitted = await self.models.admit(tenant, load.task, load.family, load.min_accuracy)
        build = await self.models.register(admitted, load.model, load.validation)
        await stream.send_initial_metadata(metadata={BUILD_ID_KEY: build["id"]})
        await stream.send_message(oip.RepositoryModelLoadResponse())
        await stream.send_trailing_metadata(metadata={BUILD_ID_KEY: build["id"]})

    # -- inference -----------------------------------------------------------------------------
    async def model_infer(self, stream: Stream[Any, Any]) -> None:
        started, handled = time.perf_counter(), clock.monotonic()  # its budget runs from here ...
        # ... or from the start of a freeze of this process it may have waited through (StallWatch.arrival)
        arrived = handled if self.arrival is None else self.arrival(handled)
        task, tenant, req = "?", "?", None
        try:
            tenant = self.tenant(stream)
            if self.quota_check is not None:
                self.quota_check(tenant)  # before the message: an over-quota caller's is never read or decoded
            msg = await _receive(stream, oip.ModelInferRequest, self.max_message)
            task = msg.model_name
            sig = self.signature(task, tenant)
            dec = decode_infer_request(msg)
            params = dec.parameters
            slo = parse_slo(params)
            check_claim(params, tenant)
            check_outputs(sig, dec.outputs)
            header = stream.metadata.get("traceparent") if stream.metadata is not None else None
            traced = (traceparent_for(header if isinstance(header, str) else None, params.get("trace"))
                      if "trace" in params else None)
            req = InferRequest.entering(task, dec.inputs, slo, tenant, dec.request_id, now=arrived)
            if arrived < handled and req.deadline <= clock.monotonic():
                # it waited out a freeze of this process longer than its budget: not run, ask another edge
                raise EdgeStalled(f"request {req.request_id}: this edge was stopped while the query waited at its "
                                  "door; not run")
            if stream.deadline is not None:  # the caller's gRPC deadline, if shorter, is the query's
                req.deadline = min(req.deadline, clock.monotonic() + stream.deadline.time_remaining())
            req.traceparent = traced
            req.version = parse_version(params)
            resp = await self.dp.infer(req)
            outputs = resp.outputs
            if dec.outputs is not None:
                outputs = {n: outputs[n] for n in dec.outputs if n in outputs}
                if dec.classification is not None:  # Triton's classification extension, as REST's
                    outputs = {n: classify(a, dec.classification[n], task_labels(task), n)
                               if n in dec.classification else a for n, a in outputs.items()}
            if resp.timing.total_ms == 0.0:
                resp.timing.total_ms = (time.perf_counter() - started) * 1000.0
            rparams = response_parameters(resp)
            if req.traceparent is not None:  # asked for, or sampled at the door
                rparams["trace_id"] = trace_id_of(req.traceparent)
            reply = encode_infer_response(task, req.request_id, outputs, rparams)
        except MeshError as exc:
            if isinstance(exc, UnknownTask):  # the data plane's words may name tasks or owners
                exc = unknown_task(task)
            log.info("infer rejected: %s", exc.message,
                     extra=kv(event="grpc_error", reason=exc.code, tenant=tenant, task=task))
            if req is None and self.rejected is not None:
                self.rejected(task, tenant, exc.code)
            raise exc from None
        await stream.send_message(reply)


class _Connection(H2Protocol):
    """grpclib's HTTP/2 protocol, its connection handler tracked by the server only once a connection is handed
    over: grpclib tracks it at accept, and forgets it only when its connection is lost, which a connection the guard
    drops before the hand-over never reports (each would stay in ``Server._handlers`` until the server stopped)."""

    def __init__(self, server: _GuardedServer, handler: ConnectionHandler) -> None:
        super().__init__(handler, server._config, server._h2_config)
        self._server, self._handler = server, handler

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._server._handlers.add(self._handler)
        super().connection_made(transport)


class _GuardedServer(Server):
    """grpclib's server, its connections accepted through ``guard`` (TLS, if any, started there: pass no ``ssl``
    to ``start``). ``_protocol_factory`` is what grpclib's ``start`` hands ``loop.create_server``."""

    def __init__(self, handlers: list[GrpcFront], guard: ConnectionGuard) -> None:
        # the codec given: grpclib would otherwise look for googleapis' status protos (the protobuf runtime)
        super().__init__(handlers, codec=ProtoCodec())
        self._accept = guard.factory(self._connection)

    def _connection(self) -> asyncio.Protocol:
        self.__gc_step__()
        return _Connection(self, ConnectionHandler(self._mapping, self._codec, self._status_details_codec,
                                                   self.__dispatch__))

    def _protocol_factory(self) -> asyncio.Protocol:  # type: ignore[override]  # the guard's, before grpclib's
        return self._accept()


class EdgeGrpcServer(Service):
    """Serves :class:`GrpcFront` over ``dp`` on ``host:port`` (port 0 picks a free one; ``address`` and ``url``
    say which). ``tls``: mutual TLS with the edge's credentials, in a context of its own (ALPN ``h2``, which gRPC
    clients require, where the REST front's offers HTTP/1.1), reloaded with them; its owner (the REST front, in an
    agent) starts and stops it. Connections pass a :class:`ConnectionGuard` (``max_pending``,
    ``handshake_timeout_s``, ``first_request_s``, as the REST front's). Other arguments as :class:`GrpcFront`'s."""

    def __init__(self, dp: DataPlane, host: str = DEFAULT_BIND, port: int = 0, *, advertise: str | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE, tls: EdgeTls | None = None,
                 visible: Visible | None = None, quota_check: Callable[[str], None] | None = None,
                 rejected: Callable[[str, str, str], None] | None = None, metrics: AgentMetrics | None = None,
                 max_pending: int = MAX_PENDING, handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
                 first_request_s: float = FIRST_REQUEST_S, arrival: Callable[[float], float] | None = None,
                 models: Registrar | None = None) -> None:
        self.host, self.port = normalise_host(host, "bind address"), port
        self.advertise = advertised_host(self.host, advertise)
        self.tls = tls
        # its TLS context is set at start, once the credentials are loaded
        self.guard = ConnectionGuard(None, max_pending=max_pending, handshake_timeout_s=handshake_timeout_s,
                                     first_request_s=first_request_s)
        self.front = GrpcFront(dp, tls=tls, max_message_bytes=max_message_bytes, visible=visible,
                               quota_check=quota_check, rejected=rejected, guard=self.guard, metrics=metrics,
                               arrival=arrival, models=models)
        self._ssl: ssl.SSLContext | None = None
        self._server: Server | None = None

    def _url(self, host: str) -> str:
        return ("grpcs" if self.tls is not None else "grpc") + tcp_endpoint(host, self.port).removeprefix("tcp")

    @property
    def address(self) -> str:
        """``host:port`` as ``tritonclient.grpc`` takes it (advertised host, bound port)."""
        return self.url.split("://", 1)[1]

    @property
    def url(self) -> str:
        """``grpcs://host:port`` (``grpc://`` without TLS): advertised host, bound port."""
        self._require_running("its URL")
        return self._url(self.advertise)

    async def _start(self) -> None:
        if self.tls is not None:
            self._ssl = self.tls.credentials.server_context()  # held here: the credentials keep it only weakly
            self._ssl.set_alpn_protocols(["h2"])
        self.guard.ssl_context = self._ssl
        self._server = _GuardedServer([self.front], self.guard)
        await self._server.start(self.host, self.port)
        listener = self._server._server
        assert isinstance(listener, asyncio.Server)  # what loop.create_server made
        self.port = int(listener.sockets[0].getsockname()[1])
        log.info("grpc api listening on %s (advertised %s)", self._url(self.host), self._url(self.advertise),
                 extra=kv(event="grpc_start"))

    async def _stop(self) -> None:
        await self.guard.close()  # first: a server that stops admits nobody new
        if self._server is not None and self._server._server is not None:  # started (a failed start may not be)
            self._server.close()
            await self._server.wait_closed()

    def __repr__(self) -> str:
        return f"<EdgeGrpcServer {self.host}:{self.port} {self.state.value}>"
