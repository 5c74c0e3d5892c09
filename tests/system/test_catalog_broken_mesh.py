"""Issue 34, item 0, end to end: a duplicate variant id and a garbage entry written straight into a running mesh's
catalog stop nothing (the console reports both; the scheduler's rounds go on), and the mesh stopped and started
again on the same home, as ``tiermesh up`` after Ctrl-C, starts and serves with them in its etcd (before:
``agent core-eu exited with 1``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import pytest

from mesh.client import AsyncClient
from mesh.errors import MeshError
from mesh.etcd import messages as rpc
from mesh.etcd.keys import catalog_key
from mesh.etcd.store import Store
from tests.helpers.waiting import eventually
from tests.system.conftest import SMALL_TOPOLOGY, TASK, Holdout, catalog_variants, wait_warm
from tiermesh.harness import LocalMesh
from tiermesh.mesh_options import MeshOptions

pytestmark = [pytest.mark.system, pytest.mark.slow, pytest.mark.timeout(300)]

SITES = ["core-eu", "edge-fra-1"]
EDGE = "edge-fra-1"
MINE = "my-digits"


async def _put_raw(store: Store, key: str, raw: bytes) -> None:
    req = rpc.PutRequest(key=store.prefix.encode() + key.encode(), value=raw)
    await store.call(f"put {key!r}", lambda m, t: m.kv.Put(req, timeout=t))


async def _serves(mesh: LocalMesh, holdout: Holdout) -> Any:
    url = mesh.sites[EDGE].http
    assert url is not None
    async with AsyncClient(url, timeout=10.0) as client:
        for _ in range(120):
            try:
                return await client.infer(TASK, holdout.x[:1], latency_ms=400, min_accuracy=0.9)
            except MeshError:  # a started mesh may still be loading its placement
                await asyncio.sleep(0.25)
    return None


async def _reported(mesh: LocalMesh, keys: set[str]) -> None:
    assert mesh.console is not None
    console = mesh.console.model

    async def reported() -> bool:
        return {b["key"] for b in console.build()["catalog_broken"]} == keys

    await eventually(reported, 20, f"the console reports {sorted(keys)}")


async def test_a_bad_catalog_entry_leaves_the_mesh_serving_and_restartable(
        holdout: Holdout, caplog: pytest.LogCaptureFixture) -> None:
    with tempfile.TemporaryDirectory(prefix="tiermesh-sys-", ignore_cleanup_errors=True) as tmp:
        opts = MeshOptions(topology=SMALL_TOPOLOGY, home=Path(tmp), sites=SITES, console=True)
        mesh = LocalMesh(opts)
        caplog.set_level(logging.WARNING)
        try:
            await mesh.start()
            assert mesh.store is not None and mesh.scheduler is not None
            await wait_warm(mesh, holdout.x)
            variants = await catalog_variants(mesh)
            vid = sorted(variants)[0]
            dup, junk = catalog_key(MINE, vid), catalog_key(MINE, "junk")
            await _put_raw(mesh.store, dup, json.dumps({**variants[vid].to_json(), "task": MINE}).encode())
            await _put_raw(mesh.store, junk, b"\x00not json{")
            rounds = mesh.scheduler.rounds
            reply = await _serves(mesh, holdout)
            assert reply is not None and reply.outputs
            await eventually(lambda: _true(mesh.scheduler.rounds > rounds + 2), 20, "placement rounds go on")  # type: ignore[union-attr]
            snap = mesh.scheduler.snapshots.build()  # what each round plans on (it raised `appears twice`)
            assert snap is not None and snap.variant_by_id[vid].task == TASK and MINE not in snap.variants
            failed = [r.getMessage() for r in caplog.records if "placement round" in r.getMessage()]
            assert not failed and not mesh.scheduler._task.done(), failed  # type: ignore[union-attr]
        finally:
            await mesh.stop()

        again = LocalMesh(opts)  # `tiermesh up` again on the same home: its etcd holds both entries
        try:
            await again.start()
            assert all(sp.proc is not None and sp.proc.returncode is None for sp in again.sites.values())
            reply = await _serves(again, holdout)
            assert reply is not None and reply.outputs, "the restarted mesh serves nothing"
            await _reported(again, {dup, junk})
        finally:
            await again.stop()


async def _true(value: bool) -> bool:
    return value
