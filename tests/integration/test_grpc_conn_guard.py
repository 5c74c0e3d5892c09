"""Idle connections at the edge's gRPC door, as at its REST one (issue 31, the guard of issue 29): a slow-loris flood
of TCP connections that never complete a TLS handshake or make a call does not stop a real tenant being served over
``tritonclient.grpc.aio``, and an idle connection is closed within the guard's bounds
(:class:`edge_agent.conn_guard.ConnectionGuard`, which :class:`edge_agent.grpc_api.EdgeGrpcServer` now accepts
through). Without it grpclib left a TLS handshake to asyncio's 60 s and an idle connection open for good."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
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

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
FILES = 512      # the edge's descriptor limit, as a container's
FLOOD = 1200     # idle connections, each made and then left alone
SERVE = """
import asyncio, resource, sys
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, ({files}, hard))
from edge_agent.grpc_api import EdgeGrpcServer
from edge_agent.mtls import EdgeTls
from tests.helpers_dataplane import OnnxDataPlane

async def main():
    dp = OnnxDataPlane({site!r}, {model!r}, accuracy=0.96)
    tls = EdgeTls.under({home!r}, {site!r}) if {tls!r} else None
    if tls is not None:
        await tls.start()
    async with EdgeGrpcServer(dp, "127.0.0.1", tls=tls) as srv:
        print(srv.address, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the test closes stdin
    if tls is not None:
        await tls.stop()
    dp.close()

asyncio.run(main())
"""


@contextlib.contextmanager
def grpc_edge_process(tmp_path: Path, tls: bool) -> Iterator[tuple[str, int]]:
    """A gRPC edge in its own process with ``FILES`` descriptors; yields its ``host:port`` and pid."""
    model = digits_model(tmp_path)
    code = SERVE.format(files=FILES, site=SITE.name, model=str(model), home=str(tmp_path), tls=tls)
    with (tmp_path / "edge.log").open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=log, env={**os.environ, "PYTHONPATH": str(REPO)})
        try:
            assert proc.stdout is not None
            address = proc.stdout.readline().decode().strip()
            assert address.startswith("127.0.0.1:"), (tmp_path / "edge.log").read_text()[-2000:]
            yield address, proc.pid
        finally:
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _flood(port: int, n: int) -> list[socket.socket]:
    """``n`` TCP connections to the edge that send nothing (connects left to finish in the kernel)."""
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        socks.append(s)
    return socks


def _descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


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
    with grpc_edge_process(tmp_path, tls) as (address, pid):
        port = int(address.rsplit(":", 1)[1])
        await _tenant_served(address, pki if tls else None)  # warm: the model answers
        idle = _descriptors(pid)
        socks = _flood(port, FLOOD)
        try:
            await asyncio.sleep(3.0)  # the connects land (a dropped SYN is sent again after 1 s)
            held = _descriptors(pid) - idle  # at most the bound: the others closed, oldest first
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
