"""Issue 34 item 1 on a live local mesh, secured as deployed (mutual TLS at the edges, etcd with client certificates
and RBAC): tenant acme, holding only its tenant certificate, registers a logistic regression it trained here (not a
committed family) at one edge, follows the build, then queries the new task through the SDK from two edges: the
variants were catalogued as acme's own, sites load them on demand (nothing was built there), and their answers are
the model's. globex can neither see the build nor query the task."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import onnxruntime as ort
import pytest

from mesh.client import AsyncClient
from mesh.errors import MeshError, RequestError
from mesh.models import AsyncModels
from tests.helpers_models import digits_split
from tests.integration.test_tenant_models import logreg_onnx
from tests.system.conftest import mesh_running
from variant_store.catalog import Catalog

pytestmark = [pytest.mark.system, pytest.mark.slow, pytest.mark.timeout(600)]

TASK, FAMILY = "acme-digits", "acme-logreg"
SERVE_TIMEOUT_S = 180.0


async def _answer(client: AsyncClient, x: np.ndarray, timeout_s: float) -> np.ndarray:
    """The task's answer once a site has it placed and loaded (bounded: queries every 0.5 s until ``timeout_s``)."""
    end, last = time.monotonic() + timeout_s, None
    while time.monotonic() < end:
        try:
            res = await client.infer(TASK, x, latency_ms=2000.0, timeout=10.0)
            return np.asarray(next(iter(res.outputs.values())))
        except MeshError as exc:  # no route until placement has seen the demand and a site loaded a variant
            last = exc
        await asyncio.sleep(0.5)
    pytest.fail(f"{TASK} not served within {timeout_s:.0f} s: {last}")


async def test_acme_registers_a_model_and_queries_it_from_two_edges() -> None:
    split = digits_split()
    model = logreg_onnx()
    reference = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    x = split.x_val[:8]
    want = reference.run(None, {"x": x})[0].argmax(axis=1)
    async with mesh_running(tls=True, lease_ttl_s=3.0) as mesh:
        edges = list(mesh.edge_urls().values())[:2]
        assert len(edges) == 2
        a, g = mesh.tenant_files("acme"), mesh.tenant_files("globex")
        async with AsyncModels(edges[0], cert=a["cert"], key=a["key"], ca=a["ca"]) as acme:
            build = await acme.register(TASK, FAMILY, model=model, validation=(split.x_val, split.y_val))
            done = await build.wait(poll_s=10.0, timeout=300)
        assert done["state"] == "done" and done["variants"], done
        assert max(v["accuracy"] for v in done["variants"]) > 0.9
        assert mesh.store is not None
        assert {m.owner for m in await Catalog(mesh.store).list_variants(TASK)} == {"acme"}
        for url in edges:
            async with AsyncClient(url, timeout=15.0, cert=a["cert"], key=a["key"], ca=a["ca"]) as client:
                got = await _answer(client, x, SERVE_TIMEOUT_S)
            # an INT8 or FP16 variant may flip a close call: most answers are the model's own
            assert got.shape == (8, 10) and (got.argmax(axis=1) == want).mean() >= 0.75
        async with AsyncModels(edges[1], cert=g["cert"], key=g["key"], ca=g["ca"]) as globex:
            with pytest.raises(RequestError):
                await globex.show(TASK, build.id)
            assert await globex.list() == []
        async with AsyncClient(edges[1], timeout=10.0, cert=g["cert"], key=g["key"], ca=g["ca"]) as other:
            with pytest.raises(MeshError):
                await other.infer(TASK, x, latency_ms=2000.0)
