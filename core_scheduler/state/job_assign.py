"""The scheduler leader's chunk assignments in etcd: ``jobassign/<id>/<n>`` (``mesh.etcd.keys.assign_key``) =
``{"schema": 1, "site": S, "since": t0, "at": t, "leader": R, "tenant": T, "task": K, "variant": V}``: chunk n of
the job is S's to claim, handed out at ``t0`` and last renewed at ``t`` (the leader's wall clock), by the leader
that won its election at revision R, for tenant T's job on variant V of task K.

Only the leader writes them, each txn fenced by its election key (``CreateRevision(key, "==", leader_revision)``,
as placement is): a deposed leader's plan never lands. And only the scheduler role may write ``jobassign/`` at all
(``mesh.etcd.rbac``; sites may write ``jobs/``, not this), because an assignment is also a grant: the variant store
lets S fetch variant V while it stands and for a grace after (``variant_store.job_grants``, whose
:func:`~variant_store.job_grants.decode_record` decodes the value for both). For claiming, an assignment is advice,
never a lock: the claim (``core_scheduler.state.jobs``) decides who runs a chunk, so a stale assignment can delay a
chunk by at most ``ASSIGN_GRACE_S`` (``core_scheduler.policy.jobs.claim_choice``), never lose or double it. Values
are read back as hostile: one that does not decode is skipped and logged, as if absent.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from core_scheduler.policy.jobs import Assigned
from mesh.errors import ProtocolError
from mesh.etcd.keys import assign_key
from mesh.etcd.ops import KV, Compare, Delete, Op, Put, chunk_ops
from mesh.etcd.store import Store
from mesh.log import get_logger, kv
from variant_store.job_grants import SCHEMA, Granted, decode_record, split_key

__all__ = ["JobAssignments", "decode_assignment"]

log = get_logger(__name__)


def decode_assignment(job_id: str, item: KV) -> tuple[int, Assigned]:
    """One assignment read from etcd: (chunk index, assignment); ``ProtocolError`` for anything else."""
    job, idx = split_key(item.key)
    if job != job_id:
        raise ProtocolError(f"assignment {item.key}: not a chunk's assignment key of job {job_id}")
    rec = decode_record(f"assignment {item.key}", item.value)
    return idx, Assigned(rec.site, rec.since, rec.at)


class JobAssignments:
    """Reading a job's assignments, and the leader's fenced writes of them."""

    def __init__(self, store: Store) -> None:
        self.store = store

    async def read(self, job_id: str) -> dict[int, Assigned]:
        """The job's readable assignments by chunk index (unreadable ones skipped and logged)."""
        out: dict[int, Assigned] = {}
        for item in await self.store.get_prefix(assign_key(job_id)):
            try:
                idx, a = decode_assignment(job_id, item)
            except ProtocolError as exc:
                log.warning("unreadable job assignment: %s", exc, extra=kv(event="job_unreadable", job=job_id))
                continue
            out[idx] = a
        return out

    async def write(self, puts: Mapping[tuple[str, int], Assigned], deletes: Iterable[tuple[str, int]],
                    fence: Sequence[Compare], leader_revision: int,
                    variants: Mapping[str, Granted] | None = None) -> bool:
        """Put ``puts`` and delete ``deletes`` (by ``(job, chunk)``), in txns of etcd's size each guarded by
        ``fence``; False when etcd refused one (we are no longer the leader: what was written before it was
        written while we were). ``variants``: each job's (tenant, task, variant id), which its assignments let
        their sites fetch (a job without one grants nothing)."""
        variants = variants or {}

        def value(job: str, a: Assigned) -> dict[str, object]:
            v: dict[str, object] = {"schema": SCHEMA, "site": a.site, "since": a.since, "at": a.at,
                                    "leader": leader_revision}
            if (g := variants.get(job)) is not None:
                v.update(tenant=g[0], task=g[1], variant=g[2])
            return v

        ops: list[Op] = [Put(assign_key(job, idx), value(job, a)) for (job, idx), a in sorted(puts.items())]
        ops += [Delete(assign_key(job, idx)) for job, idx in sorted(deletes)]
        for part in chunk_ops(ops):
            if not (await self.store.txn(list(fence), part)).succeeded:
                return False
        return True
