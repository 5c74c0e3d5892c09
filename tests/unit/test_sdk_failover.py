"""Issue 31 item 5: the SDK's failover across edges. The policy (``mesh.failover``) as tables of cases, then the
client over ``MockTransport`` edges that refuse, stay silent or answer."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import numpy as np
import pytest

from mesh import errors
from mesh import failover as fo
from mesh.client import AsyncClient, Client
from mesh.failover import EdgeHealth, EdgeHealthBook, Outcome
from mesh.sdk_transport import MockTransport, Response, SharedRefresh, open_edges
from mesh.v2 import codec
from mesh.v2.body import HEADER_LENGTH
from tests.unit.test_client_mock import Server

pytestmark = pytest.mark.unit

X = np.ones((1, 64), np.float32)
TASK = "digit-classification"


# ------------------------------------------------------------------------------------------------- the policy


@pytest.mark.parametrize(("exc", "want"), [
    (None, Outcome.ANSWERED),
    (errors.PeerUnavailable("connection refused"), Outcome.REFUSED),
    (errors.DeadlineExceeded("no answer within 0.1 s"), Outcome.SILENT),
    (TimeoutError(), Outcome.SILENT),
    (errors.UnknownTask("nope"), None),       # a definite answer raised by a transport: never asked again
    (RuntimeError("bug"), None),
    (asyncio.CancelledError(), None),
])
def test_classify(exc: BaseException | None, want: Outcome | None) -> None:
    assert fo.classify(exc) is want


@pytest.mark.parametrize(("health", "now", "want"), [
    ([EdgeHealth(), EdgeHealth()], 10.0, [0, 1]),
    ([EdgeHealth(1, 12.0), EdgeHealth()], 10.0, [1, 0]),                         # the first cools down
    ([EdgeHealth(1, 9.0), EdgeHealth()], 10.0, [0, 1]),                          # ... and is back, nearest first
    ([EdgeHealth(1, 9.0, probing=True), EdgeHealth()], 10.0, [1, 0]),            # a probe in flight: keep off
    ([EdgeHealth(2, 15.0), EdgeHealth(1, 11.0), EdgeHealth(1, 13.0)], 10.0, [1, 2, 0]),  # all cool: soonest back
    ([EdgeHealth(1, 15.0), EdgeHealth(), EdgeHealth()], 10.0, [1, 2, 0]),
])
def test_order(health: list[EdgeHealth], now: float, want: list[int]) -> None:
    assert fo.order(health, now) == want


@pytest.mark.parametrize(("left", "budget", "share", "last", "want"), [
    (0.9, 0.1, 1 / 3, False, 0.1 / 3),      # a third of the budget on an edge with another after it
    (0.9, 0.1, 1 / 3, True, 0.9),           # the last edge: all that is left of the bound
    (0.01, 0.1, 1 / 3, False, 0.01),        # never more than is left
    (0.9, 0.003, 1 / 3, False, fo.MIN_SILENCE_S),  # a tiny budget: not less than the floor
    (0.9, 0.3, 0.5, False, 0.15),
])
def test_attempt_wait(left: float, budget: float, share: float, last: bool, want: float) -> None:
    assert fo.attempt_wait(left, budget, share, last) == pytest.approx(want)


@pytest.mark.parametrize(("latency_ms", "spent_s", "want"), [(100, 0.034, 66.0), (100, 0.0, 100.0), (20, 0.5, 1.0)])
def test_a_retry_is_sent_with_what_is_left_of_the_budget(latency_ms: float, spent_s: float, want: float) -> None:
    assert fo.retry_budget_ms(latency_ms, spent_s) == pytest.approx(want)


@pytest.mark.parametrize(("before", "outcome", "want"), [
    (EdgeHealth(), Outcome.REFUSED, EdgeHealth(1, 12.0)),
    (EdgeHealth(1, 9.0, probing=True), Outcome.SILENT, EdgeHealth(2, 12.0)),
    (EdgeHealth(3, 9.0, probing=True), Outcome.ANSWERED, EdgeHealth()),
])
def test_after(before: EdgeHealth, outcome: Outcome, want: EdgeHealth) -> None:
    assert fo.after(before, outcome, 10.0, 2.0) == want


def test_the_book_backs_off_probes_one_at_a_time_and_forgets_on_an_answer() -> None:
    book = EdgeHealthBook(2, draw=lambda: 0.0)  # equal jitter at its low end: half of each step
    now = 100.0
    for n, cooldown in enumerate([0.5, 1.0, 2.0, 4.0], start=1):
        book.record(0, Outcome.SILENT, now)
        assert book.health[0] == EdgeHealth(n, now + cooldown)
        book.record(0, Outcome.SILENT, now + 0.01)  # another query in flight then: the same failure
        assert book.health[0] == EdgeHealth(n, now + cooldown)
        now += cooldown  # its probe fails next
    book.record(0, Outcome.ANSWERED, 100.0)
    book.record(0, Outcome.REFUSED, 200.0)
    assert book.health[0] == EdgeHealth(1, 200.5)  # back to the first step
    assert book.plan(200.1) == [1, 0]
    assert book.claim(0, 200.1)                     # cooling, not expired: tried only when all else failed
    assert not book.health[0].probing
    assert book.plan(201.0) == [0, 1] and book.claim(0, 201.0)  # expired: this query probes it ...
    assert book.health[0].probing and book.plan(201.0) == [1, 0]
    assert not book.claim(0, 201.0)                 # ... and another query leaves it alone
    book.release(0)                                 # the probing query was cancelled
    assert book.plan(201.0) == [0, 1]
    with pytest.raises(ValueError):
        EdgeHealthBook(0)


def test_every_transport_sharing_one_refresh_learns_of_a_change() -> None:
    changes = iter([False, True, False, False])
    shared = SharedRefresh(lambda: next(changes))
    a, b = shared.view(), shared.view()
    assert (a(), b(), a(), b()) == (False, True, True, False)


def test_edges_take_one_tls_setting_and_one_transport_per_url() -> None:
    with pytest.raises(errors.ConfigError, match="mix schemes"):
        open_edges(["http://a", "https://b"], None, timeout=1.0, ssl_context=None, refresh=None)
    with pytest.raises(errors.ConfigError, match="one per URL"):
        AsyncClient(["http://a", "http://b"], transport=MockTransport(Server()))
    with pytest.raises(errors.ConfigError, match="edge URL"):
        AsyncClient([])
    with pytest.raises(errors.ConfigError, match="failover_share"):
        AsyncClient(["http://a", "http://b"], failover_share=0.0)
    edges = open_edges(["http://a:1", "http://b:2"], None, timeout=1.0, ssl_context=None, refresh=None)
    assert [e.url for e in edges] == ["http://a:1", "http://b:2"] and all(e.own is e.transport for e in edges)


# ------------------------------------------------------------------------------------------------- the client


class Edge:
    """An edge for a failover test: answers like ``Server``, or refuses, or stays silent, as set; records the
    request id and budget of every query it saw."""

    def __init__(self, name: str, mode: str = "answer", status: tuple[int, str] | None = None) -> None:
        self.name, self.mode, self.status = name, mode, status
        self.server = Server({"site": name})
        self.seen: list[tuple[str, float]] = []

    async def __call__(self, method: str, path: str, headers: dict[str, str], body: bytes) -> Response:
        if path.endswith("/infer"):
            hlen = headers.get(HEADER_LENGTH)
            dec = codec.decode_infer_request(body, int(hlen) if hlen else None)
            self.seen.append((dec.request_id or "", float(dec.parameters["latency_ms"])))
        if self.mode == "refuse":
            raise errors.PeerUnavailable(f"{self.name}: connection refused")
        if self.mode == "silent":
            await asyncio.sleep(30)
        if self.status is not None and path.endswith("/infer"):
            code, name = self.status
            return code, {}, json.dumps({"error": f"{self.name} says {name}", "code": name}).encode()
        return self.server(method, path, headers, body)


def _client(*edges: Edge, **kwargs: Any) -> AsyncClient:
    return AsyncClient([f"http://{e.name}" for e in edges], transport=[MockTransport(e) for e in edges], **kwargs)


async def test_a_refused_edge_fails_over_with_the_same_id_and_cools_down() -> None:
    a, b = Edge("a", "refuse"), Edge("b")
    async with _client(a, b) as c:
        r = await c.infer(TASK, {"x": X}, latency_ms=100)
        assert r.site == "b" and r.edge == "http://b"
        assert a.seen[0][0] == b.seen[0][0] == r.request_id != ""  # one id, drawn by the client
        a.mode = "answer"
        r2 = await c.infer(TASK, {"x": X}, latency_ms=100)  # a cools down: not asked
        assert r2.site == "b" and len(a.seen) == 1 and r2.request_id != r.request_id


async def test_a_silent_edge_costs_a_share_of_the_budget_and_the_retry_gets_the_rest() -> None:
    a, b = Edge("a", "silent"), Edge("b")
    async with _client(a, b) as c:
        t0 = time.perf_counter()
        r = await c.infer(TASK, {"x": X}, latency_ms=300)
        took = time.perf_counter() - t0
    assert r.site == "b" and r.within_slo
    assert 0.1 <= took < 0.3  # a third of 300 ms on a, then b at once
    (rid_a, budget_a), = a.seen
    (rid_b, budget_b), = b.seen
    assert rid_a == rid_b == r.request_id and budget_a == 300 and 190 <= budget_b <= 200


async def test_definite_answers_are_never_asked_again() -> None:
    for status in [(404, "unknown_task"), (422, "impossible_slo"), (400, "bad_tensor"), (429, "quota_exceeded"),
                   (503, "overloaded"), (504, "deadline")]:
        a, b = Edge("a", status=status), Edge("b")
        async with _client(a, b) as c:
            with pytest.raises(errors.MeshError, match="a says"):
                await c.infer(TASK, X, latency_ms=100)
        assert not b.seen and len(a.seen) == 1, status


async def test_when_no_edge_answers() -> None:
    async with _client(Edge("a", "refuse"), Edge("b", "refuse")) as c:
        with pytest.raises(errors.PeerUnavailable, match="b: connection refused"):
            await c.infer(TASK, {"x": X}, latency_ms=100)
    async with _client(Edge("a", "silent"), Edge("b", "silent"), timeout=0.3) as c:
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError) as info:
            await c.infer(TASK, {"x": X}, latency_ms=100)
        assert isinstance(info.value, errors.DeadlineExceeded) and time.perf_counter() - t0 < 0.6


async def test_a_failed_edge_is_tried_again_after_its_cool_down(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fo, "COOLDOWN_S", 0.05)
    a, b = Edge("a", "refuse"), Edge("b")
    async with _client(a, b) as c:
        assert (await c.infer(TASK, {"x": X}, latency_ms=100)).site == "b"
        a.mode = "answer"
        await asyncio.sleep(0.11)  # past the first cool-down, whatever its jitter
        assert (await c.infer(TASK, {"x": X}, latency_ms=100)).site == "a"


async def test_one_query_probes_a_cooled_down_edge_while_the_others_keep_away(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fo, "COOLDOWN_S", 0.02)
    a, b = Edge("a", "refuse"), Edge("b")
    async with _client(a, b) as c:
        await c.infer(TASK, {"x": X}, latency_ms=300)
        a.mode = "silent"
        await asyncio.sleep(0.05)
        results = await asyncio.gather(*(c.infer(TASK, {"x": X}, latency_ms=300) for _ in range(5)))
    assert {r.site for r in results} == {"b"}
    assert len(a.seen) == 2  # the first refusal, then one probe: not five


async def test_the_id_rides_in_kept_plans_and_json_bodies_alike() -> None:
    for binary in (True, False):
        a, b = Edge("a"), Edge("b")
        async with _client(a, b, binary=binary) as c:
            ids = [(await c.infer(TASK, {"x": X}, latency_ms=100)).request_id for _ in range(3)]
            mine = (await c.infer(TASK, {"x": X}, latency_ms=100, request_id="mine-1")).request_id
        assert len(set(ids)) == 3 and all(ids) and [i for i, _ in a.seen] == [*ids, "mine-1"] and mine == "mine-1"


async def test_one_url_is_one_edge_as_before() -> None:
    server = Server()
    async with AsyncClient("http://edge", transport=MockTransport(server)) as c:
        r = await c.infer(TASK, {"x": X}, latency_ms=100)
    _, _, headers, body = server.seen[-1]
    assert "id" not in json.loads(body[:int(headers[HEADER_LENGTH])]) and r.request_id == "gen"
    assert r.edge == "http://edge" and c.base_urls == ("http://edge",)


async def test_a_call_without_a_budget_passes_a_silent_edge_over_after_a_second(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fo, "NO_BUDGET_S", 0.3)
    a, b = Edge("a", "silent"), Edge("b")
    async with _client(a, b) as c:
        t0 = time.perf_counter()
        assert await c.ready() is True and (await c.task_metadata(TASK)).inputs[0].name == "x"
        assert 0.1 <= time.perf_counter() - t0 < 0.3  # a third of it on a once; then a cools down
        r = await c.infer(TASK, X, latency_ms=100)  # the bare array's metadata: cached
        assert r.site == "b"


def test_the_sync_client_fails_over_too() -> None:
    a, b = Edge("a", "refuse"), Edge("b")
    with Client(["http://a", "http://b"], transport=[MockTransport(a), MockTransport(b)]) as c:
        assert c.infer(TASK, {"x": X}, latency_ms=100).site == "b"
        assert c.ready() is True
