"""Dynamic batching per loaded variant.

Requests queue per variant; one loop per variant takes the oldest, waits for companions for a
window taken from the *deadline slack* of what is queued (never holding a request past what its
SLO allows), runs them as one batch off the event loop, and splits the outputs back.

The window is a pure function (``batch_window_s``) so it can be tested with tables.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

import numpy as np

from mesh.errors import DeadlineExceeded, MeshError, Overloaded
from mesh.log import get_logger, kv

__all__ = ["BatchResult", "Batcher", "batch_window_s"]

log = get_logger(__name__)
# The learnt overhead fades with this time constant while no batch runs to refresh it. Without
# it one slow batch (a burst of CPU contention) could make admission refuse every later request
# for ever: refused requests never run, so the estimate would never come down again.
OVERHEAD_DECAY_S = 1.0
InferFn = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


def batch_window_s(slacks_s: list[float], compute_s: float, max_window_s: float,
                   safety_s: float = 0.001, expected_gap_s: float | None = None) -> float:
    """How long the batch may stay open for more requests.

    ``slacks_s``: time left to each queued request's deadline. The tightest one bounds the window:
    it must still have time for the batch's compute after the window closes. ``expected_gap_s``:
    the recent mean time between arrivals; when no companion is expected within the window,
    waiting only adds latency, so the batch closes at once (low load runs unbatched).
    """
    if not slacks_s:
        return 0.0
    room = min(slacks_s) - compute_s - safety_s
    window = max(0.0, min(max_window_s, room))
    if expected_gap_s is not None and expected_gap_s > window:
        return 0.0
    return window


@dataclass(slots=True)
class BatchResult:
    outputs: dict[str, np.ndarray]
    queue_ms: float
    compute_ms: float
    batch_rows: int


@dataclass(slots=True)
class _Item:
    inputs: dict[str, np.ndarray]
    rows: int
    deadline: float
    enqueued: float
    future: asyncio.Future[BatchResult] = field(repr=False)


class Batcher:
    """Owns one variant's queue and its batching loop (start/stop; the loop never dies)."""

    def __init__(self, variant_id: str, infer: InferFn, *, executor: Executor | None,
                 compute_ms: Callable[[int], float], max_batch: int = 32, max_window_ms: float = 4.0,
                 max_queue_rows: int = 4096, site: str = "") -> None:
        self.variant_id = variant_id
        self._infer = infer
        self._executor = executor
        self._profile_ms = compute_ms
        # what a batch really costs beyond the profile (executor hop, contention), learnt online
        self._overhead_ms = 0.0
        self._overhead_seen = 0.0
        self.max_batch = max(1, max_batch)
        self.max_window_s = max_window_ms / 1000.0
        self.max_queue_rows = max_queue_rows
        self.site = site
        self._queue: deque[_Item] = deque()
        self._queued_rows = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._busy_until = 0.0
        # recent observed service, for heartbeats: exponentially weighted
        self.ewma_compute_ms = compute_ms(1)
        self.served = 0
        self.batches = 0
        self._last_arrival = 0.0
        self.ewma_gap_s: float | None = None  # mean time between arrivals, for the window
        # Windows that caught no companion: callers that wait for each reply (closed loop) never
        # send a second request while one is held, however short their gap looks. After a few
        # futile windows, stop holding batches open for a while, then probe again.
        self._futile = 0
        self._skip_windows = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name=f"batcher:{self.variant_id}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        while self._queue:
            item = self._queue.popleft()
            if not item.future.done():
                item.future.set_exception(Overloaded(f"variant {self.variant_id} unloaded"))
        self._queued_rows = 0

    @property
    def overhead_ms(self) -> float:
        """Learnt cost beyond the profile, faded by the time since a batch last measured it."""
        age = max(0.0, time.monotonic() - self._overhead_seen)
        return self._overhead_ms * math.exp(-age / OVERHEAD_DECAY_S)

    def _compute_ms(self, rows: int) -> float:
        return self._profile_ms(rows) + self.overhead_ms

    @property
    def queued_rows(self) -> int:
        return self._queued_rows

    def expected_wait_ms(self, now: float | None = None) -> float:
        """Time a new request would wait before its batch starts computing."""
        now = time.monotonic() if now is None else now
        busy = max(0.0, self._busy_until - now) * 1000.0
        full_batches = self._queued_rows // self.max_batch
        return busy + full_batches * self._compute_ms(self.max_batch)

    async def submit(self, inputs: dict[str, np.ndarray], deadline: float) -> BatchResult:
        """Queue rows for inference. ``deadline`` is absolute on ``time.time()``'s clock."""
        rows = int(next(iter(inputs.values())).shape[0])
        now_wall = time.time()
        remaining_ms = (deadline - now_wall) * 1000.0
        if remaining_ms <= 0:
            raise DeadlineExceeded(f"deadline passed before queueing on {self.variant_id}")
        if self._queued_rows + rows > self.max_queue_rows:
            raise Overloaded(f"queue of {self.variant_id} full ({self._queued_rows} rows)")
        expected = self.expected_wait_ms() + self._compute_ms(min(rows, self.max_batch))
        if expected > remaining_ms:
            raise Overloaded(f"{self.variant_id}: expected {expected:.1f} ms > {remaining_ms:.1f} ms left")
        fut: asyncio.Future[BatchResult] = asyncio.get_running_loop().create_future()
        # the deadline moves onto the monotonic clock for the loop's arithmetic
        now = time.monotonic()
        mono_deadline = now + remaining_ms / 1000.0
        if self._last_arrival:
            gap = now - self._last_arrival
            self.ewma_gap_s = gap if self.ewma_gap_s is None else 0.8 * self.ewma_gap_s + 0.2 * gap
        self._last_arrival = now
        self._queue.append(_Item(inputs, rows, mono_deadline, now, fut))
        self._queued_rows += rows
        self._wake.set()
        return await fut

    async def _loop(self) -> None:
        while True:
            try:
                await self._one_batch()
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop never dies; the failing batch's futures got the error
                log.exception("batch loop error", extra=kv(site=self.site, variant=self.variant_id))

    async def _one_batch(self) -> None:
        while not self._queue:
            self._wake.clear()
            await self._wake.wait()
        # keep the window open while the tightest deadline allows and the batch is not full
        waited = False
        while self._queued_rows < self.max_batch and self._skip_windows == 0:
            now = time.monotonic()
            slacks = [it.deadline - now for it in self._queue]
            rows = min(self._queued_rows, self.max_batch)
            window_end = self._queue[0].enqueued + batch_window_s(
                slacks, self._compute_ms(max(rows, 1)) / 1000.0, self.max_window_s,
                expected_gap_s=self.ewma_gap_s)
            wait = window_end - now
            if wait <= 0:
                break
            waited = True
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)
        if self._skip_windows:
            self._skip_windows -= 1
        elif waited:
            self._futile = self._futile + 1 if len(self._queue) == 1 else 0
            if self._futile >= 3:
                self._futile, self._skip_windows = 0, 64
        batch: list[_Item] = []
        rows = 0
        now = time.monotonic()
        while self._queue and (not batch or rows + self._queue[0].rows <= self.max_batch):
            item = self._queue.popleft()
            self._queued_rows -= item.rows
            if item.future.done():
                continue  # caller gave up
            if item.deadline <= now:
                item.future.set_exception(DeadlineExceeded(f"deadline passed in queue of {self.variant_id}"))
                continue
            batch.append(item)
            rows += item.rows
        if batch:
            await self._run(batch, rows)

    async def _run(self, batch: list[_Item], rows: int) -> None:
        names = list(batch[0].inputs)
        merged = {n: (batch[0].inputs[n] if len(batch) == 1
                      else np.concatenate([it.inputs[n] for it in batch], axis=0)) for n in names}
        started = time.monotonic()
        self._busy_until = started + self._compute_ms(rows) / 1000.0
        loop = asyncio.get_running_loop()
        try:
            outputs = await loop.run_in_executor(self._executor, self._infer, merged)
        except Exception as exc:
            err = exc if isinstance(exc, MeshError) else MeshError(f"inference failed: {exc}")
            for it in batch:
                if not it.future.done():
                    it.future.set_exception(err)
            return
        finally:
            self._busy_until = 0.0
        done = time.monotonic()
        compute_ms = (done - started) * 1000.0
        self.ewma_compute_ms = 0.8 * self.ewma_compute_ms + 0.2 * compute_ms
        excess = max(0.0, compute_ms - self._profile_ms(rows))
        self._overhead_ms = 0.8 * self.overhead_ms + 0.2 * excess
        self._overhead_seen = done
        self.batches += 1
        offset = 0
        for it in batch:
            part = {k: v[offset:offset + it.rows] for k, v in outputs.items()}
            offset += it.rows
            self.served += it.rows
            if not it.future.done():
                it.future.set_result(BatchResult(part, (started - it.enqueued) * 1000.0, compute_ms, rows))
