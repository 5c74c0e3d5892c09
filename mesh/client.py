"""The tiermesh SDK: name a task and an SLO, get outputs plus where and how they were served.

One implementation, ``AsyncClient``; ``Client`` is a synchronous wrapper that runs the async client
on a private event loop in one background thread, started on first use and stopped by ``close()``.
That thread owns the only ``aiohttp`` session, so connections are reused across sync calls (an
``asyncio.run`` per call would open a new session, and so a new TCP connection, every time).

Both speak the Open Inference Protocol to an edge agent (``edge_agent.http_api``) through a
``Transport`` (``mesh.sdk_transport``). Failures arrive as ``mesh.errors`` classes: an error body
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
"""

from __future__ import annotations

import asyncio
import enum
import json
import threading
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar
from urllib.parse import quote

from mesh.cache import BoundedCache
from mesh.errors import BadTensor, DeadlineExceeded, MeshError, error_from_reply
from mesh.pki.reload import client_tls
from mesh.sdk_transport import AiohttpTransport, Transport
from mesh.types import DEFAULT_PREFER, DEFAULT_TENANT, TaskSignature, Timing
from mesh.v2 import sdk as wire
from mesh.v2.body import HEADER_LENGTH, TENANT_HEADER
from mesh.v2.params import backbone_tenants, metadata_to_signature, result_values

__all__ = ["AsyncClient", "Client", "InferResult"]

T = TypeVar("T")
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
    # answered within the latency asked and at the accuracy asked (not late, accuracy >= min_accuracy)
    within_slo: bool = True

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


def _header(headers: Mapping[str, str], name: str) -> str | None:
    # aiohttp's headers look up case-insensitively, and most dicts use the canonical spelling
    found = headers.get(name)
    if found is not None:
        return found
    lname = name.lower()
    for k, v in headers.items():
        if k.lower() == lname:
            return v
    return None


def _retry_after(headers: Mapping[str, str] | None) -> int | None:
    """RFC 9110 ``Retry-After`` in whole seconds (the delay form; a date or garbage: None)."""
    raw = _header(headers, "Retry-After") if headers is not None else None
    if raw is None or not raw.strip().isdigit():
        return None
    return int(raw.strip())


PathLike = str | Path


@dataclass(slots=True, frozen=True)
class _Plan:
    header: bytes  # the request's JSON header (binary mode, no request id)
    headers: dict[str, str]  # HTTP headers; transports only read them
    path: str
    bound: float



