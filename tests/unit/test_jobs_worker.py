"""The chunk worker yields to online work between batches (online always wins) and stops a chunk whose lease is
lost: ``ChunkWorker._run`` against fakes of its data client, host and runtime (the real ones run in
tests/integration/test_jobs_e2e.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from core_scheduler.state.jobs import JobView, SeenChunk
from edge_agent.chunks import ChunkWorker
from mesh.errors import ConflictError
from mesh.jobspec import ChunkRecord, JobRecord
from variant_store.meta import VariantMeta

pytestmark = pytest.mark.unit


class _Runtime:
    def __init__(self) -> None:
        self.batches: list[int] = []

    async def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.batches.append(len(inputs["x"]))
        return {"y": inputs["x"].sum(axis=1, keepdims=True)}


class _Host:
    base = None  # a plain variant: no backbone

    def __init__(self) -> None:
        self.runtime = _Runtime()

    async def ensure(self, meta: VariantMeta, isolated_for: str = "") -> Any:
        return self


class _View:
    topology = None


class _Data:
    def __init__(self, path: Path) -> None:
        self.path = path

    async def get_file(self, tenant: str, digest: str, path: Path, *, max_bytes: int) -> Path:
        return self.path


class _Lease:
    alive = True


def _setup(tmp: Path, busy: list[bool]) -> tuple[ChunkWorker, JobView, SeenChunk, _Host]:
    x = np.arange(40, dtype=np.float32).reshape(10, 4)
    np.savez(tmp / "in.npz", x=x)
    host = _Host()
    worker = ChunkWorker("edge-1", cast(Any, None), cast(Any, _View()), cast(Any, host),
                         cast(Any, _Data(tmp / "in.npz")), tmp, lambda: busy[0], batch_rows=3, pause_s=0.001)
    job = JobRecord(job_id="a" * 32, task="t", tenant="acme", min_accuracy=0.0, deadline=2e9, input_digest="b" * 64,
                    rows=10, input_format="npz", chunk_rows=10)
    seen = SeenChunk(ChunkRecord(0, 0, 10), 5, None)
    return worker, JobView(job, 1, (seen,)), seen, host


async def test_a_chunk_waits_while_online_work_is_in_flight(tmp_path: Path) -> None:
    busy = [True]
    worker, view, seen, host = _setup(tmp_path, busy)
    meta = cast(VariantMeta, type("M", (), {"inputs": [{"name": "x"}]})())
    run = asyncio.create_task(worker._run(view, seen, meta, cast(Any, _Lease())))
    try:
        await asyncio.sleep(0.05)
        assert host.runtime.batches == [] and not run.done()  # online in flight: not one batch ran
        busy[0] = False
        out = await asyncio.wait_for(run, 5)
    finally:
        run.cancel()
    assert host.runtime.batches == [3, 3, 3, 1] and worker.paused_s >= 0.04
    assert out["y"][:, 0].tolist() == np.arange(40, dtype=np.float32).reshape(10, 4).sum(axis=1).tolist()


async def test_a_lost_lease_stops_the_chunk(tmp_path: Path) -> None:
    worker, view, seen, host = _setup(tmp_path, [False])
    lease = _Lease()
    lease.alive = False
    meta = cast(VariantMeta, type("M", (), {"inputs": [{"name": "x"}]})())
    with pytest.raises(ConflictError, match="lease lost"):
        await worker._run(view, seen, meta, cast(Any, lease))
    assert host.runtime.batches == []
