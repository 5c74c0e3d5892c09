"""A job's result streams through the real door (``edge_agent.job_results``): a result of many chunks arrives whole
and in row order as JSON lines (chunked, written chunk by chunk) and as an NPZ (assembled on the spool disk, sent
with its length, then gone), through the SDK (``result``, ``result_to``) and raw HTTP. The job's input goes in as
the Open Inference Protocol's binary layout, as ``tritonclient.http`` writes it, with its
``Inference-Header-Content-Length``; a header that lies about its length is refused naming both numbers.

Real parts: the session etcd, a variant store with a data area, two agents in process (``test_jobs_e2e._mesh``)."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import tritonclient.http as th

from core_scheduler.state.jobs import JobBook
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from mesh.jobs import AsyncJobs
from mesh.v2.body import TENANT_HEADER
from tests.integration.test_jobs_e2e import CHEAP, _mesh, _rows
from tests.integration.test_quota_flood import TASK

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

CHUNK_ROWS = 150  # 3633 rows: 25 chunks, each its own output object in the data area


def _oip(x: np.ndarray) -> tuple[bytes, int]:
    inp = th.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    body, header_length = th.InferenceServerClient.generate_request_body([inp])
    return bytes(body), int(header_length)


async def test_a_many_chunk_result_streams_whole_as_jsonl_and_npz(
        store: Store, etcd_server: EmbeddedEtcd, tmp_path: Path) -> None:
    x, _, want, accuracy = _rows(7)
    body, header_length = _oip(x)
    async with _mesh(store, etcd_server, tmp_path, accuracy) as mesh, \
            AsyncJobs(mesh.agents[CHEAP].http_url, tenant="acme") as jobs:
        url = f"{mesh.agents[CHEAP].http_url}/v2/models/{TASK}/jobs"
        headers = {TENANT_HEADER: "acme", "Inference-Header-Content-Length": str(header_length)}
        async with aiohttp.ClientSession() as http:
            # the header's length must be the header's
            async with http.post(url, params={"format": "oip", "chunk_rows": str(CHUNK_ROWS)}, data=body,
                                 headers={**headers, "Inference-Header-Content-Length": str(header_length + 1)}) as r:
                err = (await r.json())["error"]
                assert r.status == 400 and f"says {header_length + 1}" in err and f"is {header_length} bytes" in err
            async with http.post(url, params={"format": "oip", "chunk_rows": str(CHUNK_ROWS), "deadline_s": "600"},
                                 data=body, headers=headers) as r:
                assert r.status == 202, await r.text()
                admitted = await r.json()
        assert admitted["rows"] == len(x) and admitted["chunks"] == 25
        job = jobs.job(TASK, admitted["id"])
        assert (await job.wait(poll_s=0.2, timeout=120))["state"] == "done"
        v = await JobBook(store).view(job.id)
        assert v is not None and len({c.chunk.output_digest for c in v.chunks}) == 25

        # the SDK in memory, and to files as it streams
        np.testing.assert_allclose((await job.result())["logits"], want, rtol=1e-4, atol=1e-4)
        npz_file, jsonl_file = tmp_path / "out.npz", tmp_path / "out.jsonl"
        size = await job.result_to(npz_file)
        assert size == npz_file.stat().st_size
        with np.load(npz_file, allow_pickle=False) as npz:
            assert npz.files == ["logits"]
            np.testing.assert_allclose(npz["logits"], want, rtol=1e-4, atol=1e-4)
        await job.result_to(jsonl_file, format="jsonl")
        lines = jsonl_file.read_text().splitlines()
        assert len(lines) == len(x)
        np.testing.assert_allclose(np.array([json.loads(line) for line in lines]), want, rtol=1e-4, atol=1e-4)
        assert not await asyncio.to_thread(lambda: list(tmp_path.glob(".*.part")))  # no partial file left

        # raw HTTP: JSON lines chunked (no length: written as chunks arrive), the NPZ with its length
        async with aiohttp.ClientSession(headers={TENANT_HEADER: "acme"}) as http:
            async with http.get(f"{url}/{job.id}/result", params={"format": "jsonl"}) as r:
                assert r.status == 200 and r.headers.get("Transfer-Encoding") == "chunked"
                assert r.content_length is None and r.headers["X-Tiermesh-Rows"] == str(len(x))
                assert (await r.read()).decode().splitlines() == lines
            async with http.get(f"{url}/{job.id}/result", params={"format": "npz"}) as r:
                raw = await r.read()
                assert r.status == 200 and r.content_length == len(raw) == size
            with np.load(io.BytesIO(raw), allow_pickle=False) as npz:
                np.testing.assert_allclose(npz["logits"], want, rtol=1e-4, atol=1e-4)
            async with http.get(f"{url}/{job.id}/result", params={"format": "oip"}) as r:
                assert r.status == 400 and "npz, jsonl" in (await r.json())["error"]
        spool = mesh.agents[CHEAP].jobs_api.spool  # type: ignore[union-attr]
        assert not [p for p in spool.iterdir() if p.is_file()]  # the NPZs assembled there are gone
