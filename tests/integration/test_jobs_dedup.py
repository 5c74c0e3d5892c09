"""Resubmitting a job's input (issue 32): the same input, task and ``min_accuracy`` as a queued, running or done job
of the tenant is answered with that job (200, ``"deduplicated": true``) and runs nothing again, unless the caller
asks for a fresh run; a failed or cancelled job, another tenant's, or a tampered index entry is never reused.
On a real etcd, and end to end through two agents in process (the mesh of ``test_jobs_e2e``)."""

from __future__ import annotations

import asyncio
import io
import json
import time
import uuid
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from core_scheduler.state.jobs import JobBook
from mesh.errors import ConflictError
from mesh.etcd.keys import job_dedup_key, job_prefix
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from mesh.jobs import AsyncJobs, Jobs
from mesh.jobspec import JobRecord, dedup_fingerprint
from mesh.v2.body import TENANT_HEADER
from tests.integration.test_jobs_e2e import CHEAP, DEAR, TASK, _mesh, _rows
from tiermesh.cli.main import main as cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _job(tenant: str = "acme", digest: str = "a" * 64) -> JobRecord:
    now = time.time()
    return JobRecord(job_id=uuid.uuid4().hex, task="t", tenant=tenant, min_accuracy=0.5, deadline=now + 600,
                     input_digest=digest, rows=10, input_format="npz", chunk_rows=4, variant="v", created=now,
                     updated=now)


async def test_the_index_names_a_live_or_done_job_and_nothing_else(store: Store) -> None:
    book = JobBook(store)
    job = _job()
    fp = dedup_fingerprint("t", "npz", 0.5, "v", "a" * 64)
    assert fp == job.fingerprint and await book.duplicate_of("acme", fp) == (None, 0)
    await book.create(job, index_seen=0)
    found, seen = await book.duplicate_of("acme", fp)
    assert found is not None and found.job_id == job.job_id and seen > 0
    assert (await book.duplicate_of("globex", fp))[0] is None  # the index is per tenant
    assert (await book.duplicate_of("acme", dedup_fingerprint("t", "npz", 0.6, "v", "a" * 64)))[0] is None
    # a hostile site points globex's entry at acme's job: the job's own record says it is not globex's
    await store.put(job_dedup_key("globex", fp), {"schema": 1, "job": job.job_id})
    assert (await book.duplicate_of("globex", fp))[0] is None
    for junk in ([1], {"schema": 1, "job": "../x"}, {"schema": 2, "job": job.job_id}, "x" * 10):
        await store.put(job_dedup_key("acme", fp), junk)
        assert (await book.duplicate_of("acme", fp))[0] is None, junk
    await store.put(job_dedup_key("acme", fp), {"schema": 1, "job": job.job_id})
    # a cancelled job is run afresh; the fresh one is what the index names from then on
    await book.set_state(job.job_id, "cancelled")
    gone, seen = await book.duplicate_of("acme", fp)
    assert gone is None
    again = _job()
    await book.create(again, index_seen=seen)
    found, _ = await book.duplicate_of("acme", fp)
    assert found is not None and found.job_id == again.job_id
    assert [v.job.job_id for v in await book.views("acme")] == [again.job_id, job.job_id]  # dedup keys skipped


async def test_two_identical_submissions_at_once_make_one_job(store: Store) -> None:
    book = JobBook(store)
    first, second = _job(), _job()
    assert await book.duplicate_of("acme", first.fingerprint) == (None, 0)  # both doors see no such job...
    await book.create(first, index_seen=0)
    with pytest.raises(ConflictError, match="identical job") as lost:  # ...and the second to write loses
        await book.create(second, index_seen=0)
    assert lost.value.details["key"] == job_dedup_key("acme", first.fingerprint)
    assert await store.get_prefix(job_prefix(second.job_id)) == []  # not even its chunks are left behind
    found, _ = await book.duplicate_of("acme", first.fingerprint)
    assert found is not None and found.job_id == first.job_id
    with pytest.raises(ConflictError, match="already has chunks"):  # a job is written once
        await book.create(first)


