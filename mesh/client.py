"""The tiermesh SDK: name a task and an SLO, get outputs plus where and how they were served.

One implementation, ``AsyncClient``; ``Client`` runs it on a private loop thread (``mesh.sdk_loop``).

Both speak the Open Inference Protocol to an edge agent (``edge_agent.http_api``) through a
``Transport`` (``mesh.sdk_transport``); a ``grpcs://`` (``grpc://``) URL speaks it over gRPC to the agent's gRPC
front (``mesh.grpc_transport``, the ``grpc`` extra), with the same results and errors. Failures arrive as
``mesh.errors`` classes: an error body
becomes the class its ``code`` names, an unreachable agent ``PeerUnavailable``, a timeout
``DeadlineExceeded``. A closed client raises ``RuntimeError``, as a closed file would.

Identity: with ``cert=``, ``key=`` and ``ca=`` (PEM paths, as ``tiermesh pki issue --tenant T`` writes
them) the client speaks HTTPS with that client certificate, and the certificate names the tenant; the
server's certificate must come from the mesh CA ``ca`` (and, with ``check_hostname``, name the host
dialled). The SSL context is built once; the files are checked again at most every second, so a
re-issued certificate is presented on new connections without a new client. Without them (an
``--insecure`` agent) ``tenant=`` names the tenant in a header (default ``public``).

Revocation of the *server*: with ``crl=`` (the CA's revocation list, ``pki/crl.pem``, kept current on the device
as ``ca=`` is) the handshake refuses an edge whose certificate the list names, before any request is sent: a
revoked site key cannot pose as an edge. It is checked by ``ssl`` alone (the base install has no
``cryptography``), re-read like the other files, and fails closed: a list past its nextUpdate (two days after it
was signed; the operator re-signs it) refuses every server, as it does in every verifier of the mesh.

Several edges: ``Client([url_a, url_b])`` (nearest first; the same TLS files for all) fails a query over to the
next edge when one refuses the connection or stays silent past a share of the query's budget, with the same
request id, and tries a failed edge again after a cool-down (``mesh.failover`` has the policy). One URL works as it
always did: one edge, no failover, no id drawn by the client.

Per call: ``timeout=`` caps that call's wait (in place of the client's ``timeout``; a query's wait is also capped
by its budget and grace, ``DEADLINE_GRACE_S``); ``headers=`` adds HTTP headers, a W3C ``traceparent`` for one
(with ``trace=True`` the edge records the query's trace under the caller's trace id). The headers the SDK writes
itself (the tenant, content type and length, the binary header's length) cannot be given: ``RequestError``.
"""

from __future__ import annotations

import asyncio
import enum
import json
import time
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

from mesh import failover
from mesh.cache import BoundedCache
from mesh.errors import BadTensor, ConfigError, DeadlineExceeded, EdgeStalled, MeshError, error_from_reply
from mesh.failover import FAILOVER_SHARE, EdgeHealthBook, first_answer, retry_budget_ms
from mesh.pki.reload import client_tls
from mesh.sdk_loop import LoopThread
from mesh.sdk_transport import Response, Transport, open_edges
from mesh.types import DEFAULT_PREFER, DEFAULT_TENANT, StageInfo, TaskSignature, Timing, new_request_id
from mesh.v2 import sdk as wire
from mesh.v2.body import HEADER_LENGTH, TENANT_HEADER
from mesh.v2.params import backbone_tenants, cascade_stages, metadata_to_signature, result_values

__all__ = ["AsyncClient", "Client", "InferResult"]

# how long past a query's budget the SDK waits for its answer before raising DeadlineExceeded itself (an agent
# that hangs, a frozen edge): room for a best-effort answer's grace (mesh.types.BEST_EFFORT_GRACE_MS,
# 0.5 s) and the loopback/LAN hop, and so that every query is answered or failed within budget + 1 s
DEADLINE_GRACE_S = 0.8
# A numpy array, a mesh.Tensor, nested lists or an array.array (the task's datatype), a list of str/bytes (texts:
# a BYTES tensor); or a dict of those by input name. Without numpy (the base install) outputs are mesh.Tensor.
Inputs = Any


