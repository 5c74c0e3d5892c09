"""The delay proxy adds its latency to a real TCP echo on loopback, keeps order, and cuts/restores."""

from __future__ import annotations

import asyncio
import time

import pytest

from tiermesh.delayproxy import DelayProxy, LinkShape

pytestmark = pytest.mark.integration


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


async def _rtt(port: int, payload: bytes) -> tuple[float, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.perf_counter()
    writer.write(payload)
    await writer.drain()
    got = await asyncio.wait_for(reader.readexactly(len(payload)), 5)
    dt = time.perf_counter() - t0
    writer.close()
    await writer.wait_closed()
    return dt, got


async def test_latency_order_and_cut() -> None:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with DelayProxy("127.0.0.1", port, forward=LinkShape(latency_ms=40)) as proxy:
            direct, _ = await _rtt(port, b"x" * 100)
            payload = bytes(range(256)) * 400
            delayed, got = await _rtt(proxy.port, payload)
            assert got == payload  # order and content preserved across chunks
            # 40 ms each way: the round trip must take at least ~80 ms, and far more than direct
            assert delayed >= 0.075
            assert delayed > direct + 0.05
            await proxy.cut()
            with pytest.raises((asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError)):
                await _rtt(proxy.port, b"y" * 10)
            proxy.restore()
            _, got = await _rtt(proxy.port, b"z" * 10)
            assert got == b"z" * 10
    finally:
        server.close()
        await server.wait_closed()


async def test_bandwidth_limits_throughput() -> None:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        # 8 Mbit/s = 1 MB/s: 400 KB each way needs >= ~0.4 s one way
        async with DelayProxy("127.0.0.1", port, forward=LinkShape(bandwidth_mbps=8)) as proxy:
            dt, got = await _rtt(proxy.port, b"b" * 400_000)
            assert len(got) == 400_000
            assert dt >= 0.35
    finally:
        server.close()
        await server.wait_closed()
