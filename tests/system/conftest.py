"""Fixtures for system tests: a real local mesh (etcd, variant store, scheduler, one agent process
per site behind WAN delay proxies) on the small topology, warmed before it is measured.

A mesh started here is always stopped in ``finally`` (agents, proxies, etcd), and its home
directory removed, even when the test or the start-up fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from mesh.client import AsyncClient
from mesh.errors import MeshError
from mesh.etcd.keys import live_key
from tiermesh.harness import LocalMesh
from tiermesh.mesh_options import MeshOptions
from tiermesh.workload import DEFAULT_CLASSES
from variant_store.catalog import Catalog
from variant_store.families.datasets import load_validation_npz
from variant_store.meta import VariantMeta

__all__ = [
    "SMALL_TOPOLOGY",
    "TASK",
    "Holdout",
    "catalog_variants",
    "mesh_running",
    "wait_warm",
]

TASK = "digit-classification"
SMALL_TOPOLOGY = Path(__file__).resolve().parents[1] / "data" / "topology_small.yaml"
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, slots=True)
class Holdout:
    """Labelled digits no model saw in training or calibration."""

    x: np.ndarray
    y: np.ndarray


@pytest.fixture(scope="session")
def holdout() -> Holdout:
    val = load_validation_npz()
    return Holdout(x=val.x[val.calib_count:], y=val.y[val.calib_count:])


async def catalog_variants(mesh: LocalMesh, task: str = TASK) -> dict[str, VariantMeta]:
    assert mesh.store is not None
    return {m.variant_id: m for m in await Catalog(mesh.store).list_variants(task)}


async def _unplaced(mesh: LocalMesh, names: list[str]) -> dict[str, str]:
    """Sites whose placement is missing, empty or not yet loaded, and why (empty: all placed)."""
    assert mesh.store is not None
    out: dict[str, str] = {}
    for name in names:
        place = await mesh.store.get(f"placement/{name}")
        live = await mesh.store.get(live_key(name))
        if place is None or live is None:
            out[name] = "no placement" if place is None else "not live"
            continue
        want = {v["variant_id"] for v in place.value.get("variants", [])}
        missing = want - set(live.value.get("loaded") or {})
        if not want or missing:
            out[name] = "placement empty" if not want else f"not loaded yet: {sorted(missing)}"
    return out


async def wait_warm(mesh: LocalMesh, x: np.ndarray, *, timeout_s: float = 90.0) -> None:
    """Wait for the scheduler's first real placement to be loaded everywhere, then send a few
    queries of every SLO class through every edge so that cold starts (variant loads on first
    use, first ZeroMQ connections) are behind us before anything is measured.

    ``LocalMesh.wait_placed`` returns as soon as each placement key exists, and the first plan
    the scheduler writes is empty (no demand seen yet), so it does not wait for this."""
    deadline = time.monotonic() + timeout_s
    names = mesh.running_sites()
    edges = mesh.edge_urls()
    files = mesh.tenant_files("public") if mesh.pki is not None else {}
    clients = [AsyncClient(url, timeout=5.0, **files) for url in edges.values()]
    try:
        rounds = 0
        while time.monotonic() < deadline:
            rounds += 1
            for c in clients:
                for cls in DEFAULT_CLASSES:
                    with contextlib.suppress(MeshError):
                        await c.infer(TASK, x[rounds % len(x)][None, :], latency_ms=cls.latency_ms,
                                      min_accuracy=cls.min_accuracy, prefer=cls.prefer)
            # a few rounds after placement settles, so routing has seen the loaded variants
            if rounds >= 5 and not await _unplaced(mesh, names):
                for _ in range(3):
                    for c in clients:
                        for cls in DEFAULT_CLASSES:
                            with contextlib.suppress(MeshError):
                                await c.infer(TASK, x[:1], latency_ms=cls.latency_ms,
                                              min_accuracy=cls.min_accuracy, prefer=cls.prefer)
                    await asyncio.sleep(0.3)
                return
            await asyncio.sleep(0.3)
    finally:
        for c in clients:
            await c.aclose()
    pending = await _unplaced(mesh, names)
    pytest.fail(f"mesh placement not loaded everywhere within {timeout_s:.0f} s: {pending}")


@contextlib.asynccontextmanager
async def mesh_running(**options: Any) -> AsyncIterator[LocalMesh]:
    """A started ``LocalMesh`` on the small topology (or ``topology=``) in a private home; stopped and removed
    after."""
    topology = options.pop("topology", SMALL_TOPOLOGY)
    with tempfile.TemporaryDirectory(prefix="tiermesh-sys-", ignore_cleanup_errors=True) as tmp:
        mesh = LocalMesh(MeshOptions(topology=topology, home=Path(tmp), **options))
        try:
            await mesh.start()
            yield mesh
        finally:
            await mesh.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def small_mesh(holdout: Holdout) -> AsyncIterator[LocalMesh]:
    """One warmed mesh shared by a module's tests (none of which may kill or cut anything)."""
    async with mesh_running() as mesh:
        await wait_warm(mesh, holdout.x)
        yield mesh
