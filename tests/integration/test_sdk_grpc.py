"""The SDK over gRPC (issue 31, item 2): ``Client("grpcs://...")`` and ``AsyncClient`` against a real edge's gRPC
front over mutual TLS (the fixtures of ``test_tritonclient_grpc``: the digits ONNX model and a BYTES echo task),
returning the ``InferResult`` REST returns and raising the same errors: an unknown task, an impossible SLO with
``prefer="refuse"``, no client certificate, a per-call timeout (the gRPC deadline, seen by the edge too), and a
failover from a refusing ``grpcs://`` URL to a live one; a REST edge and a gRPC edge answer one query alike."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import TypedDict

import numpy as np
import pytest

from edge_agent.mtls import EdgeTls
from mesh.client import AsyncClient, Client, InferResult
from mesh.errors import DeadlineExceeded, EdgeStalled, ImpossibleSLO, PeerUnavailable, RequestError, UnknownTask
from mesh.grpc_transport import GrpcTransport
from mesh.pki.identity import Identity
from mesh.tracecontext import new_traceparent, trace_id_of
from mesh.types import InferRequest, InferResponse, TaskSignature
from tests.helpers.grpc_edge import grpc_in_thread
from tests.helpers.mtls_edge import ACME, GLOBEX, SITE, TASK, make_pki
from tests.helpers_dataplane import digits_plane, serve_in_thread
from tests.integration.test_sdk_failover_http import Silent
from tests.integration.test_tritonclient_grpc import TEXT, Edge, TwoTasks, visible

pytestmark = pytest.mark.integration

SLOW = "slow-digits"  # the digits model, answered after SLOW_S
SLOW_S = 1.5


class ThreeTasks(TwoTasks):
    """``TwoTasks`` and a slow copy of the digits task (a per-call timeout shorter than it)."""

    def task_signature(self, task: str) -> TaskSignature:
        return super().task_signature(TASK if task == SLOW else task)

    def tasks(self) -> list[str]:
        return [*super().tasks(), SLOW]

    async def infer(self, req: InferRequest) -> InferResponse:
        if req.task == SLOW:
            self.budget_ms = req.remaining_ms()
            await asyncio.sleep(SLOW_S)
            req.task = TASK
            return await self.digits.infer(req)
        return await super().infer(req)


@pytest.fixture(scope="module")
def dp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreeTasks]:
    with digits_plane(tmp_path_factory.mktemp("model"), SITE.name, accuracy=0.96,
                      tenants=frozenset({"public", "acme", "globex"})) as plane:
        yield ThreeTasks(plane)


@pytest.fixture(scope="module")
def edge(dp: ThreeTasks, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    home = tmp_path_factory.mktemp("pki")
    pki = make_pki(home)
    tls = EdgeTls(pki.paths, SITE.name, interval_s=0.2)
    with grpc_in_thread(dp, tls, visible=visible, max_message_bytes=1 << 20) as server:
        yield Edge(server, pki, tls, home)


class Tls(TypedDict):
    cert: Path
    key: Path
    ca: Path


def tls_of(edge: Edge, who: Identity = ACME) -> Tls:
    """The client's TLS files as ``who`` (the mesh CA's tenant certificate)."""
    paths = edge.pki.paths
    return {"cert": paths.cert(who), "key": paths.key(who), "ca": paths.ca_cert}


X = np.asarray([[v / 16.0 for v in range(64)]] * 3, np.float32)


def test_a_digits_query_returns_the_result_rest_returns(edge: Edge, dp: ThreeTasks) -> None:
    with Client(edge.server.url, **tls_of(edge, GLOBEX)) as c:
        assert isinstance(c.transport, GrpcTransport) and c.ready()
        assert [s.name for s in c.task_metadata(TASK).inputs] == ["x"]
        r = c.infer(TASK, X, latency_ms=3000, request_id="sdk-grpc-1", trace=True)
        r2 = c.infer(TASK, {"x": X.tolist()}, latency_ms=3000)  # lists: converted with the task's signature
    np.testing.assert_allclose(r.output(), dp.digits.run_direct({"x": X})["logits"], rtol=1e-6)
    np.testing.assert_allclose(r2.output(), r.output(), rtol=1e-6)
    assert (r.site, r.variant, r.tenant, r.reason, r.request_id) == (SITE.name, dp.digits.variant, "globex",
                                                                     "local_ok", "sdk-grpc-1")
    assert r.accuracy == pytest.approx(0.96) and not r.best_effort and not r.late and r.within_slo
    assert r.timing.total_ms > 0 and r.hops == [SITE.name] and r.edge == edge.server.url and r.trace_id


def test_a_bytes_text_query_and_the_caller_headers(edge: Edge) -> None:
    tp = new_traceparent()

    async def run() -> InferResult:
        async with AsyncClient(edge.server.url, **tls_of(edge)) as c:
            with pytest.raises(RequestError):  # the SDK's own header, as over REST
                await c.infer(TEXT, ["a"], latency_ms=3000, headers={"X-Tiermesh-Tenant": "globex"})
            with pytest.raises(RequestError):  # gRPC's own
                await c.infer(TEXT, ["a"], latency_ms=3000, headers={"grpc-timeout": "1S"})
            return await c.infer(TEXT, ["héllo", "gRPC", ""], latency_ms=3000, trace=True,
                                 headers={"traceparent": tp})

    r = asyncio.run(run())
    assert r.output("length").tolist() == [6, 4, 0]
    assert r.output("upper").tolist() == ["HéLLO".encode(), b"GRPC", b""]
    assert r.variant == "echo.v1" and r.trace_id == trace_id_of(tp)


async def test_errors_are_the_mesh_errors_rest_raises(edge: Edge) -> None:
    async with AsyncClient(edge.server.url, **tls_of(edge, GLOBEX)) as c:
        with pytest.raises(UnknownTask):
            await c.infer("no-such-task", X, latency_ms=3000)
        with pytest.raises(UnknownTask):  # another tenant's private task: the same answer
            await c.infer("acme-digits", X, latency_ms=3000)
        with pytest.raises(ImpossibleSLO):
            await c.infer(TASK, X, latency_ms=3000, min_accuracy=0.999, prefer="refuse")
        assert (await c.infer(TASK, X, latency_ms=3000)).tenant == "globex"  # the connection serves on


async def test_no_client_certificate_is_refused(edge: Edge) -> None:
    async with AsyncClient(edge.server.url, ca=edge.pki.paths.ca_cert) as c:
        with pytest.raises(PeerUnavailable):
            await c.infer(TASK, X, latency_ms=3000)


async def test_a_per_call_timeout_is_the_grpc_deadline(edge: Edge, dp: ThreeTasks) -> None:
    async with AsyncClient(edge.server.url, **tls_of(edge)) as c:
        await c.infer(TASK, X, latency_ms=3000)  # connected
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(DeadlineExceeded):
            await c.infer(SLOW, X, latency_ms=5000, timeout=0.4)
        took = loop.time() - t0
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0  # grpclib's timer left no cancellation behind
        assert 0.35 < took < 1.0 and 0 < dp.budget_ms <= 400  # the edge routed within the deadline
        with pytest.raises(TimeoutError):  # an asyncio.timeout of the caller's still reads as a timeout
            async with asyncio.timeout(0.3):
                await c.infer(SLOW, X, latency_ms=5000)
        assert (await c.infer(TASK, X, latency_ms=3000)).site == SITE.name


@pytest.fixture
def refused() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"grpcs://127.0.0.1:{s.getsockname()[1]}"


async def test_failover_from_a_refusing_grpcs_edge_to_a_live_one(edge: Edge, refused: str) -> None:
    async with AsyncClient([refused, edge.server.url], **tls_of(edge)) as c:
        r = await c.infer(TASK, X, latency_ms=2000)
        again = await c.infer(TASK, X, latency_ms=2000)  # the refusing edge cools down
    assert r.edge == again.edge == edge.server.url and r.request_id and r.within_slo
    async with AsyncClient([refused], **tls_of(edge)) as alone:
        with pytest.raises(PeerUnavailable):
            await alone.infer(TASK, X, latency_ms=2000)


async def test_failover_from_a_silent_grpcs_edge(edge: Edge) -> None:
    """An edge that accepts the connection and never answers (not even the TLS handshake) is passed over after its
    share of the budget, by the gRPC deadline of that attempt."""
    silent = Silent()
    async with silent as quiet:
        url = quiet.replace("http://", "grpcs://")
        async with AsyncClient([url, edge.server.url], **tls_of(edge)) as c:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            r = await c.infer(TASK, X, latency_ms=600)
            took = loop.time() - t0
    task = asyncio.current_task()
    assert r.edge == edge.server.url and 0.19 <= took < 0.6 and silent.received  # a third of 600 ms there
    assert task is not None and task.cancelling() == 0


def test_a_rest_edge_and_a_grpc_edge_in_one_client(edge: Edge, dp: ThreeTasks) -> None:
    """Mixed schemes fail over alike: a REST edge over the same TLS files first, the gRPC one after it."""
    with serve_in_thread(dp, host="127.0.0.1", port=0, tls=EdgeTls(edge.pki.paths, SITE.name)) as rest:
        url = rest.url
        with Client([url, edge.server.url], **tls_of(edge)) as c:
            via_rest = c.infer(TASK, X, latency_ms=3000)
    assert via_rest.edge == url
    with Client([url, edge.server.url], **tls_of(edge)) as c:
        via_grpc = c.infer(TASK, X, latency_ms=3000)  # the REST edge is gone: refused
    assert via_grpc.edge == edge.server.url
    np.testing.assert_allclose(via_grpc.output(), via_rest.output(), rtol=1e-6)
    assert (via_grpc.site, via_grpc.variant, via_grpc.tenant) == (via_rest.site, via_rest.variant, via_rest.tenant)


def test_a_plain_grpc_edge_takes_the_tenant_header(dp: ThreeTasks) -> None:
    with grpc_in_thread(dp, visible=visible) as server:
        assert server.url.startswith("grpc://")
        with Client(server.url, tenant="acme") as c:
            assert c.infer(TASK, X, latency_ms=3000).tenant == "acme"
            assert c.task_metadata("acme-digits").task == "acme-digits"
        with Client(server.url, tenant="globex") as c, pytest.raises(UnknownTask):
            c.task_metadata("acme-digits")



def test_a_grpc_edge_that_was_frozen_refuses_stalled_and_the_client_asks_the_next(edge: Edge, dp: ThreeTasks) -> None:
    """The gRPC front charges a query from the start of a freeze it may have waited through (as REST's): one whose
    budget that used up is refused ``stalled``, not run; a client of several edges asks the next one."""
    with grpc_in_thread(dp, visible=visible, arrival=lambda now: now - 5.0) as thawed:  # "woke from a 5 s freeze"
        with Client(thawed.url, tenant="acme") as c:
            with pytest.raises(EdgeStalled):
                c.infer(TASK, X, latency_ms=1000)
            assert c.infer(TASK, X, latency_ms=10_000).within_slo  # budget to spare: run, charged the freeze
        with grpc_in_thread(dp, visible=visible) as healthy, Client([thawed.url, healthy.url], tenant="acme") as c:
            r = c.infer(TASK, X, latency_ms=1000)
            assert r.edge == healthy.url
