"""The text family's two-stage pipeline (issue 33, item 2) on a live mesh (small topology, TLS): ``text-section``
(globex's) is ``text-group`` then a per-group head on the same embedding. Served end to end through the SDK and
through unmodified ``tritonclient.http``; every reply names each stage's task (by its variant), site, variant and
timing, and the accuracy is the one measured end to end and catalogued. Each stage is an ordinary query of its
task: the mesh routes and places it as any (the stages may run at different sites)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import numpy as np
import pytest

from mesh.client import AsyncClient, InferResult
from mesh.errors import MeshError
from tests.system.conftest import mesh_running
from tiermesh.harness import LocalMesh
from variant_store.families.text_corpus import GROUPS, SECTIONS, load_corpus
from variant_store.pipeline_catalog import get_pipeline
from variant_store.text_pipeline import PIPELINE_TASK, group_task

pytestmark = [pytest.mark.system, pytest.mark.slow]
EDGE = "edge-fra-1"
SLO: dict[str, Any] = {"latency_ms": 3000}
TEXTS = ["Real-time strategy game of ancient warfare", "IMAP and POP3 mail client"]


async def _answer(client: AsyncClient, texts: Any) -> InferResult:
    """An answer, waiting out cold starts: the encoder and heads are fetched and loaded on first use, and a site
    may fetch globex's private heads only once placement has it serve globex (a stage routed to a site before
    that fails, as any query of a private task does)."""
    deadline, last = time.monotonic() + 150, ""
    while time.monotonic() < deadline:
        try:
            return await client.infer(PIPELINE_TASK, texts, **SLO)
        except MeshError as exc:
            last = f"{exc.code}: {exc}"
        await asyncio.sleep(0.5)
    pytest.fail(f"{PIPELINE_TASK} not served within 150 s: {last}")


def _tritonclient(mesh: LocalMesh, http: str) -> dict[str, Any]:
    import tritonclient.http as tritonhttp

    files = mesh.tenant_files("globex")
    options = {"ca_certs": str(files["ca"]), "certfile": str(files["cert"]), "keyfile": str(files["key"])}
    c = tritonhttp.InferenceServerClient(http.removeprefix("https://"), ssl=True, ssl_options=options,
                                         network_timeout=60.0)
    try:
        meta = c.get_model_metadata(PIPELINE_TASK)
        inp = tritonhttp.InferInput("text", [len(TEXTS)], "BYTES")
        inp.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=np.object_))
        res = c.infer(PIPELINE_TASK, [inp], parameters=SLO)
        logits = res.as_numpy("logits")
        return {"meta": meta, "logits": logits, "params": res.get_response()["parameters"]}
    finally:
        c.close()


def _client(mesh: LocalMesh, http: str, tenant: str) -> AsyncClient:
    files = mesh.tenant_files(tenant)
    return AsyncClient(http, cert=files["cert"], key=files["key"], ca=files["ca"])


async def test_text_pipeline_served_end_to_end() -> None:
    x, y = load_corpus().holdout()
    async with mesh_running(tls=True, text_backbones=["minilm-l6-int8"]) as mesh:
        http = mesh.sites[EDGE].http
        assert http is not None and mesh.catalog is not None
        entry = await get_pipeline(mesh.catalog.store, PIPELINE_TASK)
        assert entry.accuracy is not None and entry.owner == "globex"
        tasks = {v.variant_id: v.task for v in await mesh.catalog.list_variants()}
        async with _client(mesh, http, "globex") as globex:
            first = await _answer(globex, TEXTS)
            assert first.reason == "pipeline" and first.accuracy == pytest.approx(entry.accuracy)
            assert [SECTIONS[i] for i in first.output().argmax(axis=1)] == ["games", "mail"]
            sel, *branches = first.stages
            assert tasks[sel.variant] == sel.task == "text-group" and sel.rows == 2
            assert all(tasks[b.variant] == b.task for b in branches)  # each stage names its own task
            assert sorted(tasks[b.variant] for b in branches) == [group_task("games"), group_task("network")]
            for st in first.stages:  # per-stage placement and timing
                assert st.site in mesh.sites and st.total_ms > 0.0
            placed = [(tasks[s.variant], s.site, s.variant, round(s.total_ms, 1)) for s in first.stages]
            print(f"\n{PIPELINE_TASK}: stages {placed}")
            # delivered accuracy on held-out rows, in batches: the catalogued figure, within noise
            rows = np.random.default_rng(5).choice(len(x), 90, replace=False)
            hits = 0
            for i in range(0, 90, 30):
                batch = rows[i:i + 30]
                res = await _answer(globex, x[batch])
                hits += int(np.sum(res.output().argmax(axis=1) == y[batch]))
                assert {tasks[s.variant] for s in res.stages[1:]} <= {group_task(g) for g in GROUPS}
            assert hits / 90 >= entry.accuracy - 0.15, f"delivered {hits}/90 against a measured {entry.accuracy}"
        # acme may not know globex's pipeline
        async with _client(mesh, http, "acme") as acme:
            with pytest.raises(MeshError):
                await acme.infer(PIPELINE_TASK, TEXTS, **SLO)
        # unmodified tritonclient.http over mutual TLS
        got = await asyncio.to_thread(_tritonclient, mesh, http)
        assert got["meta"]["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
        assert [SECTIONS[i] for i in got["logits"].argmax(axis=1)] == ["games", "mail"]
        params = got["params"]
        assert params["reason"] == "pipeline" and params["cascade"] == PIPELINE_TASK
        stages = json.loads(params["cascade_stages"])
        assert tasks[stages[0]["variant"]] == "text-group"
        assert all(s["site"] in mesh.sites and s["total_ms"] > 0 for s in stages)
