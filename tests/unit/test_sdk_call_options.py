"""Issue 31 item 6 (the SDK's part): per-call ``timeout=`` and ``headers=``, and ``DeadlineExceeded`` as a
``TimeoutError``."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

from mesh import errors
from mesh.client import AsyncClient, Client
from mesh.errors import DeadlineExceeded, MeshError, error_from_code, error_from_reply
from mesh.sdk_transport import MockTransport, Response
from mesh.tracecontext import new_traceparent
from mesh.v2.body import HEADER_LENGTH, TENANT_HEADER
from tests.unit.test_client_mock import Server

pytestmark = pytest.mark.unit

TASK = "digit-classification"
X = {"x": np.ones((1, 64), np.float32)}


def test_deadline_exceeded_is_a_timeout_error_and_still_a_mesh_error() -> None:
    err = DeadlineExceeded("no answer within 0.1 s", budget_ms=100)
    assert isinstance(err, TimeoutError) and isinstance(err, MeshError)
    assert (err.code, err.http_status, str(err), err.details) == ("deadline", 504, "no answer within 0.1 s",
                                                                  {"budget_ms": 100})
    for catch in (TimeoutError, MeshError, OSError):
        with pytest.raises(catch):
            raise err
    assert isinstance(error_from_code("deadline", "late"), TimeoutError)
    assert isinstance(error_from_reply(504, b'{"code": "deadline", "error": "late"}'), TimeoutError)


async def test_a_silent_edge_is_caught_as_a_timeout_error() -> None:
    async def hang(*_: Any) -> Response:
        await asyncio.sleep(30)
        raise AssertionError

    async with AsyncClient("http://edge", transport=MockTransport(hang)) as c:
        try:
            await c.infer(TASK, X, latency_ms=10, timeout=0.05)
        except TimeoutError as exc:
            assert isinstance(exc, DeadlineExceeded)
        else:
            pytest.fail("no timeout")


def _recording(seen: list[dict[str, str]], delay_s: float = 0.0) -> MockTransport:
    server = Server()

    async def handler(method: str, path: str, headers: dict[str, str], body: bytes) -> Response:
        seen.append(headers)
        await asyncio.sleep(delay_s)
        return server(method, path, headers, body)

    return MockTransport(handler)


async def test_headers_of_a_call_reach_the_edge_on_every_kind_of_call() -> None:
    seen: list[dict[str, str]] = []
    tp = new_traceparent()
    async with AsyncClient("http://edge", tenant="acme", transport=_recording(seen)) as c:
        r = await c.infer(TASK, X, latency_ms=50, trace=True, headers={"traceparent": tp, "X-App": "cam-7"})
        await c.infer(TASK, X, latency_ms=50)  # the same kept plan, no headers: none leak into it
        await c.task_metadata(TASK, headers={"traceparent": tp})
        assert await c.ready(headers={"X-App": "cam-7"})
    assert r.site == "edge-a"
    first, second, meta, ready = seen
    assert first["traceparent"] == tp and first["X-App"] == "cam-7" and first[TENANT_HEADER] == "acme"
    assert HEADER_LENGTH in first and "traceparent" not in second and "X-App" not in second
    assert meta["traceparent"] == tp and meta[TENANT_HEADER] == "acme"
    assert ready["X-App"] == "cam-7"


@pytest.mark.parametrize("name", [TENANT_HEADER, "x-tiermesh-tenant", "Content-Type", "content-length",
                                  HEADER_LENGTH, "INFERENCE-HEADER-CONTENT-LENGTH", "Transfer-Encoding"])
async def test_the_sdks_own_headers_cannot_be_set_per_call(name: str) -> None:
    seen: list[dict[str, str]] = []
    async with AsyncClient("http://edge", tenant="acme", transport=_recording(seen)) as c:
        with pytest.raises(errors.RequestError, match="SDK's own"):
            await c.infer(TASK, X, latency_ms=50, headers={name: "mallory"})
        with pytest.raises(errors.RequestError, match="SDK's own"):
            await c.task_metadata(TASK, headers={name: "1"})
        with pytest.raises(errors.RequestError, match="SDK's own"):
            await c.ready(headers={name: "1"})
        with pytest.raises(errors.RequestError, match="str names"):
            await c.ready(headers={"X-Count": 3})  # type: ignore[dict-item]
    assert seen == []  # refused before anything was sent


async def test_a_calls_timeout_caps_its_wait_either_way() -> None:
    seen: list[dict[str, str]] = []
    async with AsyncClient("http://edge", timeout=30.0, transport=_recording(seen, 0.2)) as c:
        t0 = time.perf_counter()
        with pytest.raises(DeadlineExceeded):
            await c.infer(TASK, X, latency_ms=1000, timeout=0.05)  # shorter than the budget and the client's
        with pytest.raises(DeadlineExceeded):
            await c.ready(timeout=0.05)
        with pytest.raises(DeadlineExceeded):
            await c.task_metadata(TASK, timeout=0.05)
        assert time.perf_counter() - t0 < 0.5
    async with AsyncClient("http://edge", timeout=0.05, transport=_recording(seen, 0.1)) as c:
        assert await c.ready(timeout=1.0)  # longer than the client's: this call waits for it
        assert (await c.infer(TASK, X, latency_ms=500, timeout=1.0)).site == "edge-a"
        with pytest.raises(DeadlineExceeded):
            await c.ready()  # the client's own


def test_the_sync_client_takes_them_too() -> None:
    seen: list[dict[str, str]] = []
    with Client("http://edge", transport=_recording(seen, 0.1)) as c:
        assert c.infer(TASK, X, latency_ms=500, headers={"X-App": "cam-7"}, timeout=1.0).site == "edge-a"
        with pytest.raises(TimeoutError):
            c.ready(timeout=0.02)
        assert c.task_metadata(TASK, headers={"X-App": "2"}, timeout=1.0).task == TASK
    assert seen[0]["X-App"] == "cam-7" and seen[-1]["X-App"] == "2"
