"""A backbone shared by several heads: one session, one batcher, batches that span tenants.

A backbone + head variant (``VariantMeta.shared_base_digest``) is served as two ONNX sessions: the
backbone (task inputs -> features) and the head (features -> the task's outputs). Every head on a
site that names the same backbone blob, whoever owns it, queues into the backbone's one
:class:`BackboneBatcher`: a batch runs the backbone once over all its rows, then each head once over
its own rows (the rows of one head are batched together), and each request gets its head's rows
back. The batch window is the plain batcher's, from the tightest deadline in the batch.

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

from edge_agent.batching import Batcher, InferFn, Part
from mesh.errors import Overloaded
from variant_store.runtimes.base import Runtime

__all__ = ["BackboneBatcher", "measure_compute_ms"]

ComputeFn = Callable[[int], float]


class BackboneBatcher(Batcher):
    """The batcher of one backbone instance; ``lane`` of a request = the head it goes to."""

    shared_backbone = True

    def __init__(self, name: str, base: Runtime, *, executor: Executor | None, compute_ms: ComputeFn,
                 max_batch: int = 32, max_window_ms: float = 4.0, site: str = "", parallel: int = 1) -> None:
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
        self._parallel = max(1, parallel)
        self._slots = asyncio.Semaphore(self._parallel)
        self._running: set[asyncio.Task[None]] = set()
        self._slot_taken = False
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
        return self._window_s if len(self._running) >= self._parallel - 1 else 0.0

    @max_window_s.setter
    def max_window_s(self, value: float) -> None:
        self._window_s = value

    async def _one_batch(self) -> None:
        await self._slots.acquire()
        self._slot_taken = False
        try:
            await super()._one_batch()
        finally:
            if not self._slot_taken:  # nothing ran (every request had expired or given up)
                self._slots.release()

    def _cost(self, rows: int) -> float:
        # the backbone's measured cost plus the dearest head's: heads are small next to a backbone
        heads = [h[2](rows) for h in list(self._heads.values())]
        return self._base_ms(rows) + (max(heads) if heads else 0.0)

    @property
    def heads(self) -> frozenset[str]:
        return frozenset(self._heads)

    def add_head(self, lane: str, head: Runtime, compute_ms: ComputeFn) -> None:
        self._heads[lane] = (head, head.input_specs[0].name, compute_ms)

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
        # batches started from now on look the head up and miss it; wait for those already running
        # (inline runs hold the event loop, so none of them can be under way here)
        if self._running:
            await asyncio.wait(set(self._running), timeout=wait_s)

    async def _run(self, batch: list[Any], rows: int) -> None:
        """Start the batch on the slot ``_one_batch`` took and return (the loop forms the next)."""
        self._slot_taken = True
        task = asyncio.create_task(self._run_held(batch, rows), name=f"batch:{self.variant_id}")
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run_held(self, batch: list[Any], rows: int) -> None:
        try:
            await super()._run(batch, rows)
        finally:
            self._slots.release()

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
        starts = np.cumsum([0] + [rows for _, rows in parts])
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
            else:
                lane_feats = np.concatenate([feats[starts[i]:starts[i + 1]] for i in idx], axis=0)
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


def measure_compute_ms(runtime: Runtime, sizes: tuple[int, ...] = (1, 32), repeats: int = 5) -> ComputeFn:
    """A linear cost model (ms per batch of n rows) from timing ``runtime`` on zero inputs at two batch
    sizes (median of ``repeats``). Used for a backbone, whose profile a head's metadata does not carry;
    a few milliseconds at load time, off the event loop."""
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

    lo, hi = min(sizes), max(sizes)
    a, b = once(lo), once(hi)
    slope = max(0.0, (b - a) / max(1, hi - lo))
    fixed = max(0.0, a - slope * lo)
    return lambda n: fixed + slope * n
