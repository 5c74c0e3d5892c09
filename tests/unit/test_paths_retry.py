"""Gray failures, the pure parts: learnt path overhead (from failures as well as successes), the
attempt limit of a forward, and the data plane's retry loop over the real routing policy with a
fake transport (which site is tried next, never twice, never past the deadline)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from core_scheduler.policy.routing import Decision, RoutingTable
from edge_agent.demand import DemandMeter
from edge_agent.paths import ATTEMPT_SLACK_MS, MIN_RETRY_MS, PRIOR_DEV_MS, PathEstimates, attempt_ms
from edge_agent.site_dataplane import _RETRYABLE, RETRIED, SiteDataPlane
from mesh.errors import (
    BlobError,
    DeadlineExceeded,
    NoRoute,
    PayloadTooLarge,
    PeerUnavailable,
    PermissionDenied,
    RuntimeLoadError,
)
from mesh.types import BEST_EFFORT_GRACE_MS, SLO, InferRequest, InferResponse, TaskSignature, TensorSpec, Timing
from mesh.zmq.client import ReplyWait
from tests.unit.test_routing import ALL, snap

pytestmark = pytest.mark.unit


# ---------------------------------------------------------------- overhead learning

def test_a_timeout_raises_the_learnt_overhead_and_successes_bring_it_down() -> None:
    est = PathEstimates()
    for t in range(20):
        est.observe("core", 1.0, now=float(t))
    calm = est.correction(now=20.0)["core"]
    assert calm < 3.0
    # an attempt expected in 40 ms, abandoned at its 90 ms limit after waiting 90 ms
    assert est.observe_failure("core", 90.0, 40.0, 90.0, now=20.0)
    hit = est.correction(now=20.0)["core"]
    assert hit > calm + 10.0
    # a second timeout raises it further
    est.observe_failure("core", 90.0, 40.0, 90.0, now=20.0)
    assert est.correction(now=20.0)["core"] > hit
    # successes return: the estimate comes back down towards the calm value
    for _ in range(30):
        est.observe("core", 1.0, now=21.0)
    assert est.correction(now=21.0)["core"] < hit / 3


def test_a_failure_is_capped_at_the_attempt_limit_and_a_fast_one_teaches_nothing() -> None:
    capped, at_limit = PathEstimates(), PathEstimates()
    capped.observe_failure("mid", 5000.0, 10.0, 60.0, now=0.0)  # a peer lost mid-flight after 5 s
    at_limit.observe_failure("mid", 60.0, 10.0, 60.0, now=0.0)
    assert capped.correction(0.0) == at_limit.correction(0.0)
    est = PathEstimates()
    assert not est.observe_failure("mid", 0.3, 10.0, 60.0, now=0.0)  # refused at once: already known dead
    assert est.correction(0.0) == {}


# A replay of what issue 30 saw on a capped edge: its first forwards answered 80-200 ms late because the
# edge itself stalled (its CPU quota, TLS handshakes), then the path answered as declared (0-2 ms excess).
SLOW_START = (200.0, 150.0, 80.0)
CALM = (1.0, 0.0, 2.0, 0.5, 1.5) * 8
# balanced (60 ms) from an edge to its core 16 ms away: a 32 ms round trip and a few ms of compute leave
# ~20 ms; a correction under this keeps the path feasible
FEASIBLE_MS = 18.0


def replay(est: PathEstimates, excess: tuple[float, ...], local: tuple[float, ...] = ()) -> list[float]:
    out = []
    for k, x in enumerate(excess):
        est.observe("core", x, now=k * 0.1, local_ms=local[k] if k < len(local) else 0.0)
        out.append(est.correction(now=k * 0.1)["core"])
    return out


def test_a_slow_start_keeps_the_path_feasible_and_recovers_in_a_few_successes() -> None:
    # not knowing the stalls were local: bounded, and back within a few fast answers
    seen = replay(PathEstimates(), SLOW_START + CALM)
    assert max(seen) < FEASIBLE_MS  # the old estimator: 373 ms
    assert seen[len(SLOW_START) + 7] < 5.0  # 8 fast answers later (the old one: 205 ms)
    assert seen[len(SLOW_START) + 15] < 3.0  # 16 fast answers later: the calm path's own spread
    # the first sample starts from the declared latency and moves it only by the usual gain
    first = PathEstimates()
    first.observe("core", 200.0, now=0.0)
    assert first.correction(0.0)["core"] < 10.0


def test_local_stalls_are_not_booked_to_the_path_and_are_counted_apart() -> None:
    est = PathEstimates()
    seen = replay(est, SLOW_START + CALM[:5], local=SLOW_START)  # the door measured its stalls
    assert max(seen) < 2 * PRIOR_DEV_MS + 1.0
    assert est.local_total_ms == pytest.approx(sum(SLOW_START))
    assert est.local_delay_ms() > 10.0
    # a failure's wait is the path's only beyond the door's own delay
    failed = PathEstimates()
    assert not failed.observe_failure("core", 90.0, 40.0, 90.0, now=0.0, local_ms=60.0)
    assert failed.correction(0.0) == {} and failed.local_total_ms == 60.0


def test_a_truly_degraded_path_still_raises_the_correction() -> None:
    calm = replay(PathEstimates(), CALM)
    assert calm[-1] < 3.0
    # sustained: 30 ms more than declared from now on
    est = PathEstimates()
    replay(est, CALM)
    seen = []
    for k in range(8):
        est.observe("core", 30.0, now=10.0 + k * 0.1)
        seen.append(est.correction(now=10.0 + k * 0.1)["core"])
    assert seen[3] > 20.0 and seen[7] > 40.0
    # intermittent: one answer in three 40 ms late
    assert sum(replay(PathEstimates(), (1.0, 1.0, 40.0) * 40)[-30:]) / 30 > 30.0


def test_an_unused_path_fades() -> None:
    est = PathEstimates(decay_s=10.0)
    est.observe_failure("core", 100.0, 20.0, 100.0, now=0.0)
    first = est.correction(now=0.0)["core"]
    assert est.correction(now=10.0)["core"] == pytest.approx(first / np.e)


@pytest.mark.parametrize(("remaining", "expected", "best_effort", "limit"), [
    (400.0, 35.0, False, 35.0 + ATTEMPT_SLACK_MS),  # a fast path: expected + slack
    (400.0, 100.0, False, 200.0),                   # a slower one: twice what was expected
    (60.0, 35.0, False, 60.0),                       # cutting short would leave no room: the whole rest
    (85.0 + MIN_RETRY_MS, 35.0, False, 85.0),        # just room enough to cut
    (400.0, 35.0, True, 400.0),                      # best effort: nothing better to retry with
    (400.0, float("inf"), False, 400.0),
])
def test_attempt_limit(remaining: float, expected: float, best_effort: bool, limit: float) -> None:
    assert attempt_ms(remaining, expected, best_effort=best_effort) == pytest.approx(limit)


# ---------------------------------------------------------------- the retry loop

class FakeZmq:
    """Answers per site: 'ok', 'dead' (PeerUnavailable at once) or 'silent' (no reply: the real
    client's timer ends the wait at the request's deadline)."""

    def __init__(self, behaviour: dict[str, str]) -> None:
        self.behaviour = behaviour
        self.calls: list[tuple[str, float]] = []  # (site, budget ms given to it)
        self.listeners: list[Any] = []

    def add_reachability_listener(self, fn: Any) -> None:
        self.listeners.append(fn)

    async def request(self, endpoint: str, req: InferRequest, *, reserve_ms: float = 0.0,
                      attempt_ms: float | None = None, wait: ReplyWait | None = None) -> InferResponse:
        site = endpoint.removeprefix("tcp://")
        # the real client's timer ends a send's wait at the attempt's limit, or at the deadline
        until = req.deadline if attempt_ms is None else min(req.deadline, time.monotonic() + attempt_ms / 1000.0)
        self.calls.append((site, (until - time.monotonic()) * 1000.0))
        what = self.behaviour.get(site, "ok")
        if what == "dead":
            raise PeerUnavailable(f"{endpoint}: disconnected")
        if what == "load_fails":
            raise RuntimeLoadError(f"{endpoint}: loading {req.target_variant} failed: disk full")
        if what == "too_large":
            raise PayloadTooLarge(f"{endpoint}: 1 row exceeds the queue")
        if what == "silent":
            await asyncio.sleep(max(0.0, until - time.monotonic()))
            raise DeadlineExceeded(f"no reply from {endpoint} before the deadline")
        if what == "slow":  # a path 20 ms slower than declared, every time
            await asyncio.sleep(0.02)
        if what == "stalled":  # answered at once, but this loop got to the reply 150 ms late
            await asyncio.sleep(0.15)
            if wait is not None:
                wait.lag_s = 0.15
        return InferResponse(req.request_id, {"y": np.zeros(1, np.float32)}, site, str(req.target_variant),
                             0.99, "forward", tenant=req.tenant, timing=Timing(total_ms=1.0),
                             hops=[*req.hops, site])


def plane(behaviour: dict[str, str]) -> tuple[SiteDataPlane, FakeZmq]:
    # edge-b holds nothing and has no room to load anything: every decision is a forward
    table = RoutingTable.build(snap(ALL, site_over={"edge-b": {"memory_mb": 0}}), "edge-b")
    view = SimpleNamespace(live={s: object() for s in ("edge-a", "edge-b", "mid", "core")}, variants={})
    zmq = FakeZmq(behaviour)
    dp = SiteDataPlane("edge-b", view, None, zmq, table=lambda: table,  # type: ignore[arg-type]
                       peer_endpoint=lambda s: f"tcp://{s}", demand=DemandMeter())
    return dp, zmq


def query(budget_ms: float, min_accuracy: float = 0.98, prefer: str = "latency") -> InferRequest:
    req = InferRequest.entering("digits", {"x": np.zeros((1, 4), np.float32)},
                                SLO(budget_ms, min_accuracy, prefer=prefer))  # type: ignore[arg-type]
    req.hops = ["edge-b"]
    return req


async def test_a_dead_peer_is_retried_elsewhere_and_the_reply_says_so() -> None:
    dp, zmq = plane({"mid": "dead"})
    resp = await dp._route(query(500.0), time.monotonic())
    first, second = (s for s, _ in zmq.calls)
    assert first == "mid" and second not in ("mid", "edge-b")
    assert resp.site == second and resp.reason.endswith(RETRIED) and dp.retried == 1


async def test_a_silent_peer_is_abandoned_at_its_attempt_limit_and_retried_in_budget() -> None:
    dp, zmq = plane({"mid": "silent"})
    t0 = time.monotonic()
    resp = await dp._route(query(500.0), t0)
    elapsed_ms = (time.monotonic() - t0) * 1000
    first, second = (s for s, _ in zmq.calls)
    assert first == "mid" and second not in ("mid", "edge-b")
    # mid got only its attempt's budget, not the query's whole 500 ms; the retry had the rest
    assert zmq.calls[0][1] < 150.0 and 300.0 < zmq.calls[1][1] and elapsed_ms < 500.0
    assert resp.site == second and resp.reason.endswith(RETRIED)
    assert dp.rtt_correction()["mid"] > 10.0  # the timeout taught the path estimate
    # ... and the attempt it cost is not booked to the site that answered the retry at once
    assert dp.rtt_correction()[second] < 2 * PRIOR_DEV_MS + 1.0


async def test_the_doors_own_delay_and_an_earlier_attempt_are_not_booked_to_the_path() -> None:
    dp, _ = plane({"mid": "stalled"})
    d = Decision(site="mid", variant_id="v", reason="forward", expected_latency_ms=13.0, cost=0.0,
                 accuracy=0.99, best_effort=False, feasible_count=1)
    # a retry: the query arrived 200 ms ago, spent on an earlier attempt elsewhere
    await dp._forward(query(500.0), d, time.monotonic() - 0.2, 300.0)
    assert dp.rtt_correction()["mid"] < 2 * PRIOR_DEV_MS + 1.0
    assert dp.paths.local_total_ms == pytest.approx(150.0)
    assert dp.net_rtt_ms["mid"] < 10.0


async def test_a_slow_path_is_learnt_in_full_though_each_plan_includes_the_correction() -> None:
    """A decision's expected latency includes the correction its table was built with; measured against it, each
    sample shrank as the correction grew, and a path 20 ms slower than declared settled near 7 ms (issue 30's
    balanced class: forwards to a far core kept planned feasible while a share of them missed)."""
    dp, _ = plane({"mid": "slow"})
    for _ in range(24):
        dp.table_correction = dp.rtt_correction()  # as the agent sets it with each table it builds
        d = Decision(site="mid", variant_id="v", reason="forward",
                     expected_latency_ms=1.0 + dp.table_correction.get("mid", 0.0), cost=0.0, accuracy=0.99,
                     best_effort=False, feasible_count=1)
        await dp._forward(query(500.0), d, time.monotonic(), 500.0)
    assert dp.rtt_correction()["mid"] > 15.0


async def test_every_site_fails_once_at_most_and_never_past_the_deadline() -> None:
    dp, zmq = plane({"mid": "silent", "core": "silent", "edge-a": "silent"})
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        await dp._route(query(300.0), t0)
    sites = [s for s, _ in zmq.calls]
    assert len(sites) == len(set(sites)) and "edge-b" not in sites
    assert time.monotonic() - t0 < 0.3 + 0.25  # the last attempt ends at the deadline


async def test_a_tight_budget_gets_one_attempt_to_its_deadline() -> None:
    dp, zmq = plane({"mid": "silent"})
    with pytest.raises(DeadlineExceeded):
        await dp._route(query(40.0), time.monotonic())
    assert [s for s, _ in zmq.calls] == ["mid"]


async def test_sites_marked_unreachable_are_routed_around_until_probed_back() -> None:
    dp, zmq = plane({})
    zmq.listeners[0]("tcp://mid", True)
    assert dp.unreachable == {"mid"}
    resp = await dp._route(query(500.0), time.monotonic())
    assert len(zmq.calls) == 1 and zmq.calls[0][0] != "mid"
    assert resp.reason in ("forward", "cold_start")  # chosen so, not retried
    for site in ("core", "edge-a"):
        zmq.listeners[0](f"tcp://{site}", True)
    assert dp.unreachable == {"mid", "core", "edge-a"}
    with pytest.raises(NoRoute):  # edge-b itself has no room for any variant
        await dp._route(query(500.0), time.monotonic())
    for site in ("mid", "core", "edge-a"):
        zmq.listeners[0](f"tcp://{site}", False)
    assert dp.unreachable == frozenset()
    zmq.calls.clear()
    await dp._route(query(500.0), time.monotonic())
    assert [s for s, _ in zmq.calls] == ["mid"]


async def test_a_traced_retry_records_each_attempt_and_forwards_the_trace_context() -> None:
    from edge_agent.traces import HopTrace
    from mesh.tracecontext import new_traceparent, trace_id_of

    dp, zmq = plane({"mid": "dead"})
    req = query(500.0)
    req.traceparent = new_traceparent()
    hop = HopTrace("edge-b", "edge")
    seen: list[str | None] = []
    real = zmq.request

    async def spy(endpoint: str, fwd: InferRequest, *, reserve_ms: float = 0.0,
                  attempt_ms: float | None = None, wait: ReplyWait | None = None) -> InferResponse:
        seen.append(fwd.traceparent)
        return await real(endpoint, fwd, reserve_ms=reserve_ms, attempt_ms=attempt_ms, wait=wait)

    zmq.request = spy  # type: ignore[method-assign]
    resp = await dp._route(req, time.monotonic(), hop)
    first, second = hop.records
    assert first["choice"]["site"] == "mid" and first["choice"]["reason"].endswith("failed: peer_down")
    assert second["choice"]["site"] == resp.site and "failed" not in second["choice"]["reason"]
    assert any(c["why_not"] == "excluded" and c["site"] == "mid" for c in second["candidates"])
    # each forward carries the same trace, with this hop's own span as the parent
    assert len(seen) == 2 and all(tp and trace_id_of(tp) == trace_id_of(req.traceparent) for tp in seen)
    assert seen[0] != req.traceparent


async def test_a_request_too_large_for_any_queue_is_not_retried_elsewhere() -> None:
    dp, zmq = plane({"mid": "too_large", "core": "too_large", "edge-a": "too_large"})
    with pytest.raises(PayloadTooLarge):
        await dp._route(query(500.0), time.monotonic())
    assert len(zmq.calls) == 1 and dp.retried == 0  # a 4xx of the caller's, not an overload


@pytest.mark.parametrize("prefer", ["accuracy", "latency"])
async def test_a_best_effort_query_carries_its_grace_past_the_budget(prefer: str) -> None:
    """Nothing meets 0.999 within 20 ms: best effort is served, and the hop serving it gets the
    query's budget plus the grace, so an answer a little late is not cut into a 504."""
    dp, zmq = plane({})
    resp = await dp._route(query(20.0, 0.999, prefer), time.monotonic())
    assert resp.best_effort and resp.reason == f"best_effort_{prefer}"
    (site, budget), = zmq.calls
    assert 20.0 < budget <= 20.0 + BEST_EFFORT_GRACE_MS
    if prefer == "accuracy":
        assert site == "mid"  # the most accurate reachable in 20 ms, not the big model at core


