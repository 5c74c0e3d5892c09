"""A backbone shared by several heads: one session, one batcher, batches that span tenants.

A backbone + head variant (``VariantMeta.shared_base_digest``) is served as two ONNX sessions: the
backbone (task inputs -> features) and the head (features -> the task's outputs). Every head on a
site that names the same backbone blob, whoever owns it, queues into the backbone's one
:class:`BackboneBatcher`: a batch runs the backbone once over all its rows, then each head once over
its own rows (the rows of one head are batched together), and each request gets its head's rows
back. The batch window is the plain batcher's, from the tightest deadline in the batch.

Under load the executor thread that finishes a batch takes the next one itself (``BackboneBatcher._chain``)
when the loop would form it at once anyway, and hands only the answers to the loop: one backbone serves every
tenant of the site, so a slot handed back to a loop busy answering a hundred requests would leave the cores
idle for hundreds of microseconds per batch (measured in bench.shared_backbone's deployment: a sixth of the
backbone's time at 16 k requests/s).

Which heads share an instance is the host's decision (``edge_agent.host``): a tenant whose isolation
is ``strict`` gets a backbone instance and batcher of its own, so its rows never meet another
tenant's. Any family plugs in the same way: the backbone's first output is the feature tensor, the
head's first input takes it (a MiniLM encoder with topic / intent heads, say, needs no code here).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import numpy as np

from edge_agent.batch_parts import InferFn, Part, batch_window_s, fail_batch
from edge_agent.batching import Batcher
from mesh.errors import Overloaded
from variant_store.runtimes.base import Runtime

__all__ = ["BackboneBatcher", "measure_compute_ms"]

ComputeFn = Callable[[int], float]
# The most rows one backbone run takes, however many heads feed it. On CPU a 2048-wide MLP backbone
# costs 210 us a row in batches of 32, 140 in 64, 122 in 128 (one core): past ~128 little is left to win,
# and a bigger batch only holds its rows longer.
BATCH_CAP = 128
# How long one executor thread may go on taking the backbone's next batches itself (``BackboneBatcher._chain``)
# before it hands the slot back to the loop, so that other variants' batches queued for the same executor get
# their turn; a hand-off costs a few hundred microseconds.
CHAIN_MAX_S = 0.05
# Batch sizes a backbone is timed at when it loads (its cost model interpolates between them).
TIMED_SIZES = (1, 32, BATCH_CAP)


class BackboneBatcher(Batcher):
    """The batcher of one backbone instance; ``lane`` of a request = the head it goes to."""

    shared_backbone = True

    def __init__(self, name: str, base: Runtime, *, executor: Executor | None, compute_ms: ComputeFn,
                 max_batch: int = 32, max_window_ms: float = 4.0, site: str = "", parallel: int = 1,
                 batch_cap: int = BATCH_CAP) -> None:
        # lane -> (head runtime, its input name, its profile). Read from executor threads: a dict
        # lookup is atomic, and a head removed mid-batch fails only its own rows.
        self._heads: dict[str, tuple[Runtime, str, ComputeFn]] = {}
        self._base = base
        self._base_ms = compute_ms
        self._feature = base.output_specs[0].name
        # Batches in flight at once. A plain batcher runs one at a time, which is right when every
        # variant has its own; here all the site's heads of this backbone share one queue, so one batch
        # at a time would leave the other inference threads idle: up to ``parallel`` run together
        # (``InferenceSession.run`` is thread-safe).
        self.parallel = max(1, parallel)
        self._slots = asyncio.Semaphore(self.parallel)
        self._running: set[asyncio.Task[None]] = set()
        self._own_batch = max(1, max_batch)
        self.batch_cap = max(self._own_batch, batch_cap)
        self._head_batch: dict[str, int] = {}
        self._costs: dict[int, float] = {}
        self._ends: dict[object, float] = {}  # expected end of each batch computing
        self._slot_taken = False
        self._chain_pauses = 0  # heads being removed: meanwhile a run of batches ends after its batch
        self.chain_max_s = CHAIN_MAX_S  # 0: every batch goes back to the loop
        self.chained = 0  # batches an executor thread took and ran itself (a number to watch)
        self._window_s = 0.0
        super().__init__(name, base.run_checked_sync, executor=executor, compute_ms=self._cost,
                         max_batch=max_batch, max_window_ms=max_window_ms, site=site)

    # Work-conserving batching. A batch is formed once an inference slot is free, from what queued
    # meanwhile, so under load batches fill while the slots compute. A window for companions (the plain
    # batcher's, bounded by the tightest deadline queued) is held only while every other slot is busy:
    # a free slot never waits, so at light load sharing adds no waiting (the heads' traffic together
    # would otherwise keep the window open for every request).
    @property  # type: ignore[override]
    def max_window_s(self) -> float:
        return self._window_s if len(self._ends) >= self.parallel - 1 else 0.0

    @max_window_s.setter
    def max_window_s(self, value: float) -> None:
        self._window_s = value

    def _window_after(self) -> float:
        """The window for the batch a slot that has just finished one would form (itself not counted busy)."""
        return self._window_s if len(self._ends) - 1 >= self.parallel - 1 else 0.0

    async def _one_batch(self) -> None:
        await self._slots.acquire()
        self._slot_taken = False
        try:
            await super()._one_batch()
        finally:
            if not self._slot_taken:  # nothing ran (every request had expired or given up)
                self._slots.release()

    def _began(self, key: object, ends: float) -> None:
        # a slot is free until all are taken. ``key``: the slot's run of batches (see _chain); any thread
        with self._qlock:
            self._ends[key] = ends
            self._busy_until = min(self._ends.values()) if len(self._ends) >= self.parallel else 0.0

    def _ended(self, key: object) -> None:
        """The slot's run ``key`` is over: the slot is free."""
        with self._qlock:
            self._ends.pop(key, None)
            self._busy_until = min(self._ends.values()) if len(self._ends) >= self.parallel else 0.0
        self._slots.release()
        self._costs.clear()
        # a window held because every other slot was busy closes now that one is free
        if self._queue:
            self._wake.set()

    def _cost(self, rows: int) -> float:
        # the backbone's measured cost plus the dearest head's: heads are small next to a backbone.
        # Asked for twice per request; the heads' profiles can change (self-measured ones arrive), so
        # the answers are kept only until the next batch ends or a head comes or goes.
        cost = self._costs.get(rows)
        if cost is None:
            heads = [h[2](rows) for h in list(self._heads.values())]
            cost = self._costs[rows] = self._base_ms(rows) + (max(heads) if heads else 0.0)
        return cost

    @property
    def heads(self) -> frozenset[str]:
        return frozenset(self._heads)

    def add_head(self, lane: str, head: Runtime, compute_ms: ComputeFn, max_batch: int | None = None) -> None:
        """Route ``lane``'s rows to ``head``. ``max_batch``: the most rows the head's variant batches
        (its profile's largest batch); a batch of the backbone may hold that many of every head's."""
        self._heads[lane] = (head, head.input_specs[0].name, compute_ms)
        self._head_batch[lane] = max(1, max_batch or self._own_batch)
        self._resize()
        self._costs.clear()

    def _resize(self) -> None:
        # One backbone run serves every head's rows: a batch may hold a full batch of each head, up to
        # the backbone's own cap. With one head it batches as that head's own batcher would.
        self.max_batch = max(self._own_batch, min(self.batch_cap, sum(self._head_batch.values())))

    def infer_for(self, lane: str) -> InferFn:
        """The backbone then ``lane``'s head, on one batch (raises ``Overloaded`` if the head is not loaded)."""
        def run(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            head = self._heads.get(lane)
            if head is None:
                raise Overloaded(f"head {lane} is not loaded on backbone {self.variant_id}")
            runtime, in_name, _ = head
            return runtime.run_checked_sync({in_name: self._base.run_checked_sync(inputs)[self._feature]})
        return run

    async def remove_head(self, lane: str, wait_s: float = 10.0) -> None:
        """Stop routing rows to ``lane``; returns once no batch that may still use its head runs,
        so the caller can close the head's session. Rows still queued for it fail (``Overloaded``)."""
        self._heads.pop(lane, None)
        self._head_batch.pop(lane, None)
        self._resize()
        self._costs.clear()
        # batches started from now on look the head up and miss it; wait for those already running, a run
        # of batches (_chain) ending after its current one (inline runs hold the event loop, so none of
        # them can be under way here)
        if self._running:
            self._chain_pauses += 1
            try:
                await asyncio.wait(set(self._running), timeout=wait_s)
            finally:
                self._chain_pauses -= 1

    async def _run(self, batch: list[Any], rows: int) -> None:
        """Start a run of batches on the slot ``_one_batch`` took and return (the loop forms the next)."""
        try:
            merged = self._merge(batch)
        except Exception as exc:  # nothing runs: the slot goes back in _one_batch
            fail_batch(batch, exc)
            return
        self._slot_taken = True
        key = object()
        started = time.monotonic()
        self._began(key, started + self._compute_ms(rows) / 1000.0)
        loop = asyncio.get_running_loop()
        try:
            running = loop.run_in_executor(self._executor, self._chain, loop, key, batch, rows, merged, started)
        except Exception as exc:  # an executor shut down refuses work: the batch fails, its slot goes back
            fail_batch(batch, exc)
            self._ended(key)
            return
        task = asyncio.create_task(self._chain_done(key, running), name=f"batch:{self.variant_id}")
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _chain_done(self, key: object, running: asyncio.Future[None]) -> None:
        try:
            await running
        finally:
            self._ended(key)

    def _chain(self, loop: asyncio.AbstractEventLoop, key: object, batch: list[Any], rows: int,
               merged: dict[str, np.ndarray], started: float) -> None:
        """On an executor thread: run the batch, then, while requests are queued that the loop would batch at
        once (no window to hold), take and run the next batch here, each answered on the loop. Handing a
        finished batch's slot back to the loop costs a thread hand-off (hundreds of microseconds when the loop
        is busy answering the last batch's requests)."""
        since = started
        while True:
            try:
                parts: list[dict[str, np.ndarray] | Exception] | Exception = self._execute(
                    merged, [(it.lane, it.rows) for it in batch])
            except Exception as exc:
                parts = exc
            done = time.monotonic()
            nxt: tuple[list[Any], int, list[Any]] = ([], 0, [])
            try:
                nxt = self._take_now(done, since)
                merged = self._merge(nxt[0]) if nxt[0] else merged
            except Exception as exc:  # the next batch goes back to its callers as an error, this one is answered
                loop.call_soon_threadsafe(fail_batch, nxt[0], exc)
                nxt = ([], 0, nxt[2])
            if nxt[0]:
                self._began(key, done + self._compute_ms(nxt[1]) / 1000.0)
            loop.call_soon_threadsafe(self._answered, batch, rows, started, done, parts, nxt[2])
            if not nxt[0]:
                return
            with self._qlock:
                self.chained += 1
            batch, rows, started = nxt[0], nxt[1], done

    def _take_now(self, now: float, since: float) -> tuple[list[Any], int, list[Any]]:
        """The next batch, if the loop would form it now (requests queued, the batcher running, no window to
        hold for companions) and this run of batches, begun at ``since``, is not over ``chain_max_s``."""
        if now - since > self.chain_max_s or self._task is None or self._chain_pauses:
            return [], 0, []
        with self._qlock:  # (another slot may take the head meanwhile: _take pops whatever is there then)
            head = self._queue[0] if self._queue else None
            queued, tightest = self._queued_rows, self._tightest
        if head is None:
            return [], 0, []
        if queued < self.max_batch and self._skip_windows == 0:
            window = batch_window_s([tightest - now], self._compute_ms(queued) / 1000.0, self._window_after(),
                                    expected_gap_s=self.ewma_gap_s)
            if head.enqueued + window > now:
                return [], 0, []
        return self._take(now)

    def _answered(self, batch: list[Any], rows: int, started: float, done: float,
                  parts: list[dict[str, np.ndarray] | Exception] | Exception, expired: list[Any]) -> None:
        self._expire(expired)
        self._costs.clear()
        if isinstance(parts, Exception):
            fail_batch(batch, parts)
            return
        self._answer(batch, rows, started, done, parts)

    async def stop(self) -> None:
        await super().stop()
        # batches already computing finish (an executor run cannot be interrupted); their callers
        # get their answers
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)

    def _execute(self, merged: dict[str, np.ndarray], parts: list[Part]
                 ) -> list[dict[str, np.ndarray] | Exception]:
        feats = self._base.run_checked_sync(merged)[self._feature]
        # rows of each lane, in order: one head run per lane
        by_lane: dict[str, list[int]] = {}
        for i, (lane, _) in enumerate(parts):
            by_lane.setdefault(lane, []).append(i)
        single = all(rows == 1 for _, rows in parts)  # one-row requests: part i is row i
        starts = None if single else np.cumsum([0] + [rows for _, rows in parts])
        out: list[dict[str, np.ndarray] | Exception] = [Overloaded("no head")] * len(parts)
        for lane, idx in by_lane.items():
            head = self._heads.get(lane)
            if head is None:
                err = Overloaded(f"head {lane} is not loaded on backbone {self.variant_id}")
                for i in idx:
                    out[i] = err
                continue
            runtime, in_name, _ = head
            if len(idx) == len(parts):
                lane_feats = feats
            elif starts is None:
                lane_feats = feats[idx]  # one gather
            else:
                lane_feats = feats[np.concatenate([np.arange(starts[i], starts[i + 1]) for i in idx])]
            try:
                res = runtime.run_checked_sync({in_name: lane_feats})
            except Exception as exc:  # one head failing fails its own rows only
                for i in idx:
                    out[i] = exc
                continue
            offset = 0
            for i in idx:
                rows = parts[i][1]
                out[i] = {k: v[offset:offset + rows] for k, v in res.items()}
                offset += rows
        return out


