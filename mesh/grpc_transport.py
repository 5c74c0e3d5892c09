"""The SDK's gRPC transport: ``Client("grpcs://host:port", ...)`` speaks the Open Inference Protocol over gRPC
(``inference.GRPCInferenceService``, as :mod:`edge_agent.grpc_api` serves it) through the seam every SDK transport
fits (:mod:`mesh.sdk_transport`): the client hands it the V2 REST request it would have sent and reads back
``(status, headers, body)`` as REST's, so results, errors and failover stay the client's one code path.

    the client's request              the gRPC call      what is carried over
    GET  v2/health/ready              ServerReady        ready=False -> 503, as REST answers
    GET  v2/health/live               ServerLive
    GET  v2/models/{task}             ModelMetadata      the reply as V2 metadata JSON
    POST v2/models/{task}/infer       ModelInfer         the JSON header's id, parameters and input descriptors;
                                                         binary tensors as ``raw_input_contents``, byte for byte
                                                         (BYTES: the same length-prefixed form), JSON ``data``
                                                         made raw (:mod:`mesh.v2.plain`)
    headers                           metadata           lower-cased; the body's framing (content type, binary
                                                         header length) dropped; what gRPC reserves refused
    limit_s, the call's bound         the gRPC deadline  the edge routes within it (a deadline shorter than
                                                         ``latency_ms`` is the query's budget there)

A reply's ``raw_output_contents`` become the binary extension's body behind a JSON header: the cost of the
translation is one small orjson header each way; tensors' bytes are passed along, never decoded here. An error
status becomes the REST error reply of its code, the ``tiermesh-code`` trailer's, else the status's most general
one (:func:`mesh.v2.grpc_status.code_of_status`), at that code's HTTP status, with ``retry-after`` as
``Retry-After``: the client raises it through the one table (:func:`mesh.errors.error_from_reply`).

Failures, translated as every transport's: no connection, a TLS refusal (no client certificate: on TLS 1.3 the
edge's alert arrives at the first read), a connection lost mid-call -> ``PeerUnavailable`` (failover: REFUSED); the
deadline passed -> ``DeadlineExceeded`` (SILENT), whether grpclib's timer saw it or the edge's DEADLINE_EXCEEDED
without a code did (grpclib's own, for the same deadline; with the ``deadline`` code it is the mesh's answer, as
REST's 504). grpclib's timer cancels the calling task and raises ``TimeoutError`` without ``uncancel()``: the count
is taken back here, or a caller's ``asyncio.timeout`` around the call would take its own expiry, later, for a
cancellation from outside and raise ``CancelledError``.

TLS: each channel gets a context from the client's factory (certificate, key, CA, revocation list) with ALPN
``h2``, which gRPC requires; a ``refresh`` that reports a change replaces the channel, the old one closed once the
calls on it have had their time, as :class:`mesh.sdk_transport.AiohttpTransport` replaces its pool.

Needs the ``grpc`` extra (grpclib, pure Python over ``h2``); without it, importing this raises
:class:`mesh.extras.MissingExtra`, which is what a ``grpcs://`` URL gets on the base install.
"""

from __future__ import annotations

from mesh.extras import require

require("grpc", "grpclib", "h2")

import asyncio
import ssl
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import unquote, urlsplit

import orjson
from grpclib.client import Channel, Stream
from grpclib.const import Cardinality, Status
from grpclib.encoding.proto import ProtoCodec
from grpclib.exceptions import GRPCError, StreamTerminatedError
from grpclib.exceptions import ProtocolError as H2ProtocolError
from grpclib.metadata import encode_metadata
from h2.exceptions import H2Error

from mesh.errors import (
    ConfigError,
    DeadlineExceeded,
    PeerUnavailable,
    ProtocolError,
    RequestError,
    error_from_code,
)
from mesh.v2 import grpc_messages as oip
from mesh.v2.body import HEADER_LENGTH, dumps, split_body
from mesh.v2.grpc_status import CODE_TRAILER, RETRY_TRAILER, code_of_status
from mesh.v2.plain import as_tensor

