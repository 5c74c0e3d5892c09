"""The SDK's transport seam: how ``mesh.client.AsyncClient`` moves bytes.

``AiohttpTransport`` is the real one (one ``aiohttp.ClientSession``, so connections are reused
across calls); ``MockTransport`` answers from a function so unit tests need no server. A transport
translates its own failures at the boundary: unreachable peer -> ``PeerUnavailable``,
timeout -> ``DeadlineExceeded``. HTTP error statuses are *not* errors here; the client reads them.

Over HTTPS the transport takes a ready ``ssl.SSLContext``, or a factory of them (the client's, from its
certificate, key, CA and revocation list: called for each new pool) and, optionally, a ``refresh`` callable it runs
at most every ``refresh_s`` before a request: the client's credentials check their files there, so a rotated
certificate is used by new connections. When ``refresh`` says something changed, the pool is replaced: a keep-alive
connection was checked against the list in force when it opened, and a server revoked since must not keep it.
Requests already running on the old pool finish (it is closed ``timeout`` later); the next request dials with a
context made from the files now, and its handshake checks the new list. A server the handshake refuses (another
CA; revoked, with ``crl=``) is ``PeerUnavailable``: nothing was sent.

A client of several edges (``mesh.failover``) has one transport per edge, all with the same TLS settings; they share
one ``refresh`` through :class:`SharedRefresh`, so each of them learns of a change (a check reports it only once).

A transport of another protocol fits the same seam: ``request`` with the V2 REST path and headers it maps onto its own
call, a reply as ``(status, headers, body)``, and its failures translated the same way, which is all the client's
failover reads. ``open_edges`` gives a ``grpc://`` or ``grpcs://`` URL :class:`mesh.grpc_transport.GrpcTransport`
(imported then, and only then: grpclib is the ``grpc`` extra's), any other an ``AiohttpTransport``; one client may
list both kinds, if all or none of its URLs use TLS (one set of TLS files serves them all).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, cast, runtime_checkable

import aiohttp
from yarl import URL

from mesh.cache import BoundedCache
from mesh.errors import ConfigError, DeadlineExceeded, PeerUnavailable

__all__ = ["AiohttpTransport", "BoundedTransport", "Edge", "Handler", "MockTransport", "Response", "SharedRefresh",
           "Transport", "open_edges"]

# (status, headers, body); headers may be any mapping (aiohttp's are case-insensitive)
Response = tuple[int, Mapping[str, str], bytes]
Handler = Callable[[str, str, dict[str, str], bytes], Response | Awaitable[Response]]
_TLS_SCHEMES = frozenset({"https", "grpcs"})
_GRPC_SCHEMES = frozenset({"grpc", "grpcs"})  # mesh.grpc_transport.SCHEMES, known here without importing grpclib


@runtime_checkable
class Transport(Protocol):
    async def request(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> Response:
        """Send one request; ``path`` is relative to the transport's base URL."""
        ...

    async def aclose(self) -> None:
        ...


class BoundedTransport(Transport, Protocol):
    """A transport that bounds each request itself: ``limit_s`` (seconds) for that call alone, past which it raises
    ``DeadlineExceeded`` (the client then sets no timer of its own). ``AiohttpTransport`` is one; a transport of
    another protocol that has per-call deadlines (gRPC's) would be one too."""

    async def request(self, method: str, path: str, headers: Mapping[str, str], body: bytes, *,
                      limit_s: float | None = None) -> Response:
        ...


class SharedRefresh:
    """One ``refresh`` (a credentials' file check, True once per change) told to several transports: ``view()``
    gives each its own callable, True when a change happened since that transport last asked."""

    def __init__(self, refresh: Callable[[], bool]) -> None:
        self._refresh = refresh
        self._changes = 0

    def view(self) -> Callable[[], bool]:
        seen = self._changes

        def changed() -> bool:
            nonlocal seen
            if self._refresh():
                self._changes += 1
            news, seen = seen != self._changes, self._changes
            return news

        return changed


