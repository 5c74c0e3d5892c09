"""Watches on a key prefix that survive etcd restarts, over :class:`mesh.etcd.store.Store`.

Created by ``store.watch_prefix(prefix)``. Like every module but :mod:`mesh.etcd.store` this one does
not touch the etcd client: the store runs each gRPC watch stream (``Store._watch_stream``) and
translates its errors; this module owns the resume logic around it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from mesh.errors import StoreError
from mesh.lifecycle import Service, State, cancel_and_wait
from mesh.log import get_logger, kv

__all__ = ["Compacted", "Watch", "WatchEvent", "WatchSource"]

log = get_logger("mesh.etcd")


@dataclass(frozen=True)
class WatchEvent:
    kind: Literal["put", "delete"]
    key: str
    value: Any | None
    revision: int


class Compacted(Exception):
    """etcd compacted its history past the revision a watch stream asked to start from; ``args[0]``
    is the compact revision. Raised by the store's stream, turned into ``StoreError`` by :class:`Watch`."""


class WatchSource(Protocol):
    """What a watch needs of its store (:class:`mesh.etcd.store.Store`); a protocol, so this
    module does not import the store that imports it."""

    _watches: set[Watch]

    async def revision(self) -> int: ...

    def _watch_stream(self, prefix: str, start_revision: int,
                      ) -> AsyncGenerator[tuple[list[WatchEvent], bool, int], None]: ...


class Watch(Service):
    """Async iterator of :class:`WatchEvent` under a prefix, in revision order.

    A pump task owns one gRPC watch stream; when the stream drops (etcd restarted, network cut)
    it re-watches from the last revision it delivered + 1, with jittered back-off, so no event is
    missed or repeated. If etcd compacted past that revision, iteration raises ``StoreError``.
    """

    def __init__(self, store: WatchSource, prefix: str, start_revision: int | None) -> None:
        self._store = store
        self.prefix = prefix
        self._start_revision = start_revision
        # revision of the last event handed to the consumer (or start - 1)
        self.last_revision = (start_revision - 1) if start_revision else 0
        self._cursor = self.last_revision  # revision of the last event queued by the pump
        self._queue: asyncio.Queue[WatchEvent | BaseException | None] = asyncio.Queue(maxsize=4096)
        self._task: asyncio.Task[None] | None = None
        self.reconnects = 0

    async def _start(self) -> None:
        if self._start_revision is None:
            self._cursor = self.last_revision = await self._store.revision()
        self._store._watches.add(self)
        self._task = asyncio.get_running_loop().create_task(self._pump(), name=f"watch-{self.prefix}")

    async def _pump(self) -> None:
        backoff = 0.05
        while True:
            try:
                if await self._stream():
                    backoff = 0.05
            except Compacted as exc:
                await self._queue.put(StoreError(
                    f"watch on {self.prefix!r} cannot resume after revision {self._cursor}: etcd "
                    f"compacted history up to {exc.args[0]}; re-read with get_prefix and watch again",
                    prefix=self.prefix, last_revision=self._cursor, compact_revision=exc.args[0]))
                return
            except StoreError as exc:
                log.debug("watch stream dropped", extra=kv(event="watch_retry", reason=str(exc)[:200]))
            self.reconnects += 1
            await asyncio.sleep(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, 2.0)

    async def _stream(self) -> bool:
        """Run one watch stream until it fails. True if it had been established."""
        established = False
        async with contextlib.aclosing(self._store._watch_stream(self.prefix, self._cursor + 1)) as stream:
            async for events, created, revision in stream:
                established = established or created
                for ev in events:
                    await self._queue.put(ev)
                    self._cursor = ev.revision
                if not events and not created:
                    # progress notification: nothing under our prefix up to this revision
                    self._cursor = max(self._cursor, revision)
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
        self.last_revision = item.revision
        return item

    async def close(self) -> None:
        await self.stop()

    async def _stop(self) -> None:
        self._store._watches.discard(self)
        task, self._task = self._task, None
        await cancel_and_wait(task)
        with contextlib.suppress(asyncio.QueueFull):
            self._queue.put_nowait(None)  # wake a consumer blocked in __anext__


