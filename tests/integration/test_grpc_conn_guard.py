"""Idle connections at the edge's gRPC door, as at its REST one (issue 31, the guard of issue 29): a slow-loris flood
of TCP connections that never complete a TLS handshake or make a call does not stop a real tenant being served over
``tritonclient.grpc.aio``, and an idle connection is closed within the guard's bounds
(:class:`edge_agent.conn_guard.ConnectionGuard`, which :class:`edge_agent.grpc_api.EdgeGrpcServer` now accepts
through). Without it grpclib left a TLS handshake to asyncio's 60 s and an idle connection open for good."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc.aio as tgrpc_aio
from tritonclient.grpc import InferInput

from edge_agent.conn_guard import MAX_PENDING
from edge_agent.grpc_api import EdgeGrpcServer
from edge_agent.mtls import EdgeTls
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from tests.helpers.mtls_edge import ACME, SITE, TASK, make_pki, tenant_context
from tests.helpers_dataplane import OnnxDataPlane, digits_model
from tests.helpers_flood import descriptors, flood, front_process

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

FILES = 512      # the edge's descriptor limit, as a container's
FLOOD = 1200     # idle connections, each made and then left alone
def _client(address: str, pki: LocalPki | None, who: Identity = ACME) -> tgrpc_aio.InferenceServerClient:
    if pki is None:
        return tgrpc_aio.InferenceServerClient(address)
    p = pki.paths
    return tgrpc_aio.InferenceServerClient(address, ssl=True, root_certificates=str(p.ca_cert),
                                           private_key=str(p.key(who)), certificate_chain=str(p.cert(who)))


async def _query(c: tgrpc_aio.InferenceServerClient, tls: bool) -> None:
    inp = InferInput("x", [1, 64], "FP32")
    inp.set_data_from_numpy(np.full((1, 64), 0.5, np.float32))
    res = await c.infer(TASK, [inp], parameters={"latency_ms": 5000}, client_timeout=20,
                        headers=None if tls else {"x-tiermesh-tenant": "acme"})
    assert res.get_response().parameters["tenant"].string_param == "acme"


async def _tenant_served(address: str, pki: LocalPki | None) -> float:
    """Seconds until a real tenant's query, on a new channel, is answered (at most 20)."""
    t0 = time.monotonic()
    c = _client(address, pki)
    try:
        await _query(c, pki is not None)
    finally:
        await c.close()
    return time.monotonic() - t0


@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plain"])
async def test_an_idle_connection_flood_does_not_stop_a_tenant(tmp_path: Path, tls: bool) -> None:
    pki = make_pki(tmp_path)
    with front_process(tmp_path, tls=tls, grpc=True, files=FILES) as (address, pid):
        port = int(address.rsplit(":", 1)[1])
        await _tenant_served(address, pki if tls else None)  # warm: the model answers
        idle = descriptors(pid)
        socks = flood(port, FLOOD)
        try:
            await asyncio.sleep(3.0)  # the connects land (a dropped SYN is sent again after 1 s)
            held = descriptors(pid) - idle  # at most the bound: the others closed, oldest first
            assert held <= MAX_PENDING + 8, held
            took = await _tenant_served(address, pki if tls else None)
            assert took < 10.0, took
        finally:
            for s in socks:
                s.close()
        await _tenant_served(address, pki if tls else None)


async def test_an_idle_connection_is_closed_within_the_guards_bounds(tmp_path: Path) -> None:
    dp = OnnxDataPlane(SITE.name, digits_model(tmp_path), accuracy=0.96)
    pki = make_pki(tmp_path)
    tls = EdgeTls(pki.paths, SITE.name)
    await tls.start()
    try:
        async with EdgeGrpcServer(dp, "127.0.0.1", tls=tls, handshake_timeout_s=0.5, first_request_s=1.0) as srv:
            # a handshake never begun (dropped at 0.5 s), and one done but no call made (dropped at 1 s)
            raw_r, raw_w = await asyncio.open_connection("127.0.0.1", srv.port)
            ctx = tenant_context(pki, ACME)
            ctx.set_alpn_protocols(["h2"])
            tls_r, tls_w = await asyncio.open_connection("127.0.0.1", srv.port, ssl=ctx, server_hostname="127.0.0.1")
            t0 = time.monotonic()
            async with asyncio.timeout(5):
                assert await raw_r.read() == b""
                with contextlib.suppress(ConnectionError, ssl.SSLError):
                    await tls_r.read()  # the server's HTTP/2 settings, then the end of the stream
            assert time.monotonic() - t0 < 3.0
            for w in (raw_w, tls_w):
                w.close()
            assert srv.guard.pending == 0 and srv.guard.expired >= 1
            expired = srv.guard.expired
            # a connection that made its call is a caller's channel: kept past first_request_s
            c = _client(srv.address, pki)
            try:
                for _ in range(2):
                    await _query(c, True)
                    await asyncio.sleep(1.5)
            finally:
                await c.close()
            assert srv.guard.expired == expired and srv.guard.pending == 0
    finally:
        await tls.stop()
        dp.close()
