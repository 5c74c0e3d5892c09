"""etcd's v3 gRPC API on grpclib: its messages, and one HTTP/2 channel per member with the calls the store makes.

Why not grpcio: its C core was the largest thing an idle edge agent held (about 11 MiB of its pages resident,
14 MiB with aetcd's client), for a handful of unary calls and two streams. grpclib is gRPC over the ``h2``
state machine on asyncio, in Python: about 2.5 MiB.

The messages are :mod:`mesh.etcd.messages` (etcd's, in protobuf's wire format, without the protobuf runtime),
which callers import as ``rpc``: ``rpc.RangeRequest``, ``rpc.Compare.EQUAL``, ``rpc.Event.DELETE``.

Calls. ``Member.kv.Range(req, timeout=s)`` and the like are unary calls named as in etcd's services;
``Member.watch.Watch.open(metadata=...)`` and ``Member.lease.LeaseKeepAlive.open(timeout=s)`` are streams,
used as ``async with``: ``send``, ``recv`` (None once the member ended the stream), ``async for``.

Errors. Every failure is an ``RpcError`` with ``code()`` (gRPC's status codes, ``StatusCode``) and
``details()``, which the store's failover reads (:mod:`mesh.etcd.channels`): a connection that could not be
made (refused, TLS refused) is ``UNAVAILABLE`` "failed to connect" (the request never left, so even a txn may
be sent again); one lost mid-call ``UNAVAILABLE``; a passed timeout ``DEADLINE_EXCEEDED``; a member's answer
its own status; a reply that does not decode (``mesh.protowire.DecodeError``) ``UNAVAILABLE`` "undecodable
reply", so the store fails over as from a dead member (a txn is not sent again: its fate is unknown).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import tempfile
import types
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from grpclib.client import Channel as H2Channel
from grpclib.client import Stream
from grpclib.config import Configuration
from grpclib.const import Cardinality, Status
from grpclib.encoding.proto import ProtoCodec
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError
from h2.exceptions import H2Error

from mesh.etcd import messages as rpc
from mesh.etcd.endpoints import TLSFiles
from mesh.protowire import DecodeError

__all__ = ["RpcError", "Service", "StatusCode", "StreamCall", "WireChannel", "client_context", "prefix_end"]

StatusCode = Status
CONNECT_TIMEOUT_S = 3.0  # a stream's connect to a member that does not answer (see StreamCall)

# keepalive finds connections that died silently (a black-holed member); etcd refuses pings more often than
# every 5 s (its --grpc-keepalive-min-time)
_CONFIG = Configuration(_keepalive_time=10.0, _keepalive_timeout=5.0, _keepalive_permit_without_calls=True,
                        _http2_max_pings_without_data=0)




def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` of every key starting with ``prefix`` (etcd's rule: its last byte below 0xff plus one,
    what follows dropped; ``\\0``, every key from ``prefix`` on, if there is none)."""
    for i in range(len(prefix) - 1, -1, -1):
        if prefix[i] < 0xFF:
            return prefix[:i] + bytes((prefix[i] + 1,))
    return b"\0"


