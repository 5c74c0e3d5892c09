"""Following one offline job without polling: :class:`JobWatch` wakes its reader when anything under the job's keys
(``mesh.etcd.keys.job_prefix``: its record, chunks, claims) changes after a given etcd revision. One etcd watch
stream per follower, for as long as it follows (the edge bounds both: ``edge_agent.job_follow``).

The reader re-reads the job (``JobBook.view``) when woken, rather than folding the events in: a wake-up carries no
data, so the watch never decodes a value and one burst of commits costs one read. A revision the reader already saw
(``after``) makes a long poll race-free: anything that changed since, even before the watch started, is replayed.

Should the watch fail (etcd compacted past ``after``, or the stream could not be resumed), the reader is woken once
(it re-reads and so misses nothing) and the watch starts again from the store's current revision after a pause.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

from mesh.backoff import Backoff
from mesh.errors import StoreError
from mesh.etcd.keys import job_prefix
from mesh.etcd.store import Store
from mesh.etcd.watch import KeyRange
from mesh.lifecycle import cancel_and_wait
from mesh.log import get_logger, kv

__all__ = ["JobWatch"]

log = get_logger(__name__)


class JobWatch:
    """``async with JobWatch(store, job_id, after) as w: changed = await w.wait(timeout)``."""

    def __init__(self, store: Store, job_id: str, after: int) -> None:
        self.store, self.job_id = store, job_id
        self.after = after          # the last revision the reader is known to have seen
        self.wakes = 0
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> JobWatch:
        self._task = asyncio.create_task(self._pump(), name=f"job-watch:{self.job_id[:8]}")
        return self

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None,
                        tb: TracebackType | None) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def _pump(self) -> None:
        backoff = Backoff(0.5, 5.0)
        while True:
            watch = self.store.watch_ranges((KeyRange.under(job_prefix(self.job_id)),), start_revision=self.after + 1)
            try:
                async for event in watch:
                    self.after = max(self.after, event.revision)
                    self._changed.set()
                    backoff.reset()
            except StoreError as exc:
                log.info("job watch restarts: %s", exc, extra=kv(event="job_watch_retry", job=self.job_id))
            except Exception:  # a follower left waiting on a dead pump would never hear of the job again
                log.exception("job watch failed", extra=kv(event="job_watch_failed", job=self.job_id))
            finally:
                await watch.close()
            await asyncio.sleep(backoff.next())
            try:
                self.after = await self.store.revision()
            except Exception as exc:  # StoreError, or a store closing under us: the next round tries again
                log.info("job watch cannot read the revision: %s", exc, extra=kv(event="job_watch_retry"))
            # woken after the new start revision is read: the reader's re-read then covers the gap in the events
            self._changed.set()

    async def wait(self, timeout: float) -> bool:  # noqa: ASYNC109  (the caller's bound on one wait)
        """Whether something changed (since the last wait, or since ``after``) within ``timeout`` seconds."""
        if not self._changed.is_set():
            try:
                async with asyncio.timeout(max(0.0, timeout)):
                    await self._changed.wait()
            except TimeoutError:
                return False
        self._changed.clear()
        self.wakes += 1
        return True