class AsyncClient:
    """Asynchronous SDK client. Opens on first use or ``async with``; ``aclose()`` ends it.

    ``cert``, ``key``, ``ca``: the tenant's certificate and key and the mesh CA (paths) for an
    ``https://`` edge; ``crl``: the CA's revocation list (a path), to refuse a revoked server; ``tenant``: the
    tenant header for an ``--insecure`` edge (with a certificate, leave it out: the certificate names the tenant,
    and a header naming another one is refused)."""

    def __init__(self, base_url: str, *, tenant: str | None = None, timeout: float = 30.0,
                 transport: Transport | None = None, binary: bool = True, cert: PathLike | None = None,
                 key: PathLike | None = None, ca: PathLike | None = None, check_hostname: bool = True,
                 crl: PathLike | None = None) -> None:
        self.base_url = base_url
        ssl_context, self.credentials = client_tls(base_url, cert, key, ca, check_hostname, crl) \
            if transport is None else (None, None)
        if tenant is None and cert is None:
            tenant = DEFAULT_TENANT
        self._tenant_headers: dict[str, str] = {}
        self.tenant = tenant
        self.timeout = timeout
        self.binary = binary
        # our own transport bounds every request itself (aiohttp's total timeout, raised as
        # DeadlineExceeded, per call for a query's budget); a second timer per call would only add cost
        self._own: AiohttpTransport | None = None
        if transport is None:
            transport = self._own = AiohttpTransport(
                base_url, timeout=timeout, ssl_context=ssl_context,
                refresh=self.credentials.refresh if self.credentials is not None else None)
        self._transport: Transport = transport
        self._bounded = self._own is not None
        self._state = _State.UNOPENED
        self._signatures: dict[str, TaskSignature] = {}
        # A caller repeats the shape of its query (task, SLO, tensor names, dtypes and shapes):
        # the JSON header, HTTP headers, path and time bound of one are kept for the next, which
        # then skips building and serialising the JSON header.
        self._plans: BoundedCache[tuple[Any, ...], _Plan] = BoundedCache(256)

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
        return self._transport

    def _open(self) -> None:
        if self._state is _State.CLOSED:
            raise RuntimeError("client is closed")
        self._state = _State.OPEN

    async def _send(self, method: str, path: str, headers: dict[str, str] | None = None,
                    body: bytes = b"") -> tuple[int, Mapping[str, str], bytes]:
        self._open()
        hdrs = {**self._tenant_headers, **(headers or {})}
        if self._bounded:
            return await self._transport.request(method, path, hdrs, body)
        try:
            async with asyncio.timeout(self.timeout):
                return await self._transport.request(method, path, hdrs, body)
        except TimeoutError as exc:
            raise DeadlineExceeded(f"{method} {path}: no answer within {self.timeout} s") from exc

    async def _checked(self, method: str, path: str, headers: dict[str, str] | None = None,
                       body: bytes = b"") -> tuple[Mapping[str, str], bytes]:
        status, rh, rb = await self._send(method, path, headers, body)
        if status >= 400:
            raise error_from_reply(status, rb, _retry_after(rh))
        return rh, rb

    async def task_metadata(self, task: str) -> TaskSignature:
        """The task's input/output signature (cached per client)."""
        if task not in self._signatures:
            _, body = await self._checked("GET", f"v2/models/{quote(task, safe='')}")
            try:
                meta = json.loads(body)
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise MeshError(f"task metadata for {task} is not JSON") from exc
            self._signatures[task] = metadata_to_signature(meta)
        return self._signatures[task]

    async def ready(self) -> bool:
        """Whether the edge agent can answer queries (503 -> False; unreachable -> PeerUnavailable)."""
        status, _, body = await self._send("GET", "v2/health/ready")
        if status == 503:
            return False
        if status >= 400:
            raise error_from_reply(status, body)
        return True

    async def infer(self, task: str, inputs: Inputs, *, latency_ms: float, min_accuracy: float = 0.0,
                    max_cost: float | None = None, prefer: str = DEFAULT_PREFER,
                    request_id: str | None = None, trace: bool = False) -> InferResult:
        """Run ``task`` on ``inputs`` within the SLO. A bare array feeds the task's single input.
        ``trace``: ask the mesh to record its decisions for this query (``InferResult.trace_id``)."""
        if self._state is not _State.OPEN:
            self._open()
        spent = 0.0  # of the budget's wait, before the request itself (a first call's metadata lookup)
        named: Mapping[str, Any] | None = None if wire.is_single(inputs) else inputs
        sig = None
        if named is None or not wire.ready(named):  # converting lists needs the task's dtypes
            sig = self._signatures.get(task)
            if sig is None:
                sig, spent = await self._metadata_within(task, latency_ms)
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
                   type(max_cost), prefer, self._tenant, self.timeout, trace)
            try:
                plan = self._plans.get(key)
            except TypeError:  # an unhashable argument: encode it in full, let the edge judge it
                key = ()
        if plan is not None:
            body = b"".join([plan.header, *wire.tensor_data(tensors)])
        else:
            plan, body = self._plan(key, task, tensors, latency_ms, min_accuracy, max_cost, prefer, request_id,
                                    trace)
        # The edge answers by the query's deadline (or with an error); plan.bound only protects
        # the caller from an agent that hangs: the SLO budget plus a grace for the loopback/LAN hop.
        try:
            bound = plan.bound - spent if spent else plan.bound
            if bound <= 0:
                raise TimeoutError
            if self._own is not None:
                status, rh, rb = await self._own.request("POST", plan.path, plan.headers, body, limit_s=bound)
            else:
                async with asyncio.timeout(bound):
                    status, rh, rb = await self._transport.request("POST", plan.path, plan.headers, body)
        except (TimeoutError, DeadlineExceeded) as exc:
            raise DeadlineExceeded(f"{task}: no answer within {plan.bound:.3f} s (budget {latency_ms} ms)") from exc
        if status >= 400:
            raise error_from_reply(status, rb, _retry_after(rh))
        raw_len = rh.get(HEADER_LENGTH)  # aiohttp's headers: case-insensitive already
        if raw_len is None:
            raw_len = _header(rh, HEADER_LENGTH)
        dec = wire.decode_infer_response(rb, int(raw_len) if raw_len is not None else None)
        params = dec.parameters
        trace_id = params.get("trace_id")
        res = InferResult(dec.outputs, *result_values(params), request_id=dec.request_id,
                          trace_id=trace_id if type(trace_id) is str else "",
                          backbone_tenants=backbone_tenants(params) if "backbone_batch_tenants" in params else 0,
                          late=params.get("late") is True)
        res.within_slo = not res.late and res.accuracy >= min_accuracy
        return res

    async def _metadata_within(self, task: str, latency_ms: float) -> tuple[TaskSignature, float]:
        """The task's signature, and the seconds its lookup took. The caller's wait is bounded from its call, not
        from the request: a metadata lookup at a busy edge counts against it too."""
        started = time.monotonic()
        try:
            async with asyncio.timeout(min(self.timeout, latency_ms / 1000.0 + DEADLINE_GRACE_S)):
                sig = await self.task_metadata(task)
        except TimeoutError as exc:
            raise DeadlineExceeded(f"{task}: no task metadata within the budget ({latency_ms} ms) "
                                   f"and its grace") from exc
        return sig, time.monotonic() - started

    def _plan(self, key: tuple[Any, ...], task: str, tensors: dict[str, Any], latency_ms: float,
              min_accuracy: float, max_cost: float | None, prefer: str,
              request_id: str | None, trace: bool = False) -> tuple[_Plan, bytes]:
        """Encode a request in full; keep its plan for the next one with the same ``key``."""
        params: dict[str, Any] = {"latency_ms": latency_ms, "min_accuracy": min_accuracy, "prefer": prefer}
        if max_cost is not None:
            params["max_cost"] = max_cost
        if trace:
            params["trace"] = True
        body, hlen = wire.encode_infer_request(tensors, params, request_id=request_id, binary=self.binary)
        headers = dict(self._tenant_headers)
        if hlen is None:
            headers["Content-Type"] = "application/json"
        else:
            headers["Content-Type"] = "application/octet-stream"
            headers[HEADER_LENGTH] = str(hlen)
        plan = _Plan(body[:hlen] if hlen is not None else b"", headers, f"v2/models/{quote(task, safe='')}/infer",
                     min(self.timeout, latency_ms / 1000.0 + DEADLINE_GRACE_S))
        if request_id is None and hlen is not None and key:
            self._plans.put(key, plan)
        return plan, body

    async def aclose(self) -> None:
        if self._state is not _State.CLOSED:
            self._state = _State.CLOSED
            await self._transport.aclose()

    async def __aenter__(self) -> AsyncClient:
        self._open()
        return self

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()