async def test_a_resubmitted_input_costs_no_chunk_runs(
        store: Store, etcd_server: EmbeddedEtcd, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    x, _, want, accuracy = _rows(1)
    async with _mesh(store, etcd_server, tmp_path, accuracy) as mesh, \
            AsyncJobs(mesh.agents[CHEAP].http_url, tenant="acme") as jobs:
        def ran() -> int:
            return sum(a.chunks.chunks_done for a in mesh.agents.values() if a.chunks is not None)

        first = await jobs.submit(TASK, x, min_accuracy=0.9, chunk_rows=128, deadline_s=600)
        assert not first.deduplicated
        assert (await first.wait(timeout=60))["state"] == "done"  # long polls through the real door
        chunks = ran()
        assert chunks == 5

        # the same rows again, at the other door, with another deadline and chunking: the same job, nothing run
        async with AsyncJobs(mesh.agents[DEAR].http_url, tenant="acme") as other:
            again = await other.submit(TASK, x, min_accuracy=0.9, chunk_rows=64, deadline_s=900)
            assert again.deduplicated and again.id == first.id and again.admitted["state"] == "done"
            np.testing.assert_allclose((await again.result())["logits"], want, rtol=1e-4, atol=1e-4)
        async with aiohttp.ClientSession() as http:
            buf = io.BytesIO()
            np.savez(buf, x=x)
            url = f"{mesh.agents[CHEAP].http_url}/v2/models/{TASK}/jobs"
            async with http.post(url, params={"min_accuracy": "0.9"}, data=buf.getvalue(),
                                 headers={TENANT_HEADER: "acme"}) as r:
                assert r.status == 200 and (await r.json())["deduplicated"] is True
            async with http.post(url, params={"fresh": "maybe"}, data=buf.getvalue(),
                                 headers={TENANT_HEADER: "acme"}) as r:
                assert r.status == 400 and "fresh" in (await r.json())["error"]
            # a finished job's event stream: its one status, and the end
            async with http.get(f"{url}/{first.id}/events", headers={TENANT_HEADER: "acme"}) as r:
                text = (await r.read()).decode()
                assert r.status == 200 and text.count("event: job") == 1 and '"state": "done"' in text
        # another tenant's same input is its own job
        async with AsyncJobs(mesh.agents[CHEAP].http_url, tenant="public") as theirs:
            own = await theirs.submit(TASK, x[:2], min_accuracy=0.9, deadline_s=600)
            mine = await jobs.submit(TASK, x[:2], min_accuracy=0.9, deadline_s=600)
            assert not own.deduplicated and not mine.deduplicated and own.id != mine.id
            assert (await own.wait(timeout=30))["state"] == (await mine.wait(timeout=30))["state"] == "done"
        # the same input twice at once: one job, whichever door's write comes second answers with the first's
        a, b = await asyncio.gather(jobs.submit(TASK, x[5:9], min_accuracy=0.9, deadline_s=600),
                                    jobs.submit(TASK, x[5:9], min_accuracy=0.9, deadline_s=600))
        assert a.id == b.id and a.deduplicated != b.deduplicated
        assert (await a.wait(timeout=30))["state"] == "done"
        assert len(await JobBook(store).list("acme")) == 3  # the resubmissions created no record: nothing to run

        # a fresh run when asked, from the SDK and from the command line
        fresh = await jobs.submit(TASK, x, min_accuracy=0.9, chunk_rows=128, deadline_s=600, fresh=True)
        assert not fresh.deduplicated and fresh.id != first.id
        rows = tmp_path / "rows.npz"
        np.savez(rows, x=x)
        url = mesh.agents[CHEAP].http_url
        capsys.readouterr()
        assert await asyncio.to_thread(cli, ["jobs", "show", "--edge", url, "--tenant", "acme", TASK, fresh.id,
                                             "--follow"]) == 0
        out = capsys.readouterr().out
        shown = json.loads(out[out.index("{\n"):])  # after the progress bar, when rich draws one
        assert shown["state"] == "done" and shown["rows_done"] == len(x)
        assert ran() == chunks + 5 + 1 + 1 + 1  # the fresh run's 5 chunks, the two 2-row jobs, the 4-row one
        assert await asyncio.to_thread(cli, ["jobs", "submit", "--edge", url, "--tenant", "acme", TASK, str(rows),
                                             "--min-accuracy", "0.9"]) == 0
        printed = json.loads(capsys.readouterr().out)
        assert printed["deduplicated"] is True and printed["id"] == fresh.id  # the newest identical job

        def sync_resubmit() -> tuple[bool, str]:
            with Jobs(url, tenant="acme") as sync:
                job = sync.submit(TASK, x, min_accuracy=0.9, deadline_s=600)
                return job.deduplicated, job.id

        assert await asyncio.to_thread(sync_resubmit) == (True, fresh.id)
        assert ran() == chunks + 8
