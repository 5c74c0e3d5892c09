"""Unmodified ``tritonclient.http`` against the edge's Triton routes (``edge_agent.v2_extras``): model config,
statistics, repository index, load / unload, and the classification extension; each seen by one tenant only."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as tritonhttp
from tritonclient.utils import InferenceServerException

from edge_agent.http_api import EdgeHttpServer
from edge_agent.metrics import AgentMetrics
from edge_agent.observe import Observe
from edge_agent.traces import TraceStore
from mesh.errors import MeshError
from mesh.types import InferRequest, InferResponse, TaskSignature
from mesh.v2.body import TENANT_HEADER
from tests.helpers_dataplane import OnnxDataPlane, digits_model, serve_in_thread
from tests.helpers_models import digits_split

pytestmark = pytest.mark.integration

TASK = "digit-classification"
PRIVATE = "globex-digits"  # globex's private task: acme must not learn it exists
ACME, GLOBEX = {TENANT_HEADER: "acme"}, {TENANT_HEADER: "globex"}


class CountedPlane(OnnxDataPlane):
    """The digits plane with a second task private to globex, counting its door as a site's data plane does."""

    def __init__(self, path: Path) -> None:
        super().__init__("edge-extras", path, accuracy=0.96)
        self.metrics = AgentMetrics(self.site)
        self.metrics.known(tasks=[TASK, PRIVATE], tenants=["acme", "globex"], variants=[self.variant], sites=[])

    def task_signature(self, task: str) -> TaskSignature:
        return dataclasses.replace(self.signature, task=PRIVATE) if task == PRIVATE else super().task_signature(task)

    def tasks(self) -> list[str]:
        return [TASK, PRIVATE]

    async def infer(self, req: InferRequest) -> InferResponse:
        try:
            resp = await super().infer(req)
        except MeshError as exc:
            self.metrics.door_error(req.task, req.tenant, exc.code, req.slo)
            raise
        self.metrics.door_ok(req.task, req.tenant, req.slo, resp)
        return resp


def _visible(task: str, tenant: str) -> bool:
    return task != PRIVATE or tenant == "globex"


@pytest.fixture(scope="module")
def dp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CountedPlane]:
    plane = CountedPlane(digits_model(tmp_path_factory.mktemp("model")))
    try:
        yield plane
    finally:
        plane.close()


@pytest.fixture(scope="module")
def server(dp: CountedPlane) -> Iterator[EdgeHttpServer]:
    with serve_in_thread(dp, observe=Observe(dp.metrics, TraceStore()), visible=_visible) as srv:
        yield srv


@pytest.fixture
def client(server: EdgeHttpServer) -> Iterator[tritonhttp.InferenceServerClient]:
    c = tritonhttp.InferenceServerClient(server.url.removeprefix("http://"), network_timeout=30.0)
    try:
        yield c
    finally:
        c.close()


def _infer(client: tritonhttp.InferenceServerClient, x: np.ndarray,
           outputs: list[tritonhttp.InferRequestedOutput] | None = None) -> tritonhttp.InferResult:
    inp = tritonhttp.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return client.infer(TASK, [inp], outputs=outputs, headers=ACME, parameters={"latency_ms": 3000})


