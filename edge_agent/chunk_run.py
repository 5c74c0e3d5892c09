"""Running one chunk's rows on a loaded variant, batch by batch, yielding to online work between batches.

Online always wins: before each batch the run waits while online queries are in flight at this site
(``online_busy()``), so a chunk adds at most one batch's compute to an arriving query's wait; and it stops at the
first batch after its claim's lease is lost (another site may be running the chunk by then: its outputs would be
refused at commit anyway, and the compute is better left to online work).

Numbers go to the variant's runtime as its task input. Text rows go in as the Open Inference Protocol's ``BYTES``
tensor (an object array of UTF-8 ``bytes``: the text runtime tokenizes, ``variant_store.runtimes.text``), in
batches of at most ``TEXT_BATCH_ROWS``: an encoder's batch costs tens of milliseconds where a digits MLP's costs
one, and the batch is what an online query may wait behind. Every text variant in the catalog is a head on a shared
backbone (``variant_store.families.text``), so a head runs as the online path runs it
(``edge_agent.backbone.BackboneBatcher.infer_for``): the backbone's session over the rows, its first output (the
features) into the head's first input. The sessions are the site's loaded ones, called directly, outside the
online batcher: a chunk's rows never share a batch with anyone's, and a ``strict`` tenant's chunk runs on that
tenant's own instance (the caller asks the host for it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from mesh.errors import ConflictError
from variant_store.runtimes.base import Runtime

__all__ = ["TEXT_BATCH_ROWS", "ChunkRun", "batches", "run_rows"]

TEXT_BATCH_ROWS = 32  # a MiniLM encoder's batch: tens of ms on a core (what an online query may wait behind)

Infer = Callable[[np.ndarray], Awaitable[dict[str, np.ndarray]]]


@dataclass(slots=True)
class ChunkRun:
    """What a run of rows took: ``compute_s`` in the runtimes, ``paused_s`` waiting for online work to pass."""

    compute_s: float = 0.0
    paused_s: float = 0.0
    batch_sizes: list[int] = field(default_factory=list)


def batches(rows: int, batch_rows: int, text: bool) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` batches a chunk of ``rows`` runs in (so a reference can recompute them the same way: a
    dynamically quantized variant's answer to a row depends on the batch it ran in)."""
    step = max(1, min(batch_rows, TEXT_BATCH_ROWS) if text else batch_rows)
    return [(lo, min(rows, lo + step)) for lo in range(0, rows, step)]


def _as_bytes(x: np.ndarray) -> np.ndarray:
    return np.array([s.encode("utf-8") if isinstance(s, str) else bytes(s) for s in x.reshape(-1)], dtype=object)


def feed(runtime: Runtime, input_name: str, base: Runtime | None = None) -> Infer:
    """How a batch of rows reaches the variant: its runtime alone, or ``base`` (its backbone) then it."""
    if base is None:
        return lambda x: runtime.infer({input_name: x})
    feature = base.output_specs[0].name
    base_in = base.input_specs[0].name

    async def through(x: np.ndarray) -> dict[str, np.ndarray]:
        feats = (await base.infer({base_in: x}))[feature]
        return await runtime.infer({runtime.input_specs[0].name: feats})

    return through


async def run_rows(x: np.ndarray, infer: Infer, *, batch_rows: int, online_busy: Callable[[], bool],
                   lease_alive: Callable[[], bool], pause_s: float, what: str,
                   tally: ChunkRun) -> dict[str, np.ndarray]:
    """The variant's outputs for rows ``x`` (numbers, or text as an object array), one output array per name, rows
    in order. ``what`` names the chunk in the error a lost lease raises (``ConflictError``)."""
    text = x.dtype == object
    parts: dict[str, list[np.ndarray]] = {}
    for lo, hi in batches(len(x), batch_rows, text):
        while True:
            if not lease_alive():
                raise ConflictError(f"lease lost mid-{what}: another site may take it")
            if not online_busy():
                break
            t0 = time.monotonic()  # online always wins: wait between batches while it has work here
            await asyncio.sleep(pause_s)
            tally.paused_s += time.monotonic() - t0
        batch = _as_bytes(x[lo:hi]) if text else x[lo:hi]
        started = time.perf_counter()
        out = await infer(batch)
        tally.compute_s += time.perf_counter() - started
        tally.batch_sizes.append(hi - lo)
        for k, arr in out.items():
            parts.setdefault(k, []).append(np.asarray(arr))
    return {k: np.concatenate(arrs) for k, arrs in parts.items()}
