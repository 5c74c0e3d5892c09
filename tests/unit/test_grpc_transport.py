"""The SDK's gRPC transport without a network (mesh.grpc_transport): a REST request the client builds becomes the
gRPC message an edge reads (raw tensors byte for byte, JSON data made raw), a gRPC reply becomes the REST reply the
client decodes into the same result, and a gRPC error status becomes the mesh error of its ``tiermesh-code``
trailer, else of its status, through the one table."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mesh import errors
from mesh.client import AsyncClient
from mesh.errors import ConfigError, RequestError, error_from_reply
from mesh.grpc_transport import GrpcTransport, error_reply, grpc_call, metadata_of, rest_reply
from mesh.sdk_transport import AiohttpTransport, open_edges
from mesh.types import Timing
from mesh.v2 import grpc_messages as oip
from mesh.v2 import sdk as wire
from mesh.v2.body import HEADER_LENGTH
from mesh.v2.grpc_codec import decode_infer_request, encode_infer_response
from mesh.v2.grpc_status import CODE_OF_STATUS, CODE_TRAILER, STATUS_OF_CODE, code_of_status, status_of
from mesh.v2.params import metadata_to_signature, result_values

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
X = np.arange(128, dtype=np.float32).reshape(2, 64) / 16
TEXTS = np.array(["héllo", "", "gRPC"], dtype=object)


def _request(binary: bool, request_id: str | None = "q-1") -> tuple[dict[str, str], bytes]:
    params = {"latency_ms": 50.0, "min_accuracy": 0.9, "prefer": "refuse", "trace": True}
    plan, body = wire.encode_plan("digit-classification", {"x": X, "text": TEXTS}, params, request_id, binary,
                                  {"X-Tiermesh-Tenant": "acme"})
    return plan.headers, body


@pytest.mark.parametrize("binary", [True, False])
def test_an_infer_request_becomes_the_message_an_edge_decodes(binary: bool) -> None:
    headers, body = _request(binary)
    name, msg = grpc_call("POST", "v2/models/digit-classification/infer", headers, body)
    assert name == "ModelInfer" and msg.model_name == "digit-classification" and msg.id == "q-1"
    again = oip.ModelInferRequest.FromString(msg.SerializeToString())
    dec = decode_infer_request(again)  # what the edge's gRPC front reads
    np.testing.assert_array_equal(dec.inputs["x"], X)
    assert dec.inputs["text"].tolist() == [t.encode() for t in TEXTS]
    assert dec.parameters == {"latency_ms": 50.0, "min_accuracy": 0.9, "prefer": "refuse", "trace": True}
    assert len(again.raw_input_contents) == 2 and all(t.contents is None for t in again.inputs)


def test_a_request_without_id_and_task_names_that_need_quoting() -> None:
    headers, body = _request(True, None)
    name, msg = grpc_call("POST", "/v2/models/a%2Fb%20c/infer", headers, body)
    assert (name, msg.model_name, msg.id) == ("ModelInfer", "a/b c", "")
    assert grpc_call("GET", "v2/models/a%2Fb", {}, b"")[1].name == "a/b"
    assert grpc_call("GET", "v2/health/ready", {}, b"")[0] == "ServerReady"
    for method, path in (("GET", "v2/models/t/stats"), ("POST", "v2/models/t"), ("GET", "v2/traces/x"),
                         ("GET", "v2/models/t/infer")):
        with pytest.raises(RequestError):
            grpc_call(method, path, {}, b"")
    with pytest.raises(RequestError):
        grpc_call("POST", "v2/models/t/infer", {}, b'{"inputs": [{"name": "x"}]}')


def test_an_infer_reply_becomes_the_rest_reply_the_client_decodes() -> None:
    params = {"site": "edge-1", "variant": "mlp.int8", "accuracy": 0.97, "reason": "local_ok", "best_effort": False,
              "tenant": "acme", "timing_ms_network": 0.5, "timing_ms_queue": 1.0, "timing_ms_compute": 2.0,
              "timing_ms_total": 3.5, "hops": "edge-1,core-1", "late": True, "trace_id": "ab" * 16}
    logits = np.linspace(-1, 1, 20, dtype=np.float32).reshape(2, 10)
    upper = np.array([b"A", b"\xff\x00"], dtype=object)
    reply = oip.ModelInferResponse.FromString(
        encode_infer_response("t", "q-9", {"logits": logits, "upper": upper}, params).SerializeToString())
    status, headers, body = rest_reply("ModelInfer", reply)
    assert status == 200
    dec = wire.decode_reply(headers, body)
    np.testing.assert_array_equal(dec.outputs["logits"], logits)
    assert dec.outputs["upper"].tolist() == [b"A", b"\xff\x00"] and dec.request_id == "q-9"
    assert result_values(dec.parameters) == ("edge-1", "mlp.int8", 0.97, "local_ok", False, "acme",
                                             Timing(0.5, 1.0, 2.0, 3.5), ["edge-1", "core-1"])
    assert dec.parameters["late"] is True and dec.parameters["trace_id"] == "ab" * 16
    reply.raw_output_contents = reply.raw_output_contents[:1]
    with pytest.raises(errors.ProtocolError):
        rest_reply("ModelInfer", reply)


def test_metadata_and_health_replies() -> None:
    meta = oip.ModelMetadataResponse(name="t", platform="tiermesh",
                                     inputs=[oip.TensorMetadata(name="x", datatype="FP32", shape=[-1, 64])],
                                     outputs=[oip.TensorMetadata(name="y", datatype="BYTES", shape=[-1])])
    status, _, body = rest_reply("ModelMetadata", meta)
    got = metadata_to_signature(json.loads(body))  # as the client reads it
    assert status == 200 and [(s.name, s.dtype, s.shape) for s in got.inputs] == [("x", "float32", (-1, 64))]
    assert got.outputs[0].dtype == "object"
    assert rest_reply("ServerReady", oip.ServerReadyResponse(ready=False))[0] == 503
    assert rest_reply("ServerReady", oip.ServerReadyResponse(ready=True))[0] == 200


@pytest.mark.parametrize(("status", "trailers", "want"), [
    (5, {CODE_TRAILER: "unknown_task"}, errors.UnknownTask),
    (9, {CODE_TRAILER: "impossible_slo"}, errors.ImpossibleSLO),
    (3, {CODE_TRAILER: "bad_tensor"}, errors.BadTensor),
    (8, {CODE_TRAILER: "too_large"}, errors.PayloadTooLarge),
    (16, {CODE_TRAILER: "unauthenticated"}, errors.Unauthenticated),
    (7, {CODE_TRAILER: "unknown_tenant"}, errors.UnknownTenant),
    (4, {CODE_TRAILER: "deadline"}, errors.DeadlineExceeded),
    (14, {CODE_TRAILER: "no_route"}, errors.NoRoute),
    (13, {CODE_TRAILER: "no_such_code_yet"}, errors.MeshError),
    # no trailer (grpclib's own status, a proxy's): the status's most general code
    (5, None, errors.UnknownTask),
    (3, {}, errors.RequestError),
    (8, None, errors.Overloaded),
    (14, None, errors.PeerUnavailable),
    (16, None, errors.Unauthenticated),
    (12, None, errors.MeshError),  # UNIMPLEMENTED
])
def test_an_error_status_is_the_mesh_error_of_its_code(status: int, trailers: dict[str, str] | None,
                                                       want: type[errors.MeshError]) -> None:
    code, headers, body = error_reply(status, "told so", trailers)
    err = error_from_reply(code, body, wire.retry_after(headers))
    assert type(err) is want and str(err) == "told so" and code == want.http_status


def test_quota_keeps_its_retry_after() -> None:
    code, headers, body = error_reply(8, "over quota", {CODE_TRAILER: "quota_exceeded", "retry-after": "7"})
    err = error_from_reply(code, body, wire.retry_after(headers))
    assert isinstance(err, errors.QuotaExceeded) and err.retry_after_s == 7 and code == 429


def test_the_status_read_back_is_one_the_code_is_sent_with() -> None:
    for status, code in CODE_OF_STATUS.items():
        assert status_of(code) == status and code in STATUS_OF_CODE
    assert code_of_status(13) == code_of_status(2) == "internal"


def test_headers_become_metadata_without_the_bodys_framing() -> None:
    md = metadata_of({"X-Tiermesh-Tenant": "acme", "Content-Type": "application/octet-stream",
                      HEADER_LENGTH: "12", "traceparent": "00-ab-cd-01"})
    assert md == [("x-tiermesh-tenant", "acme"), ("traceparent", "00-ab-cd-01")]
    for bad in ({"grpc-timeout": "1S"}, {"te": "trailers"}, {"user-agent": "x"}, {"bad key": "v"}, {"k": "é"}):
        with pytest.raises(RequestError):
            metadata_of(bad)


def test_urls_and_tls_are_checked_at_construction() -> None:
    for url in ("grpcs://edge", "grpc://edge:port", "grpcs://edge:8001/v2", "http://edge:8001"):
        with pytest.raises(ConfigError):
            GrpcTransport(url, ssl_context=lambda: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(ConfigError, match="grpcs:// goes with TLS"):
        GrpcTransport("grpcs://edge:8001")
    assert GrpcTransport("grpc://[::1]:8001").host == "::1"


def test_open_edges_picks_a_transport_per_scheme_and_keeps_tls_apart() -> None:
    edges = open_edges(["grpc://a:1", "http://b:2", "GRPC://c:3"], None, timeout=1.0, ssl_context=None,
                       refresh=None)
    assert [type(e.own) for e in edges] == [GrpcTransport, AiohttpTransport, GrpcTransport]
    with pytest.raises(ConfigError, match="mix schemes with and without TLS"):
        open_edges(["grpcs://a:1", "http://b:2"], None, timeout=1.0, ssl_context=None, refresh=None)
    with pytest.raises(ConfigError, match="needs ca="):
        AsyncClient("grpcs://a:1")
    assert isinstance(AsyncClient("grpc://a:1").transport, GrpcTransport)


def test_a_grpc_url_without_the_extra_names_it() -> None:
    # grpclib hidden, as on the base install (tests/unit/test_extras.py has the trick)
    code = ("import sys\nsys.modules.update(dict.fromkeys(('grpclib', 'h2')))\nimport mesh\n"
            "try:\n    mesh.Client('grpc://127.0.0.1:1')\nexcept Exception as exc:\n"
            "    print(type(exc).__name__, exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.startswith("MissingExtra") and "pip install 'tiermesh[grpc]'" in out.stdout, out


async def test_a_refused_edge_is_peer_unavailable_and_a_refresh_replaces_the_channel() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    changes = iter([True, False])
    t = GrpcTransport(f"grpc://127.0.0.1:{port}", timeout=2.0, refresh=lambda: next(changes), refresh_s=0.0)
    with pytest.raises(errors.PeerUnavailable, match="ServerReady"):
        await t.request("GET", "v2/health/ready", {}, b"")
    current = t._channel  # made after the refresh; the one before it is retired, closed later
    assert len(t._retired) == 1 and current is not None and current not in t._retired
    with pytest.raises(errors.PeerUnavailable):
        await t.request("GET", "v2/health/ready", {}, b"")
    assert t._channel is current and len(t._retired) == 1
    await t.aclose()
    assert not t._retired and t._channel is None
    with pytest.raises(RuntimeError, match="closed"):
        await t.request("GET", "v2/health/ready", {}, b"")