class RpcError(Exception):
    """A call that failed: ``code()`` says how, ``details()`` in words."""

    def __init__(self, code: Status, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> Status:
        return self._code

    def details(self) -> str:
        return self._details


@contextlib.contextmanager
def _errors(target: str) -> Iterator[None]:
    """grpclib's, h2's and the socket's failures as ``RpcError``."""
    try:
        yield
    except RpcError:
        raise
    except GRPCError as exc:
        raise RpcError(exc.status, exc.message or exc.status.name) from exc
    except TimeoutError as exc:  # before OSError: asyncio's timeout is one
        raise RpcError(Status.DEADLINE_EXCEEDED, f"deadline exceeded [{target}]") from exc
    except DecodeError as exc:  # a reply that is no message: the member is broken, try the next (failover)
        raise RpcError(Status.UNAVAILABLE, f"undecodable reply from {target}: {exc}") from exc
    except (StreamTerminatedError, ProtocolError, H2Error, OSError, EOFError) as exc:
        raise RpcError(Status.UNAVAILABLE, f"connection to {target} lost: {exc or type(exc).__name__}") from exc


async def _send_request(stream: Stream[Any, Any], target: str) -> None:
    """Open the HTTP/2 stream (connecting first if need be); a failure here never reached the member."""
    try:
        await stream.send_request()
    except BaseException as exc:
        # the stream's exit does nothing for a request never sent: stop its deadline timer here
        if stream._wrapper_ctx is not None:
            stream._wrapper_ctx.__exit__(None, None, None)
            stream._wrapper_ctx = None
        if isinstance(exc, TimeoutError) or not isinstance(exc, (OSError, H2Error, EOFError)):
            raise
        raise RpcError(Status.UNAVAILABLE, f"failed to connect to {target}: {exc or type(exc).__name__}") from exc


def client_context(tls: TLSFiles) -> ssl.SSLContext:
    """TLS to a member: its certificate checked against ``tls.ca`` and the name dialled; this client's
    certificate presented where given (``--client-cert-auth``). ALPN ``h2``, as gRPC requires."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=tls.ca.decode("ascii"))
    ctx.set_alpn_protocols(["h2"])
    if tls.cert is not None and tls.key is not None:
        # ssl loads a certificate chain from files only: a private one, gone once read
        with tempfile.TemporaryDirectory(prefix="tiermesh-etcd-") as tmp:
            path = Path(tmp) / "client.pem"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(tls.key + b"\n" + tls.cert)
            ctx.load_cert_chain(path)
    return ctx


class UnaryCall:
    """One unary method of a service: ``await call(request, timeout=s)``."""

    def __init__(self, channel: WireChannel, path: str, reply: type[Any]) -> None:
        self.channel, self.path, self.reply = channel, path, reply

    async def __call__(self, request: Any, *, timeout: float | None = None,  # noqa: ASYNC109
                       metadata: Any = None) -> Any:
        stream = self.channel.h2.request(self.path, Cardinality.UNARY_UNARY, type(request), self.reply,
                                         timeout=timeout, metadata=metadata)
        with _errors(self.channel.target):
            async with stream:
                await _send_request(stream, self.channel.target)
                await stream.send_message(request, end=True)
                return await stream.recv_message()


class StreamMethod:
    """One streaming method of a service: ``async with method.open(...) as call``."""

    def __init__(self, channel: WireChannel, path: str, request: type[Any], reply: type[Any]) -> None:
        self.channel, self.path, self.request, self.reply = channel, path, request, reply

    def open(self, *, timeout: float | None = None, metadata: Any = None) -> StreamCall:
        stream = self.channel.h2.request(self.path, Cardinality.STREAM_STREAM, self.request, self.reply,
                                         timeout=timeout, metadata=metadata)
        return StreamCall(stream, self.channel.h2, self.channel.target)


class StreamCall:
    """A bidirectional stream, open within ``async with``; leaving it resets the stream."""

    def __init__(self, stream: Stream[Any, Any], h2: H2Channel, target: str) -> None:
        self._stream, self._h2, self.target = stream, h2, target
        self._ended = False

    async def __aenter__(self) -> StreamCall:
        with _errors(self.target):
            await self._channel_up()
            await self._stream.__aenter__()
            await _send_request(self._stream, self.target)
        return self

    async def _channel_up(self) -> None:
        """A stream has no deadline to bound its connect (a watch lives until closed): connect first, within
        ``CONNECT_TIMEOUT_S``, so a black-holed member is given up like a refusing one."""
        try:
            # not wait_for: on 3.11 it can swallow a cancellation that comes as the connect completes
            # (CPython gh-86296), and a closed watch's pump would then open its stream and wait forever
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                await self._h2.__connect__()
        except TimeoutError as exc:
            raise RpcError(Status.UNAVAILABLE, f"failed to connect to {self.target}: no answer in "
                                               f"{CONNECT_TIMEOUT_S:.0f} s") from exc
        except (OSError, H2Error, EOFError) as exc:
            raise RpcError(Status.UNAVAILABLE, f"failed to connect to {self.target}: {exc}") from exc

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: types.TracebackType | None) -> None:
        stream = self._stream
        if stream._send_request_done and not self._ended and not stream._cancel_done:
            with contextlib.suppress(Exception):
                await stream.cancel()  # RST_STREAM: the member drops its watchers at once
        with contextlib.suppress(Exception):
            # with the exception that ended the block, so grpclib does not wait for the member's trailers
            await stream.__aexit__(exc_type, exc, tb)

    async def send(self, message: Any) -> None:
        with _errors(self.target):
            await self._stream.send_message(message)

    async def recv(self) -> Any:
        """The next message; None once the member ended the stream (with OK; any other status raises)."""
        with _errors(self.target):
            message = await self._stream.recv_message()
            if message is None:
                self._ended = True
                await self._stream.recv_trailing_metadata()
            return message

    async def __aiter__(self) -> AsyncIterator[Any]:
        while (message := await self.recv()) is not None:
            yield message


class Service:
    """A service's methods by name (``KV``, ``Lease``, ``Watch``, ``Auth``), from ``rpc.SERVICES``."""

    def __init__(self, channel: WireChannel, name: str) -> None:
        self._channel, self._name, self._methods = channel, name, rpc.SERVICES[name]

    def __getattr__(self, name: str) -> Any:
        m = self._methods.get(name)
        if m is None:
            raise AttributeError(f"etcd service {self._name} has no method {name}")
        path = f"/{rpc.PACKAGE}.{self._name}/{name}"
        (req, reply), streaming = (getattr(rpc, n) for n in m[:2]), m[2]
        method: Any = (StreamMethod(self._channel, path, req, reply) if streaming
                       else UnaryCall(self._channel, path, reply))
        setattr(self, name, method)
        return method


class WireChannel:
    """One member's HTTP/2 connection (made on the first call, and again on the first call after it is lost)."""

    def __init__(self, target: str, tls: TLSFiles | None) -> None:
        self.target = target
        host, _, port = target.rpartition(":")
        self.h2 = H2Channel(host.strip("[]"), int(port), ssl=client_context(tls) if tls is not None else None,
                            config=_CONFIG, codec=ProtoCodec())

    def close(self) -> None:
        self.h2.close()
