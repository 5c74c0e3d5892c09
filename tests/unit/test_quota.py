"""Tenant quotas, the pure parts: the token bucket, the door's admit/release on a driven clock, and
how a tenant's global qps is shared between doors (``core_scheduler.policy.quota``)."""

from __future__ import annotations

import math

import pytest

from core_scheduler.policy.quota import FLOOR, QuotaLimit, door_limits, qps_share
from core_scheduler.state.heartbeat import DemandSample, Heartbeat
from edge_agent.quota import MAX_RETRY_AFTER_S, DoorQuotas, TokenBucket, limits_from_view
from mesh.errors import QuotaExceeded, error_from_code

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


# ---------------------------------------------------------------- the bucket

def test_a_bucket_starts_full_then_refills_at_its_rate() -> None:
    b = TokenBucket(rate=10.0, burst=5.0, now=0.0)
    assert [b.take(0.0) for _ in range(5)] == [0.0] * 5
    assert b.take(0.0) == pytest.approx(0.1)      # one token is 1/10 s away
    assert b.take(0.05) == pytest.approx(0.05)    # half of it has come
    assert b.take(0.1) == 0.0
    # idle for a long time: no more than the burst is saved up
    assert sum(b.take(100.0) == 0.0 for _ in range(20)) == 5


def test_a_zero_rate_never_refills_and_a_clock_going_back_gives_nothing() -> None:
    b = TokenBucket(rate=0.0, burst=0.0, now=0.0)
    assert math.isinf(b.take(1e6))
    c = TokenBucket(rate=1.0, burst=1.0, now=10.0)
    assert c.take(10.0) == 0.0
    assert c.take(5.0) == pytest.approx(1.0)


def test_reshaping_keeps_the_tokens_up_to_the_new_burst() -> None:
    b = TokenBucket(rate=10.0, burst=10.0, now=0.0)
    for _ in range(4):
        b.take(0.0)
    b.reshape(2.0, 3.0, now=0.0)                  # a smaller share: 6 tokens clipped to 3
    assert [b.take(0.0) for _ in range(3)] == [0.0] * 3
    assert b.take(0.0) == pytest.approx(0.5)
    b.reshape(100.0, 100.0, now=0.0)              # a larger share: no free refill
    assert b.take(0.0) == pytest.approx(0.01)


@pytest.mark.parametrize(("rate", "burst"), [(-1.0, 1.0), (1.0, -1.0), (math.inf, 1.0), (1.0, math.nan)])
def test_a_bucket_refuses_nonsense(rate: float, burst: float) -> None:
    with pytest.raises(ValueError, match="token bucket"):
        TokenBucket(rate, burst, 0.0)


# ---------------------------------------------------------------- the door

def test_over_rate_is_refused_with_retry_after_and_others_pass() -> None:
    clock = Clock()
    q = DoorQuotas(clock)
    q.update({"acme": QuotaLimit(qps=0.4, burst=1.0)})
    q.admit("acme")
    with pytest.raises(QuotaExceeded) as info:
        q.admit("acme")
    exc = info.value
    assert exc.http_status == 429 and exc.code == "quota_exceeded"
    assert exc.retry_after_s == 3                 # 2.5 s to the next token, rounded up
    assert exc.to_dict()["details"]["limit"] == "qps"
    for _ in range(100):                          # a tenant without limits, and one the topology lacks
        q.admit("globex")
    assert q.inflight == {"acme": 1, "globex": 100} and q.refused == {"acme": 1}
    clock.t += 2.5
    q.admit("acme")


def test_check_refuses_as_admit_would_and_charges_nothing() -> None:
    """The HTTP front asks before it reads a body: an over-quota tenant is refused without its body read, and a
    tenant within quota is not charged twice (check, then admit)."""
    clock = Clock()
    q = DoorQuotas(clock)
    q.update({"acme": QuotaLimit(qps=2.0, burst=2.0, max_inflight=5)})
    for _ in range(10):
        q.check("acme")  # takes no token
    q.admit("acme")
    q.check("acme")
    q.admit("acme")  # the second token: two admitted after ten checks
    with pytest.raises(QuotaExceeded) as info:
        q.check("acme")
    assert info.value.retry_after_s == 1 and q.inflight["acme"] == 2
    q.check("globex")  # no limit for it


