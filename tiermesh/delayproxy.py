"""A userspace TCP delay proxy: WAN links on loopback (this kernel has no netem).

Each accepted connection is paired with one to the upstream; every chunk read in either direction
is released to the other side ``latency_ms`` (± ``jitter_ms``) after it arrived, in order, and no
faster than ``bandwidth_mbps`` allows. ``cut()`` drops every connection and refuses new ones until
``restore()`` — a partitioned link whose ends see a reset. ``blackhole()`` is the gray failure: bytes
vanish in both directions while every connection stays open, and new connections are accepted but
go nowhere (no reset, no refusal: a peer learns only from its own timeouts and heartbeats);
``restore()`` then closes the connections that lost bytes, as their TCP sessions would have timed
out meanwhile. Only loopback addresses are accepted as listen or upstream hosts, and addresses in
``allowed`` networks: the bridge subnet of network namespaces the caller created.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import random
import time
from dataclasses import dataclass, field

from mesh.errors import ConfigError
from mesh.log import get_logger, kv

__all__ = ["DelayProxy", "LinkShape", "ProxyPool"]

log = get_logger(__name__)
_CHUNK = 256 * 1024


Networks = tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]


def _require_loopback(host: str, allowed: Networks = ()) -> None:
    try:
        addr = ipaddress.ip_address(host)
        ok = addr.is_loopback or any(addr in net for net in allowed)
    except ValueError:
        ok = host == "localhost"
    if not ok:
        raise ConfigError(f"delay proxy only talks to loopback or {[str(n) for n in allowed]}, not {host!r}")


@dataclass(frozen=True, slots=True)
class LinkShape:
    """One direction's behaviour. ``latency_ms`` is one-way."""

    latency_ms: float = 0.0
    jitter_ms: float = 0.0
    bandwidth_mbps: float = 0.0  # 0: unlimited

    def delay_s(self, rng: random.Random) -> float:
        jitter = rng.uniform(-self.jitter_ms, self.jitter_ms) if self.jitter_ms else 0.0
        return max(0.0, self.latency_ms + jitter) / 1000.0


@dataclass(slots=True)
class _Pipe:
    """One direction of one connection: a timed queue drained by a pump task."""

    shape: LinkShape
    writer: asyncio.StreamWriter
    rng: random.Random
    queue: asyncio.Queue[tuple[float, bytes] | None] = field(default_factory=asyncio.Queue)
    wire_free_at: float = 0.0  # when the emulated link finishes serialising what was queued

    def push(self, data: bytes) -> None:
        now = time.monotonic()
        release = now + self.shape.delay_s(self.rng)
        if self.shape.bandwidth_mbps > 0:
            start = max(now, self.wire_free_at)
            self.wire_free_at = start + len(data) * 8 / (self.shape.bandwidth_mbps * 1e6)
            release = max(release, self.wire_free_at + self.shape.latency_ms / 1000.0)
        self.queue.put_nowait((release, data))

    async def pump(self) -> None:
        last = 0.0
        while (item := await self.queue.get()) is not None:
            release, data = item
            release = max(release, last)  # jitter never reorders a byte stream
            last = release
            wait = release - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self.writer.write(data)
            await self.writer.drain()


