"""The console's jobs view (issue 32 item 5): each tenant's offline jobs, by state, with their progress and the sites
doing the work, read from etcd (``core_scheduler.state.jobs.JobBook.views``) when the page asks:

    GET /api/jobs[?tenant=NAME]
    {"tenants": [{"tenant": "acme", "counts": {"queued": 1, "running": 1, "done": 3, "failed": 0, "cancelled": 0},
                  "rows": 12000, "rows_done": 9000,
                  "jobs": [{"id", "task", "state", "variant", "rows", "rows_done", "chunks", "chunks_done",
                            "progress", "working": {"edge-a": 1}, "ran": {"edge-a": 12, "mid": 3},
                            "created", "updated", "deadline", "late", "error"}, ...]}, ...],
     "at": <epoch seconds>}

``working``: the sites holding a chunk claim now (how many chunks each), ``ran``: the sites that committed chunks.
Every tenant of the topology is listed (with zero counts when it has no job), and any other tenant a job names.
A tenant's list holds its newest ``MAX_JOBS`` jobs; the counts and row totals cover all of them. The read is one
range read of ``jobs/`` per request (the page asks only while its jobs tab is open).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

from core_scheduler.state.jobs import JobView
from mesh.jobspec import JOB_STATES

__all__ = ["MAX_JOBS", "summary"]

MAX_JOBS = 100


def _job(v: JobView, now: float) -> dict[str, Any]:
    j = v.job
    working = Counter(c.claimed_by for c in v.chunks if c.claimed_by and c.chunk.state == "queued")
    ran = Counter(c.chunk.site for c in v.chunks if c.chunk.state == "done" and c.chunk.site)
    return {"id": j.job_id, "task": j.task, "state": j.state, "variant": j.variant, "rows": j.rows,
            "rows_done": v.rows_done, "chunks": len(v.chunks), "chunks_done": v.chunks_done,
            "progress": v.rows_done / j.rows if j.rows else 0.0, "working": dict(sorted(working.items())),
            "ran": dict(sorted(ran.items())), "created": j.created, "updated": j.updated, "deadline": j.deadline,
            "late": not j.terminal and now > j.deadline, "error": j.error}


def summary(views: Iterable[JobView], tenants: Iterable[str], now: float | None = None) -> dict[str, Any]:
    """Per-tenant counts and jobs (newest first) of ``views``; pure."""
    now = time.time() if now is None else now
    by_tenant: dict[str, list[JobView]] = {t: [] for t in tenants}
    for v in views:
        by_tenant.setdefault(v.job.tenant, []).append(v)
    out = []
    for tenant in sorted(by_tenant):
        vs = sorted(by_tenant[tenant], key=lambda v: -v.job.created)
        counts: Counter[str] = Counter(v.job.state for v in vs)
        out.append({"tenant": tenant, "counts": {s: counts.get(s, 0) for s in JOB_STATES},
                    "rows": sum(v.job.rows for v in vs), "rows_done": sum(v.rows_done for v in vs),
                    "jobs": [_job(v, now) for v in vs[:MAX_JOBS]]})
    return {"tenants": out, "at": now}
