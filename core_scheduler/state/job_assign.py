"""The scheduler leader's chunk assignments in etcd: ``jobs/<id>/assign/<n>`` (``mesh.etcd.keys.assign_key``) =
``{"schema": 1, "site": S, "since": t0, "at": t, "leader": R}``: chunk n of the job is S's to claim, handed out at
``t0`` and last renewed at ``t`` (the leader's wall clock), by the leader that won its election at revision R.

Only the leader writes them, each txn fenced by its election key (``CreateRevision(key, "==", leader_revision)``,
as placement is): a deposed leader's plan never lands. An assignment is advice, never a lock: the claim
(``core_scheduler.state.jobs``) decides who runs a chunk, so a stale or forged assignment can delay a chunk by at
most ``ASSIGN_GRACE_S`` (``core_scheduler.policy.jobs.claim_choice``), never lose or double it. Any site may
write under ``jobs/`` (``mesh.etcd.rbac``), so values are read back as hostile: one that does not decode is
skipped and logged, as if absent.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from core_scheduler.policy.jobs import Assigned
from mesh.errors import ProtocolError
from mesh.etcd.keys import assign_key
from mesh.etcd.ops import KV, Compare, Delete, Op, Put, chunk_ops
from mesh.etcd.store import Store
from mesh.log import get_logger, kv

__all__ = ["JobAssignments", "decode_assignment"]

log = get_logger(__name__)
SCHEMA = 1
_SITE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # a topology site name
_MAX_TIME = 1e11  # epoch seconds, as mesh.jobspec bounds a deadline


def _time(d: dict[str, Any], name: str, where: str) -> float:
    v = d.get(name)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not 0.0 <= v <= _MAX_TIME:
        raise ProtocolError(f"{where}: {name!r} is not a time")
    return float(v)


def decode_assignment(job_id: str, item: KV) -> tuple[int, Assigned]:
    """One assignment read from etcd: (chunk index, assignment); ``ProtocolError`` for anything else."""
    where = f"assignment {item.key}"
    tail = item.key.removeprefix(assign_key(job_id))
    if not (tail.isdigit() and len(tail) == 6 and tail.isascii()):
        raise ProtocolError(f"{where}: not a chunk's assignment key")
    d = item.value
    if not isinstance(d, dict) or d.get("schema") != SCHEMA:
        raise ProtocolError(f"{where}: not a schema {SCHEMA} object")
    site = d.get("site")
    if not isinstance(site, str) or not _SITE.match(site):
        raise ProtocolError(f"{where}: 'site' is not a site name")
    since, at = _time(d, "since", where), _time(d, "at", where)
    return int(tail), Assigned(site, min(since, at), at)


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
                    fence: Sequence[Compare], leader_revision: int) -> bool:
        """Put ``puts`` and delete ``deletes`` (by ``(job, chunk)``), in txns of etcd's size each guarded by
        ``fence``; False when etcd refused one (we are no longer the leader: what was written before it was
        written while we were)."""
        ops: list[Op] = [Put(assign_key(job, idx), {"schema": SCHEMA, "site": a.site, "since": a.since, "at": a.at,
                                                    "leader": leader_revision})
                         for (job, idx), a in sorted(puts.items())]
        ops += [Delete(assign_key(job, idx)) for job, idx in sorted(deletes)]
        for part in chunk_ops(ops):
            if not (await self.store.txn(list(fence), part)).succeeded:
                return False
        return True