def test_model_config_describes_the_task_as_triton_would(client: tritonhttp.InferenceServerClient) -> None:
    cfg = client.get_model_config(TASK, headers=ACME)
    assert cfg["name"] == TASK and cfg["backend"] == "tiermesh" and cfg["max_batch_size"] > 0
    assert cfg["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [64]}]
    assert cfg["output"] == [{"name": "logits", "data_type": "TYPE_FP32", "dims": [10]}]
    assert client.get_model_config(TASK, model_version="anything", headers=ACME) == cfg  # versions are ignored


def test_statistics_count_the_callers_own_queries_per_task_and_variant(
        client: tritonhttp.InferenceServerClient, dp: CountedPlane) -> None:
    x = digits_split().x_val[:5]
    for _ in range(2):
        _infer(client, x)
    stats = client.get_inference_statistics(TASK, headers=ACME)["model_stats"]
    whole, by_variant = stats[0], {s["version"]: s for s in stats[1:]}
    assert whole["name"] == TASK and whole["version"] == ""
    assert whole["inference_stats"]["success"]["count"] >= 2 and whole["inference_count"] >= 10
    assert whole["inference_stats"]["compute_infer"]["ns"] > 0
    assert by_variant[dp.variant]["execution_count"] == whole["execution_count"]
    only = client.get_inference_statistics(TASK, model_version=dp.variant, headers=ACME)["model_stats"]
    assert [s["version"] for s in only] == [dp.variant]
    # globex sees its own tasks, and none of acme's queries
    everything = client.get_inference_statistics(headers=GLOBEX)["model_stats"]
    assert {s["name"] for s in everything} == {TASK, PRIVATE}
    assert all(s["inference_stats"]["success"]["count"] == 0 for s in everything)


def test_repository_index_and_load_unload_answers(client: tritonhttp.InferenceServerClient) -> None:
    assert client.get_model_repository_index(headers=ACME) == [
        {"name": TASK, "version": "", "state": "READY", "reason": ""}]
    assert {m["name"] for m in client.get_model_repository_index(headers=GLOBEX)} == {TASK, PRIVATE}
    client.load_model(TASK, headers=ACME)  # servable: 200, nothing placed
    with pytest.raises(InferenceServerException, match="places the variants") as info:
        client.load_model(TASK, config='{"backend": "onnxruntime"}', headers=ACME)
    assert info.value.status() == "403"
    with pytest.raises(InferenceServerException, match="cannot unload") as info:
        client.unload_model(TASK, headers=ACME)
    assert info.value.status() == "403"


def test_class_count_returns_the_top_classes_with_their_digit_labels(
        client: tritonhttp.InferenceServerClient, dp: CountedPlane) -> None:
    x = digits_split().x_val[:8]
    res = _infer(client, x, [tritonhttp.InferRequestedOutput("logits", class_count=3)])
    top = res.as_numpy("logits")
    assert top is not None and top.shape == (8, 3)
    logits = dp.run_direct({"x": x})["logits"]
    for row, want in zip(top, logits, strict=True):
        fields = [item.decode().split(":") for item in row]
        assert [int(f[1]) for f in fields] == list(np.argsort(-want, kind="stable")[:3])
        assert all(f[2] == f[1] for f in fields)  # digits' labels are the digits
        assert [float(f[0]) for f in fields] == pytest.approx([want[int(f[1])] for f in fields], abs=1e-5)
    json_res = _infer(client, x, [tritonhttp.InferRequestedOutput("logits", binary_data=False, class_count=1)])
    as_json = json_res.as_numpy("logits")  # JSON BYTES come back as str
    assert as_json is not None and [str(v) for v in as_json[:, 0]] == [r[0].decode() for r in top]


@pytest.mark.parametrize("call", ["config", "stats", "load", "unload"])
def test_another_tenants_private_task_is_a_404_like_a_missing_one(
        client: tritonhttp.InferenceServerClient, call: str) -> None:
    def ask(task: str) -> InferenceServerException:
        fn = {"config": client.get_model_config, "stats": client.get_inference_statistics,
              "load": client.load_model, "unload": client.unload_model}[call]
        with pytest.raises(InferenceServerException) as info:
            fn(task, headers=ACME)
        return info.value

    private, missing = ask(PRIVATE), ask("no-such-task")
    assert private.status() == missing.status() == "404"
    assert private.message().replace(PRIVATE, "T") == missing.message().replace("no-such-task", "T")
    assert PRIVATE not in {s["name"] for s in client.get_inference_statistics(headers=ACME)["model_stats"]}
