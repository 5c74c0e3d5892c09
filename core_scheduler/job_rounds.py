"""The scheduler leader's offline-job work, once per leader round after placement: assign chunks
(:mod:`core_scheduler.job_planner`), fail jobs past their deadline and remove those past retention
(:mod:`core_scheduler.job_sweeper`), and notify the webhooks of ended jobs (:mod:`core_scheduler.job_notify`).

Each part runs in its own ``try``: a failing sweep never stops assignment, nor a failing notifier a sweep, and none
stops placement. The deadline part of the sweep runs every round (it reads the live jobs' record copies only); the
retention part, which reads every tenant's record copies and talks to the variant store, every
``retention_every_s``. The first sweep of a term copies the records of jobs written before the copies existed
(``JobBook.reindex``). Retention needs the variant store's data area: the store's URL is the one it announced in
etcd (``services/variant-store``), reached with ``data_ssl`` (the scheduler's client certificate; None for an
``--insecure`` mesh). Without an announced store, retention waits.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from core_scheduler.job_notify import JobNotifier
from core_scheduler.job_planner import plan_jobs_once
from core_scheduler.job_sweeper import DATA_MIN_AGE_S, sweep_once
from core_scheduler.state.jobs import JobBook
from core_scheduler.state.view import MeshView
from mesh.errors import MeshError
from mesh.etcd.election import Election
from mesh.etcd.store import Store
from mesh.lifecycle import Service
from mesh.log import get_logger, kv
from variant_store.data_client import DataClient

__all__ = ["RETENTION_EVERY_S", "JobRounds"]

log = get_logger(__name__)
T = TypeVar("T")
RETENTION_EVERY_S = 60.0


class JobRounds(Service):
    """The leader's job round; ``round(election)`` once per placement round while leading."""

    def __init__(self, store: Store, view: MeshView, owner: str, *, retention_s: float,
                 data_ssl: Callable[[], ssl.SSLContext | None] = lambda: None,
                 retention_every_s: float = RETENTION_EVERY_S) -> None:
        self.store, self.view = store, view
        self.retention_s, self.retention_every_s = retention_s, retention_every_s
        self.data_min_age_s = DATA_MIN_AGE_S  # data stored more recently is kept whatever the sweep decides
        self.book = JobBook(store)
        self.notifier = JobNotifier(store, lambda: view.tenants, owner)
        self.data = DataClient(self._store_url, data_ssl)
        self._swept_at: float | None = None  # monotonic time of the last retention sweep (None: none this term)
        self._term = -1                       # the leader revision the last round ran under
        self.failed_late = 0                  # jobs failed at their deadline, over this replica's life
        self.removed = 0                      # jobs removed by retention

    def _store_url(self) -> str | None:
        svc = self.view.services.get("variant-store")
        url = svc.get("url") if isinstance(svc, dict) else None
        return url if isinstance(url, str) else None

    async def _start(self) -> None:
        await self.notifier.start()

    async def _stop(self) -> None:
        await self.notifier.stop()

    async def round(self, election: Election) -> None:
        if not election.is_leader:
            return
        new_term = election.leader_revision != self._term
        self._term = election.leader_revision
        await self._part("job assignment", plan_jobs_once(self.store, self.view, election))
        now = time.monotonic()
        due = self._swept_at is None or new_term or now - self._swept_at >= self.retention_every_s
        data = self.data if due and self._store_url() is not None else None
        sweep = await self._part("job sweep", sweep_once(self.book, data, time.time(), self.retention_s,
                                                         data_min_age_s=self.data_min_age_s, reindex=new_term))
        if data is not None and sweep is not None:
            self._swept_at = now
        if sweep is not None:
            self.failed_late += len(sweep.failed)
            self.removed += len(sweep.removed)
        await self._part("job notification", self.notifier.notify_once())

    async def _part(self, what: str, work: Awaitable[T]) -> T | None:
        try:
            return await work
        except MeshError as exc:  # etcd or the store unreachable, a refused write: next round again
            log.warning("%s round failed: %s", what, exc, extra=kv(event="round_failed", part=what))
        except Exception:
            log.exception("%s round error", what, extra=kv(event="round_failed", part=what))
        return None