class DelayProxy:
    """Listens on ``listen_host:listen_port`` (0: pick one) and forwards to ``upstream``."""

    def __init__(self, upstream_host: str, upstream_port: int, *, forward: LinkShape,
                 backward: LinkShape | None = None, listen_host: str = "127.0.0.1", listen_port: int = 0,
                 name: str = "", seed: int = 0, allowed: Networks = ()) -> None:
        self._allowed = allowed
        _require_loopback(upstream_host, allowed)
        _require_loopback(listen_host, allowed)
        # port 0: the upstream is not known yet (set_upstream); connections are refused until it is
        self.upstream = (upstream_host, upstream_port)
        self.forward, self.backward = forward, backward or forward
        self.listen_host, self._listen_port = listen_host, listen_port
        self.name = name or f"->{upstream_host}:{upstream_port}"
        self._rng = random.Random(seed)
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._cut = False
        self._blackholed = False
        self.bytes_forwarded = 0
        self.bytes_dropped = 0

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("proxy not started")
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.listen_host}:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.listen_host, self._listen_port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        await self._drop_all()

    async def __aenter__(self) -> DelayProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def cut(self) -> None:
        """Partition the link: drop live connections, refuse new ones."""
        self._cut = True
        await self._drop_all()
        log.info("link cut", extra=kv(event="link_cut", reason=self.name))

    def blackhole(self) -> None:
        """Make the link swallow everything, both ways, without closing or refusing anything."""
        self._blackholed = True
        log.info("link black-holed", extra=kv(event="link_blackholed", reason=self.name))

    @property
    def blackholed(self) -> bool:
        return self._blackholed

    def restore(self) -> None:
        """Heal a cut or a black hole. Connections that lost bytes in the hole are closed."""
        self._cut = False
        if self._blackholed:
            self._blackholed = False
            for t in list(self._conns):
                t.cancel()  # each connection task closes its own sockets
        log.info("link restored", extra=kv(event="link_restored", reason=self.name))

    def set_upstream(self, host: str, port: int) -> None:
        """Point new connections at ``host:port`` (0: refuse them, e.g. while the peer is down)."""
        _require_loopback(host, self._allowed)
        self.upstream = (host, port)

    def set_shape(self, forward: LinkShape, backward: LinkShape | None = None) -> None:
        """Change latency for new data (existing queued chunks keep their release times)."""
        self.forward, self.backward = forward, backward or forward

    async def _drop_all(self) -> None:
        tasks = list(self._conns)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut:
            writer.close()
            return
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            await self._serve(reader, writer)
        except asyncio.CancelledError:
            # cut(), restore() or stop() closed this connection on purpose (its sockets are closed
            # by now); ending normally keeps asyncio's server from logging a cancelled callback
            pass
        finally:
            self._conns.discard(task)

    async def _serve(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        if self._blackholed:  # accepted, never connected on: what a peer behind a black hole sees
            try:
                while await c_reader.read(_CHUNK):
                    pass
            finally:
                c_writer.close()
            return
        try:
            if not self.upstream[1]:
                raise ConnectionRefusedError("upstream not known yet")
            u_reader, u_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            c_writer.close()
            return
        to_up = _Pipe(self.forward, u_writer, self._rng)
        to_client = _Pipe(self.backward, c_writer, self._rng)
        tasks = [asyncio.create_task(self._direction(c_reader, to_up)),
                 asyncio.create_task(self._direction(u_reader, to_client))]
        try:
            # The first direction to reach EOF (after delivering what it read) ends the pairing;
            # ZeroMQ peers reconnect on their own.
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            for w in (c_writer, u_writer):
                w.close()
                with contextlib.suppress(Exception):
                    await w.wait_closed()

    async def _direction(self, reader: asyncio.StreamReader, pipe: _Pipe) -> None:
        pump = asyncio.create_task(pipe.pump())
        try:
            while data := await reader.read(_CHUNK):
                if self._blackholed:
                    self.bytes_dropped += len(data)
                    continue
                self.bytes_forwarded += len(data)
                pipe.push(data)
            pipe.queue.put_nowait(None)
            await pump
        finally:
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pump


class ProxyPool:
    """Owns many proxies (one per directed site pair in a harness); stops them all. ``listen_host``
    and ``allowed``: where they listen and which non-loopback networks they may use (namespaces)."""

    def __init__(self, listen_host: str = "127.0.0.1", allowed: Networks = ()) -> None:
        self.proxies: dict[tuple[str, str], DelayProxy] = {}
        self.listen_host, self.allowed = listen_host, allowed

    async def add(self, src: str, dst: str, upstream: tuple[str, int], shape: LinkShape) -> DelayProxy:
        proxy = DelayProxy(upstream[0], upstream[1], forward=shape, name=f"{src}->{dst}",
                           seed=hash((src, dst)) & 0xFFFF, listen_host=self.listen_host, allowed=self.allowed)
        await proxy.start()
        self.proxies[(src, dst)] = proxy
        return proxy

    async def stop(self) -> None:
        for p in self.proxies.values():
            await p.stop()
        self.proxies.clear()

    async def __aenter__(self) -> ProxyPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
