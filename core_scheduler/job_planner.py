"""The scheduler leader's offline-job round: hand live jobs' chunks to sites, cheapest first under each job's
deadline (``core_scheduler.policy.jobs.assign``), and keep those assignments in etcd
(``core_scheduler.state.job_assign``).

Each round reads the live jobs with their chunks and assignments, plans, and writes only what changed: new
assignments, renewals of standing ones (every ``RENEW_S``, so sites can tell a leader that leads from one that
died), and removals (a chunk claimed or done, a site that left or held a chunk without taking it). Each
assignment names the job's tenant, task and variant: while it stands (and a grace after) the variant store lets
its site fetch that variant, private or not (``variant_store.job_grants``), so a chunk can run where placement put
none of the tenant's variants. Every write is
fenced by the leader's election key: a deposed leader's round changes nothing, and says so by setting
``election.lost``. Sites act on assignments (``edge_agent.chunks``); should the leader die, its assignments go
stale within ``ASSIGN_GRACE_S`` and sites fall back to claiming by the local rule.

Not done here: the assignments of a job that turned terminal stay until retention removes the job's keys
(``JobBook.remove``); sites skip terminal jobs, so they are inert meanwhile.
"""

from __future__ import annotations

import time

from core_scheduler.policy.jobs import Assigned, JobWork, assign, capacities, job_variant
from core_scheduler.state.job_assign import JobAssignments
from core_scheduler.state.jobs import JobBook, JobView
from core_scheduler.state.view import MeshView
from mesh.errors import ProtocolError
from mesh.etcd.election import Election
from mesh.etcd.ops import Compare, CreateRevision
from mesh.etcd.store import Store
from mesh.log import get_logger, kv
from variant_store.job_grants import Granted

__all__ = ["plan_jobs_once"]

log = get_logger(__name__)


def _work(v: JobView, view: MeshView) -> JobWork:
    job = v.job
    meta = job_variant((view.variants.get(job.task) or {}).values(), job.tenant, job.variant, job.min_accuracy)
    left = [c for c in v.chunks if c.chunk.state != "done"]
    queued = tuple((c.chunk.index, c.chunk.rows) for c in left if c.chunk.state == "queued" and c.claimed_by is None)
    return JobWork(job.job_id, job.deadline, meta, queued, sum(c.chunk.rows for c in left), len(left))


async def plan_jobs_once(store: Store, view: MeshView, election: Election, *, now: float | None = None) -> int:
    """One assignment round as the leader of ``election``; returns how many assignment keys it put or removed (0
    also when etcd refused the write: then ``election.lost`` is set)."""
    if election.key is None or not election.is_leader:
        return 0
    book, book_of = JobBook(store), JobAssignments(store)
    works: list[JobWork] = []
    variants: dict[str, Granted] = {}  # job -> what its assignments let their sites fetch (variant_store.job_grants)
    current: dict[tuple[str, int], Assigned] = {}
    running: dict[str, int] = {}
    for rec in await book.list():
        if rec.terminal:
            continue
        try:
            v = await book.view(rec.job_id)
        except ProtocolError as exc:
            log.warning("job %s unreadable: %s", rec.job_id, exc, extra=kv(event="job_unreadable", job=rec.job_id))
            continue
        if v is None or v.job.terminal:
            continue
        for c in v.chunks:
            if c.claimed_by is not None and c.chunk.state == "queued":
                running[c.claimed_by] = running.get(c.claimed_by, 0) + 1
        work = _work(v, view)
        works.append(work)
        chosen = work.meta.variant_id if work.meta is not None else v.job.variant
        if chosen is not None:  # none known: its sites could load nothing anyway
            variants[rec.job_id] = (v.job.tenant, v.job.task, chosen)
        current.update({(rec.job_id, idx): a for idx, a in (await book_of.read(rec.job_id)).items()})
    if not works and not current:
        return 0
    topo = view.topology
    at = time.time() if now is None else now
    plan = assign(works, capacities(topo.sites if topo is not None else {}, view.live), current, running, at)
    puts = {k: a for k, a in plan.chunks.items() if current.get(k) != a}
    drops = [k for k in current if k not in plan.chunks]
    if not puts and not drops:
        return 0
    fence: list[Compare] = [CreateRevision(election.key, "==", election.leader_revision)]
    if not await book_of.write(puts, drops, fence, election.leader_revision, variants):
        log.warning("job assignment refused: no longer leader", extra=kv(event="stale_leader"))
        election.lost.set()
        return 0
    new: dict[tuple[str, str], int] = {}
    for (job_id, _), a in puts.items():
        if a.since == at:
            new[(job_id, a.site)] = new.get((job_id, a.site), 0) + 1
    for (job_id, site), n in sorted(new.items()):
        log.info("job %s: %d chunks assigned to %s (needs %s%s)", job_id, n, site, ",".join(plan.sites[job_id]),
                 "; late even on every idle site" if job_id in plan.late else "",
                 extra=kv(event="chunks_assigned", job=job_id, site=site, chunks=n, late=job_id in plan.late))
    return len(puts) + len(drops)
