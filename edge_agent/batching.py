"""Dynamic batching per loaded variant.

Requests queue per variant; one loop per variant takes the oldest, waits for companions for a
window taken from the *deadline slack* of what is queued (never holding a request past what its
SLO allows), runs them as one batch off the event loop, and splits the outputs back.

The window is a pure function (``edge_agent.batch_parts.batch_window_s``) so it can be tested with tables.

Inline fast path: a request the loop would run *at once and alone* anyway (nothing queued, no batch
running, no window to open for companions), whose profile says it is tiny, runs on the event-loop
thread instead of taking the executor hop; ``edge_agent.inline_guard`` says when, and backs off when
such runs turn out slow. Everything else, and all concurrent load that a window could batch, takes the
executor path.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor

import numpy as np

from edge_agent.batch_parts import BatchResult, InferFn, Part, Queued, batch_window_s, fail_batch
from edge_agent.inline_guard import INLINE_MAX_MS, InlineGuard
from mesh.errors import DeadlineExceeded, MeshError, Overloaded, PayloadTooLarge
from mesh.lifecycle import cancel_and_wait
from mesh.log import get_logger, kv

__all__ = ["Batcher"]

log = get_logger(__name__)
# The learnt overhead fades with this time constant while no batch runs to refresh it. Without
# it one slow batch (a burst of CPU contention) could make admission refuse every later request
# for ever: refused requests never run, so the estimate would never come down again.
OVERHEAD_DECAY_S = 1.0
# Windows that caught no companion before the batcher stops holding batches open, and for how many
# batches it then does not: SKIP_WINDOWS, doubled after each further futile probe up to SKIP_WINDOWS_MAX
# (see Batcher.__init__).
FUTILE_WINDOWS = 3
SKIP_WINDOWS = 64
SKIP_WINDOWS_MAX = 1024
# Batches remembered per batcher (tenants of each), so tests and the console can see who shared one.
MEMBERSHIP_KEPT = 256


class Batcher:
    """Owns one variant's queue and its batching loop (start/stop; the loop never dies).

    ``membership`` keeps the tenants of the last ``MEMBERSHIP_KEPT`` batches (a tuple per batch, in
    arrival order), so who shared a batch is recorded rather than assumed."""

    shared_backbone = False  # a backbone batcher says so in every result
    # batches that may compute at once; a plain batcher runs one at a time (a backbone's, several)
    parallel = 1

    def __init__(self, variant_id: str, infer: InferFn, *, executor: Executor | None,
                 compute_ms: Callable[[int], float], max_batch: int = 32, max_window_ms: float = 4.0,
                 max_queue_rows: int = 4096, site: str = "", inline_max_ms: float = INLINE_MAX_MS,
                 on_batch: Callable[[str, int], None] | None = None) -> None:
        self.variant_id = variant_id
        self.on_batch = on_batch  # (variant, rows) of every executed batch (metrics)
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
        self._queue: deque[Queued] = deque()
        # the queue and its counters change under this lock: a backbone's batches may take their rows from
        # an executor thread (edge_agent.backbone), not only from this batcher's loop
        self._qlock = threading.Lock()
        self._queued_rows = 0
        self._tightest = math.inf  # the earliest deadline queued (at most: items that left may linger)
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
        # futile windows, stop holding batches open for a while, then probe again with one window;
        # while probes stay futile, the skip doubles. A window that catches a companion starts over.
        self._futile = 0
        self._skip_windows = 0
        self._skip_next = SKIP_WINDOWS
        self.windows_held = 0  # windows held open for companions (a number to watch)
        # inline runs: the profile bound (0 turns them off) and the stall back-off
        self.inline_max_ms = inline_max_ms
        self.inline_runs = 0
        self._inline = InlineGuard()
        self.membership: deque[tuple[str, ...]] = deque(maxlen=MEMBERSHIP_KEPT)
        # a subclass that routes parts to heads (edge_agent.backbone) runs every batch through its _execute
        self._plain_execute = type(self)._execute is Batcher._execute

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name=f"batcher:{self.variant_id}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        with self._qlock:
            left, self._queue = list(self._queue), deque()
            self._queued_rows = 0
            self._tightest = math.inf
        for item in left:
            if not item.future.done():
                item.future.set_exception(Overloaded(f"variant {self.variant_id} unloaded"))

    @property
    def overhead_ms(self) -> float:
        """Learnt cost beyond the profile, faded by the time since a batch last measured it."""
        return self._overhead_at(time.monotonic())

    def _overhead_at(self, now: float) -> float:
        if not self._overhead_ms:
            return 0.0
        return self._overhead_ms * math.exp(-max(0.0, now - self._overhead_seen) / OVERHEAD_DECAY_S)

    def _compute_ms(self, rows: int) -> float:
        return self._profile_ms(rows) + self.overhead_ms

    @property
    def queued_rows(self) -> int:
        return self._queued_rows

    def infer_for(self, lane: str) -> InferFn:
        """What a batch of ``lane`` runs, end to end (for a site timing a variant itself, outside the queue)."""
        return self._infer

    def expected_wait_ms(self, now: float | None = None) -> float:
        """Time a new request would wait before its batch starts computing."""
        now = time.monotonic() if now is None else now
        busy = max(0.0, self._busy_until - now) * 1000.0
        full_batches = self._queued_rows // self.max_batch
        return busy + full_batches * self._compute_ms(self.max_batch) / self.parallel

    async def submit(self, inputs: dict[str, np.ndarray], deadline: float, *, lane: str = "",
                     tenant: str = "") -> BatchResult:
        """Queue rows for inference. ``deadline`` is an instant on ``mesh.clock.monotonic``'s clock;
        ``lane`` picks the head behind a shared backbone (ignored by a plain batcher); ``tenant`` is
        recorded in ``membership``."""
        rows = int(next(iter(inputs.values())).shape[0])
        now = time.monotonic()
        remaining_ms = (deadline - now) * 1000.0
        if remaining_ms <= 0:
            raise DeadlineExceeded(f"deadline passed before queueing on {self.variant_id}")
        if rows > self.max_queue_rows:
            # no queue here or at any peer (same cap) would ever take it: the caller's error, not
            # a retryable overload to try elsewhere
            raise PayloadTooLarge(f"{rows} rows exceed the {self.max_queue_rows}-row queue of {self.variant_id}",
                                  rows=rows, limit=self.max_queue_rows)
        if self._queued_rows + rows > self.max_queue_rows:
            raise Overloaded(f"queue of {self.variant_id} full ({self._queued_rows} rows)")
        if self._task is None:
            # stopped (unloaded between routing and here) or never started: nothing would run it
            raise Overloaded(f"variant {self.variant_id} is not running (unloaded)")
        # expected_wait_ms() + _compute_ms(), with the faded overhead worked out once
        overhead = self._overhead_at(now)
        profile = self._profile_ms(min(rows, self.max_batch))
        expected = profile + overhead
        if self._busy_until > now:
            expected += (self._busy_until - now) * 1000.0
        if self._queued_rows >= self.max_batch:
            # full batches queued ahead, drained ``parallel`` at a time
            expected += (self._queued_rows // self.max_batch * (self._profile_ms(self.max_batch) + overhead)
                         / self.parallel)
        if expected > remaining_ms:
            raise Overloaded(f"{self.variant_id}: expected {expected:.1f} ms > {remaining_ms:.1f} ms left")
        if self._last_arrival:
            gap = now - self._last_arrival
            self.ewma_gap_s = gap if self.ewma_gap_s is None else 0.8 * self.ewma_gap_s + 0.2 * gap
        self._last_arrival = now
        if rows > self.max_batch:
            profile = self._profile_ms(rows)  # an oversized request runs as one batch
        if self._inline_ok(rows, now, deadline, profile, overhead):
            return self._run_inline(inputs, rows, now, profile, overhead, lane, tenant)
        fut: asyncio.Future[BatchResult] = asyncio.get_running_loop().create_future()
        with self._qlock:
            self._queue.append(Queued(inputs, rows, deadline, now, fut, lane, tenant))
            self._queued_rows += rows
            # Wake the loop only when this arrival changes what it waits for: a first request, a full
            # batch, or a tighter deadline (which shortens the window). Any other arrival would only make
            # it recompute the same window end (a task switch per request, under load).
            wake = len(self._queue) == 1 or self._queued_rows >= self.max_batch or deadline < self._tightest
            if deadline < self._tightest:
                self._tightest = deadline
        if wake:
            self._wake.set()
        return await fut

    def _inline_ok(self, rows: int, now: float, deadline: float, profile_ms: float,
                   overhead_ms: float) -> bool:
        """Whether the loop would run this request at once and alone, and its profile is tiny."""
        if (self._queue or self._busy_until or self._task is None or not self._inline.allows(now)
                or profile_ms > self.inline_max_ms):
            return False
        if rows >= self.max_batch or self._skip_windows:
            return True
        # the window _one_batch would hold open for companions (its wait, as enqueued == now)
        return batch_window_s([deadline - now], (profile_ms + overhead_ms) / 1000.0, self.max_window_s,
                              expected_gap_s=self.ewma_gap_s) <= 0.0

    def _run_inline(self, inputs: dict[str, np.ndarray], rows: int, started: float, profile_ms: float,
                    overhead_ms: float, lane: str, tenant: str) -> BatchResult:
        """Run one request on the loop's thread: what ``_one_batch`` and ``_run`` would do for a
        batch of one, without the executor hop."""
        if self._skip_windows:
            self._skip_windows -= 1
        self.membership.append((tenant,))
        try:
            if self._plain_execute:  # one part of a plain batcher: what _execute would return, called directly
                outputs = self._infer(inputs)
            else:
                out = self._execute(inputs, [(lane, rows)])[0]
                if isinstance(out, Exception):
                    raise out
                outputs = out
        except MeshError:
            raise
        except Exception as exc:
            raise MeshError(f"inference failed: {exc}") from exc
        finally:
            done = time.monotonic()
            took_ms = (done - started) * 1000.0
            backoff_s = self._inline.ran(took_ms, done)
            if backoff_s:
                log.warning("inline run of %s took %.2f ms; executor only for %.0f s", self.variant_id, took_ms,
                            backoff_s, extra=kv(site=self.site, variant=self.variant_id, event="inline_off"))
        self._learn(took_ms, done, profile_ms, overhead_ms)
        self.inline_runs += 1
        self.served += rows
        if self.on_batch is not None:
            self.on_batch(self.variant_id, rows)
        return BatchResult(outputs, 0.0, took_ms, rows, 1, self.shared_backbone)

    def _execute(self, merged: dict[str, np.ndarray], parts: list[Part]
                 ) -> list[dict[str, np.ndarray] | Exception]:
        """Run one merged batch (off the loop, or inline); one output dict (or the error) per part,
        in order. Subclasses that route parts to different heads override this."""
        outputs = self._infer(merged)
        if len(parts) == 1:
            return [outputs]
        out: list[dict[str, np.ndarray] | Exception] = []
        offset = 0
        for _, rows in parts:
            out.append({k: v[offset:offset + rows] for k, v in outputs.items()})
            offset += rows
        return out

    def _learn(self, compute_ms: float, done: float, profile_ms: float, overhead_ms: float) -> None:
        """Fold one batch's measured compute into the estimates (``overhead_ms``: the faded
        estimate the batch was admitted with)."""
        self.ewma_compute_ms = 0.8 * self.ewma_compute_ms + 0.2 * compute_ms
        excess = max(0.0, compute_ms - profile_ms)
        self._overhead_ms = 0.8 * overhead_ms + 0.2 * excess
        self._overhead_seen = done
        self.batches += 1

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
        while self._queue and self._queued_rows < self.max_batch and self._skip_windows == 0:
            # (the queue may empty meanwhile: a backbone's executor thread takes batches too)
            now = time.monotonic()
            rows = min(self._queued_rows, self.max_batch)
            window_end = self._queue[0].enqueued + batch_window_s(
                [self._tightest - now], self._compute_ms(max(rows, 1)) / 1000.0, self.max_window_s,
                expected_gap_s=self.ewma_gap_s)
            wait = window_end - now
            if wait <= 0:
                break
            waited = True
            self._wake.clear()
            # asyncio.timeout, not wait_for: 3.11's wait_for swallows a cancel that lands as the event is set,
            # and stop() would wait on this loop for ever (and it wraps the wait in a task of its own)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._wake.wait()
        if self._skip_windows:
            self._skip_windows -= 1
        elif waited:
            self.windows_held += 1
            if len(self._queue) == 1:
                self._futile += 1
            else:
                self._futile, self._skip_next = 0, SKIP_WINDOWS
            if self._futile >= FUTILE_WINDOWS:
                # the caller was shown closed-loop already: after the skip, one more futile window (not
                # FUTILE_WINDOWS) skips again, for twice as long
                self._futile, self._skip_windows = FUTILE_WINDOWS - 1, self._skip_next
                self._skip_next = min(SKIP_WINDOWS_MAX, 2 * self._skip_next)
        batch, rows, expired = self._take(time.monotonic())
        self._expire(expired)
        if batch:
            await self._run(batch, rows)

    def _take(self, now: float) -> tuple[list[Queued], int, list[Queued]]:
        """Pop the next batch (up to ``max_batch`` rows; a bigger request alone): the live requests, their rows,
        and the requests whose deadline passed in the queue. Any thread; answers nothing."""
        batch: list[Queued] = []
        expired: list[Queued] = []
        rows = 0
        with self._qlock:
            while self._queue and (not batch or rows + self._queue[0].rows <= self.max_batch):
                item = self._queue.popleft()
                self._queued_rows -= item.rows
                if item.future.done():
                    continue  # caller gave up
                if item.deadline <= now:
                    expired.append(item)
                    continue
                batch.append(item)
                rows += item.rows
            self._tightest = min((it.deadline for it in self._queue), default=math.inf)
        return batch, rows, expired

    def _expire(self, expired: list[Queued]) -> None:
        for item in expired:
            if not item.future.done():
                item.future.set_exception(DeadlineExceeded(f"deadline passed in queue of {self.variant_id}"))

    def _began(self, key: object, ends: float) -> None:
        """A batch (``key``) started computing, expected to end at ``ends``: ``_busy_until`` = when the next
        batch could start (a subclass running several at once keeps the earliest end once all are taken)."""
        self._busy_until = ends

    def _ended(self, key: object) -> None:
        self._busy_until = 0.0

    async def _run(self, batch: list[Queued], rows: int) -> None:
        try:
            merged = self._merge(batch)
        except Exception as exc:
            fail_batch(batch, exc)
            return
        started = time.monotonic()
        try:
            running = asyncio.get_running_loop().run_in_executor(self._executor, self._execute, merged,
                                                                 [(it.lane, it.rows) for it in batch])
        except Exception as exc:  # an executor shut down refuses work: the batch fails, the loop goes on
            fail_batch(batch, exc)
            return
        self._began(running, started + self._compute_ms(rows) / 1000.0)
        try:
            parts = await running
        except Exception as exc:
            fail_batch(batch, exc)
            return
        finally:
            self._ended(running)
        self._answer(batch, rows, started, time.monotonic(), parts)

    def _merge(self, batch: list[Queued]) -> dict[str, np.ndarray]:
        """The batch's inputs as one array per input; its tenants go into ``membership``. Any thread."""
        merged = {n: (batch[0].inputs[n] if len(batch) == 1
                      else np.concatenate([it.inputs[n] for it in batch], axis=0)) for n in batch[0].inputs}
        self.membership.append(tuple(it.tenant for it in batch))
        return merged

    def _answer(self, batch: list[Queued], rows: int, started: float, done: float,
                parts: list[dict[str, np.ndarray] | Exception]) -> None:
        """Learn from a batch that ran from ``started`` to ``done`` and answer its requests (on the loop)."""
        compute_ms = (done - started) * 1000.0
        self._learn(compute_ms, done, self._profile_ms(rows), self._overhead_at(done))
        if self.on_batch is not None:
            self.on_batch(self.variant_id, rows)
        n_tenants = len(set(it.tenant for it in batch))
        for it, part in zip(batch, parts, strict=True):
            self.served += it.rows
            if it.future.done():
                continue
            if isinstance(part, Exception):
                it.future.set_exception(part if isinstance(part, MeshError) else MeshError(f"inference failed: {part}"))
            else:
                it.future.set_result(BatchResult(part, (started - it.enqueued) * 1000.0, compute_ms, rows,
                                                 n_tenants, self.shared_backbone))

