"""The edge's door against idle connections: how many may stand before their first request, and for how long
(:class:`ConnectionGuard`), and aiohttp's TCP site accepting through it (:class:`GuardedSite`). Out of
:mod:`edge_agent.http_api`, which serves what comes through."""

from __future__ import annotations

import asyncio
import ssl
from collections import OrderedDict
from collections.abc import Callable

from aiohttp import web

from mesh.addresses import http_url
from mesh.lifecycle import cancel_and_wait
from mesh.log import get_logger, kv

__all__ = ["FIRST_REQUEST_S", "HANDSHAKE_TIMEOUT_S", "MAX_PENDING", "ConnectionGuard", "GuardedSite"]

log = get_logger("edge_agent.http_api")
MAX_PENDING = 256          # pending at once; the oldest is closed to admit another (a container gets 1024 files)
HANDSHAKE_TIMEOUT_S = 5.0  # asyncio's default is 60 s: a slow-loris socket held a descriptor that long
FIRST_REQUEST_S = 10.0     # from accept to the first request; aiohttp alone waits its keep-alive (about an hour)


class _Accepted(asyncio.Protocol):
    """One accepted connection until its application protocol (``app``, aiohttp's) has it: at once without TLS;
    with it, after the handshake, meanwhile standing as the TLS layer's application protocol and keeping what
    arrives between the handshake's end and the hand-over (``loop.start_tls`` reads on before its caller resumes)."""

    def __init__(self, guard: ConnectionGuard, app: asyncio.Protocol) -> None:
        self.guard, self.app = guard, app
        self.raw: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.early: list[bytes] = []
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.raw is None:  # the TCP connection (start_tls does not make it again)
            self.raw = transport  # type: ignore[assignment]
            self.guard.accepted(self)

    def data_received(self, data: bytes) -> None:
        self.early.append(data)

    def eof_received(self) -> bool | None:
        self.lost = True  # a caller that hangs up before its first request is not handed over
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.raw is not None:
            self.raw.abort()


class ConnectionGuard:
    """How many connections may stand at the door before their first request, and for how long.

    A connection is *pending* from its accept until its first request reaches a handler (with TLS, its
    handshake first, given ``handshake_timeout_s``). A pending connection is closed ``first_request_s`` after its
    accept, and while ``max_pending`` are pending the oldest is closed to admit a new one. So a flood of idle
    sockets (slow loris) holds at most ``max_pending`` descriptors, for at most ``first_request_s`` each, and a
    real caller, whose handshake and request take milliseconds, is served through it. Before, aiohttp held an idle
    socket for its keep-alive timeout (3630 s) and a TLS handshake could take asyncio's 60 s: a flood ran the
    process out of descriptors, and nobody else was accepted.

    TLS is started here on each accepted socket (``loop.start_tls`` with ``ssl_context``): asyncio's TLS server
    shows a connection to the application only once its handshake is done and gives no handle on it before,
    so it could not be counted or closed while it was pending. One task per handshake, owned by the guard."""

    def __init__(self, ssl_context: ssl.SSLContext | None = None, *, max_pending: int = MAX_PENDING,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S, first_request_s: float = FIRST_REQUEST_S) -> None:
        if max_pending < 1 or handshake_timeout_s <= 0 or first_request_s <= 0:
            raise ValueError(f"a connection guard needs max_pending >= 1 and positive timeouts, got {max_pending}, "
                             f"{handshake_timeout_s}, {first_request_s}")
        self.ssl_context, self.max_pending = ssl_context, max_pending
        self.handshake_timeout_s, self.first_request_s = handshake_timeout_s, first_request_s
        self._pending: OrderedDict[asyncio.Protocol, _Accepted] = OrderedDict()  # by app protocol, oldest first
        self._handshakes: set[asyncio.Task[None]] = set()
        self._closed = False
        self.evicted = 0  # pending connections closed to admit newer ones
        self.expired = 0  # pending connections closed at first_request_s

    @property
    def pending(self) -> int:
        return len(self._pending)

    def factory(self, server: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """The protocol factory for ``loop.create_server`` in front of ``server`` (aiohttp's ``web.Server``)."""
        return lambda: _Accepted(self, server())

    def seen(self, app: object) -> None:
        """A request reached a handler on the connection of ``app`` (``request.protocol``): it is no longer pending.
        On every request: one dict lookup, skipped while nothing is pending."""
        if self._pending:
            conn = self._pending.pop(app, None)  # type: ignore[call-overload]
            if conn is not None and conn.timer is not None:
                conn.timer.cancel()

    def accepted(self, conn: _Accepted) -> None:
        raw = conn.raw
        assert raw is not None
        if self._closed:
            raw.abort()
            return
        while len(self._pending) >= self.max_pending:
            _, oldest = self._pending.popitem(last=False)
            if not (oldest.lost or (oldest.raw is not None and oldest.raw.is_closing())):
                self.evicted += 1  # a connection already gone makes room for free
            oldest.close()
        loop = asyncio.get_running_loop()
        self._pending[conn.app] = conn
        conn.timer = loop.call_later(self.first_request_s, self._expire, conn.app)
        if self.ssl_context is None:
            raw.set_protocol(conn.app)
            conn.app.connection_made(raw)
            return
        raw.pause_reading()  # start_tls resumes it with its own protocol in place
        task = loop.create_task(self._handshake(conn), name="edge-tls-handshake")
        self._handshakes.add(task)
        task.add_done_callback(self._handshakes.discard)

    async def _handshake(self, conn: _Accepted) -> None:
        assert conn.raw is not None and self.ssl_context is not None
        try:
            tls = await asyncio.get_running_loop().start_tls(conn.raw, conn, self.ssl_context, server_side=True,
                                                              ssl_handshake_timeout=self.handshake_timeout_s)
        except Exception as exc:  # a refused certificate, a timeout, a reset: the caller's, logged at debug
            log.debug("TLS handshake failed: %r", exc, extra=kv(event="tls_handshake_failed"))
            self._drop(conn)
            return
        except asyncio.CancelledError:
            self._drop(conn)
            raise
        if tls is None or conn.lost:
            self._drop(conn)
            return
        tls.set_protocol(conn.app)
        conn.app.connection_made(tls)
        for data in conn.early:
            conn.app.data_received(data)  # type: ignore[attr-defined]
        conn.early.clear()

    def _drop(self, conn: _Accepted) -> None:
        if self._pending.get(conn.app) is conn:
            del self._pending[conn.app]
        conn.close()

    def _expire(self, app: asyncio.Protocol) -> None:
        conn = self._pending.pop(app, None)
        if conn is not None:
            self.expired += 1
            conn.close()

    async def close(self) -> None:
        """Close every pending connection and refuse new ones (a server stopping)."""
        self._closed = True
        while self._pending:
            self._pending.popitem()[1].close()
        await cancel_and_wait(*self._handshakes)


class GuardedSite(web.BaseSite):
    """aiohttp's TCP site, its connections accepted through a :class:`ConnectionGuard`."""

    __slots__ = ("_guard", "_host", "_port")

    def __init__(self, runner: web.BaseRunner, host: str, port: int, guard: ConnectionGuard) -> None:
        super().__init__(runner)
        self._host, self._port, self._guard = host, port, guard

    @property
    def name(self) -> str:
        url = http_url(self._host, self._port)
        return url if self._guard.ssl_context is None else "https" + url.removeprefix("http")

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            self._guard.factory(server), self._host, self._port, backlog=self._backlog)