def test_retry_after_is_at_least_one_second_and_finite_for_a_suspended_tenant() -> None:
    clock = Clock()
    q = DoorQuotas(clock)
    q.update({"fast": QuotaLimit(qps=1000.0, burst=1.0), "off": QuotaLimit(qps=0.0, burst=0.0)})
    q.admit("fast")
    with pytest.raises(QuotaExceeded) as fast:
        q.admit("fast")
    assert fast.value.retry_after_s == 1
    with pytest.raises(QuotaExceeded) as off:
        q.admit("off")
    assert off.value.retry_after_s == MAX_RETRY_AFTER_S


def test_in_flight_is_capped_per_tenant_and_freed_on_release() -> None:
    q = DoorQuotas(Clock())
    q.update({"acme": QuotaLimit(max_inflight=2), "globex": QuotaLimit(max_inflight=0)})
    q.admit("acme")
    q.admit("acme")
    with pytest.raises(QuotaExceeded) as info:
        q.admit("acme")
    assert info.value.retry_after_s == 1 and info.value.details["limit"] == "max_inflight"
    with pytest.raises(QuotaExceeded):
        q.admit("globex")
    q.release("acme")
    q.admit("acme")
    q.release("acme")
    q.release("acme")
    assert q.inflight == {}


def test_an_in_flight_refusal_spends_no_token() -> None:
    q = DoorQuotas(Clock())
    q.update({"acme": QuotaLimit(qps=1.0, burst=1.0, max_inflight=0)})
    with pytest.raises(QuotaExceeded):
        q.admit("acme")
    q.update({"acme": QuotaLimit(qps=1.0, burst=1.0, max_inflight=5)})
    q.admit("acme")                               # the token is still there


def test_updates_keep_tokens_and_drop_limits_no_longer_set() -> None:
    clock = Clock()
    q = DoorQuotas(clock)
    q.update({"acme": QuotaLimit(qps=1.0, burst=1.0)})
    q.admit("acme")
    q.update({"acme": QuotaLimit(qps=1.0, burst=1.0)})   # a view change: no free refill
    with pytest.raises(QuotaExceeded):
        q.admit("acme")
    q.update({})                                  # quota removed from the topology
    for _ in range(10):
        q.admit("acme")


def test_the_error_crosses_the_wire_by_its_code() -> None:
    exc = error_from_code("quota_exceeded", "over")
    assert isinstance(exc, QuotaExceeded) and exc.retry_after_s == 1 and exc.http_status == 429


# ---------------------------------------------------------------- sharing a global quota

@pytest.mark.parametrize(("here", "doors", "demand", "share"), [
    ("a", ["a"], {}, 1.0),                                      # one door holds it all
    ("a", ["a", "b", "c", "d"], {}, 0.25),                      # no demand anywhere: even split
    ("a", ["a", "b"], {"a": 30.0, "b": 10.0}, FLOOR / 2 + (1 - FLOOR) * 0.75),
    ("b", ["a", "b"], {"a": 30.0, "b": 10.0}, FLOOR / 2 + (1 - FLOOR) * 0.25),
    ("new", ["a", "b", "c"], {"a": 50.0}, FLOOR / 4),           # a door not yet live gets the floor
    ("a", ["a", "b"], {"a": 10.0, "b": -3.0}, FLOOR / 2 + (1 - FLOOR)),  # nonsense demand counts as none
    ("a", ["a", "b"], {"a": 5.0, "gone": 50.0}, FLOOR / 2 + (1 - FLOOR)),  # only doors count
])
def test_qps_share(here: str, doors: list[str], demand: dict[str, float], share: float) -> None:
    assert qps_share(here, doors, demand) == pytest.approx(share)


@pytest.mark.parametrize("demand", [{}, {"a": 1.0}, {"a": 3.0, "b": 7.0, "c": 0.5}, {"d": 2.0}])
def test_shares_over_the_same_view_add_up_to_one(demand: dict[str, float]) -> None:
    doors = ["a", "b", "c", "d"]
    assert sum(qps_share(s, doors, demand) for s in doors) == pytest.approx(1.0)


