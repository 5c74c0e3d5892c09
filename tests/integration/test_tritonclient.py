"""The unmodified ``tritonclient.http`` client against the edge agent's HTTP front."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as tritonhttp
from tritonclient.utils import InferenceServerException

from edge_agent.http_api import EdgeHttpServer
from tests.helpers_dataplane import OnnxDataPlane, digits_model, serve_in_thread
from tests.helpers_models import digits_split

pytestmark = pytest.mark.integration

TASK = "digit-classification"


@pytest.fixture(scope="module")
def dp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OnnxDataPlane]:
    path: Path = digits_model(tmp_path_factory.mktemp("model"))
    plane = OnnxDataPlane("edge-triton", path, accuracy=0.96)
    try:
        yield plane
    finally:
        plane.close()


@pytest.fixture(scope="module")
def server(dp: OnnxDataPlane) -> Iterator[EdgeHttpServer]:
    with serve_in_thread(dp) as srv:
        yield srv


@pytest.fixture
def client(server: EdgeHttpServer) -> Iterator[tritonhttp.InferenceServerClient]:
    c = tritonhttp.InferenceServerClient(server.url.removeprefix("http://"), network_timeout=30.0)
    try:
        yield c
    finally:
        c.close()


def test_health_and_metadata(client: tritonhttp.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready(TASK)
    assert not client.is_model_ready("no-such-task")
    meta = client.get_model_metadata(TASK)
    assert meta["name"] == TASK and meta["platform"] == "tiermesh"
    assert meta["inputs"][0]["datatype"] == "FP32" and meta["inputs"][0]["shape"] == [-1, 64]
    assert client.get_server_metadata()["name"] == "tiermesh"


@pytest.mark.parametrize("binary_in", [True, False])
@pytest.mark.parametrize("binary_out", [True, False, None])
def test_infer_matches_onnxruntime_and_labels(client: tritonhttp.InferenceServerClient, dp: OnnxDataPlane,
                                              binary_in: bool, binary_out: bool | None) -> None:
    split = digits_split()
    x, y = split.x_val, split.y_val
    inp = tritonhttp.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary_in)
    # None: no outputs named, so tritonclient asks for all of them as binary (binary_data_output)
    outputs = None if binary_out is None else [tritonhttp.InferRequestedOutput("logits", binary_data=binary_out)]
    res = client.infer(TASK, [inp], outputs=outputs, request_id="tc-1",
                       parameters={"latency_ms": 3000, "min_accuracy": 0.9})
    logits = res.as_numpy("logits")
    assert logits is not None and logits.shape == (len(x), 10)
    want = dp.run_direct({"x": x})["logits"]
    if binary_out is False:
        np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-6)
    else:
        np.testing.assert_array_equal(logits, want)
    assert float(np.mean(logits.argmax(axis=1) == y)) > 0.9
    body = res.get_response()
    assert body["id"] == "tc-1" and body["parameters"]["site"] == "edge-triton"
    assert body["parameters"]["best_effort"] is False
    assert body["parameters"]["late"] is False  # a reply past its budget says so here (issue 30)


def test_errors_surface_as_triton_exceptions(client: tritonhttp.InferenceServerClient) -> None:
    x = np.zeros((2, 64), np.float64)
    inp = tritonhttp.InferInput("x", [2, 64], "FP64")
    inp.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException, match="float64"):
        client.infer(TASK, [inp], parameters={"latency_ms": 100})
    good = tritonhttp.InferInput("x", [2, 64], "FP32")
    good.set_data_from_numpy(x.astype(np.float32))
    with pytest.raises(InferenceServerException, match="min_accuracy"):
        client.infer(TASK, [good], parameters={"latency_ms": 100, "min_accuracy": 3})
    with pytest.raises(InferenceServerException, match="no-such-task"):
        client.infer("no-such-task", [good])
    assert client.infer(TASK, [good]).as_numpy("logits").shape == (2, 10)  # still serving


def test_gzip_request_body(client: tritonhttp.InferenceServerClient, dp: OnnxDataPlane) -> None:
    x = np.linspace(0, 1, 640, dtype=np.float32).reshape(10, 64)
    inp = tritonhttp.InferInput("x", [10, 64], "FP32")
    inp.set_data_from_numpy(x)
    res = client.infer(TASK, [inp], request_compression_algorithm="gzip",
                       response_compression_algorithm="gzip")
    np.testing.assert_array_equal(res.as_numpy("logits"), dp.run_direct({"x": x})["logits"])
