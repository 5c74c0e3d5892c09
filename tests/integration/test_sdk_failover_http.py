"""The SDK's failover over real HTTP (issue 31): an edge that refuses connections, one that accepts and never answers
(the SDK closes the connection after its share of the budget), and a real edge (the V2 front over an ONNX data
plane) behind them; two mutual-TLS edges dialled with one client's credentials; and a caller's own
``traceparent`` reaching the edge's trace."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest

from edge_agent.http_api import EdgeHttpServer
from edge_agent.mtls import EdgeTls
from mesh.client import AsyncClient
from mesh.errors import PeerUnavailable
from mesh.tracecontext import new_traceparent, trace_id_of
from tests.helpers.mtls_edge import ACME, SITE, make_pki
from tests.helpers_dataplane import OnnxDataPlane, digits_model

pytestmark = pytest.mark.integration

TASK = "digit-classification"
X = {"x": np.ones((1, 64), np.float32)}


@pytest.fixture
def dp(tmp_path: Path) -> Iterator[OnnxDataPlane]:
    plane = OnnxDataPlane("edge-real", digits_model(tmp_path))
    try:
        yield plane
    finally:
        plane.close()


@pytest.fixture
async def real(dp: OnnxDataPlane) -> AsyncIterator[str]:
    async with EdgeHttpServer(dp, "127.0.0.1", 0) as srv:
        yield srv.url


@pytest.fixture
def refused() -> str:
    """A loopback port nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


class Silent:
    """Accepts connections, reads what comes, never answers: a frozen host's kernel, as a client sees it."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.closed_by_client = 0
        self.server: asyncio.Server | None = None

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            self.received += data
        self.closed_by_client += 1
        writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *_: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


async def test_refused_and_silent_edges_are_passed_over_with_one_request_id(real: str, refused: str) -> None:
    silent = Silent()
    async with silent as quiet, AsyncClient([quiet, refused, real], timeout=5.0) as client:
        t0 = time.perf_counter()
        r = await client.infer(TASK, X, latency_ms=300)
        took = time.perf_counter() - t0
        assert r.site == "edge-real" and r.edge == real and r.within_slo
        assert 0.09 <= took < 0.3  # a third of the budget at the silent edge, nothing at the refusing one
        assert r.request_id.encode() in silent.received  # the silent edge was asked the same query
        await asyncio.sleep(0.05)
        assert silent.closed_by_client == 1  # abandoned: its connection closed, not left to answer late

        t0 = time.perf_counter()
        r2 = await client.infer(TASK, X, latency_ms=300)  # both cool down: straight to the real edge
        assert r2.edge == real and time.perf_counter() - t0 < 0.09 and r2.request_id != r.request_id
        assert silent.received.count(b"POST") == 1


async def test_when_every_edge_refuses_the_last_refusal_is_raised(refused: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        other = f"http://127.0.0.1:{s.getsockname()[1]}"
    async with AsyncClient([refused, other], timeout=2.0) as client:
        with pytest.raises(PeerUnavailable, match=other.removeprefix("http://")):
            await client.infer(TASK, X, latency_ms=100)
        with pytest.raises(PeerUnavailable):
            await client.ready()


async def test_a_callers_traceparent_names_the_edges_trace(real: str) -> None:
    tp = new_traceparent()
    async with AsyncClient(real, timeout=5.0) as client:
        r = await client.infer(TASK, X, latency_ms=300, trace=True, headers={"traceparent": tp})
        untraced = await client.infer(TASK, X, latency_ms=300, headers={"traceparent": tp})
    assert r.trace_id == trace_id_of(tp) and untraced.trace_id == ""


async def test_every_edge_is_dialled_with_the_same_tls_settings(dp: OnnxDataPlane, tmp_path: Path) -> None:
    """Two mutual-TLS edges, one client certificate: both serve the tenant it names; when the first goes away the
    second answers over its own TLS connection, the same credentials presented."""
    pki = make_pki(tmp_path)
    paths = pki.paths
    a = EdgeHttpServer(dp, tls=EdgeTls(paths, SITE.name))
    b = EdgeHttpServer(dp, tls=EdgeTls(paths, SITE.name))
    await a.start()
    try:
        async with b:
            url_a, url_b = a.url, b.url
            async with AsyncClient([url_a, url_b], cert=paths.cert(ACME), key=paths.key(ACME),
                                   ca=paths.ca_cert) as client:
                first = await client.infer(TASK, X, latency_ms=2000)
                await a.stop()
                second = await client.infer(TASK, X, latency_ms=2000)
            assert (first.edge, first.tenant) == (url_a, "acme")
            assert (second.edge, second.tenant) == (url_b, "acme")
            async with AsyncClient([url_b, url_a], ca=paths.ca_cert) as anonymous:  # no certificate: refused by all
                with pytest.raises(PeerUnavailable):
                    await anonymous.infer(TASK, X, latency_ms=2000)
    finally:
        await a.stop()