@dataclass(slots=True)
class InferResult:
    """Outputs of one query and the mesh's account of serving it. Outputs are numpy arrays where numpy is
    installed, ``mesh.Tensor`` objects on the base install (``mesh.v2.sdk``)."""

    outputs: dict[str, Any]
    site: str
    variant: str
    accuracy: float
    reason: str
    best_effort: bool
    tenant: str
    timing: Timing
    hops: list[str] = field(default_factory=list)
    request_id: str = ""
    # set when the query was traced (asked with trace=True, or sampled): look it up at the edge's
    # GET /v2/traces/{trace_id} (or by request_id)
    trace_id: str = ""
    # served through a backbone shared across tenants: how many tenants its batch held (0: not shared)
    backbone_tenants: int = 0
    # answered past the latency asked (measured by the edge from the query's entry: ``timing.total_ms``), best
    # effort or not: a late answer is an answer, never a met SLO
    late: bool = False
    within_slo: bool = True  # answered within the latency and at the accuracy asked (not late, accuracy >= min)
    edge: str = ""  # the URL of the edge that answered (a client of several edges: the one its failover reached)
    stages: tuple[StageInfo, ...] = ()  # answered by a cascade (reason cascade_*): each stage that ran, in order

    def output(self, name: str | None = None) -> Any:
        """The output called ``name``; with no name, the only output (``KeyError`` if several)."""
        if name is not None:
            return self.outputs[name]
        if len(self.outputs) != 1:
            raise KeyError(f"result has outputs {sorted(self.outputs)}; name one")
        return next(iter(self.outputs.values()))


class _State(enum.Enum):
    UNOPENED = "unopened"
    OPEN = "open"
    CLOSED = "closed"


PathLike = str | Path


