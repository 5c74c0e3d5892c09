"""Issue 30: 422 means impossible, not late; a late answer says so.

The door's own delay (a busy capped edge, a blocked loop) spends a query's budget before routing; routing
judges an SLO impossible only on the whole budget asked, so such a query is answered ``deadline`` (or
served best effort when it asked for that), never ``impossible_slo``. A reply that comes past its budget is
flagged ``late`` by the door, which measured the whole time, and is counted missed; none within it is.
The data plane over the real routing policy with a fake transport (``test_paths_retry``)."""

from __future__ import annotations

import asyncio
import time

import msgpack
import numpy as np
import pytest

from edge_agent.site_dataplane import SiteDataPlane
from edge_agent.traces import clean_hops
from mesh.client import AsyncClient
from mesh.errors import DeadlineExceeded, ImpossibleSLO
from mesh.sdk_transport import MockTransport
from mesh.tracecontext import new_traceparent
from mesh.types import SLO, InferRequest, InferResponse, TaskSignature, TensorSpec, Timing
from mesh.v2.params import response_parameters
from mesh.zmq import protocol
from mesh.zmq.client import ReplyWait
from tests.unit.test_client_mock import Server
from tests.unit.test_paths_retry import FakeZmq, plane

pytestmark = pytest.mark.unit

SIG = TaskSignature("digits", (TensorSpec("x", "float32", (-1, 4)),), (TensorSpec("y", "float32", (-1,)),))


def door(dp: SiteDataPlane) -> SiteDataPlane:
    dp.view.topology = None  # type: ignore[misc]
    dp.view.signatures = {"digits": SIG}  # type: ignore[misc]
    return dp


def entering(latency_ms: float, min_accuracy: float, prefer: str = "refuse", *, spent_ms: float = 0.0,
             traced: bool = False) -> InferRequest:
    """A query as the door gets it, ``spent_ms`` after it entered (the door's own delay before routing)."""
    req = InferRequest.entering("digits", {"x": np.zeros((1, 4), np.float32)},
                                SLO(latency_ms, min_accuracy, prefer=prefer),  # type: ignore[arg-type]
                                now=time.monotonic() - spent_ms / 1000.0)
    if traced:
        req.traceparent = new_traceparent()
    return req


# From edge-b, cnn.fp32 (0.985) at mid answers in 14 ms: a 10 ms round trip, 1 ms of margin, 3 ms of compute.

async def test_a_budget_spent_at_the_door_is_a_deadline_not_an_impossible_slo() -> None:
    dp, zmq = plane({})
    door(dp)
    # 145 ms of the 150 asked were lost before routing: 5 ms left, less than any site needs
    with pytest.raises(DeadlineExceeded) as late:
        await dp.infer(entering(150.0, 0.98, spent_ms=145.0, traced=True))
    assert "spent before this decision" in late.value.message and not zmq.calls
    # the door's delay is counted as such: in the metrics and in the trace
    (h,) = dp.metrics.door_delays.values()
    assert sum(h.counts) == 1 and 0.145 <= h.sum < 0.3
    assert dp.metrics.requests[("other", "public", "none", "deadline", "none")] == 1
    kept, = (t for own in dp.traces._tenants.values() for t in own.values())
    assert kept.trace["outcome"] == "deadline" and kept.trace["hops"][0]["door_delay_ms"] >= 145.0
    assert clean_hops(kept.trace["hops"])[0]["door_delay_ms"] >= 145.0  # the shape a peer's records are read in
    # the same query on its whole budget is served
    resp = await dp.infer(entering(150.0, 0.98))
    assert (resp.site, resp.variant, resp.best_effort, resp.late) == ("mid", "cnn.fp32", False, False)


async def test_a_query_that_asked_for_best_effort_is_served_whatever_the_door_spent() -> None:
    dp, _ = plane({})
    door(dp)
    resp = await dp.infer(entering(150.0, 0.98, "latency", spent_ms=145.0))
    assert resp.best_effort and resp.reason == "best_effort_latency"


@pytest.mark.parametrize(("latency_ms", "min_accuracy", "spent_ms"), [
    (150.0, 0.999, 0.0),    # above every variant's accuracy (the tenant's best is 0.99)
    (150.0, 0.999, 145.0),  # ... and a door delay does not make it a deadline
    (0.5, 0.98, 0.0),       # below every variant's floor: cnn.fp32 needs 14 ms from here at best
])
async def test_a_truly_impossible_slo_is_still_422(latency_ms: float, min_accuracy: float, spent_ms: float) -> None:
    dp, zmq = plane({})
    door(dp)
    with pytest.raises(ImpossibleSLO) as refused:
        await dp.infer(entering(latency_ms, min_accuracy, spent_ms=spent_ms))
    assert refused.value.http_status == 422 and not zmq.calls
    assert f"within {latency_ms:.1f} ms" in refused.value.message  # judged on the budget asked


