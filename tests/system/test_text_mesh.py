"""The text family served by a secured local mesh (issue 14 item 2, issue 13 item 4): a text query through the
SDK and through raw Open Inference Protocol JSON ``BYTES`` is answered by a MiniLM encoder + tenant head with
the accuracy the variant store measured on held-out package descriptions; the same encoder serves globex's own
head; a tenant's private text head is neither usable nor readable by another tenant."""

from __future__ import annotations

import asyncio
import ssl
import time
from typing import Any

import aiohttp
import numpy as np
import pytest

from mesh.client import AsyncClient, InferResult
from mesh.errors import MeshError
from mesh.pki.identity import Identity
from tests.system.conftest import SMALL_TOPOLOGY, mesh_running
from tiermesh.harness import LocalMesh
from variant_store.families.text_corpus import GROUPS, SECTIONS, load_corpus

pytestmark = [pytest.mark.system, pytest.mark.slow]
EDGE = "edge-fra-1"
BACKBONES = ["minilm-l2-int8", "minilm-l6-int8"]
SLO: dict[str, Any] = {"latency_ms": 3000, "min_accuracy": 0.70}


def _context(mesh: LocalMesh, tenant: str) -> ssl.SSLContext:
    assert mesh.creds is not None
    ctx = ssl.create_default_context(cafile=str(mesh.creds.pki.paths.ca_cert))
    ctx.check_hostname = False
    who = Identity("tenant", tenant)
    ctx.load_cert_chain(mesh.creds.pki.paths.cert(who), mesh.creds.pki.paths.key(who))
    return ctx


async def _first_answer(client: AsyncClient, task: str, texts: list[str], slo: dict[str, Any]) -> InferResult:
    """The first answer, waiting out cold starts (an encoder is fetched and loaded on first use)."""
    deadline, last = time.monotonic() + 120, ""
    while time.monotonic() < deadline:
        try:
            return await client.infer(task, texts, **slo)
        except MeshError as exc:
            last = f"{exc.code}: {exc}"
        await asyncio.sleep(0.5)
    pytest.fail(f"{task} not served within 120 s: {last}")


def _grpc_bytes(tc_module: Any) -> Any:
    inp = tc_module.InferInput("text", [2], "BYTES")
    inp.set_data_from_numpy(np.array([b"Real-time strategy game of ancient warfare", b"IMAP and POP3 mail client"],
                                     dtype=np.object_))
    return inp


async def _grpc_text(mesh: LocalMesh) -> None:
    """acme's text query over gRPC with ``tritonclient.grpc`` (sync, in a thread) and ``.aio``; globex is refused
    acme's private task there, as over REST."""
    import tritonclient.grpc as tgrpc_sync
    import tritonclient.grpc.aio as tgrpc
    from tritonclient.utils import InferenceServerException

    url = mesh.sites[EDGE].grpc
    assert url is not None and url.startswith("grpcs://")
    addr = url.removeprefix("grpcs://")

    def files(tenant: str) -> dict[str, str]:
        f = mesh.tenant_files(tenant)
        return {"root_certificates": str(f["ca"]), "private_key": str(f["key"]), "certificate_chain": str(f["cert"])}

    def check(reply: Any) -> None:
        assert reply.parameters["tenant"].string_param == "acme"
        # the 6-layer head, or the calibrated cascade that ends on it (whose reply names the stage that answered)
        variant, reason = reply.parameters["variant"].string_param, reply.parameters["reason"].string_param
        assert variant == "topic-minilm-l6-int8.onnx.fp32" or reason.startswith("cascade"), (variant, reason)

    def sync_query() -> list[str]:
        client = tgrpc_sync.InferenceServerClient(addr, ssl=True, **files("acme"))
        try:
            result = client.infer("text-topic", [_grpc_bytes(tgrpc_sync)], parameters=SLO)
            check(result.get_response())
            return [SECTIONS[i] for i in result.as_numpy("logits").argmax(axis=1)]
        finally:
            client.close()

    assert await asyncio.to_thread(sync_query) == ["games", "mail"]
    client = tgrpc.InferenceServerClient(addr, ssl=True, **files("acme"))
    try:
        result = await client.infer("text-topic", [_grpc_bytes(tgrpc)], parameters=SLO)
        check(result.get_response())
        assert [SECTIONS[i] for i in result.as_numpy("logits").argmax(axis=1)] == ["games", "mail"]
    finally:
        await client.close()
    other = tgrpc.InferenceServerClient(addr, ssl=True, **files("globex"))
    try:
        with pytest.raises(InferenceServerException, match=r"(?i)not_found|unknown"):
            await other.infer("text-topic", [_grpc_bytes(tgrpc)], parameters=SLO)
    finally:
        await other.close()