class AsyncClient:
    """Asynchronous SDK client. Opens on first use or ``async with``; ``aclose()`` ends it.

    ``base_url``: the edge's URL (``https://``, ``grpcs://``; ``http://``, ``grpc://`` without TLS), or a list of
    edges' URLs, nearest first (failover: the module docstring).
    ``cert``, ``key``, ``ca``: the tenant's certificate and key and the mesh CA (paths) for an
    ``https://`` edge; ``crl``: the CA's revocation list (a path), to refuse a revoked server; ``tenant``: the
    tenant header for an ``--insecure`` edge (with a certificate, leave it out: the certificate names the tenant,
    and a header naming another one is refused). ``transport``: one per URL, in place of HTTP (tests).
    ``failover_share``: of a query's latency budget, how long an edge that is not the last one may stay silent."""

    def __init__(self, base_url: str | Sequence[str], *, tenant: str | None = None, timeout: float = 30.0,
                 transport: Transport | Sequence[Transport] | None = None, binary: bool = True,
                 cert: PathLike | None = None, key: PathLike | None = None, ca: PathLike | None = None,
                 check_hostname: bool = True, crl: PathLike | None = None,
                 failover_share: float = FAILOVER_SHARE) -> None:
        urls = (base_url,) if isinstance(base_url, str) else tuple(base_url)
        if not urls:
            raise ConfigError("an SDK client needs an edge URL")
        self.base_url, self.base_urls = urls[0], urls
        tls = client_tls(urls[0], cert, key, ca, check_hostname, crl) if transport is None else (None, None)
        self.credentials = tls[1]
        if tenant is None and cert is None:
            tenant = DEFAULT_TENANT
        self._tenant_headers: dict[str, str] = {}
        self.tenant = tenant
        self.timeout = timeout
        self.binary = binary
        if not 0.0 < failover_share <= 1.0:
            raise ConfigError(f"failover_share must be in (0, 1], got {failover_share!r}")
        self.failover_share = failover_share
        self._edges = open_edges(urls, transport, timeout=timeout, ssl_context=tls[0],
                                 refresh=tls[1].refresh if tls[1] is not None else None)
        # our own transport bounds every request itself (aiohttp's total timeout, raised as
        # DeadlineExceeded, per call for a query's budget); a second timer per call would only add cost
        self._own = self._edges[0].own
        self._transport: Transport = self._edges[0].transport
        self._book = EdgeHealthBook(len(self._edges)) if len(self._edges) > 1 else None
        self._state = _State.UNOPENED
        self._signatures: dict[str, TaskSignature] = {}
        # A caller repeats the shape of its query (task, SLO, tensor names, dtypes and shapes):
        # the JSON header, HTTP headers and path of one are kept for the next, which
        # then skips building and serialising the JSON header.
        self._plans: BoundedCache[tuple[Any, ...], wire.Plan] = BoundedCache(256)

    @property
    def tenant(self) -> str | None:
        """The tenant named in a header (None: none sent; the client certificate names it)."""
        return self._tenant

    @tenant.setter
    def tenant(self, tenant: str | None) -> None:
        self._tenant = tenant
        self._tenant_headers = {TENANT_HEADER: tenant} if tenant is not None else {}

    @property
    def state(self) -> str:
        return self._state.value

    @property
    def transport(self) -> Transport:
        """The first edge's transport."""
        return self._transport

    def _open(self) -> None:
        if self._state is _State.CLOSED:
            raise RuntimeError("client is closed")
        self._state = _State.OPEN

    async def _attempt(self, i: int, method: str, path: str, headers: Mapping[str, str], body: bytes,
                       wait: float | None) -> Response:
        """One request to edge ``i``, waited on for ``wait`` seconds (None: the client's timeout)."""
        edge = self._edges[i]
        if edge.own is not None:
            return await edge.own.request(method, path, headers, body, limit_s=wait)
        bound = self.timeout if wait is None else wait
        try:
            async with asyncio.timeout(bound):
                return await edge.transport.request(method, path, headers, body)
        except DeadlineExceeded:
            raise
        except TimeoutError as exc:
            raise DeadlineExceeded(f"{method} {path}: no answer within {bound:.3f} s") from exc

    async def _send(self, method: str, path: str, headers: Mapping[str, str] | None = None, body: bytes = b"", *,
                    bound: float | None = None, budget: float | None = None) -> Response:
        """A request to the first edge that answers; ``bound``: the whole wait (None: the client's timeout);
        ``budget``: the query's latency budget, whose share an edge that is not the last may be silent (None: the
        bound, at most ``failover.NO_BUDGET_S``)."""
        self._open()
        hdrs = {**self._tenant_headers, **headers} if headers else self._tenant_headers
        if self._book is None:
            return await self._attempt(0, method, path, hdrs, body, bound)
        whole = self.timeout if bound is None else bound

        def attempt(i: int, wait: float, _: int) -> Coroutine[Any, Any, Response]:
            return self._attempt(i, method, path, hdrs, body, wait)

        return await first_answer(self._book, attempt, bound_s=whole,
                                  budget_s=min(whole, failover.NO_BUDGET_S) if budget is None else budget,
                                  share=self.failover_share, what=f"{method} {path}")

    async def task_metadata(self, task: str, *, timeout: float | None = None,  # noqa: ASYNC109 (this call's bound)
                            headers: Mapping[str, str] | None = None) -> TaskSignature:
        """The task's input/output signature (cached per client). ``timeout``, ``headers``: this call's."""
        return await self._task_metadata(task, timeout, wire.call_headers(headers) if headers else None)

    async def _task_metadata(self, task: str, bound: float | None, headers: Mapping[str, str] | None,
                             budget: float | None = None) -> TaskSignature:
        if task not in self._signatures:
            status, rh, body = await self._send("GET", f"v2/models/{quote(task, safe='')}", headers, bound=bound,
                                                budget=budget)
            if status >= 400:
                raise error_from_reply(status, body, wire.retry_after(rh))
            try:
                meta = json.loads(body)
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise MeshError(f"task metadata for {task} is not JSON") from exc
            self._signatures[task] = metadata_to_signature(meta)
        return self._signatures[task]

    async def ready(self, *, timeout: float | None = None,  # noqa: ASYNC109 (this call's bound)
                    headers: Mapping[str, str] | None = None) -> bool:
        """Whether the edge agent (the first of several that answers) can answer queries (503 -> False;
        unreachable -> PeerUnavailable). ``timeout``, ``headers``: this call's."""
        status, _, body = await self._send("GET", "v2/health/ready", wire.call_headers(headers) if headers else None,
                                           bound=timeout)
        if status == 503:
            return False
        if status >= 400:
            raise error_from_reply(status, body)
        return True

    async def infer(self, task: str, inputs: Inputs, *, latency_ms: float, min_accuracy: float = 0.0,
                    max_cost: float | None = None, prefer: str = DEFAULT_PREFER, request_id: str | None = None,
                    trace: bool = False, timeout: float | None = None,  # noqa: ASYNC109 (this call's bound)
                    headers: Mapping[str, str] | None = None, version: int | None = None) -> InferResult:
        """Run ``task`` on ``inputs`` within the SLO. A bare array feeds the task's single input.
        ``trace``: ask the mesh to record its decisions for this query (``InferResult.trace_id``).
        ``timeout``: this call's longest wait (default the client's); ``headers``: HTTP headers of this call (a
        ``traceparent``, say), none of the SDK's own (``RequestError``); ``version``: pin a version of your task."""
        if self._state is not _State.OPEN:
            self._open()
        started = time.monotonic()
        extra = wire.call_headers(headers) if headers else None
        # The edge answers by the query's deadline (or with an error); the bound only protects
        # the caller from an agent that hangs: the SLO budget plus a grace for the loopback/LAN hop.
        bound = min(self.timeout if timeout is None else timeout, latency_ms / 1000.0 + DEADLINE_GRACE_S)
        named: Mapping[str, Any] | None = None if wire.is_single(inputs) else inputs
        sig = None
        if named is None or not wire.ready(named):  # converting lists needs the task's dtypes
            sig = self._signatures.get(task)
            if sig is None:
                # within the call's bound: a metadata lookup at a busy edge counts against the caller's wait too
                sig = await self._task_metadata(task, bound, None, latency_ms / 1000.0)
        if named is None:
            assert sig is not None
            if len(sig.inputs) != 1:
                raise BadTensor(f"task {task} takes inputs {[s.name for s in sig.inputs]}; pass a dict")
            named = {sig.inputs[0].name: inputs}
        tensors, shape_key = wire.prepare(named, sig)
        plan = None
        key: tuple[Any, ...] = ()
        if shape_key and request_id is None and self.binary:
            # types are part of the key: 20 == 20.0 but they are written differently
            key = (task, shape_key, latency_ms, type(latency_ms), min_accuracy, type(min_accuracy), max_cost,
                   type(max_cost), prefer, self._tenant, trace, version)
            try:
                plan = self._plans.get(key)
            except TypeError:  # an unhashable argument: encode it in full, let the edge judge it
                key = ()
        # a client of several edges sends every attempt with one id: the caller's, else one it draws
        drawn = request_id is None and self._book is not None
        rid = new_request_id() if drawn else request_id
        if plan is not None and not drawn:
            body = b"".join([plan.header, *wire.tensor_data(tensors)])
        elif plan is None:
            plan, body = self._plan(key, task, tensors, latency_ms, min_accuracy, max_cost, prefer, request_id,
                                    trace, version)
        sent = plan.headers
        if drawn:
            assert rid is not None
            if plan.header:  # binary: the id goes into the kept JSON header, whose length the HTTP header says
                head = wire.with_id(plan.header, rid)
                body = b"".join([head, *wire.tensor_data(tensors)])
                sent = {**sent, HEADER_LENGTH: str(len(head))}
            else:
                body = wire.with_id(body, rid)
        if extra:
            sent = {**sent, **extra}
        left = bound - (time.monotonic() - started)
        try:
            if self._book is not None:
                i, (status, rh, rb) = await self._failover(task, tensors, plan.path, body, sent, left, latency_ms,
                                                           (min_accuracy, max_cost, prefer, rid, trace, extra, version),
                                                           started)
            elif left <= 0:
                raise TimeoutError
            else:
                i = 0
                if (own := self._own) is not None:  # every query: no frame more than it needs
                    status, rh, rb = await own.request("POST", plan.path, sent, body, limit_s=left)
                else:
                    status, rh, rb = await self._attempt(0, "POST", plan.path, sent, body, left)
        except TimeoutError as exc:  # DeadlineExceeded is one
            raise DeadlineExceeded(f"{task}: no answer within {bound:.3f} s (budget {latency_ms} ms)") from exc
        if status >= 400:
            raise error_from_reply(status, rb, wire.retry_after(rh))
        dec = wire.decode_reply(rh, rb)
        params = dec.parameters
        trace_id = params.get("trace_id")
        res = InferResult(dec.outputs, *result_values(params), request_id=dec.request_id,
                          trace_id=trace_id if type(trace_id) is str else "",
                          backbone_tenants=backbone_tenants(params) if "backbone_batch_tenants" in params else 0,
                          late=params.get("late") is True, edge=self._edges[i].url,
                          stages=cascade_stages(params) if "cascade_stages" in params else ())
        res.within_slo = not res.late and res.accuracy >= min_accuracy
        return res

    async def _failover(self, task: str, tensors: dict[str, Any], path: str, body: bytes, headers: dict[str, str],
                        left: float, latency_ms: float, rest: tuple[Any, ...],
                        started: float) -> tuple[int, Response]:
        """The query asked of the edges in turn (``mesh.failover.first_answer``): the first attempt sends ``body``,
        a retry is encoded again with the same id and only what is left of the budget."""
        assert self._book is not None
        min_accuracy, max_cost, prefer, rid, trace, extra, version = rest

        async def attempt(i: int, wait: float, n: int) -> tuple[int, Response]:
            b, h = body, headers
            if n:  # told only what is left of the budget
                plan, b = self._plan((), task, tensors, retry_budget_ms(latency_ms, time.monotonic() - started),
                                     min_accuracy, max_cost, prefer, rid, trace, version)
                h = {**plan.headers, **extra} if extra else plan.headers
            status, rh, rb = await self._attempt(i, "POST", path, h, b, wait)
            if status == EdgeStalled.http_status and (err := error_from_reply(status, rb)).code == EdgeStalled.code:
                raise err  # not run there (it was frozen): a refusal, asked of the next edge
            return i, (status, rh, rb)

        return await first_answer(self._book, attempt, bound_s=left, budget_s=latency_ms / 1000.0,
                                  share=self.failover_share, what=task)

    def _plan(self, key: tuple[Any, ...], task: str, tensors: dict[str, Any], latency_ms: float,
              min_accuracy: float, max_cost: float | None, prefer: str,
              request_id: str | None, trace: bool = False, version: int | None = None) -> tuple[wire.Plan, bytes]:
        """Encode a request in full; keep its plan for the next one with the same ``key``."""
        params: dict[str, Any] = {"latency_ms": latency_ms, "min_accuracy": min_accuracy, "prefer": prefer}
        if max_cost is not None:
            params["max_cost"] = max_cost
        if trace:
            params["trace"] = True
        if version is not None:
            params["version"] = version
        plan, body = wire.encode_plan(task, tensors, params, request_id, self.binary, self._tenant_headers)
        if request_id is None and plan.header and key:
            self._plans.put(key, plan)
        return plan, body

    async def aclose(self) -> None:
        if self._state is not _State.CLOSED:
            self._state = _State.CLOSED
            for edge in self._edges:
                await edge.transport.aclose()

    async def __aenter__(self) -> AsyncClient:
        self._open()
        return self

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