__all__ = ["SCHEMES", "GrpcTransport", "error_reply", "grpc_call", "metadata_of", "rest_reply"]

SCHEMES = ("grpc", "grpcs")
# (status, headers, body), as mesh.sdk_transport.Response
Reply = tuple[int, Mapping[str, str], bytes]
_CODEC = ProtoCodec()  # given: grpclib would otherwise look for googleapis' status protos (the protobuf runtime)
_FRAMING = frozenset({"content-type", "content-length", HEADER_LENGTH.lower()})  # the body's, not metadata
_MAX_REPLY = 1 << 31
_INFER = "/infer"


# -------------------------------------------------------------------------- the translation (pure)


def metadata_of(headers: Mapping[str, str]) -> list[tuple[str, str]]:
    """A request's HTTP headers as gRPC metadata (``RequestError`` for one gRPC cannot carry, or reserves)."""
    md = [(k.lower(), v) for k, v in headers.items() if k.lower() not in _FRAMING]
    try:
        encode_metadata(md)  # grpclib's own checks, here rather than mid-call
    except (ValueError, TypeError) as exc:
        raise RequestError(f"a header cannot go as gRPC metadata: {exc}") from exc
    return md


def _infer_request(task: str, headers: Mapping[str, str], body: bytes) -> oip.ModelInferRequest:
    hlen = next((v for k, v in headers.items() if k.lower() == HEADER_LENGTH.lower()), None)
    head, tail = split_body(body, int(hlen) if hlen is not None else None, _MAX_REPLY)
    params = dict(head.get("parameters") or {})
    params.pop("binary_data_output", None)  # REST's: gRPC answers raw always
    inputs: list[oip.InferInputTensor] = []
    raws: list[bytes | memoryview] = []
    offset = 0
    for t in head.get("inputs") or []:
        name, datatype, shape = t["name"], t["datatype"], list(t["shape"])
        size = (t.get("parameters") or {}).get("binary_data_size")
        if size is None:  # JSON data (a client made with binary=False): its raw form
            raws.append(as_tensor(t.get("data"), datatype, where=f"input {name!r}").tobytes())
        else:
            raws.append(tail[offset:offset + size])
            offset += size
        inputs.append(oip.InferInputTensor(name=name, datatype=datatype, shape=shape))
    outputs = [oip.InferRequestedOutputTensor(name=o["name"]) for o in head.get("outputs") or []]
    rid = head.get("id")
    return oip.ModelInferRequest(model_name=task, id=rid if type(rid) is str else "", parameters=oip.entries(params),
                                 inputs=inputs, outputs=outputs, raw_input_contents=raws)


def grpc_call(method: str, path: str, headers: Mapping[str, str], body: bytes) -> tuple[str, Any]:
    """The gRPC method and request message of a V2 REST request the SDK makes (``RequestError`` for others)."""
    p = path.lstrip("/")
    if p == "v2/health/ready":
        return "ServerReady", oip.ServerReadyRequest()
    if p == "v2/health/live":
        return "ServerLive", oip.ServerLiveRequest()
    rest = p.removeprefix("v2/models/")
    if rest != p and "/" not in rest.removesuffix(_INFER):
        if method == "POST" and rest.endswith(_INFER):
            try:
                return "ModelInfer", _infer_request(unquote(rest.removesuffix(_INFER)), headers, body)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise RequestError(f"infer request cannot be sent over gRPC: {exc!r}") from exc
        if method == "GET" and not rest.endswith(_INFER):
            return "ModelMetadata", oip.ModelMetadataRequest(name=unquote(rest))
    raise RequestError(f"{method} {path} has no gRPC call in the SDK")


def _tensors(items: list[Any]) -> list[dict[str, Any]]:
    return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in items]