class Client:
    """Synchronous SDK client: ``AsyncClient`` on a private loop thread (see the module docstring)."""

    def __init__(self, base_url: str, *, tenant: str | None = None, timeout: float = 30.0,
                 transport: Transport | None = None, binary: bool = True, cert: PathLike | None = None,
                 key: PathLike | None = None, ca: PathLike | None = None, check_hostname: bool = True,
                 crl: PathLike | None = None) -> None:
        self._async = AsyncClient(base_url, tenant=tenant, timeout=timeout, transport=transport,
                                  binary=binary, cert=cert, key=key, ca=ca, check_hostname=check_hostname, crl=crl)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    @property
    def state(self) -> str:
        return self._async.state

    @property
    def transport(self) -> Transport:
        return self._async.transport

    def _ensure_loop(self) -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
        # Caller holds self._lock.
        if self._loop is None or self._thread is None:
            loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=loop.run_forever, name="tiermesh-client", daemon=True)
            self._thread.start()
            self._loop = loop
        return self._loop, self._thread

    def _loop_for_call(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._closed:
                raise RuntimeError("client is closed")
            return self._ensure_loop()[0]

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            loop = self._loop_for_call()
        except RuntimeError:
            coro.close()
            raise
        fut = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return fut.result()
        except BaseException:
            fut.cancel()
            raise

    def infer(self, task: str, inputs: Inputs, *, latency_ms: float, min_accuracy: float = 0.0,
              max_cost: float | None = None, prefer: str = DEFAULT_PREFER,
              request_id: str | None = None, trace: bool = False) -> InferResult:
        return self._call(self._async.infer(task, inputs, latency_ms=latency_ms, min_accuracy=min_accuracy,
                                            max_cost=max_cost, prefer=prefer, request_id=request_id, trace=trace))

    def task_metadata(self, task: str) -> TaskSignature:
        return self._call(self._async.task_metadata(task))

    def ready(self) -> bool:
        return self._call(self._async.ready())

    def close(self) -> None:
        """Close the transport, stop the loop thread and close the loop. Idempotent."""
        with self._lock:
            if self._closed:
                return
            # Even an unused client closes its transport on its own loop, so close() works
            # from inside a caller's running event loop too.
            loop, thread = self._ensure_loop()
            self._closed = True
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(loop), loop).result()
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()

    async def _shutdown(self, loop: asyncio.AbstractEventLoop) -> None:
        # Runs on the client's own loop, so close() works even from inside another running loop.
        try:
            await self._async.aclose()
        finally:
            await loop.shutdown_asyncgens()
            await loop.shutdown_default_executor()

    def __enter__(self) -> Client:
        self._loop_for_call()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
