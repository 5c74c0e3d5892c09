"""A private event loop on one background thread, for the SDK's synchronous ``mesh.client.Client``.

The thread starts on first use and ends with :meth:`LoopThread.close`. It owns everything the async client opens
(its ``aiohttp`` session, so connections are reused across sync calls: an ``asyncio.run`` per call would open a new
session, and so a new TCP connection, every time). ``close`` works from inside a caller's running event loop too:
the last coroutine runs on this loop, not the caller's.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread"]

T = TypeVar("T")


class LoopThread:
    """Runs coroutines for synchronous callers on its own loop thread; closed once (then ``RuntimeError``)."""

    def __init__(self, name: str, what: str = "client") -> None:
        self._name, self._what = name, what
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def _ensure(self) -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
        # Caller holds self._lock.
        if self._loop is None or self._thread is None:
            loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=loop.run_forever, name=self._name, daemon=True)
            self._thread.start()
            self._loop = loop
        return self._loop, self._thread

    def start(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._what} is closed")
            return self._ensure()[0]

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop thread and wait for it (a caller's interrupt cancels it there)."""
        try:
            loop = self.start()
        except RuntimeError:
            coro.close()
            raise
        fut = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return fut.result()
        except BaseException:
            fut.cancel()
            raise

    def close(self, last: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``last()`` on the loop (the client's own close), stop the thread and close the loop. Idempotent."""
        with self._lock:
            if self._closed:
                return
            # even an unused client closes its transport on its own loop
            loop, thread = self._ensure()
            self._closed = True
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(loop, last), loop).result()
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()

    @staticmethod
    async def _shutdown(loop: asyncio.AbstractEventLoop, last: Callable[[], Coroutine[Any, Any, None]]) -> None:
        try:
            await last()
        finally:
            await loop.shutdown_asyncgens()
            await loop.shutdown_default_executor()