class Client:
    """Synchronous SDK client: ``AsyncClient`` on a private loop thread (see the module docstring); the same
    arguments, and the same per-call ``timeout=`` and ``headers=``."""

    def __init__(self, base_url: str | Sequence[str], *, tenant: str | None = None, timeout: float = 30.0,
                 transport: Transport | Sequence[Transport] | None = None, binary: bool = True,
                 cert: PathLike | None = None, key: PathLike | None = None, ca: PathLike | None = None,
                 check_hostname: bool = True, crl: PathLike | None = None,
                 failover_share: float = FAILOVER_SHARE) -> None:
        self._async = AsyncClient(base_url, tenant=tenant, timeout=timeout, transport=transport, binary=binary,
                                  cert=cert, key=key, ca=ca, check_hostname=check_hostname, crl=crl,
                                  failover_share=failover_share)
        self._runner = LoopThread("tiermesh-client")

    @property
    def state(self) -> str:
        return self._async.state

    @property
    def transport(self) -> Transport:
        return self._async.transport

    def infer(self, task: str, inputs: Inputs, *, latency_ms: float, min_accuracy: float = 0.0,
              max_cost: float | None = None, prefer: str = DEFAULT_PREFER, request_id: str | None = None,
              trace: bool = False, timeout: float | None = None,
              headers: Mapping[str, str] | None = None, version: int | None = None) -> InferResult:
        return self._runner.call(self._async.infer(
            task, inputs, latency_ms=latency_ms, min_accuracy=min_accuracy, max_cost=max_cost, prefer=prefer,
            request_id=request_id, trace=trace, timeout=timeout, headers=headers, version=version))

    def task_metadata(self, task: str, *, timeout: float | None = None,
                      headers: Mapping[str, str] | None = None) -> TaskSignature:
        return self._runner.call(self._async.task_metadata(task, timeout=timeout, headers=headers))

    def ready(self, *, timeout: float | None = None, headers: Mapping[str, str] | None = None) -> bool:
        return self._runner.call(self._async.ready(timeout=timeout, headers=headers))

    def close(self) -> None:
        """Close the transports, stop the loop thread and close the loop. Idempotent."""
        self._runner.close(self._async.aclose)

    def __enter__(self) -> Client:
        self._runner.start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