async def test_a_site_that_cannot_load_the_variant_is_retried_elsewhere() -> None:
    dp, zmq = plane({"mid": "load_fails"})
    resp = await dp._route(query(500.0), time.monotonic())
    first, second = (s for s, _ in zmq.calls)
    assert first == "mid" and second != "mid" and resp.site == second and resp.reason.endswith(RETRIED)


async def test_a_store_refusing_this_site_a_variant_is_a_failure_of_this_site_not_of_the_query() -> None:
    """A private variant the store will not yet give a site (placement has not placed its tenant there: 403) fails
    that site's attempt as a BlobError, which the door retries elsewhere, not the caller's PermissionDenied."""
    from variant_store.meta import VariantMeta

    meta = VariantMeta(task="mine", family="fam", variant_id="v1", format="onnx", precision="fp32",
                       runtime="onnxruntime", blob_digest="a" * 64, size_bytes=1, accuracy=0.9, owner="acme")

    async def refused(*_a: Any, **_k: Any) -> Any:
        raise PermissionDenied("spiffe://tiermesh/site/core may not read blob aaaa", reason="private_variant")

    view: Any = SimpleNamespace(variant=lambda task, vid: meta, topology=None)
    host: Any = SimpleNamespace(instances={}, ensure_by=refused)
    dp = SiteDataPlane("core", view, host, FakeZmq({}), table=lambda: None,  # type: ignore[arg-type]
                       peer_endpoint=lambda s: None, demand=DemandMeter())
    req = InferRequest.entering("mine", {"x": np.zeros((1, 2), np.float32)}, SLO(1000.0, 0.5), "acme")
    with pytest.raises(BlobError, match="core may not fetch v1") as err:
        await dp._serve_local(req, "v1", "local", False, time.monotonic())
    assert isinstance(err.value, _RETRYABLE)