def measure_compute_ms(runtime: Runtime, sizes: tuple[int, ...] = TIMED_SIZES, repeats: int = 5,
                       budget_ms: float = 50.0) -> ComputeFn:
    """A piecewise-linear cost model (ms per batch of n rows) from timing ``runtime`` on zero inputs at
    ``sizes`` (median of ``repeats`` each; a size whose run took over ``budget_ms`` is the last timed,
    so a heavy encoder loads in a few hundred ms at most). Between two timed sizes it interpolates;
    past the ends it extends the nearest segment. Used for a backbone, whose profile a head's metadata
    does not carry; off the event loop."""
    def zeros(dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
        if np.dtype(dtype) == np.dtype(object):  # a BYTES (text) input: a short sentence per row
            return np.full(shape, b"a short sentence to time the encoder with", dtype=object)
        return np.zeros(shape, dtype=dtype)

    def once(n: int) -> float:
        feed = {s.name: zeros(s.dtype, (n, *[d if d > 0 else 1 for d in s.shape[1:]]))
                for s in runtime.input_specs}
        runtime.run_checked_sync(feed)  # warm
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            runtime.run_checked_sync(feed)
            times.append((time.perf_counter() - t0) * 1000.0)
        return float(np.median(times))

    xs: list[int] = []
    ys: list[float] = []
    for n in sorted(set(sizes)):
        xs.append(n)
        ys.append(once(n))
        if ys[-1] > budget_ms:
            break
    return _piecewise(xs, ys)


def _piecewise(xs: list[int], ys: list[float]) -> ComputeFn:
    """Through the points (xs ascending), never decreasing, extended linearly past both ends."""
    ys = list(np.maximum.accumulate(ys))
    if len(xs) == 1:
        return lambda n: ys[0] * max(1, n) / xs[0]
    segs = [(xs[i], ys[i], (ys[i + 1] - ys[i]) / max(1, xs[i + 1] - xs[i])) for i in range(len(xs) - 1)]

    def cost(n: int) -> float:
        for x0, y0, slope in reversed(segs):
            if n >= x0:
                return y0 + slope * (n - x0)
        x0, y0, slope = segs[0]
        return max(0.0, y0 - slope * (x0 - n))

    return cost
