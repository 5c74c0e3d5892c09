"""The leader's chunk assignment as tables (``core_scheduler.policy.jobs.assign``): cheapest sites first, dearer
ones only while the deadline needs them, a few chunks ahead per site, earliest deadline first, standing
assignments kept, renewed or taken back; the admission estimate spread over several sites; a site's choice of
chunk (``claim_choice``); assignments read back from etcd as hostile (``decode_assignment``)."""

from __future__ import annotations

from typing import Any

import pytest

from core_scheduler.policy.jobs import (
    ASSIGN_GRACE_S,
    CLAIM_GRACE_S,
    HARVEST,
    HOLD_S,
    MIN_AHEAD,
    RENEW_S,
    SAFETY,
    Assigned,
    Capacity,
    JobWork,
    assign,
    cheapest_plan,
    claim_choice,
    estimate,
)
from core_scheduler.state.job_assign import decode_assignment
from mesh.errors import ProtocolError
from mesh.etcd.keys import assign_key
from mesh.etcd.ops import KV
from variant_store.meta import LatencyStats, Profile, VariantMeta

pytestmark = pytest.mark.unit

NOW = 1.8e9
J, K = "a" * 32, "b" * 32


def _meta(ms_per_row: dict[str, float], load_ms: float = 0.0) -> VariantMeta:
    profiles = {hw: Profile(hw, load_ms, {32: LatencyStats(32 * ms, 32 * ms)}, 1) for hw, ms in ms_per_row.items()}
    return VariantMeta(task="t", family="f", variant_id="v", format="onnx", precision="fp32", runtime="onnxruntime",
                       blob_digest="d" * 64, size_bytes=1, accuracy=0.9, profiles=profiles)


META = _meta({"cpu": 1.0, "gpu": 0.1})  # 1 ms a row on a cpu site, 0.1 on a gpu one
A, B, CORE = Capacity("edge-a", "cpu", 0.1), Capacity("edge-b", "cpu", 0.2), Capacity("core", "cpu", 0.5)


def _job(deadline_in: float, chunks: int = 10, rows: int = 1000, job_id: str = J, meta: VariantMeta | None = META,
         first: int = 0) -> JobWork:
    queued = tuple((i, rows) for i in range(first, chunks))
    return JobWork(job_id, NOW + deadline_in, meta, queued, rows * (chunks - first), chunks - first)