def rest_reply(name: str, msg: Any) -> Reply:
    """A gRPC reply as REST's (``ProtocolError`` for an infer reply without raw outputs: tiermesh always sends
    them, as Triton does)."""
    if name == "ModelInfer":
        raws, outs = msg.raw_output_contents, msg.outputs
        if len(raws) != len(outs):
            raise ProtocolError(f"infer reply carries {len(raws)} raw buffers for {len(outs)} outputs")
        descs = [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape),
                  "parameters": {"binary_data_size": len(raw)}} for t, raw in zip(outs, raws, strict=True)]
        header = dumps({"model_name": msg.model_name, "id": msg.id, "parameters": oip.params_of(msg.parameters),
                        "outputs": descs})
        return 200, {HEADER_LENGTH: str(len(header))}, b"".join([header, *raws])
    if name == "ModelMetadata":
        meta = {"name": msg.name, "versions": list(msg.versions), "platform": msg.platform,
                "inputs": _tensors(msg.inputs), "outputs": _tensors(msg.outputs)}
        return 200, {"Content-Type": "application/json"}, dumps(meta)
    if name == "ServerReady":
        return (200 if msg.ready else 503), {}, b""
    return 200, {}, b""


def error_reply(status: int, message: str | None, trailers: Mapping[str, Any] | None) -> Reply:
    """A gRPC error status as the REST error reply of its tiermesh code (module docstring)."""
    code = trailers.get(CODE_TRAILER) if trailers is not None else None
    if not isinstance(code, str):
        code = code_of_status(status)
    text = message or f"gRPC status {status}"
    headers: dict[str, str] = {"Content-Type": "application/json"}
    retry = trailers.get(RETRY_TRAILER) if trailers is not None else None
    if isinstance(retry, str):
        headers["Retry-After"] = retry
    return error_from_code(code, text).http_status, headers, orjson.dumps({"error": text, "code": code})


# -------------------------------------------------------------------------- the transport


