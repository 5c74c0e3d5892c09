"""Pure parts of following and resubmitting jobs (issue 32): the resubmission fingerprint, the long poll's
parameters, the follower limits, the dedup index key, and the console's per-tenant summary."""

from __future__ import annotations

from typing import cast

import pytest

from console.jobs import MAX_JOBS, summary
from core_scheduler.state.jobs import JobView, SeenChunk
from edge_agent.job_follow import MAX_WAIT_S, JobFollow, since_of, wait_s_of
from mesh.errors import QuotaExceeded, RequestError
from mesh.etcd.keys import job_dedup_key, job_prefix
from mesh.etcd.store import Store
from mesh.jobspec import ChunkRecord, JobRecord, dedup_fingerprint

pytestmark = pytest.mark.unit
BASE = ("t", "npz", 0.9, "v1", "a" * 64)


def test_the_fingerprint_is_the_work_not_the_schedule() -> None:
    fp = dedup_fingerprint(*BASE)
    assert fp == dedup_fingerprint(*BASE) and len(fp) == 32
    for i, other in enumerate(("u", "jsonl", 0.9000001, "v2", "b" * 64)):
        changed = list(BASE)
        changed[i] = other
        assert dedup_fingerprint(*changed) != fp, other  # type: ignore[arg-type]
    job = JobRecord(job_id="0" * 32, task="t", tenant="acme", min_accuracy=0.9, deadline=1.0, input_digest="a" * 64,
                    rows=5, input_format="npz", chunk_rows=2, variant="v1")
    later = JobRecord(job_id="1" * 32, task="t", tenant="acme", min_accuracy=0.9, deadline=9e9, input_digest="a" * 64,
                      rows=5, input_format="npz", chunk_rows=5, variant="v1", max_cost=1.0)
    assert job.fingerprint == later.fingerprint == fp  # deadline, chunking and cost ceiling are not the work


def test_keys() -> None:
    assert job_prefix("a" * 32) == f"jobs/{'a' * 32}/"
    assert job_dedup_key("acme", "f" * 32) == f"jobs/dedup/acme/{'f' * 32}"
    with pytest.raises(ValueError):
        job_dedup_key("ac/me", "f" * 32)


@pytest.mark.parametrize(("raw", "want"), [("0", 0.0), ("2.5", 2.5), ("60", MAX_WAIT_S)])
def test_wait_parses(raw: str, want: float) -> None:
    assert wait_s_of(raw) == want


@pytest.mark.parametrize("raw", ["-1", "61", "inf", "nan", "", "1e400", "soon"])
def test_wait_refuses(raw: str) -> None:
    with pytest.raises(RequestError, match="wait"):
        wait_s_of(raw)


def test_since() -> None:
    assert since_of(None) is None and since_of("0") == 0 and since_of("12345") == 12345
    for raw in ("-1", "1.5", "", "x", "9" * 20, "١٢"):
        with pytest.raises(RequestError, match="since"):
            since_of(raw)


async def test_followers_are_bounded_per_tenant_and_in_all() -> None:
    follow = JobFollow(cast(Store, None), per_tenant=2, total=3)
    with follow._slot("acme"), follow._slot("acme"):
        with pytest.raises(QuotaExceeded, match="at most 2 per tenant"), follow._slot("acme"):
            pass
        with follow._slot("globex"):
            with pytest.raises(QuotaExceeded, match="3 in all"), follow._slot("initech"):
                pass
            assert follow.open == {"acme": 2, "globex": 1}
    assert follow.open == {} and follow.followers == 0
    await follow.close()
    with pytest.raises(QuotaExceeded, match="stopping"), follow._slot("acme"):
        pass


def _view(tenant: str, state: str, created: float, done: int, claims: dict[int, str]) -> JobView:
    job = JobRecord(job_id=f"{int(created):032x}", task="t", tenant=tenant, min_accuracy=0.5, deadline=100.0,
                    input_digest="a" * 64, rows=10, input_format="npz", chunk_rows=4, state=state,  # type: ignore[arg-type]
                    created=created)
    chunks = []
    for i, (a, b) in enumerate(job.chunks):
        c = ChunkRecord(i, a, b, "done", "edge-a", "c" * 64, "v") if i < done else ChunkRecord(i, a, b)
        chunks.append(SeenChunk(c, 1, claims.get(i)))
    return JobView(job, 1, tuple(chunks))


def test_the_console_summary() -> None:
    views = [_view("acme", "running", 2, 1, {1: "mid", 2: "mid"}), _view("acme", "queued", 3, 0, {}),
             _view("globex", "done", 1, 3, {})]
    out = summary(views, ["acme", "globex", "initech"], now=50.0)
    acme, globex, initech = out["tenants"]
    assert acme["counts"] == {"queued": 1, "running": 1, "done": 0, "failed": 0, "cancelled": 0}
    assert [j["created"] for j in acme["jobs"]] == [3, 2] and acme["rows_done"] == 4
    running = acme["jobs"][1]
    assert running["working"] == {"mid": 2} and running["ran"] == {"edge-a": 1} and not running["late"]
    assert globex["jobs"][0]["progress"] == 1.0 and initech == {
        "tenant": "initech", "counts": dict.fromkeys(("queued", "running", "done", "failed", "cancelled"), 0),
        "rows": 0, "rows_done": 0, "jobs": []}
    assert summary(views, [], now=500.0)["tenants"][0]["jobs"][0]["late"]  # past its deadline and not finished
    many = [_view("acme", "done", i, 3, {}) for i in range(1, MAX_JOBS + 6)]
    big = summary(many, [], now=0.0)["tenants"][0]
    assert len(big["jobs"]) == MAX_JOBS and big["counts"]["done"] == MAX_JOBS + 5
