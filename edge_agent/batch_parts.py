"""What a batch is made of: a queued request, what it gets back, the window rule, the error for a batch
that could not run. Shared by the plain batcher (``edge_agent.batching``) and a shared backbone's
(``edge_agent.backbone``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from mesh.errors import MeshError

__all__ = ["BatchResult", "InferFn", "Part", "Queued", "batch_window_s", "fail_batch"]

InferFn = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]
# One request's share of a batch, as ``Batcher._execute`` sees it: (lane, rows). A plain batcher
# has one lane; a shared backbone's batcher (edge_agent.backbone) has one per head.
Part = tuple[str, int]


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
    tenants: int = 1          # distinct tenants whose requests were in the batch
    shared_backbone: bool = False  # run through a backbone shared by several heads (edge_agent.backbone)


@dataclass(slots=True)
class Queued:
    """A request waiting in a batcher's queue (``lane``: the head it goes to, behind a shared backbone)."""

    inputs: dict[str, np.ndarray]
    rows: int
    deadline: float
    enqueued: float
    future: asyncio.Future[BatchResult] = field(repr=False)
    lane: str = ""
    tenant: str = ""


def fail_batch(batch: list[Queued], exc: Exception) -> None:
    """Every request of a batch that could not run gets the error (a ``MeshError``)."""
    err = exc if isinstance(exc, MeshError) else MeshError(f"inference failed: {exc}")
    for it in batch:
        if not it.future.done():
            it.future.set_exception(err)
