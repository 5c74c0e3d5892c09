"""Watches on a key prefix that survive etcd restarts, over :class:`mesh.etcd.store.Store`.

Created by ``store.watch_prefix(prefix)`` or ``store.watch_ranges(ranges)``. Like every module but
:mod:`mesh.etcd.store` this one does not touch the etcd client: the store runs each gRPC watch stream
(``Store._watch_stream``) and translates its errors; this module owns the resume logic around it.

Several :class:`KeyRange` ride one gRPC stream (one etcd watcher each), so a reader that follows a
few hundred keys scattered over a prefix costs etcd one stream, not a stream per key, and receives
nothing about the keys between them. Each range keeps its own cursor: etcd orders events within a
watcher, not across the watchers of a stream, so a resume restarts each range after the last event
of *that* range.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from mesh.backoff import Backoff
from mesh.errors import StoreError
from mesh.lifecycle import Service, State, cancel_and_wait
from mesh.log import get_logger, kv

__all__ = ["Compacted", "KeyRange", "Watch", "WatchEvent", "WatchSource"]

log = get_logger("mesh.etcd")


@dataclass(frozen=True)
class WatchEvent:
    kind: Literal["put", "delete"]
    key: str
    value: Any | None
    revision: int
    size: int = 0  # bytes of key and value as etcd sent them


@dataclass(frozen=True, order=True)
class KeyRange:
    """Keys ``start <= k < end`` relative to the store prefix. ``end=None``: the one key ``start``;
    :meth:`under`: every key starting with a prefix."""

    start: str
    end: str | None = None
    prefix: bool = False

    @classmethod
    def key(cls, key: str) -> KeyRange:
        return cls(key)

    @classmethod
    def under(cls, prefix: str) -> KeyRange:
        return cls(prefix, None, True)

    def __str__(self) -> str:
        if self.prefix:
            return f"{self.start}*"
        return self.start if self.end is None else f"[{self.start}, {self.end})"


class Compacted(Exception):
    """etcd compacted its history past the revision a watch stream asked to start from; ``args[0]``
    is the compact revision. Raised by the store's stream, turned into ``StoreError`` by :class:`Watch`."""


class WatchSource(Protocol):
    """What a watch needs of its store (:class:`mesh.etcd.store.Store`); a protocol, so this
    module does not import the store that imports it."""

    _watches: set[Watch]

    async def revision(self) -> int: ...

    def _watch_stream(self, ranges: Sequence[KeyRange], start_revisions: Sequence[int],
                      ) -> AsyncGenerator[tuple[int, list[WatchEvent], bool, int], None]: ...


class Watch(Service):
    """Async iterator of :class:`WatchEvent` under one or more key ranges, each range in revision order.

    A pump task owns one gRPC watch stream (one etcd watcher per range); when the stream drops (etcd
    restarted, network cut) it re-watches each range from the last revision it delivered + 1, with
    jittered back-off, so no event is missed or repeated. If etcd compacted past that revision, or the pump
    failed in any other way (logged), iteration raises ``StoreError``: the reader re-reads and watches again.
    ``start_revision``: one for all ranges, or one per range.
    """

    def __init__(self, store: WatchSource, ranges: Sequence[KeyRange],
                 start_revision: int | Sequence[int] | None) -> None:
        if not ranges:
            raise ValueError("a watch needs at least one key range")
        self._store = store
        self.ranges = tuple(ranges)
        self.prefix = ", ".join(str(r) for r in self.ranges[:3]) + (" ..." if len(self.ranges) > 3 else "")
        starts = [start_revision] * len(self.ranges) if not isinstance(start_revision, Sequence) \
            else list(start_revision)
        if len(starts) != len(self.ranges):
            raise ValueError(f"{len(starts)} start revisions for {len(self.ranges)} ranges")
        self._start_revision = None if any(s is None for s in starts) else starts
        # revision of the last event handed to the consumer (or start - 1), overall and per range
        self.last_revision = max((s - 1 for s in starts if s), default=0)
        self.delivered = [(s - 1) if s else 0 for s in starts]
        self._cursors = list(self.delivered)  # per range: the last event queued by the pump
        self._queue: asyncio.Queue[tuple[int, WatchEvent] | BaseException | None] = asyncio.Queue(maxsize=4096)
        self._task: asyncio.Task[None] | None = None
        self.reconnects = 0

    async def _start(self) -> None:
        if self._start_revision is None:
            rev = await self._store.revision()
            self._cursors = [rev] * len(self.ranges)
            self.delivered = list(self._cursors)
            self.last_revision = rev
        self._store._watches.add(self)
        self._task = asyncio.get_running_loop().create_task(self._pump(), name=f"watch-{self.prefix}")

    async def _pump(self) -> None:
        backoff = Backoff(0.05, 2.0)
        while True:
            try:
                if await self._stream():
                    backoff.reset()
            except Compacted as exc:
                await self._queue.put(StoreError(
                    f"watch on {self.prefix!r} cannot resume after revision {min(self._cursors)}: etcd "
                    f"compacted history up to {exc.args[0]}; re-read with get_prefix and watch again",
                    prefix=self.prefix, last_revision=min(self._cursors), compact_revision=exc.args[0]))
                return
            except StoreError as exc:
                log.debug("watch stream dropped", extra=kv(event="watch_retry", reason=str(exc)[:200]))
            except Exception as exc:
                # Not a dropped stream but a bug (or a value no decoder foresaw): resuming would meet the same
                # event again, so the reader is told, as for compaction, and re-reads. A pump that died silently
                # left its reader waiting for ever.
                log.exception("watch on %s failed", self.prefix, extra=kv(event="watch_failed"))
                await self._queue.put(StoreError(
                    f"watch on {self.prefix!r} failed after revision {min(self._cursors)}: "
                    f"{type(exc).__name__}: {str(exc)[:200]}; re-read with get_prefix and watch again",
                    prefix=self.prefix, last_revision=min(self._cursors)))
                return
            self.reconnects += 1
            await asyncio.sleep(backoff.next())

    async def _stream(self) -> bool:
        """Run one watch stream until it fails. True if it had been established."""
        established = False
        starts = [c + 1 for c in self._cursors]
        async with contextlib.aclosing(self._store._watch_stream(self.ranges, starts)) as stream:
            async for i, events, created, revision in stream:
                established = established or created
                for ev in events:
                    await self._queue.put((i, ev))
                    self._cursors[i] = ev.revision
                if not events and not created:
                    # progress notification: nothing in this range up to this revision
                    self._cursors[i] = max(self._cursors[i], revision)
        return established

    def __aiter__(self) -> Watch:
        return self

    async def __anext__(self) -> WatchEvent:
        if self.state is State.NEW:
            await self.start()
        elif self.state is not State.RUNNING and self._queue.empty():
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            await self.close()
            raise item
        i, ev = item
        self.delivered[i] = ev.revision
        self.last_revision = max(self.last_revision, ev.revision)
        return ev

    async def close(self) -> None:
        await self.stop()

    async def _stop(self) -> None:
        self._store._watches.discard(self)
        task, self._task = self._task, None
        await cancel_and_wait(task)
        with contextlib.suppress(asyncio.QueueFull):
            self._queue.put_nowait(None)  # wake a consumer blocked in __anext__