async def test_text_family_served_to_its_tenants() -> None:
    assert SMALL_TOPOLOGY.exists()
    corpus = load_corpus()
    x, y = corpus.holdout()
    async with mesh_running(tls=True, text_backbones=BACKBONES) as mesh:
        http = mesh.sites[EDGE].http
        assert http is not None and mesh.catalog is not None and mesh.store_url is not None
        variants = {v.variant_id: v for v in await mesh.catalog.list_variants("text-topic")}
        cascades = await mesh.catalog.cascades("text-topic")
        promised = {v.accuracy for v in variants.values()} | {c.accuracy for c in cascades}
        async with AsyncClient(http, **mesh.tenant_files("acme")) as acme:
            first = await _first_answer(acme, "text-topic", ["Real-time strategy game of ancient warfare"], SLO)
            # the 6-layer encoder's head, the only variant whose measured accuracy meets min_accuracy 0.70, or the
            # task's calibrated cascade (the L2 head first, the L6 one for what it is unsure of: issue 33), whose
            # measured accuracy meets it too
            assert not first.best_effort, first
            assert first.variant == "topic-minilm-l6-int8.onnx.fp32" or first.reason.startswith("cascade"), first
            assert first.accuracy in promised and 0.70 <= first.accuracy <= 0.85
            assert first.output().shape == (1, len(SECTIONS))
            # delivered accuracy on held-out rows, through the SDK in batches (numpy str array and bytes)
            rows = np.random.default_rng(3).choice(len(x), 120, replace=False)
            hits = 0
            for i in range(0, 120, 30):
                batch = rows[i:i + 30]
                res = await acme.infer("text-topic", x[batch], **SLO)
                hits += int(np.sum(res.output().argmax(axis=1) == y[batch]))
            assert hits / 120 >= 0.62, f"delivered {hits}/120 against a measured {first.accuracy:.3f}"
            # acme may not use globex's head, though it runs on the same encoder
            with pytest.raises(MeshError):
                await acme.infer("text-group", ["an email client"], **SLO)

        # raw OIP JSON BYTES, no SDK: tenant by client certificate
        body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2],
                            "data": ["Real-time strategy game of ancient warfare", "IMAP and POP3 mail client"]}],
                "parameters": SLO}
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{http}/v2/models/text-topic/infer", json=body, ssl=_context(mesh, "acme"),
                              timeout=aiohttp.ClientTimeout(total=30)) as resp:
                assert resp.status == 200, await resp.text()
                reply = await resp.json()
            out = {o["name"]: o for o in reply["outputs"]}
            logits = np.array(out["logits"]["data"], dtype=np.float32).reshape(out["logits"]["shape"])
            assert [SECTIONS[i] for i in logits.argmax(axis=1)] == ["games", "mail"]
            variant, reason = reply["parameters"]["variant"], reply["parameters"]["reason"]
            assert variant == "topic-minilm-l6-int8.onnx.fp32" or reason.startswith("cascade"), (variant, reason)
            assert 0.70 <= reply["parameters"]["accuracy"] <= 0.85
            # the private head's bytes: its tenant and sites fetch them, another tenant is refused
            head = variants["topic-minilm-l6-int8.onnx.fp32"]
            blob = f"{mesh.store_url}/blobs/{head.blob_digest}"
            async with s.get(blob, ssl=_context(mesh, "acme")) as r:
                assert r.status == 200
            async with s.get(blob, ssl=_context(mesh, "globex")) as r:
                assert r.status == 403

        # unmodified tritonclient.grpc, sync and aio, BYTES over mutual TLS: the tenant from the certificate
        await _grpc_text(mesh)

        # globex: its own head on the same encoder blob, never acme's
        async with AsyncClient(http, **mesh.tenant_files("globex")) as globex:
            # >= 0.86: only the 6-layer encoder's group head measures that (the 2-layer one 0.84), so globex's
            # query runs on the very encoder blob acme's did
            slo = {**SLO, "min_accuracy": 0.86}
            grp = await _first_answer(globex, "text-group", ["IMAP and POP3 mail client", "a 3D modelling tool"], slo)
            assert grp.variant == "group-minilm-l6-int8.onnx.fp32"
            assert list(GROUPS)[int(grp.output()[0].argmax())] == "network"
            group_meta = await mesh.catalog.get_variant("text-group", grp.variant)
            assert group_meta.shared_base_digest == head.shared_base_digest
            with pytest.raises(MeshError):
                await globex.infer("text-topic", ["Real-time strategy game"], **SLO)
