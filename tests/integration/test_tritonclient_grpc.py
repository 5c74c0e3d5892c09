"""Unmodified ``tritonclient.grpc`` (sync and ``aio``) against the edge's gRPC front over mutual TLS, the tenant
from its certificate: health, metadata and config, a digits query on a real ONNX model, a BYTES text query, the
response parameters REST carries, and the refusal matrix as REST's (no certificate, another CA, another
tenant's private task, an unknown tenant, a claimed tenant, an oversized message, a revoked certificate)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.grpc.aio as tgrpc_aio
from tritonclient.utils import InferenceServerException

from edge_agent.grpc_api import EdgeGrpcServer
from edge_agent.metrics import AgentMetrics
from edge_agent.mtls import EdgeTls
from mesh.errors import MeshError
from mesh.pki.ca import CertificateAuthority
from mesh.pki.files import cert_pem, key_pem, write_file
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from mesh.types import InferRequest, InferResponse, TaskSignature, TensorSpec, Timing, check_inputs
from tests.helpers.grpc_edge import grpc_in_thread
from tests.helpers.mtls_edge import ACME, GLOBEX, SITE, TASK, make_pki
from tests.helpers_dataplane import OnnxDataPlane, digits_plane
from tests.helpers_models import digits_split

pytestmark = pytest.mark.integration

TEXT = "text-echo"
PRIVATE_OF = {TASK: None, TEXT: None, "acme-digits": "acme"}  # task -> its owner (None: public)


class TwoTasks:
    """The digits model, and a BYTES task that answers each text's length and its upper case; digits queries counted
    at the door as a site's data plane counts them (the statistics)."""

    def __init__(self, digits: OnnxDataPlane) -> None:
        self.site, self.digits = digits.site, digits
        self.metrics = AgentMetrics(self.site)
        self.metrics.known(tasks=[TASK, TEXT], tenants=["acme", "globex"], variants=[digits.variant], sites=[])
        self.budget_ms = 0.0  # what was left of the last query's budget when it reached the data plane
        self.text = TaskSignature(TEXT, (TensorSpec("text", "object", (-1,)),),
                                  (TensorSpec("length", "int64", (-1,)), TensorSpec("upper", "object", (-1,))))

    def task_signature(self, task: str) -> TaskSignature:
        if task == TEXT:
            return self.text
        if task == "acme-digits":
            return TaskSignature(task, self.digits.signature.inputs, self.digits.signature.outputs)
        return self.digits.task_signature(task)

    def tasks(self) -> list[str]:
        return [TASK, TEXT, "acme-digits"]

    def ready(self) -> bool:
        return True

    async def infer(self, req: InferRequest) -> InferResponse:
        self.budget_ms = req.remaining_ms()
        if req.task != TEXT:
            try:
                resp = await self.digits.infer(req)
            except MeshError as exc:
                self.metrics.door_error(req.task, req.tenant, exc.code, req.slo)
                raise
            self.metrics.door_ok(req.task, req.tenant, req.slo, resp)
            return resp
        inputs = check_inputs(self.text.inputs, req.inputs)
        items = inputs["text"].tolist()
        upper = np.empty(len(items), dtype=object)
        upper[:] = [bytes(t).upper() for t in items]
        return InferResponse(req.request_id, {"length": np.array([len(t) for t in items], np.int64), "upper": upper},
                             self.site, "echo.v1", 1.0, "local_ok", False, req.tenant, Timing(0.0, 0.0, 0.1, 0.1),
                             [*req.hops, self.site])


def visible(task: str, tenant: str) -> bool:
    owner = PRIVATE_OF.get(task)
    return owner is None or owner == tenant


@dataclass
class Edge:
    server: EdgeGrpcServer
    pki: LocalPki
    tls: EdgeTls
    home: Path


@pytest.fixture(scope="module")
def dp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoTasks]:
    with digits_plane(tmp_path_factory.mktemp("model"), SITE.name, accuracy=0.96,
                      tenants=frozenset({"public", "acme", "globex"})) as plane:
        yield TwoTasks(plane)