async def test_the_door_counts_a_many_row_request_in_a_demand_class_of_its_own() -> None:
    dp, _ = plane({})
    dp.view.topology = None  # type: ignore[misc]
    dp.view.signatures = {"digits": TaskSignature("digits", (TensorSpec("x", "float32", (-1, 4)),),  # type: ignore[misc]
                                                  (TensorSpec("y", "float32", (-1,)),))}
    for rows in (1, 1, 50):
        await dp.infer(InferRequest.entering("digits", {"x": np.zeros((rows, 4), np.float32)}, SLO(500.0, 0.98)))
    got = {d.slo_class: (d.rows, d.qps) for d in dp.demand.snapshot(time.monotonic())}
    assert got == {"loose-hi": (1, pytest.approx(0.2)), "loose-hi-x64": (50, pytest.approx(0.1))}


async def test_a_failed_forward_names_the_site_not_its_endpoint() -> None:
    """The caller knows sites, not the addresses this host dials them at (a lab's delay proxy, say): a forward
    that fails says which site failed it."""
    dp, _ = plane({s: "dead" for s in ("edge-a", "mid", "core")})
    with pytest.raises(PeerUnavailable) as caught:
        await dp._route(query(500.0), time.monotonic())
    assert "tcp://" not in caught.value.message and "site " in caught.value.message, caught.value.message
    assert caught.value.details.get("site") in ("edge-a", "mid", "core") and "url" not in caught.value.details
