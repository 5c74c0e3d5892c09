"""One lifecycle for the long-lived parts: :class:`Service` (start once, stop always, ``async with``)
and :func:`cancel_and_wait` for the background tasks a part owns (every task has an owner that
stops it); :func:`single_flight` shares one run of a coroutine among the callers asking for the same key.

A subclass writes ``_start`` and ``_stop``; the base keeps the state and the rules around them:

- ``start()`` runs once; a second start, or a start after stop, is a ``RuntimeError`` (a part
  that can come back, like a supervised etcd process, sets ``_restartable`` and may start again
  once stopped);
- a ``_start`` that fails is followed by ``_stop`` (so ``_stop`` must cope with a half-started
  part), and the error propagates; the part is then stopped;
- ``stop()`` is idempotent and safe on a part that never started;
- ``async with part:`` starts it (unless a factory already did) and stops it, whatever
  happened in between.
"""

from __future__ import annotations

import asyncio
import enum
import os
from collections.abc import Awaitable, Callable, Hashable
from types import TracebackType
from typing import ClassVar, Self, TypeVar

from mesh.log import get_logger

__all__ = ["Service", "State", "cancel_and_wait", "pid_alive", "single_flight"]

log = get_logger("mesh.lifecycle")
T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


async def single_flight(pending: dict[K, asyncio.Future[T]], key: K, make: Callable[[], Awaitable[T]],
                        cancelled: Callable[[], Exception] = lambda: RuntimeError("cancelled")) -> T:
    """``await make()``, shared by every caller that asks for ``key`` while it runs (``pending`` holds the runs in
    flight). Its error reaches every waiter; if the first caller is cancelled, the others get ``cancelled()``."""
    fut = pending.get(key)
    if fut is not None:
        return await asyncio.shield(fut)
    fut = pending[key] = asyncio.get_running_loop().create_future()
    try:
        result = await make()
        fut.set_result(result)
        return result
    except BaseException as exc:
        fut.set_exception(exc if isinstance(exc, Exception) else cancelled())
        fut.exception()  # mark retrieved: other waiters re-raise it themselves
        raise
    finally:
        pending.pop(key, None)


async def cancel_and_wait(*tasks: asyncio.Task[object] | None) -> None:
    """Cancel ``tasks`` (``None`` entries are skipped) and wait until each has finished, so nothing
    it holds outlives its owner's ``stop()``. A task that had already died of an error is logged,
    not re-raised: its owner's stop must still finish."""
    live = [t for t in tasks if t is not None]
    for t in live:
        t.cancel()
    for t in live:
        try:
            await t
        except asyncio.CancelledError:
            if not t.cancelled():  # the caller itself is being cancelled
                raise
        except Exception:
            log.exception("task %s had failed before it was stopped", t.get_name())


class State(enum.Enum):
    NEW = "new"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


class Service:
    """Base of the long-lived components (agent, servers, etcd, store, watches, leases, harness)."""

    _state: State = State.NEW
    _restartable: ClassVar[bool] = False

    @property
    def state(self) -> State:
        return self._state

    def _require_running(self, what: str) -> None:
        if self._state is not State.RUNNING:
            raise RuntimeError(f"{self!r} is {self._state.value}: {what} needs it running")

    async def _start(self) -> None:
        """Acquire what the part holds; may leave it half-started when it raises."""

    async def _stop(self) -> None:
        """Release what the part holds, including after a half-finished ``_start``."""

    async def start(self) -> None:
        if not (self._state is State.NEW or (self._restartable and self._state is State.STOPPED)):
            raise RuntimeError(f"cannot start {self!r}: it is {self._state.value}")
        self._state = State.STARTING
        try:
            await self._start()
        except BaseException:
            self._state = State.STOPPING
            try:
                await self._stop()
            except Exception:
                log.exception("cleanup after a failed start of %r failed", self)
            finally:
                self._state = State.STOPPED
            raise
        self._state = State.RUNNING

    async def stop(self) -> None:
        if self._state in (State.STOPPING, State.STOPPED):
            return
        if self._state is State.NEW:
            self._state = State.STOPPED
            return
        self._state = State.STOPPING
        try:
            await self._stop()
        finally:
            self._state = State.STOPPED

    async def __aenter__(self) -> Self:
        if self._state is not State.RUNNING:
            await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.stop()


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still exists (also when it is another user's): how a part finds out that
    the owner recorded beside something it left behind is gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