def _by_site(chunks: dict[tuple[str, int], Assigned]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for (_, idx), a in sorted(chunks.items()):
        out.setdefault(a.site, []).append(idx)
    return out


# 10 chunks of 1000 rows at 1 ms a row: one cpu site projects 2 x (10000 / 750 + 2.5) = 31.7 s, two 15.8 s,
# three 10.6 s; a chunk takes 1.58 s, so each chosen site holds MIN_AHEAD (2) chunks
@pytest.mark.parametrize(("deadline_in", "sites", "want", "late"), [
    (100.0, [CORE, B, A], {"edge-a": [0, 1]}, False),                       # generous: the cheapest alone
    (20.0, [CORE, B, A], {"edge-a": [0, 1], "edge-b": [2, 3]}, False),      # one site is too slow: the next dearer
    (12.0, [CORE, B, A], {"edge-a": [0, 1], "edge-b": [2, 3], "core": [4, 5]}, False),
    (5.0, [CORE, B, A], {"edge-a": [0, 1], "edge-b": [2, 3], "core": [4, 5]}, True),  # impossible: all, flagged
    (100.0, [CORE, B, Capacity("edge-a", "cpu", 0.1, idle=False)], {"edge-b": [0, 1]}, False),  # busy: skipped
    # dear per core but ten times faster: cheapest per row (0.5 x 0.1 < 0.1 x 1)
    (100.0, [A, Capacity("gpu-1", "gpu", 0.5)], {"gpu-1": [0, 1, 2, 3, 4, 5, 6, 7]}, False),
    (100.0, [], {}, False),                                                 # no live site: nothing to hand out
])
def test_cheapest_sites_first_and_more_only_for_the_deadline(
        deadline_in: float, sites: list[Capacity], want: dict[str, list[int]], late: bool) -> None:
    plan = assign([_job(deadline_in)], sites, {}, {}, NOW)
    assert _by_site(plan.chunks) == want
    assert (J in plan.late) is late
    assert all(a.since == a.at == NOW for a in plan.chunks.values())


def test_the_projection_counts_what_is_left_and_the_time_left() -> None:
    # the same job with 8 of its 10 chunks done and 20 s left: the cheap site alone finishes 2000 rows in time
    plan = assign([_job(20.0, first=8)], [CORE, B, A], {}, {}, NOW)
    assert _by_site(plan.chunks) == {"edge-a": [8, 9]} and plan.sites[J] == ("edge-a",)
    # all 10 left but only 12 s: every site
    assert assign([_job(12.0)], [CORE, B, A], {}, {}, NOW).sites[J] == ("edge-a", "edge-b", "core")


@pytest.mark.parametrize(("current", "running", "want_site", "want_since", "want_at"), [
    (Assigned("gone", NOW - 1, NOW - 1), {}, "edge-a", NOW, NOW),                     # its site left: reassigned
    (Assigned("edge-b", NOW - 1, NOW - 1), {}, "edge-b", NOW - 1, NOW - 1),           # standing: kept as it is
    (Assigned("edge-b", NOW - 5, NOW - RENEW_S - 1), {}, "edge-b", NOW - 5, NOW),     # renewed, same since
    (Assigned("edge-b", NOW - HOLD_S - 1, NOW - 1), {}, "edge-a", NOW, NOW),          # held, never taken: back
    (Assigned("edge-b", NOW - HOLD_S - 1, NOW - 1), {"edge-b": 1}, "edge-b", NOW - HOLD_S - 1, NOW - 1),  # busy
])
def test_standing_assignments(current: Assigned, running: dict[str, int], want_site: str, want_since: float,
                              want_at: float) -> None:
    plan = assign([_job(100.0, chunks=1)], [CORE, B, A], {(J, 0): current}, running, NOW)
    assert plan.chunks[(J, 0)] == Assigned(want_site, want_since, want_at)


def test_a_site_holds_a_few_chunks_not_the_job() -> None:
    # two running (any job) and none assigned: the cheap site gets nothing more this round
    assert assign([_job(100.0)], [A], {}, {"edge-a": 2}, NOW).chunks == {}
    # one running: one more
    assert _by_site(assign([_job(100.0)], [A], {}, {"edge-a": 1}, NOW).chunks) == {"edge-a": [0]}
    # standing assignments count too; chunks claimed or done are not in the plan (the planner deletes them)
    current = {(J, 0): Assigned("edge-a", NOW, NOW), (J, 7): Assigned("edge-a", NOW, NOW)}
    plan = assign([_job(100.0, first=1)], [A], current, {}, NOW)
    assert _by_site(plan.chunks) == {"edge-a": [1, 7]} and len(plan.chunks) == MIN_AHEAD
    # small chunks: enough to last until the next round, at most MAX_AHEAD
    small = assign([_job(100.0, chunks=50, rows=10)], [A], {}, {}, NOW)
    assert 2 < len(small.chunks) <= 8


def test_earliest_deadline_first() -> None:
    later, sooner = _job(200.0, job_id=J), _job(100.0, job_id=K)
    plan = assign([later, sooner], [A], {}, {}, NOW)
    assert {job for job, _ in plan.chunks} == {K}  # the cheap site's slots go to the job due first
    assert plan.sites == {J: ("edge-a",), K: ("edge-a",)}


def test_a_job_without_a_profile_goes_to_the_cheapest_idle_site() -> None:
    plan = assign([_job(100.0, meta=_meta({}))], [CORE, B, A], {}, {}, NOW)
    assert _by_site(plan.chunks) == {"edge-a": [0, 1]} and not plan.late


def test_the_estimate_spreads_over_the_idle_sites() -> None:
    one = estimate(10_000, 10, META, [A])
    three = estimate(10_000, 10, META, [CORE, B, A])
    assert one is not None and three is not None
    assert one.seconds == pytest.approx(SAFETY * (10_000 / (HARVEST * 1000) + 2.5))
    assert three.seconds == pytest.approx(SAFETY * (10_000 / (3 * HARVEST * 1000) + 2.5 / 3))
    assert three.site == "edge-a" and three.sites == ("edge-a", "edge-b", "core")
    assert three.cost == pytest.approx(one.cost)  # the least any plan costs: every row on the cheapest
    busy = estimate(10_000, 10, META, [A, Capacity("edge-b", "cpu", 0.2, idle=False)])
    assert busy is not None and busy.sites == ("edge-a",)  # a busy site is not counted on
    all_busy = estimate(10_000, 10, META, [Capacity("edge-a", "cpu", 0.1, idle=False)])
    assert all_busy is not None and all_busy.seconds == pytest.approx(one.seconds)  # ... unless all are


@pytest.mark.parametrize(("within_s", "sites", "over"), [
    (100.0, ("edge-a",), False),
    (20.0, ("edge-a", "edge-b"), False),
    (12.0, ("edge-a", "edge-b", "core"), False),
    (5.0, ("edge-a", "edge-b", "core"), True),
])
def test_the_cheapest_plan_meeting_a_deadline(within_s: float, sites: tuple[str, ...], over: bool) -> None:
    plan = cheapest_plan(10_000, 10, META, [CORE, B, A], within_s)
    alone = estimate(10_000, 10, META, [A])
    assert plan is not None and alone is not None and plan.sites == sites and (plan.seconds > within_s) is over
    if len(sites) == 1:
        assert plan.cost == pytest.approx(alone.cost)
    else:  # dearer sites' shares cost more
        assert plan.cost > alone.cost
    assert cheapest_plan(10, 1, _meta({}), [A], 100.0) is None


FRESH, STALE = Assigned("edge-b", NOW - 1, NOW - 1), Assigned("edge-b", NOW - 60, NOW - ASSIGN_GRACE_S - 1)


@pytest.mark.parametrize(("me", "assigned", "age", "want"), [
    ("edge-b", {3: FRESH}, 0.0, 3),                    # assigned to me: mine first, cheapest or not
    ("edge-a", {3: FRESH}, 0.0, None),                 # the leader leads the job and gave me nothing
    ("edge-a", {3: STALE}, 0.0, 1),                    # its assignments stale (leader dead): the local rule
    ("edge-b", {}, 0.0, None),                         # no leader yet: only the cheapest claims ...
    ("edge-a", {}, 0.0, 1),
    ("edge-b", {}, CLAIM_GRACE_S, 1),                  # ... and any idle site after the grace
    ("edge-b", {7: STALE}, 0.0, None),                 # a stale assignment to a chunk not queued: local rule
])
def test_which_chunk_a_site_claims(me: str, assigned: dict[int, Assigned], age: float, want: int | None) -> None:
    assert claim_choice(me, [1, 3, 5], assigned, [A, B], NOW, age) == want


def _kv(key: str, value: Any) -> KV:
    return KV(key, value, 5, 5, 0)


GOOD = {"schema": 1, "site": "edge-a", "since": NOW - 2, "at": NOW, "leader": 7}


@pytest.mark.parametrize(("key", "value", "ok"), [
    (assign_key(J, 3), GOOD, True),
    (assign_key(J, 3), {**GOOD, "since": NOW + 5}, True),          # since after at: clamped, still readable
    (assign_key(J) + "3", GOOD, False),                            # not a chunk's key
    (assign_key(J, 3), [1, 2], False),
    (assign_key(J, 3), {**GOOD, "schema": 2}, False),
    (assign_key(J, 3), {**GOOD, "site": "../x"}, False),
    (assign_key(J, 3), {**GOOD, "site": "a" * 200}, False),
    (assign_key(J, 3), {**GOOD, "at": True}, False),
    (assign_key(J, 3), {**GOOD, "at": 1e400}, False),
    (assign_key(J, 3), {**GOOD, "since": "yesterday"}, False),
    (assign_key(J, 3), {**GOOD, "at": -1}, False),
])
def test_assignments_are_read_as_hostile(key: str, value: Any, ok: bool) -> None:
    if ok:
        idx, a = decode_assignment(J, _kv(key, value))
        assert idx == 3 and a.site == "edge-a" and a.at == NOW and a.since <= a.at
    else:
        with pytest.raises(ProtocolError):
            decode_assignment(J, _kv(key, value))
    with pytest.raises(ValueError):
        assign_key(J, -1)
