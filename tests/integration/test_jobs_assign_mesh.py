"""Leader-driven chunk assignment on real parts (the session etcd, a variant store, two agents serving the committed
tiny MLP, a real scheduler leading by etcd election): the leader hands chunks to the cheap site first and to the
dear one only when the job's deadline needs it; sites claim what is assigned to them; when the assigned site stops,
its chunks are handed to the other, which finishes the job with every row answered once. A deposed leader's plan
never lands, and junk under a job's assignments is read as absent.

The local claim rule's grace (``CLAIM_GRACE_S``: after it, any idle site may claim by itself) is pushed out of
reach here, so a chunk the dear site runs is one the leader assigned to it."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest

import core_scheduler.policy.jobs as policy
from core_scheduler.job_planner import plan_jobs_once
from core_scheduler.policy.jobs import Assigned
from core_scheduler.scheduler import Scheduler, SchedulerConfig
from core_scheduler.state.job_assign import JobAssignments
from core_scheduler.state.jobs import JobBook, JobView
from core_scheduler.state.view import MeshView
from mesh.etcd.election import Election
from mesh.etcd.keys import assign_key
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from mesh.jobs import AsyncJobs
from mesh.jobspec import JobRecord
from tests.integration.test_jobs_e2e import CHEAP, DEAR, TASK, VID, Mesh, _mesh, _rows
from variant_store.catalog import Catalog
from variant_store.meta import LatencyStats

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ROW_MS = 2.0  # the profile the catalog is given: 2 ms a row (the runtime is far faster: chunks finish in ms)
T = TypeVar("T")


async def _eventually(probe: Callable[[], Awaitable[T | None]], within_s: float, what: str) -> T:
    for _ in range(int(within_s / 0.05)):  # bounded
        got = await probe()
        if got is not None and got is not False:
            return got
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {within_s} s: {what}")


async def _slow_profile(mesh: Mesh, sched: Scheduler) -> None:
    """Give the variant a per-row cost that makes deadlines of seconds matter, and wait until every view has it."""
    cat = Catalog(mesh.store)
    meta = next(m for m in await cat.list_variants(TASK) if m.variant_id == VID)
    for p in meta.profiles.values():
        p.latency = {1: LatencyStats(ROW_MS, ROW_MS), 8: LatencyStats(8 * ROW_MS, 8 * ROW_MS)}
    await cat.put_variant(meta)
    views = [sched.view, *(a.view for a in mesh.agents.values() if a.view is not None)]

    async def seen() -> bool:
        return all(policy.row_ms(v.variants[TASK][VID]) == pytest.approx(ROW_MS) for v in views
                   if TASK in v.variants and VID in v.variants[TASK]) and all(
                       {CHEAP, DEAR} <= set(v.live) for v in views)

    await _eventually(seen, 30, "the slow profile and both sites in every view")


def _by_site(v: JobView) -> dict[str, int]:
    return {s: sum(c.chunk.rows for c in v.chunks if c.chunk.site == s) for s in (CHEAP, DEAR)}


async def test_the_dear_site_works_only_when_the_deadline_needs_it(
        store: Store, etcd_server: EmbeddedEtcd, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(policy, "CLAIM_GRACE_S", 1e6)
    x, _, want, accuracy = _rows(7)  # 3633 rows
    async with _mesh(store, etcd_server, tmp_path, accuracy) as mesh, \
            Scheduler(store, SchedulerConfig(candidate_id="s1", interval_s=0.3, proactive=False)) as sched, \
            AsyncJobs(mesh.agents[DEAR].http_url, tenant="acme") as jobs:
        await _slow_profile(mesh, sched)
        await _eventually(lambda: asyncio.sleep(0, sched.is_leader), 30, "a leader")
        # 29 chunks at 2 ms a row: one site projects ~34 s, both ~17 s. A deadline of 25 s needs both
        tight = await jobs.submit(TASK, x, chunk_rows=128, deadline_s=25)
        assert tight.admitted["estimate_s"] < 25  # admission counts both sites too
        status = await tight.wait(poll_s=0.1, timeout=120)
        assert status["state"] == "done"
        np.testing.assert_allclose((await tight.result())["logits"], want, rtol=1e-4, atol=1e-4)
        v = await JobBook(store).view(tight.id)
        assert v is not None and v.chunks[0].chunk.site == CHEAP  # the cheap site is handed the first chunks
        by = _by_site(v)
        assert by[CHEAP] > 0 and by[DEAR] > 0 and by[CHEAP] + by[DEAR] == len(x), by
        # a day to spare: the cheap site alone, however long it takes
        dear = mesh.agents[DEAR].chunks
        assert dear is not None
        before = dear.chunks_done
        easy = await jobs.submit(TASK, x[:1500], chunk_rows=64, deadline_s=86_400)
        assert (await easy.wait(poll_s=0.1, timeout=120))["state"] == "done"
        v = await JobBook(store).view(easy.id)
        assert v is not None and _by_site(v) == {CHEAP: 1500, DEAR: 0} and dear.chunks_done == before
        assert sched.is_leader and sched.refused == 0


async def test_the_chunks_of_a_site_that_stops_are_handed_to_another(
        store: Store, etcd_server: EmbeddedEtcd, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(policy, "CLAIM_GRACE_S", 1e6)
    x, _, want, accuracy = _rows(3)  # 1557 rows
    async with _mesh(store, etcd_server, tmp_path, accuracy) as mesh, \
            Scheduler(store, SchedulerConfig(candidate_id="s1", interval_s=0.3, proactive=False)) as sched, \
            AsyncJobs(mesh.agents[DEAR].http_url, tenant="acme") as jobs:
        await _slow_profile(mesh, sched)
        cheap, dear = mesh.agents[CHEAP].chunks, mesh.agents[DEAR].chunks
        assert cheap is not None and dear is not None
        job = await jobs.submit(TASK, x, chunk_rows=32, deadline_s=86_400)
        await _eventually(lambda: asyncio.sleep(0, cheap.chunks_done >= 3), 60, "the cheap site at work")
        assigned = await JobAssignments(store).read(job.id)
        assert assigned and {a.site for a in assigned.values()} == {CHEAP} and dear.chunks_done == 0
        await mesh.agents[CHEAP].stop()  # its claim goes with its lease, its heartbeat with its liveness

        async def handed_over() -> bool:
            now = await JobAssignments(store).read(job.id)
            return bool(now) and {a.site for a in now.values()} == {DEAR}

        await _eventually(handed_over, 30, "the stopped site's chunks assigned to the other")
        status = await job.wait(poll_s=0.1, timeout=120)
        assert status["state"] == "done"
        np.testing.assert_allclose((await job.result())["logits"], want, rtol=1e-4, atol=1e-4)
        v = await JobBook(store).view(job.id)
        assert v is not None
        by = _by_site(v)
        assert by[CHEAP] > 0 and by[DEAR] > 0 and by[CHEAP] + by[DEAR] == len(x), by


async def test_a_deposed_leader_plans_nothing_and_junk_reads_as_absent(store: Store) -> None:
    now = time.time()
    job = JobRecord(job_id=uuid.uuid4().hex, task=TASK, tenant="acme", min_accuracy=0.5, deadline=now + 600,
                    input_digest="a" * 64, rows=10, input_format="npz", chunk_rows=4, created=now, updated=now)
    await JobBook(store).create(job)
    book = JobAssignments(store)
    await book.write({(job.job_id, 2): Assigned("gone", now, now)}, [], [], 0)  # to a site that is not live
    await store.put(assign_key(job.job_id, 0), {"schema": 1, "site": "../etc", "since": now, "at": now})
    await store.put(assign_key(job.job_id, 1), "junk")
    assert await book.read(job.job_id) == {2: Assigned("gone", now, now)}
    election = Election(store, "scheduler", "old", ttl=5.0)
    await election.campaign()
    try:
        async with MeshView(store, "test") as view:
            token = election.leader_revision
            election.leader_revision = token - 1  # the token of a leader whose term has ended
            assert await plan_jobs_once(store, view, election) == 0 and election.lost.is_set()
            assert len(await store.get_prefix(assign_key(job.job_id))) == 3  # nothing written, nothing removed
            election.leader_revision = token  # the leader now: the dead site's assignment goes
            assert await plan_jobs_once(store, view, election) == 1
            assert await book.read(job.job_id) == {}
    finally:
        await election.resign()
