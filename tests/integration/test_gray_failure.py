"""Gray failures on real ZeroMQ: a link that swallows traffic without a reset (the delay proxy's
black hole) is noticed by heartbeats within the stated bound, its pending requests fail once no new
connection comes within ``redial_ms``, it is refused locally while down, and it is probed back in once the
link heals."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest

from mesh.errors import PeerUnavailable
from mesh.types import SLO, InferRequest, InferResponse
from mesh.zmq.base import DEFAULT_HEARTBEAT
from mesh.zmq.client import ZmqClient
from mesh.zmq.server import ZmqServer
from tiermesh.delayproxy import DelayProxy, LinkShape

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

BOUND_S = DEFAULT_HEARTBEAT.detect_s  # 1.25 s from the last byte heard
REDIAL_S = DEFAULT_HEARTBEAT.redial_ms / 1000.0  # how long a dropped connection's requests wait to be re-sent
NOISE_S = 1.0  # a shared 2-core machine: the event loop may run late


def _req(deadline_s: float) -> InferRequest:
    return InferRequest(task="echo", inputs={"x": np.ones(4, np.float32)}, slo=SLO(1000.0), tenant="acme",
                        deadline=time.monotonic() + deadline_s, hops=["edge-a"])


async def _echo(req: InferRequest) -> InferResponse:
    return InferResponse(request_id=req.request_id, outputs=dict(req.inputs), site="core", variant="echo",
                         accuracy=1.0, reason="local", tenant=req.tenant, hops=[*req.hops, "core"])


@pytest.fixture
async def linked() -> AsyncIterator[tuple[ZmqServer, DelayProxy, ZmqClient, list[tuple[float, str, bool]]]]:
    server = ZmqServer(_echo)
    await server.start()
    proxy = DelayProxy("127.0.0.1", int(server.endpoint.rsplit(":", 1)[1]), forward=LinkShape(latency_ms=5))
    client = ZmqClient()
    events: list[tuple[float, str, bool]] = []
    client.add_reachability_listener(lambda ep, down: events.append((time.monotonic(), ep, down)))
    try:
        await proxy.start()
        yield server, proxy, client, events
    finally:
        await client.close()
        await proxy.stop()
        await server.stop()


async def _until(pred: object, timeout_s: float) -> float:
    t0 = time.monotonic()
    while not pred():  # type: ignore[operator]
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"not within {timeout_s} s")
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


async def test_black_holed_peer_is_marked_unreachable_in_bound_and_probed_back(linked: tuple) -> None:
    _server, proxy, client, events = linked
    resp = await client.request(proxy.endpoint, _req(5.0))
    assert resp.site == "core"
    # a request in flight when the link goes dark, with a deadline far away
    proxy.blackhole()
    t0 = time.monotonic()
    pending = asyncio.create_task(client.request(proxy.endpoint, _req(30.0)))
    with pytest.raises(PeerUnavailable):  # after waiting redial_ms for a new connection, in vain
        await asyncio.wait_for(pending, BOUND_S + REDIAL_S + NOISE_S + 1.0)
    failed_after = time.monotonic() - t0
    assert events and events[0][1:] == (proxy.endpoint, True)
    detected = events[0][0] - t0
    print(f"black hole noticed after {detected:.2f} s (bound {BOUND_S:.2f} s); pending failed after "
          f"{failed_after:.2f} s")
    assert detected <= BOUND_S + NOISE_S
    assert proxy.endpoint in client.unreachable()
    # while it is marked, a request fails at once instead of spending its budget there
    t1 = time.monotonic()
    with pytest.raises(PeerUnavailable, match="unreachable"):
        await client.request(proxy.endpoint, _req(30.0))
    assert time.monotonic() - t1 < 0.5
    # the link heals: a probe's handshake lifts the mark, and requests flow again
    await asyncio.sleep(1.0)  # probes are failing meanwhile: the mark must hold
    assert proxy.endpoint in client.unreachable()
    proxy.restore()
    healed = await _until(lambda: proxy.endpoint not in client.unreachable(), 10.0)
    print(f"probed back in {healed:.2f} s after the link healed")
    assert events[-1][1:] == (proxy.endpoint, False)
    resp = await client.request(proxy.endpoint, _req(5.0))
    assert resp.site == "core"


async def test_a_peer_black_holed_from_the_start_is_given_up_after_the_handshake_limit(linked: tuple) -> None:
    _server, proxy, client, events = linked
    proxy.blackhole()  # the TCP connect succeeds, the ZMTP greeting never comes back
    t0 = time.monotonic()
    with pytest.raises(PeerUnavailable):
        await asyncio.wait_for(client.request(proxy.endpoint, _req(30.0)), 10.0)
    limit = DEFAULT_HEARTBEAT.handshake_ms / 1000.0
    assert time.monotonic() - t0 <= limit + NOISE_S
    assert events and events[0][2] is True
    proxy.restore()
    await _until(lambda: proxy.endpoint not in client.unreachable(), 10.0)
    assert (await client.request(proxy.endpoint, _req(5.0))).site == "core"


async def test_fail_peer_forgets_the_mark(linked: tuple) -> None:
    _server, proxy, client, events = linked
    await client.request(proxy.endpoint, _req(5.0))
    proxy.blackhole()
    await _until(lambda: proxy.endpoint in client.unreachable(), BOUND_S + NOISE_S + 1.0)
    client.fail_peer(proxy.endpoint, "lease expired")
    assert client.unreachable() == {} and events[-1][1:] == (proxy.endpoint, False)
    proxy.restore()
    assert (await client.request(proxy.endpoint, _req(5.0))).site == "core"


class _ForgetfulSecurity:
    """A client-side security that stops being able to dial once told to (a CURVE key that left
    with its peer's live record). Server side unused."""

    def __init__(self) -> None:
        self.known = True

    def apply_server(self, sock: object) -> None:  # pragma: no cover - client only
        raise AssertionError("client only")

    def release_server(self, sock: object) -> None:  # pragma: no cover - client only
        pass

    def apply_client(self, sock: object, server_key: bytes | None) -> None:
        if not self.known:
            raise PeerUnavailable("no key known for this peer")

    def peer(self, frame: object) -> str | None:  # pragma: no cover - client only
        return None


async def test_a_peer_that_cannot_be_probed_is_not_left_marked(linked: tuple) -> None:
    _, proxy, _, _ = linked
    security = _ForgetfulSecurity()
    client = ZmqClient(security=security)  # type: ignore[arg-type]
    loop_errors: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: loop_errors.append(ctx))
    try:
        assert (await client.request(proxy.endpoint, _req(2.0))).variant == "echo"
        security.known = False
        await proxy.cut()  # the peer goes: the monitor marks it down and cannot open a probe
        await asyncio.sleep(2 * BOUND_S + NOISE_S)
        assert client.unreachable() == {}  # no mark that no probe could ever lift
        with pytest.raises(PeerUnavailable):
            await client.request(proxy.endpoint, _req(1.0))
        security.known = True
        proxy.restore()
        assert (await client.request(proxy.endpoint, _req(3.0))).variant == "echo"
    finally:
        await client.close()
        asyncio.get_running_loop().set_exception_handler(None)
    assert not [c for c in loop_errors if "never retrieved" in str(c.get("message"))], loop_errors
