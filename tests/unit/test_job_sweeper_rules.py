"""The job sweeper's pure rules (``core_scheduler.job_sweeper``) as tables: which jobs are late, what a late job
becomes, which finished jobs are past retention, and which of their data may go."""

from __future__ import annotations

import pytest

from core_scheduler.job_sweeper import closing, deadline_error, expired, late, removable, sharing
from core_scheduler.state.jobs import JobView, SeenChunk
from mesh.jobspec import ChunkRecord, JobRecord

pytestmark = pytest.mark.unit

T0 = 1_800_000_000.0  # 2027-01-15T08:00:00Z


def _job(n: int, state: str = "running", *, deadline: float = T0, updated: float = T0, tenant: str = "acme",
         digest: str = "a") -> JobRecord:
    return JobRecord(job_id=f"{n:032x}", task="t", tenant=tenant, min_accuracy=0.5, deadline=deadline,
                     input_digest=digest * 64, rows=10, input_format="npz", chunk_rows=4,
                     state=state, created=T0 - 100 + n, updated=updated)  # type: ignore[arg-type]


@pytest.mark.parametrize(("state", "deadline", "now", "grace", "is_late"), [
    ("queued", T0, T0 + 31, 30.0, True),
    ("running", T0, T0 + 31, 30.0, True),
    ("running", T0, T0 + 30, 30.0, False),       # within the grace: a committing chunk may still land
    ("running", T0, T0 - 5, 0.0, False),         # before its deadline
    ("running", T0, T0 + 0.5, 0.0, True),
    ("done", T0, T0 + 3600, 30.0, False),        # finished: stays what it is
    ("failed", T0, T0 + 3600, 30.0, False),
    ("cancelled", T0, T0 + 3600, 30.0, False),
])
def test_late(state: str, deadline: float, now: float, grace: float, is_late: bool) -> None:
    assert [r.job_id for r in late([_job(1, state, deadline=deadline)], now, grace)] == \
        ([_job(1).job_id] if is_late else [])


def test_late_orders_by_deadline() -> None:
    jobs = [_job(1, deadline=T0 + 5), _job(2, deadline=T0 - 50), _job(3, deadline=T0)]
    assert [r.job_id[-1] for r in late(jobs, T0 + 100, 0.0)] == ["2", "3", "1"]


def _view(done: tuple[bool, bool, bool]) -> JobView:
    job = _job(1)  # 10 rows in chunks of 4: 4, 4, 2
    chunks = tuple(SeenChunk(ChunkRecord(i, a, b, "done" if d else "queued", "edge-1" if d else None,
                                         "c" * 64 if d else None), 5, None)
                   for i, ((a, b), d) in enumerate(zip(job.chunks, done, strict=True)))
    return JobView(job, 3, chunks)


@pytest.mark.parametrize(("done", "state", "rows"), [
    ((False, False, False), "failed", 0),
    ((True, False, False), "failed", 4),
    ((True, False, True), "failed", 6),
    ((True, True, True), "done", 10),  # its last commit beat the sweep: done, not failed
])
def test_closing(done: tuple[bool, bool, bool], state: str, rows: int) -> None:
    got_state, error = closing(_view(done))
    assert got_state == state
    if state == "failed":
        assert error == f"deadline passed at 2027-01-15T08:00:00Z: {rows} of 10 rows done"
    else:
        assert error == ""


def test_deadline_error_names_the_time_and_the_progress() -> None:
    assert deadline_error(_job(1, deadline=T0 + 61), 61440) == \
        "deadline passed at 2027-01-15T08:01:01Z: 61440 of 10 rows done"


@pytest.mark.parametrize(("state", "age", "retention", "gone"), [
    ("done", 100.0, 100.0, True),
    ("failed", 101.0, 100.0, True),
    ("cancelled", 5000.0, 100.0, True),
    ("done", 99.0, 100.0, False),      # not old enough
    ("running", 5000.0, 100.0, False),  # live: never removed, however old
    ("queued", 5000.0, 100.0, False),
])
def test_expired(state: str, age: float, retention: float, gone: bool) -> None:
    assert bool(expired([_job(1, state, updated=T0)], T0 + age, retention)) is gone


def test_expired_oldest_first() -> None:
    jobs = [_job(1, "done", updated=T0 - 10), _job(2, "done", updated=T0 - 30), _job(3, "done", updated=T0 - 20)]
    assert [r.job_id[-1] for r in expired(jobs, T0, 5)] == ["2", "3", "1"]


def test_sharing_is_same_tenant_and_input() -> None:
    gone = [_job(1, "done", digest="a")]
    kept = [_job(2, digest="a"), _job(3, digest="b"), _job(4, digest="a", tenant="globex")]
    assert [r.job_id[-1] for r in sharing(gone, kept)] == ["2"]


A, B, C, O1, O2 = "a" * 64, "b" * 64, "c" * 64, "1" * 64, "2" * 64


@pytest.mark.parametrize(("gone", "kept", "kept_outputs", "delete", "keep"), [
    # nothing shared: everything goes
    ({"j1": ("acme", [A, O1, O2])}, [], [], [("acme", A), ("acme", O1), ("acme", O2)], []),
    # a kept job of the tenant has the same input: the input stays, the outputs go
    ({"j1": ("acme", [A, O1])}, [_job(2, digest="a")], [], [("acme", O1)], [("acme", A)]),
    # ... and one of the same outputs (the same rows through the same variant)
    ({"j1": ("acme", [A, O1, O2])}, [_job(2, digest="a")], [("acme", O1)], [("acme", O2)],
     [("acme", A), ("acme", O1)]),
    # another tenant's job with the same digest shares nothing: data is private to a tenant
    ({"j1": ("acme", [A])}, [_job(2, digest="a", tenant="globex")], [], [("acme", A)], []),
    # two removed jobs naming one object: deleted once
    ({"j1": ("acme", [A, O1]), "j2": ("acme", [A, O2])}, [], [], [("acme", A), ("acme", O1), ("acme", O2)], []),
    # nothing to remove
    ({}, [_job(2)], [], [], []),
])
def test_removable(gone: dict[str, tuple[str, list[str]]], kept: list[JobRecord], kept_outputs: list[tuple[str, str]],
                   delete: list[tuple[str, str]], keep: list[tuple[str, str]]) -> None:
    assert removable(gone, kept, kept_outputs) == (sorted(delete), sorted(keep))