class SlowZmq(FakeZmq):
    """Mid answers after ``delay_s[i]`` for the i-th query (within the attempt's wait, else the real client's timer
    ends it), then the event loop is blocked for ``stall_s[i]`` (another task holding it): what a saturated
    site and a busy door do to a reply."""

    def __init__(self, delay_s: list[float], stall_s: list[float]) -> None:
        super().__init__({})
        self.delay_s, self.stall_s, self.n = delay_s, stall_s, 0

    async def request(self, endpoint: str, req: InferRequest, *, reserve_ms: float = 0.0,
                      attempt_ms: float | None = None, wait: ReplyWait | None = None) -> InferResponse:
        i, self.n = self.n, self.n + 1
        until = req.deadline if attempt_ms is None else min(req.deadline, time.monotonic() + attempt_ms / 1000.0)
        if time.monotonic() + self.delay_s[i] > until:
            await asyncio.sleep(max(0.0, until - time.monotonic()))
            raise DeadlineExceeded(f"no reply from {endpoint} before the deadline")
        await asyncio.sleep(self.delay_s[i])
        time.sleep(self.stall_s[i])  # noqa: ASYNC251 - the point: the loop is blocked, as a busy door's is
        site = endpoint.removeprefix("tcp://")
        return InferResponse(req.request_id, {"y": np.zeros(1, np.float32)}, site, str(req.target_variant),
                             0.99, "forward", tenant=req.tenant, timing=Timing(total_ms=self.delay_s[i] * 1000.0),
                             hops=[*req.hops, site])


async def test_every_answer_past_its_budget_is_flagged_late_and_counted_missed() -> None:
    """60 ms budgets; mid answers in 0-60 ms and the loop then stalls 0-60 ms, so about half the answers come
    late. Best effort (accuracy 0.999: nothing meets it) gets a grace past its budget, the others not."""
    rng = np.random.default_rng(30)
    n = 24
    delay = [float(x) for x in rng.uniform(0.0, 0.04, n)]
    stall = [float(x) if k % 2 else 0.0 for k, x in enumerate(rng.uniform(0.0, 0.06, n))]
    dp, _ = plane({})
    door(dp)
    dp.zmq = SlowZmq(delay, stall)  # type: ignore[assignment]
    answered: list[tuple[bool, float, bool]] = []  # (late, whole ms measured here, best effort)
    for k in range(n):
        req = entering(60.0, 0.999 if k % 3 == 0 else 0.98, "latency", traced=k % 4 == 0)
        t0 = req.deadline - 0.060
        try:
            resp = await dp.infer(req)
        except DeadlineExceeded:
            continue
        whole = (time.monotonic() - t0) * 1000.0
        answered.append((resp.late, whole, resp.best_effort))
        assert resp.timing.total_ms <= whole  # the door's total is the whole time from entry ...
        assert resp.timing.total_ms > 60.0 if resp.late else resp.timing.total_ms <= 60.0  # ... and says late
        assert response_parameters(resp)["late"] is resp.late
        if req.traceparent is not None:
            assert resp.trace is not None and resp.trace[0]["late"] is resp.late
    late = [a for a in answered if a[0]]
    on_time = [a for a in answered if not a[0]]
    assert late and on_time, answered  # both kinds were driven
    assert all(whole > 60.0 for _, whole, _ in late)
    assert any(not be for _, _, be in late)  # not only best effort's grace: a stalled loop too
    # the SLO metrics count every late answer missed; met ones are on time and accurate enough
    met = sum(v for (_, _, result), v in dp.metrics.slo.items() if result == "met")
    assert met == sum(1 for lt, _, be in answered if not lt and not be)


async def test_the_sdk_and_the_wire_carry_the_late_flag() -> None:
    x = np.ones((1, 64), np.float32)
    for extra, late, within in (({"late": True}, True, False), ({"late": False}, False, True), ({}, False, True)):
        async with AsyncClient("http://edge", transport=MockTransport(Server(extra))) as c:
            r = await c.infer("digit-classification", x, latency_ms=20, min_accuracy=0.9)
        assert (r.late, r.within_slo) == (late, within)
    async with AsyncClient("http://edge", transport=MockTransport(Server())) as c:  # accuracy 0.97 < 0.98
        assert not (await c.infer("digit-classification", x, latency_ms=20, min_accuracy=0.98)).within_slo
    for late in (True, False):  # a caller over ZeroMQ reads it too; absent on the wire when on time
        resp = InferResponse("r", {"y": np.ones(3, np.float32)}, "edge", "v", 0.9, "local", late=late)
        frames = [bytes(f) for f in protocol.encode_response(resp)]
        assert ("late" in msgpack.unpackb(frames[0])) is late
        assert protocol.decode_response(frames).late is late
        head = msgpack.unpackb(frames[0])
        head["accuracy"] = 1  # an int: not the fast path's exact types, so the checked decoder reads it
        assert protocol.decode_response([msgpack.packb(head), *frames[1:]]).late is late