@pytest.fixture(scope="module")
def edge(dp: TwoTasks, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    home = tmp_path_factory.mktemp("pki")
    pki = make_pki(home)
    tls = EdgeTls(pki.paths, SITE.name, interval_s=0.2)
    with grpc_in_thread(dp, tls, visible=visible, max_message_bytes=1 << 20, metrics=dp.metrics) as server:
        yield Edge(server, pki, tls, home)


def client(edge: Edge, who: Identity | None = ACME, *, cert: Path | None = None,
           key: Path | None = None) -> tgrpc.InferenceServerClient:
    """tritonclient.grpc over mutual TLS as ``who`` (None: no certificate, unless ``cert`` and ``key``)."""
    paths = edge.pki.paths
    if who is not None:
        cert, key = paths.cert(who), paths.key(who)
    return tgrpc.InferenceServerClient(edge.server.address, ssl=True, root_certificates=str(paths.ca_cert),
                                       private_key=str(key) if key else None,
                                       certificate_chain=str(cert) if cert else None)


def digits_input(x: np.ndarray) -> tgrpc.InferInput:
    inp = tgrpc.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return inp


SLO = {"latency_ms": 5000, "min_accuracy": 0.0}


def _params(result: tgrpc.InferResult) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, p in result.get_response().parameters.items():
        out[k] = getattr(p, p.WhichOneof("parameter_choice"))
    return out


def test_the_address_is_the_bound_port(edge: Edge) -> None:
    assert edge.server.url.startswith("grpcs://127.0.0.1:") and edge.server.port > 0


def test_health_metadata_and_config(edge: Edge) -> None:
    with client(edge) as c:
        assert c.is_server_live() and c.is_server_ready() and c.is_model_ready(TASK)
        meta = c.get_model_metadata(TASK, as_json=True)
        assert meta["name"] == TASK and meta["inputs"][0]["datatype"] == "FP32"
        assert meta["inputs"][0]["shape"] == ["-1", "64"]  # protobuf's JSON writes int64 as strings
        cfg = c.get_model_config(TASK, as_json=True)["config"]
        assert cfg["name"] == TASK and cfg["input"][0]["data_type"] == "TYPE_FP32"
        assert c.get_server_metadata().name == "tiermesh"


def test_a_digits_query_with_the_tenant_of_the_certificate(edge: Edge, dp: TwoTasks) -> None:
    split = digits_split()
    x, y = split.x_val[:32].astype(np.float32), split.y_val
    with client(edge, GLOBEX) as c:
        res = c.infer(TASK, [digits_input(x)], parameters=SLO, request_id="grpc-q1")
    logits = res.as_numpy("logits")
    np.testing.assert_allclose(logits, dp.digits.run_direct({"x": x})["logits"], rtol=1e-6)
    assert float(np.mean(logits.argmax(axis=1) == y[:32])) > 0.8
    params = _params(res)
    assert params["tenant"] == "globex" and params["site"] == SITE.name and params["reason"] == "local_ok"
    assert {"variant", "accuracy", "timing_ms_total", "hops", "late", "best_effort"} <= set(params)
    assert res.get_response().id == "grpc-q1"


def test_the_classification_extension(edge: Edge, dp: TwoTasks) -> None:
    x = digits_split().x_val[:4].astype(np.float32)
    with client(edge) as c:
        res = c.infer(TASK, [digits_input(x)], parameters=SLO,
                      outputs=[tgrpc.InferRequestedOutput("logits", class_count=3)])
    top = res.as_numpy("logits")
    assert top.shape == (4, 3)
    want = dp.digits.run_direct({"x": x})["logits"].argmax(axis=1)
    assert [int(row[0].split(b":")[1]) for row in top] == want.tolist()


def test_a_bytes_text_query(edge: Edge) -> None:
    texts = np.array(["héllo", "gRPC", ""], dtype=object)
    inp = tgrpc.InferInput("text", [3], "BYTES")
    inp.set_data_from_numpy(texts)
    with client(edge) as c:
        res = c.infer(TEXT, [inp], parameters=SLO, outputs=[tgrpc.InferRequestedOutput("upper"),
                                                            tgrpc.InferRequestedOutput("length")])
    assert res.as_numpy("length").tolist() == [6, 4, 0]
    assert res.as_numpy("upper").tolist() == ["HéLLO".encode(), b"GRPC", b""]


def test_the_aio_client(edge: Edge) -> None:
    async def run() -> tuple[bool, np.ndarray]:
        paths = edge.pki.paths
        c = tgrpc_aio.InferenceServerClient(edge.server.address, ssl=True, root_certificates=str(paths.ca_cert),
                                            private_key=str(paths.key(ACME)), certificate_chain=str(paths.cert(ACME)))
        try:
            live = await c.is_server_live()
            res = await c.infer(TASK, [digits_input(np.full((2, 64), 0.5, np.float32))], parameters=SLO)
            return live, res.as_numpy("logits")
        finally:
            await c.close()

    live, logits = asyncio.run(run())
    assert live and logits.shape == (2, 10)


def test_statistics_count_the_callers_own_queries(edge: Edge, dp: TwoTasks) -> None:
    x = digits_split().x_val[:5].astype(np.float32)
    with client(edge, GLOBEX) as g:
        before = g.get_inference_statistics(as_json=True)["model_stats"]
    with client(edge, ACME) as c:
        for _ in range(2):
            c.infer(TASK, [digits_input(x)], parameters=SLO)
        stats = c.get_inference_statistics(TASK, as_json=True)["model_stats"]
        only = c.get_inference_statistics(TASK, model_version=dp.digits.variant, as_json=True)["model_stats"]
        with pytest.raises(InferenceServerException) as missing:
            c.get_inference_statistics("no-such-task")
        mine = {s["name"] for s in c.get_inference_statistics(as_json=True)["model_stats"]}
    whole, by_variant = stats[0], {s["version"]: s for s in stats[1:]}
    # protobuf's JSON writes uint64 as strings, and leaves out what is empty or zero
    assert whole["name"] == TASK and "version" not in whole
    assert int(whole["inference_stats"]["success"]["count"]) >= 2 and int(whole["inference_count"]) >= 10
    assert int(whole["inference_stats"]["compute_infer"]["ns"]) > 0
    assert by_variant[dp.digits.variant]["execution_count"] == whole["execution_count"]
    assert [s["version"] for s in only] == [dp.digits.variant]
    assert missing.value.status() == "StatusCode.NOT_FOUND"
    assert mine == {TASK, TEXT, "acme-digits"}
    with client(edge, GLOBEX) as g:  # globex's own, untouched by acme's queries; acme's private task unseen
        after = g.get_inference_statistics(as_json=True)["model_stats"]
        with pytest.raises(InferenceServerException) as private:
            g.get_inference_statistics("acme-digits")
    assert after == before and {s["name"] for s in after} == {TASK, TEXT}
    assert private.value.status() == "StatusCode.NOT_FOUND"


# -- refusals -----------------------------------------------------------------------------------------------------

def _refused(c: tgrpc.InferenceServerClient, task: str = TASK, **kw: object) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        c.infer(task, [digits_input(np.zeros((1, 64), np.float32))], parameters={**SLO, **kw}, client_timeout=15)
    return info.value


def test_no_client_certificate_is_refused(edge: Edge) -> None:
    with client(edge, None) as c:
        err = _refused(c)
    assert err.status() == "StatusCode.UNAVAILABLE"


def test_a_certificate_of_another_ca_is_refused(edge: Edge, tmp_path: Path) -> None:
    other = CertificateAuthority.create().issue(ACME)
    write_file(tmp_path / "acme.pem", cert_pem(other.cert))
    write_file(tmp_path / "acme-key.pem", key_pem(other.key), private=True)
    with client(edge, None, cert=tmp_path / "acme.pem", key=tmp_path / "acme-key.pem") as c:
        err = _refused(c)
    assert err.status() == "StatusCode.UNAVAILABLE"
    with client(edge) as c:  # and the good tenant is served after
        assert c.is_server_live()


def test_another_tenants_private_task_is_not_found_as_no_task(edge: Edge) -> None:
    with client(edge, GLOBEX) as c:
        private = _refused(c, "acme-digits")
        missing = _refused(c, "no-such-task")
        with pytest.raises(InferenceServerException) as meta:
            c.get_model_metadata("acme-digits")
    assert private.status() == missing.status() == meta.value.status() == "StatusCode.NOT_FOUND"
    assert private.message().replace("acme-digits", "T") == missing.message().replace("no-such-task", "T")
    with client(edge, ACME) as c:  # its owner is served
        assert c.get_model_metadata("acme-digits").name == "acme-digits"


def test_an_unknown_tenant_and_a_claimed_one_are_refused(edge: Edge) -> None:
    initech = Identity("tenant", "initech")
    edge.pki.issue(initech)
    with client(edge, initech) as c:
        assert _refused(c).status() == "StatusCode.PERMISSION_DENIED"
    with client(edge, ACME) as c:
        assert _refused(c, tenant="globex").status() == "StatusCode.PERMISSION_DENIED"
        with pytest.raises(InferenceServerException) as info:
            c.infer(TASK, [digits_input(np.zeros((1, 64), np.float32))], parameters=SLO,
                    headers={"x-tiermesh-tenant": "globex"})
        assert info.value.status() == "StatusCode.PERMISSION_DENIED"


def test_bad_requests_map_to_grpc_statuses(edge: Edge) -> None:
    with client(edge) as c:
        assert _refused(c, latency_ms=-1).status() == "StatusCode.INVALID_ARGUMENT"
        assert _refused(c, min_accuracy=0.999, prefer="refuse").status() == "StatusCode.FAILED_PRECONDITION"
        big = np.zeros((5000, 64), np.float32)  # 1.3 MB, over this edge's 1 MiB
        with pytest.raises(InferenceServerException) as info:
            c.infer(TASK, [digits_input(big)], parameters=SLO)
        assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert c.is_server_live()


def test_a_grpc_deadline_shorter_than_the_slo_caps_the_budget(edge: Edge, dp: TwoTasks) -> None:
    with client(edge) as c:
        c.infer(TASK, [digits_input(np.zeros((1, 64), np.float32))], parameters={"latency_ms": 60000},
                client_timeout=5)
        assert 4000 < dp.budget_ms <= 5000
        c.infer(TASK, [digits_input(np.zeros((1, 64), np.float32))], parameters={"latency_ms": 3000},
                client_timeout=5)
        assert 2000 < dp.budget_ms <= 3000  # the SLO's, when it is the shorter


def test_a_revoked_tenant_is_unauthenticated(edge: Edge) -> None:
    hooli = Identity("tenant", "hooli")
    edge.pki.issue(hooli)
    with client(edge, hooli) as c:
        assert c.is_server_live()
        edge.pki.revoke(hooli)
        edge.tls.trust.refresh()
        with pytest.raises(InferenceServerException) as info:
            c.is_server_live()
    assert info.value.status() == "StatusCode.UNAUTHENTICATED" and "revoked" in info.value.message()