def test_a_bad_floor_is_refused() -> None:
    with pytest.raises(ValueError, match="floor"):
        qps_share("a", ["a"], {}, floor=1.5)


def test_door_limits_per_tenant() -> None:
    quotas = {"acme": {"qps": 100.0, "max_inflight": 8.0}, "globex": {"max_inflight": 3.0},
              "slow": {"qps": 0.5}, "open": {}, "off": {"qps": 0.0}}
    demand = {"a": {"acme": 30.0}, "b": {"acme": 10.0}}
    lim = door_limits("a", ["a", "b"], quotas, demand, floor=0.2, burst_s=1.0)
    assert set(lim) == {"acme", "globex", "slow", "off"}
    assert lim["acme"].qps == pytest.approx(100.0 * (0.1 + 0.8 * 0.75))
    assert lim["acme"].burst == pytest.approx(lim["acme"].qps)   # one second's worth
    assert lim["acme"].max_inflight == 8                          # in-flight is per door, not shared
    assert lim["globex"] == QuotaLimit(qps=None, burst=1.0, max_inflight=3)
    assert lim["slow"].qps == pytest.approx(0.25) and lim["slow"].burst == 1.0  # at least one token
    assert lim["off"].qps == 0.0 and lim["off"].burst == 0.0


def test_limits_from_view_sum_each_doors_samples_for_the_tenant() -> None:
    def beat(site: str, *samples: tuple[str, float]) -> Heartbeat:
        return Heartbeat(site=site, demand=tuple(DemandSample(task="t", slo_class=f"c{i}", tenant=tenant, qps=qps,
                                                              budget_ms=50.0, min_accuracy=0.9)
                                                 for i, (tenant, qps) in enumerate(samples)))

    live = {"a": beat("a", ("acme", 20.0), ("acme", 10.0), ("globex", 5.0)), "b": beat("b", ("acme", 10.0)),
            "core": beat("core")}
    lim = limits_from_view("b", {"acme": {"qps": 90.0}}, live)
    assert lim["acme"].qps == pytest.approx(90.0 * (FLOOR / 3 + (1 - FLOOR) * 10.0 / 40.0))


@pytest.mark.parametrize("lie", [1e12, math.inf, 500.0])
def test_a_door_publishing_huge_demand_cannot_starve_the_others(lie: float) -> None:
    """A door writes its own heartbeat: its demand is believed only up to the tenant's qps (no door admits more),
    and a value that is not a finite number counts as none. Without the clamp, one liar left every other door
    FLOOR / n of the tenant's quota."""
    qps, honest = 100.0, {"a": 40.0, "b": 20.0}
    doors = ["a", "b", "liar"]
    for here, d in honest.items():
        share = qps_share(here, doors, {**honest, "liar": lie}, cap=qps)
        # the bound in core_scheduler.policy.quota's docstring
        assert share >= FLOOR / 3 + (1 - FLOOR) * d / (qps + sum(honest.values())) - 1e-12
        assert share >= FLOOR / 3 + (1 - FLOOR) * d / (2 * qps)
    # what door_limits (every door's bucket) does with a liar's heartbeat
    def beat(site: str, qps_claimed: float) -> Heartbeat:
        return Heartbeat(site=site, demand=(DemandSample(task="t", slo_class="c", tenant="acme", qps=qps_claimed,
                                                         budget_ms=50.0, min_accuracy=0.9),))

    live = {"a": beat("a", 40.0), "b": beat("b", 20.0), "liar": beat("liar", lie)}
    lim = limits_from_view("a", {"acme": {"qps": qps}}, live)
    assert lim["acme"].qps is not None and lim["acme"].qps >= qps * (FLOOR / 3 + (1 - FLOOR) * 40.0 / 160.0) - 1e-9


def test_demand_that_is_not_a_number_counts_as_none() -> None:
    assert qps_share("a", ["a", "b"], {"a": 10.0, "b": math.nan}, cap=100.0) == pytest.approx(FLOOR / 2 + 1 - FLOOR)
    assert qps_share("a", ["a", "b"], {"a": 10.0, "b": math.inf}) == pytest.approx(FLOOR / 2 + 1 - FLOOR)