class AiohttpTransport:
    """HTTP/1.1 over one lazily created ``ClientSession`` (created inside the running loop).

    ``request`` takes an optional ``limit_s`` (seconds) for that call alone, in place of the
    transport's ``timeout``: the SDK bounds a query by its budget with it, so aiohttp's own timer is
    the only one.
    """

    def __init__(self, base_url: str, *, timeout: float = 30.0, limit: int = 16,
                 ssl_context: ssl.SSLContext | Callable[[], ssl.SSLContext] | None = None,
                 refresh: Callable[[], bool] | None = None,
                 refresh_s: float = 1.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._limit = limit
        self._ssl = ssl_context
        self._refresh, self._refresh_s, self._next_refresh = refresh, refresh_s, 0.0
        self._session: aiohttp.ClientSession | None = None
        self._retired: set[aiohttp.ClientSession] = set()  # pools replaced after a refresh, closing soon
        self._retired_tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        # parsing a URL and building a ClientTimeout cost micro-seconds per request; a client's
        # paths and budgets repeat, so each is made once
        self._urls: BoundedCache[str, URL] = BoundedCache(256)
        self._timeouts: BoundedCache[float, aiohttp.ClientTimeout] = BoundedCache(256)

    def _url(self, path: str) -> URL:
        url = self._urls.get(path)
        if url is None:
            url = self._urls.put(path, URL(f"{self.base_url}/{path.lstrip('/')}"))
        return url

    def _timeout(self, seconds: float) -> aiohttp.ClientTimeout:
        found = self._timeouts.get(seconds)
        if found is None:
            # ceil_threshold=inf: aiohttp would round a bound above 5 s up to a whole second
            found = self._timeouts.put(seconds, aiohttp.ClientTimeout(total=seconds, ceil_threshold=math.inf))
        return found

    @property
    def session(self) -> aiohttp.ClientSession | None:
        return self._session

    def _get_session(self) -> aiohttp.ClientSession:
        if self._closed:
            raise RuntimeError("transport is closed")
        if self._session is None:
            # a factory: each pool gets a context made from the files in force (a revocation list changed since)
            ctx = self._ssl() if callable(self._ssl) else self._ssl
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._limit, ssl=ctx if ctx is not None else True),
                timeout=aiohttp.ClientTimeout(total=self.timeout),
            )
        return self._session

    async def request(self, method: str, path: str, headers: Mapping[str, str], body: bytes, *,
                      limit_s: float | None = None) -> Response:
        # the cached session, URL and timeout looked up here rather than through their methods: this
        # runs for every query
        session = self._session or self._get_session()
        if self._refresh is not None and (now := time.monotonic()) >= self._next_refresh:
            self._next_refresh = now + self._refresh_s
            if self._refresh():
                session = self._retire_pool()
        url = self._urls.get(path) or self._url(path)
        bound = self.timeout if limit_s is None else limit_s
        timeout = self._timeouts.get(bound) or self._timeout(bound)
        try:
            async with session.request(method, url, headers=headers, data=body or None,
                                       timeout=timeout) as resp:
                data = await resp.read()
                # the read-only view needs no copy: it outlives the response it came from
                return resp.status, resp.headers, data
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise DeadlineExceeded(f"{method} {url}: no answer within {bound} s") from exc
        except aiohttp.ClientError as exc:
            raise PeerUnavailable(f"{method} {url}: {exc}") from exc
        except ssl.SSLError as exc:  # a TLS alert outside aiohttp's wrapping (the server refused us)
            raise PeerUnavailable(f"{method} {url}: TLS: {exc}") from exc

    def _retire_pool(self) -> aiohttp.ClientSession:
        """A new pool for new requests; the old one closed once nothing can still be running on it."""
        old, self._session = self._session, None
        if old is not None:
            self._retired.add(old)
            asyncio.get_running_loop().call_later(self.timeout + 1.0, self._close_retired, old)
        return self._get_session()

    def _close_retired(self, old: aiohttp.ClientSession) -> None:
        if old in self._retired:
            self._retired.discard(old)
            task = asyncio.ensure_future(old.close())
            self._retired_tasks.add(task)
            task.add_done_callback(self._retired_tasks.discard)

    async def aclose(self) -> None:
        self._closed = True
        sessions = [*self._retired, *([self._session] if self._session is not None else [])]
        self._retired.clear()
        self._session = None
        for session in sessions:
            await session.close()
        if self._retired_tasks:
            await asyncio.gather(*self._retired_tasks, return_exceptions=True)


@dataclass(slots=True, frozen=True)
class Edge:
    """One edge of an SDK client: its URL, its transport, and that transport again where it bounds each request
    itself (``own``: one the client made)."""

    url: str
    transport: Transport
    own: BoundedTransport | None


def open_edges(urls: Sequence[str], transport: Transport | Sequence[Transport] | None, *, timeout: float,
               ssl_context: ssl.SSLContext | Callable[[], ssl.SSLContext] | None,
               refresh: Callable[[], bool] | None) -> list[Edge]:
    """A client's edges: the ``transport`` given for each URL, else one per URL (``GrpcTransport`` for a gRPC URL,
    ``AiohttpTransport`` for the rest), all with the same TLS settings (and one ``refresh``, shared)."""
    if transport is not None:
        given = list(transport) if isinstance(transport, list | tuple) else [transport]
        if len(given) != len(urls):
            raise ConfigError(f"{len(given)} transport(s) for {len(urls)} edge URL(s): pass one per URL")
        return [Edge(u, cast(Transport, t), None) for u, t in zip(urls, given, strict=True)]
    schemes = [u.split(":", 1)[0].lower() for u in urls]
    if len({s in _TLS_SCHEMES for s in schemes}) > 1:
        raise ConfigError(f"edge URLs mix schemes with and without TLS: {list(urls)} (one TLS setting applies to "
                          f"every edge)")
    shared = SharedRefresh(refresh) if refresh is not None and len(urls) > 1 else None
    out = []
    for u, scheme in zip(urls, schemes, strict=True):
        view = shared.view() if shared is not None else refresh
        own: BoundedTransport
        if scheme in _GRPC_SCHEMES:
            from mesh.grpc_transport import GrpcTransport  # grpclib: the grpc extra (MissingExtra without it)

            own = GrpcTransport(u, timeout=timeout, ssl_context=ssl_context, refresh=view)
        else:
            own = AiohttpTransport(u, timeout=timeout, ssl_context=ssl_context, refresh=view)
        out.append(Edge(u, own, own))
    return out


class MockTransport:
    """Answers every request by calling ``handler(method, path, headers, body)`` (sync or async)."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.calls: list[tuple[str, str]] = []
        self.closed = False

    async def request(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> Response:
        if self.closed:
            raise RuntimeError("transport is closed")
        self.calls.append((method, path))
        out = self.handler(method, path, dict(headers), body)
        if inspect.isawaitable(out):
            out = await out
        return out  # type: ignore[return-value]

    async def aclose(self) -> None:
        self.closed = True
