"""Idle connections at an edge's door (issue 29): a slow-loris flood of TCP connections that never complete a TLS
handshake or send a request does not stop a real tenant being served, and an idle connection is closed within the
guard's bounds (:class:`edge_agent.conn_guard.ConnectionGuard`).

The flood runs against an edge in a child process whose descriptors are limited as a container's are (512 here):
before the guard, the idle sockets held every descriptor (TLS handshakes waited 60 s, plain connections aiohttp's
keep-alive of about an hour), accept failed with EMFILE, and the tenant's connection waited in the kernel's queue
until the test gave up."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from edge_agent.conn_guard import MAX_PENDING
from edge_agent.http_api import EdgeHttpServer
from edge_agent.mtls import EdgeTls
from tests.helpers.mtls_edge import ACME, SITE, TASK, infer_body, make_pki, tenant_context
from tests.helpers_dataplane import OnnxDataPlane, digits_model
from tests.helpers_flood import descriptors, flood, front_process

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

FILES = 512      # the edge's descriptor limit
FLOOD = 1200     # idle connections, each made and then left alone
async def _tenant_served(url: str, ctx: ssl.SSLContext | None) -> float:
    """Seconds until a real tenant's query is answered 200 (at most 20)."""
    t0 = time.monotonic()
    connector = aiohttp.TCPConnector(ssl=ctx if ctx is not None else False, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=20)) as s, \
            s.post(f"{url}/v2/models/{TASK}/infer", data=infer_body(np.full((1, 64), 0.5, np.float32)),
                   headers=None if ctx is not None else {"X-Tiermesh-Tenant": "acme"}) as resp:
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["parameters"]["tenant"] == "acme"
    return time.monotonic() - t0


@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plain"])
async def test_an_idle_connection_flood_does_not_stop_a_tenant(tmp_path: Path, tls: bool) -> None:
    pki = make_pki(tmp_path)
    ctx = tenant_context(pki, ACME) if tls else None
    with front_process(tmp_path, tls=tls, grpc=False, files=FILES) as (url, pid):
        port = int(url.rsplit(":", 1)[1])
        await _tenant_served(url, ctx)  # warm: the model answers
        idle = descriptors(pid)
        socks = flood(port, FLOOD)
        try:
            await asyncio.sleep(3.0)  # the connects land (a dropped SYN is sent again after 1 s)
            # the edge holds at most its bound of them (within the 5 s a TLS handshake may take): it closed the
            # others, oldest first
            held = descriptors(pid) - idle
            assert held <= MAX_PENDING + 8, held
            took = await _tenant_served(url, ctx)
            assert took < 10.0, took
        finally:
            for s in socks:
                s.close()
        await _tenant_served(url, ctx)


async def test_an_idle_connection_is_closed_within_the_guards_bounds(tmp_path: Path) -> None:
    dp = OnnxDataPlane(SITE.name, digits_model(tmp_path), accuracy=0.96)
    pki = make_pki(tmp_path)
    tls = EdgeTls(pki.paths, SITE.name)
    try:
        async with EdgeHttpServer(dp, "127.0.0.1", tls=tls, handshake_timeout_s=0.5, first_request_s=1.0) as srv:
            # no handshake at all, and a handshake that never sends a request: each closed by the edge
            raw_r, raw_w = await asyncio.open_connection("127.0.0.1", srv.port)
            tls_r, tls_w = await asyncio.open_connection("127.0.0.1", srv.port, ssl=tenant_context(pki, ACME),
                                                         server_hostname="127.0.0.1")
            t0 = time.monotonic()
            async with asyncio.timeout(5):
                assert await raw_r.read() == b""
                with contextlib.suppress(ConnectionError, ssl.SSLError):
                    assert await tls_r.read() == b""
            assert time.monotonic() - t0 < 3.0
            for w in (raw_w, tls_w):
                w.close()
            assert srv.guard.pending == 0 and srv.guard.expired >= 1
            # a connection that made its request is a caller's keep-alive: kept past first_request_s
            async with aiohttp.ClientSession(srv.url, connector=aiohttp.TCPConnector(
                    ssl=tenant_context(pki, ACME))) as s:
                for _ in range(2):
                    async with s.post(f"/v2/models/{TASK}/infer",
                                      data=infer_body(np.full((1, 64), 0.5, np.float32))) as resp:
                        assert resp.status == 200
                    await asyncio.sleep(1.5)
                assert len(s.connector._conns) == 1  # type: ignore[union-attr]  # the same connection, reused
    finally:
        dp.close()
