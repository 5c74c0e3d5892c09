"""Offline jobs end to end on real parts: the session etcd, a variant store with a data area, and two agents in
process (plain HTTP and ZeroMQ, ``--insecure``: the tenant is the header's) serving the committed tiny MLP through
onnxruntime. A digits job of a few thousand rows submitted through the SDK is answered row for row, in order,
exactly once, with the accuracy the variant measures on the labels; the door's refusals say why; and a job whose
working site stops mid-way is finished by the other."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
import onnxruntime as ort
import pytest

from core_scheduler.policy.jobs import CLAIM_GRACE_S
from core_scheduler.state.jobs import JobBook
from edge_agent.agent import Agent
from edge_agent.agent_config import AgentConfig
from mesh.errors import ConflictError, ImpossibleSLO, UnknownTask
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from mesh.jobs import AsyncJobs, Jobs
from mesh.v2.body import TENANT_HEADER
from tests.integration.test_quota_flood import MODEL, TASK, _catalog
from tiermesh.cli.main import main as cli
from topology.loader import load_topology_file
from topology.store_io import apply as apply_topology
from variant_store.blobs import BlobStore
from variant_store.catalog import Catalog
from variant_store.data_area import DataArea
from variant_store.families.datasets import load_validation_npz
from variant_store.server import VariantStoreServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SMALL = Path(__file__).resolve().parents[1] / "data" / "topology_small.yaml"
VID = "mlp-tiny.onnx.fp32"
CHEAP, DEAR = "edge-fra-1", "edge-par-1"  # 0.21 and 0.23 USD per core-hour in topology_small.yaml


def _rows(times: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """The held-out digits ``times`` over: (x, labels, the variant's own logits, its measured accuracy)."""
    val = load_validation_npz()
    x = np.tile(val.x[val.calib_count:], (times, 1))
    y = np.tile(val.y[val.calib_count:], times)
    logits = ort.InferenceSession(str(MODEL), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    return x, y, logits, float((logits.argmax(1) == y).mean())


@dataclass
class Mesh:
    store: Store
    agents: dict[str, Agent]
    area: DataArea


@asynccontextmanager
async def _mesh(store: Store, etcd: EmbeddedEtcd, tmp: Path, accuracy: float) -> AsyncIterator[Mesh]:
    text = SMALL.read_text()
    path = tmp / "topology.yaml"  # acme as in the file; globex with a tiny data quota (below)
    path.write_text(text)
    await apply_topology(store, load_topology_file(path))
    blobs = BlobStore(tmp / "blobs")
    await _catalog(store, blobs)
    cat = Catalog(store)
    meta = next(m for m in await cat.list_variants(TASK) if m.variant_id == VID)
    meta.accuracy = accuracy  # measured here, on the rows the job sends
    await cat.put_variant(meta)
    area = DataArea(tmp / "data", quota_bytes=8 << 20, quotas={"globex": 1000})
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(VariantStoreServer(blobs, cat, host="127.0.0.1", data=area))
        agents = {}
        for site in (CHEAP, DEAR):
            # a query's body may hold 256 KiB; a job's input (930 KB here) is streamed past that bound, never read whole
            cfg = AgentConfig(site=site, etcd=etcd.url, prefix=store.prefix, home=tmp / site, lease_ttl_s=2.0,
                              heartbeat_s=0.5, insecure=True, max_body_bytes=256 * 1024)
            agents[site] = await stack.enter_async_context(Agent(cfg))
        for _ in range(200):  # bounded: the store's announcement and both heartbeats reach every view
            if all(a.host is not None and a.host.blobs.store_url and a.view is not None
                   and {CHEAP, DEAR} <= set(a.view.live) for a in agents.values()):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the mesh never came up")
        yield Mesh(store, agents, area)


async def test_a_digits_job_is_answered_once_per_row_with_the_measured_accuracy(
        store: Store, etcd_server: EmbeddedEtcd, tmp_path: Path) -> None:
    x, y, want, accuracy = _rows(7)
    async with _mesh(store, etcd_server, tmp_path, accuracy) as mesh, \
            AsyncJobs(mesh.agents[CHEAP].http_url, tenant="acme") as jobs:
        job = await jobs.submit(TASK, x, min_accuracy=0.9, deadline_s=600)
        assert job.admitted["variant"] == VID and job.admitted["rows"] == len(x) == 3633
        seen: list[float] = []
        status = await job.wait(poll_s=0.1, timeout=120, progress=lambda st: seen.append(st["progress"]))
        assert status["state"] == "done" and status["rows_done"] == len(x) and seen[-1] == 1.0
        out = (await job.result())["logits"]
        assert out.shape == want.shape  # every row answered, none twice
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)  # each row's own answer, in input order
        assert float((out.argmax(1) == y).mean()) == pytest.approx(accuracy, abs=1e-9)
        v = await JobBook(store).view(job.id)
        assert v is not None and all(c.chunk.state == "done" for c in v.chunks)
        assert sum(c.chunk.rows for c in v.chunks) == len(x)
        if v.job.updated - v.job.created < CLAIM_GRACE_S:  # the dearer site may help only after the grace
            assert {c.chunk.site for c in v.chunks} == {CHEAP}  # the cheaper idle site took every chunk
        # the same job seen from the other door, as JSON lines; and as nobody else's
        async with AsyncJobs(mesh.agents[DEAR].http_url, tenant="acme") as other:
            lines = (await other.result_bytes(TASK, job.id, "jsonl")).decode().splitlines()
            assert len(lines) == len(x) and np.allclose(json.loads(lines[5]), want[5], atol=1e-4)
            assert [j["id"] for j in await other.list()] == [job.id]
        async with aiohttp.ClientSession() as http:
            url = f"{mesh.agents[CHEAP].http_url}/v2/models/{TASK}/jobs"
            async with http.get(f"{url}/{job.id}", headers={TENANT_HEADER: "globex"}) as r:
                assert r.status == 404  # another tenant's job does not exist for globex
            async with http.delete(f"{url}/{job.id}", headers={TENANT_HEADER: "acme"}) as r:
                body = await r.json()
                assert r.status == 409 and "done" in body["error"] and "nothing to cancel" in body["error"]
            async with http.post(url, params={"format": "jsonl"}, data=b"[1, 2]\n[3, 4]\n[5\n",
                                 headers={TENANT_HEADER: "acme"}) as r:
                assert r.status == 400 and "line 3" in (await r.json())["error"]
            async with http.post(url, params={"format": "jsonl", "chunk_rows": "1.5"}, data=b"[1]\n",
                                 headers={TENANT_HEADER: "acme"}) as r:
                assert r.status == 400 and "chunk_rows" in (await r.json())["error"]
            async with http.post(url, params={"format": "jsonl"}, data=b"[0.5]\n" * 300,
                                 headers={TENANT_HEADER: "globex"}) as r:
                body = await r.json()
                assert r.status == 413 and "quota" in body["error"] and "1000" in body["error"]
        with pytest.raises(UnknownTask):
            await jobs.submit("no-such-task", x[:10])
        with pytest.raises(ImpossibleSLO, match="best feasible deadline is"):
            await jobs.submit(TASK, x, deadline_s=1)
        with pytest.raises(ImpossibleSLO, match="min_accuracy"):
            await jobs.submit(TASK, x[:10], min_accuracy=0.999)
        with pytest.raises(ImpossibleSLO, match="max_cost"):
            await jobs.submit(TASK, x, max_cost=1e-9)
        small = await jobs.submit(TASK, x[:10], chunk_rows=5, deadline_s=600)
        try:  # cancelled while it runs, or done first: either way a second cancel is a conflict
            assert (await small.cancel())["state"] == "cancelled"
            assert (await small.status())["state"] == "cancelled"
        except ConflictError:
            assert (await small.status())["state"] == "done"
        with pytest.raises(ConflictError, match="nothing to cancel"):
            await small.cancel()
        assert mesh.area.used("acme") > x.nbytes  # the input, stored in the tenant's data area
        # the synchronous SDK and the command line, off this loop (each runs its own)
        rows = tmp_path / "rows.jsonl"
        rows.write_text("".join(json.dumps(r.tolist()) + "\n" for r in x[:50]))
        url = mesh.agents[CHEAP].http_url

        def sync_sdk() -> np.ndarray:
            with Jobs(url, tenant="acme") as sync:
                done = sync.submit(TASK, rows, deadline_s=600)
                assert done.wait(poll_s=0.1, timeout=60)["state"] == "done"
                return done.result()["logits"]

        np.testing.assert_allclose(await asyncio.to_thread(sync_sdk), want[:50], rtol=1e-4, atol=1e-4)
        out_file = tmp_path / "cli.jsonl"
        assert await asyncio.to_thread(cli, ["jobs", "submit", "--edge", url, "--tenant", "acme", TASK, str(rows),
                                             "--wait", "--deadline-s", "600"]) == 0
        listed = await jobs.list(TASK)
        assert await asyncio.to_thread(cli, ["jobs", "result", "--edge", url, "--tenant", "acme", TASK,
                                             listed[0]["id"], "--out", str(out_file), "--format", "jsonl"]) == 0
        assert len(out_file.read_text().splitlines()) == 50
        assert await asyncio.to_thread(cli, ["jobs", "cancel", "--edge", url, "--tenant", "acme", TASK,
                                             listed[0]["id"]]) == 1  # done: a conflict, said on stderr


async def test_a_job_whose_site_stops_is_finished_by_another(
        store: Store, etcd_server: EmbeddedEtcd, tmp_path: Path) -> None:
    x, _, want, accuracy = _rows(7)
    async with _mesh(store, etcd_server, tmp_path, accuracy) as mesh, \
            AsyncJobs(mesh.agents[DEAR].http_url, tenant="acme") as jobs:
        cheap = mesh.agents[CHEAP]
        job = await jobs.submit(TASK, x, chunk_rows=32, deadline_s=600)
        for _ in range(3000):  # bounded (30 s): the cheap site starts on it within a poll
            if cheap.chunks is not None and cheap.chunks.chunks_done >= 3:
                break
            await asyncio.sleep(0.01)
        assert cheap.chunks is not None and cheap.chunks.chunks_done >= 3
        await cheap.stop()  # mid-job: its claim goes with its lease, its heartbeat with its liveness
        status = await job.wait(poll_s=0.1, timeout=120)
        assert status["state"] == "done"
        out = (await job.result())["logits"]
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
        v = await JobBook(store).view(job.id)
        assert v is not None
        by = {site: sum(c.chunk.rows for c in v.chunks if c.chunk.site == site) for site in (CHEAP, DEAR)}
        assert by[CHEAP] > 0 and by[DEAR] > 0 and by[CHEAP] + by[DEAR] == len(x), by