class GrpcTransport:
    """One edge's gRPC channel (HTTP/2, made on the first call in the running loop; grpclib dials again after a
    lost connection). ``base_url``: ``grpcs://host:port`` (TLS: ``ssl_context``, a context or a factory of them,
    required) or ``grpc://host:port``; ``timeout``: a call's bound when it names none; ``refresh``: as
    :class:`mesh.sdk_transport.AiohttpTransport`'s. A :class:`mesh.sdk_transport.BoundedTransport`."""

    def __init__(self, base_url: str, *, timeout: float = 30.0,
                 ssl_context: ssl.SSLContext | Callable[[], ssl.SSLContext] | None = None,
                 refresh: Callable[[], bool] | None = None, refresh_s: float = 1.0) -> None:
        try:
            parts = urlsplit(base_url)
            host, port = parts.hostname, parts.port
        except ValueError as exc:
            raise ConfigError(f"not a gRPC URL: {base_url!r}: {exc}") from exc
        scheme = parts.scheme.lower()
        if scheme not in SCHEMES or not host or port is None or parts.path.strip("/"):
            raise ConfigError(f"a gRPC edge is grpcs://host:port (grpc:// without TLS), not {base_url!r}")
        if (scheme == "grpcs") != (ssl_context is not None):
            raise ConfigError(f"{base_url}: grpcs:// goes with TLS (ca=, cert=, key=), grpc:// without")
        self.base_url, self.host, self.port, self.timeout = base_url, host, port, timeout
        self._ssl = ssl_context
        self._refresh, self._refresh_s, self._next_refresh = refresh, refresh_s, 0.0
        self._channel: Channel | None = None
        self._retired: dict[Channel, asyncio.TimerHandle] = {}  # replaced after a refresh, closing soon
        self._closed = False

    def _get_channel(self) -> Channel:
        if self._closed:
            raise RuntimeError("transport is closed")
        ctx = self._ssl() if callable(self._ssl) else self._ssl
        if ctx is not None:
            ctx.set_alpn_protocols(["h2"])
        self._channel = Channel(self.host, self.port, ssl=ctx, codec=_CODEC)
        return self._channel

    def _retire_channel(self) -> Channel:
        old, self._channel = self._channel, None
        if old is not None:
            self._retired[old] = asyncio.get_running_loop().call_later(self.timeout + 1.0, self._close_retired, old)
        return self._get_channel()

    def _close_retired(self, old: Channel) -> None:
        if self._retired.pop(old, None) is not None:
            old.close()

    async def request(self, method: str, path: str, headers: Mapping[str, str], body: bytes, *,
                      limit_s: float | None = None) -> Reply:
        channel = self._channel or self._get_channel()
        if self._refresh is not None and (now := time.monotonic()) >= self._next_refresh:
            self._next_refresh = now + self._refresh_s
            if self._refresh():
                channel = self._retire_channel()
        name, req = grpc_call(method, path, headers, body)
        bound = self.timeout if limit_s is None else limit_s
        stream = channel.request(f"/{oip.PACKAGE}.{oip.SERVICE}/{name}", Cardinality.UNARY_UNARY, type(req),
                                 oip.METHODS[name][1], timeout=bound, metadata=metadata_of(headers))
        task = asyncio.current_task()
        cancelling = task.cancelling() if task is not None else 0
        what = f"{name} {self.base_url}"
        try:
            reply = await _unary(stream, req)
        except GRPCError as exc:
            trailers = stream.trailing_metadata
            if exc.status is Status.DEADLINE_EXCEEDED and (trailers is None or CODE_TRAILER not in trailers):
                raise DeadlineExceeded(f"{what}: no answer within {bound:.3f} s") from exc
            return error_reply(exc.status.value, exc.message, trailers)
        except TimeoutError as exc:  # grpclib's deadline (before OSError: TimeoutError is one)
            if task is not None and task.cancelling() > cancelling:
                task.uncancel()  # the cancellation grpclib's timer made, taken back (module docstring)
            raise DeadlineExceeded(f"{what}: no answer within {bound:.3f} s") from exc
        except (StreamTerminatedError, H2ProtocolError, H2Error, OSError, EOFError) as exc:
            raise PeerUnavailable(f"{what}: {exc or type(exc).__name__}") from exc
        return rest_reply(name, reply)

    async def aclose(self) -> None:
        self._closed = True
        channels = [*self._retired, *([self._channel] if self._channel is not None else [])]
        for handle in self._retired.values():
            handle.cancel()
        self._retired.clear()
        self._channel = None
        for channel in channels:
            _abort(channel)
        await asyncio.sleep(0)  # the aborted sockets close on the loop's next turn


def _abort(channel: Channel) -> None:
    """Close ``channel``'s connection now. grpclib's ``close()`` starts a TLS shutdown that waits for the edge's
    close_notify, and a client closed just before its loop ends would leave the socket open (ResourceWarning);
    nothing is in flight on a closed client's channels, so there is nothing to shut down gracefully."""
    proto = channel._protocol
    transport = getattr(getattr(proto, "connection", None), "_transport", None) if proto is not None else None
    channel.close()
    if isinstance(transport, asyncio.BaseTransport) and hasattr(transport, "abort"):
        transport.abort()

    def __repr__(self) -> str:
        return f"<GrpcTransport {self.base_url}>"


async def _unary(stream: Stream[Any, Any], req: Any) -> Any:
    async with stream:
        try:
            await stream.send_request()
        except BaseException:
            # the stream's exit does nothing for a request never sent: stop its deadline timer here
            if stream._wrapper_ctx is not None:
                stream._wrapper_ctx.__exit__(None, None, None)
                stream._wrapper_ctx = None
            raise
        await stream.send_message(req, end=True)
        reply = await stream.recv_message()
        await stream.recv_trailing_metadata()
    if reply is None:
        raise ProtocolError("the edge ended the call without a reply")
    return reply
