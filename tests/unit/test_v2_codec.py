"""The V2 codec: round trips (JSON and binary), tritonclient's exact layout, and every rejection."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from mesh.errors import BadTensor, PayloadTooLarge, RequestError
from mesh.types import SLO, InferResponse, TaskSignature, TensorSpec, Timing
from mesh.v2 import codec as codec
from mesh.v2.params import (
    DEFAULT_LATENCY_MS,
    metadata_to_signature,
    parse_slo,
    response_parameters,
    result_fields,
    signature_to_metadata,
)
from mesh.v2.tensors import COPY_MAX_BYTES, datatype_of, dtype_of

pytestmark = pytest.mark.unit

SIG = TaskSignature("digit-classification", (TensorSpec("x", "float32", (-1, 64)),),
                    (TensorSpec("logits", "float32", (-1, 10)),))
DTYPES = ["bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
          "float16", "float32", "float64"]


def _req(inputs: list[dict[str, Any]], **extra: Any) -> bytes:
    return json.dumps({"inputs": inputs, **extra}).encode()


@pytest.mark.parametrize("binary", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_request_round_trip_every_dtype(dtype: str, binary: bool) -> None:
    rng = np.random.default_rng(1)
    arr = (rng.random((3, 4)) * 100).astype(dtype)
    body, hlen = codec.encode_infer_request({"a": arr}, {"latency_ms": 5}, request_id="r1", binary=binary)
    assert (hlen is not None) == binary
    dec = codec.decode_infer_request(body, hlen)
    assert dec.request_id == "r1"
    assert dec.parameters["latency_ms"] == 5
    assert dec.inputs["a"].dtype == arr.dtype
    np.testing.assert_array_equal(dec.inputs["a"], arr)
    assert dec.outputs is None and dec.binary_default is binary


@settings(max_examples=40, deadline=None)
@given(hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=3, max_side=5),
                  elements=st.floats(-1e6, 1e6, width=32)),
       st.booleans())
def test_response_round_trip_property(arr: np.ndarray, binary: bool) -> None:
    body, hlen = codec.encode_infer_response("t", "id9", {"y": arr, "z": arr[..., :1]}, {"site": "e1"},
                                             {"y": binary, "z": not binary})
    dec = codec.decode_infer_response(body, hlen)
    np.testing.assert_array_equal(dec.outputs["y"], arr)
    np.testing.assert_array_equal(dec.outputs["z"], arr[..., :1])
    assert dec.request_id == "id9" and dec.parameters == {"site": "e1"}


def test_binary_layout_matches_tritonclient() -> None:
    """Decode a body built by tritonclient's own request builder, byte for byte."""
    from tritonclient.http import InferInput, InferRequestedOutput
    from tritonclient.http._utils import _get_inference_request

    x = np.arange(128, dtype=np.float32).reshape(2, 64) / 128
    y = np.arange(6, dtype=np.int64).reshape(2, 3)
    a = InferInput("x", [2, 64], "FP32")
    a.set_data_from_numpy(x, binary_data=True)
    b = InferInput("y", [2, 3], "INT64")
    b.set_data_from_numpy(y, binary_data=False)
    outs = [InferRequestedOutput("logits", binary_data=True), InferRequestedOutput("p", binary_data=False)]
    body, hlen = _get_inference_request([a, b], "abc", outs, 0, False, False, 0, None, {"latency_ms": 20})
    dec = codec.decode_infer_request(body, hlen)
    np.testing.assert_array_equal(dec.inputs["x"], x)
    np.testing.assert_array_equal(dec.inputs["y"], y)
    assert dec.outputs == {"logits": True, "p": False}
    assert dec.request_id == "abc" and dec.parameters["latency_ms"] == 20


def test_response_parses_with_tritonclient_infer_result() -> None:
    from tritonclient.http import InferResult

    logits = np.random.default_rng(0).random((4, 10)).astype(np.float32)
    ids = np.arange(4, dtype=np.int32)
    body, hlen = codec.encode_infer_response("t", "r", {"logits": logits, "ids": ids}, {},
                                             {"logits": True, "ids": False})
    res = InferResult.from_response_body(body, header_length=hlen)
    np.testing.assert_array_equal(res.as_numpy("logits"), logits)
    np.testing.assert_array_equal(res.as_numpy("ids"), ids)


def _bin_body(shape: list[int], raw: bytes, declared: int | None = None, datatype: str = "FP32") -> tuple[
        bytes, int]:
    head = json.dumps({"inputs": [{"name": "x", "shape": shape, "datatype": datatype,
                                   "parameters": {"binary_data_size": len(raw) if declared is None
                                                  else declared}}]}).encode()
    return head + raw, len(head)


@pytest.mark.parametrize("make, err, fragment", [
    (lambda: (b"{not json", None), RequestError, "not valid JSON"),
    (lambda: (b"[1, 2]", None), RequestError, "JSON object"),
    (lambda: (_req([], id=7), None), RequestError, "'id'"),
    (lambda: (json.dumps({"parameters": {}}).encode(), None), RequestError, "no 'inputs'"),
    (lambda: (_req([{"name": "x", "shape": [2, 2], "datatype": "FP32", "data": [1, 2, 3]}]), None),
     BadTensor, "needs 4"),
    (lambda: (_req([{"name": "x", "shape": [2], "datatype": "COMPLEX", "data": [1, 2]}]), None),
     BadTensor, "unsupported datatype"),
    (lambda: (_req([{"name": "x", "shape": [2], "datatype": "BF16", "data": [1, 2]}]), None),
     BadTensor, "unsupported datatype"),
    (lambda: (_req([{"name": "x", "shape": [2], "datatype": "BYTES", "data": ["a", 2]}]), None),
     BadTensor, "must be strings"),
    (lambda: (_req([{"name": "x", "shape": [3], "datatype": "BYTES", "data": ["a", "b"]}]), None),
     BadTensor, "needs 3"),
    (lambda: (_req([{"name": "x", "shape": [-1], "datatype": "FP32", "data": [1]}]), None),
     BadTensor, "non-negative"),
    (lambda: (_req([{"name": "x", "shape": [1], "datatype": "FP32", "data": ["a"]}]), None),
     BadTensor, "not FP32"),
    (lambda: (_req([{"name": "x", "shape": [1], "datatype": "FP32", "data": 3}]), None),
     BadTensor, "must be a list"),
    (lambda: (_req([{"name": "x", "shape": [1], "datatype": "FP32"}]), None), BadTensor, "neither"),
    (lambda: (_req([{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}] * 2), None),
     BadTensor, "twice"),
    (lambda: _bin_body([2, 2], np.zeros(4, np.float32).tobytes()[:12], declared=16), BadTensor, "truncated"),
    (lambda: _bin_body([2, 2], np.zeros(3, np.float32).tobytes()), BadTensor, "needs 16"),
    (lambda: (lambda b: (b[0] + b"xx", b[1]))(_bin_body([1], np.zeros(1, np.float32).tobytes())),
     BadTensor, "after the declared"),
    (lambda: _bin_body([1], b"", declared=1 << 30), PayloadTooLarge, "exceeds"),
    (lambda: (b"{}", 10), RequestError, "Inference-Header-Content-Length"),
    # found by the fuzz test (tests/integration/test_agent_fuzz.py): each was a 500
    (lambda: (_req([{"name": "x", "shape": [2**40, 2**40, 2**40, 0], "datatype": "FP32", "data": []}]), None),
     BadTensor, "below"),
    (lambda: _bin_body([2**40, 2**40, 2**40, 0], b""), BadTensor, "below"),
    # every dimension below 2**31, none holding anything, yet more than numpy indexes (a 500 the fuzz found later)
    (lambda: (_req([{"name": "x", "shape": [0, 2**30, 2**30], "datatype": "BYTES", "data": []}]), None),
     BadTensor, "numpy can hold"),
    (lambda: (_req([{"name": "x", "shape": [0, 2**30, 2**30], "datatype": "FP64", "data": []}]), None),
     BadTensor, "numpy can hold"),
    (lambda: _bin_body([2**20, 2**20, 2**20, 0], b"", datatype="FP64"), BadTensor, "numpy can hold"),
    (lambda: (_req([{"name": "x", "shape": [2], "datatype": "FP32", "data": [1e39, 1]}]), None),
     BadTensor, "overflow"),
])
def test_malformed_requests_are_rejected(make: Any, err: type[Exception], fragment: str) -> None:
    body, hlen = make()
    with pytest.raises(err, match=fragment):
        codec.decode_infer_request(body, hlen, max_bytes=1 << 20)


def test_body_over_limit_is_too_large() -> None:
    body, hlen = codec.encode_infer_request({"x": np.zeros(1000, np.float32)}, {})
    with pytest.raises(PayloadTooLarge):
        codec.decode_infer_request(body, hlen, max_bytes=1000)


def test_requested_outputs_default_to_request_level_binary_flag() -> None:
    body = json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}],
                       "parameters": {"binary_data_output": True},
                       "outputs": [{"name": "a"},
                                   {"name": "b", "parameters": {"binary_data": False}}]}).encode()
    dec = codec.decode_infer_request(body)
    assert dec.outputs == {"a": True, "b": False}


@pytest.mark.parametrize("params, expected", [
    ({}, SLO(latency_ms=DEFAULT_LATENCY_MS)),
    ({"latency_ms": 20, "min_accuracy": 0.97, "max_cost": 2, "prefer": "accuracy"},
     SLO(20.0, 0.97, 2.0, "accuracy")),
    ({"latency_ms": 0.5, "prefer": "refuse", "min_accuracy": 1}, SLO(0.5, 1.0, None, "refuse")),
])
def test_parse_slo_accepts(params: dict[str, Any], expected: SLO) -> None:
    assert parse_slo(params) == expected


@pytest.mark.parametrize("params, fragment", [
    ({"latency_ms": -1}, "latency_ms must be positive"),
    ({"latency_ms": 0}, "latency_ms must be positive"),
    ({"latency_ms": "fast"}, "latency_ms must be a finite number"),
    ({"latency_ms": True}, "latency_ms must be a finite number"),
    ({"min_accuracy": 1.2}, r"min_accuracy must be in \[0, 1\]"),
    ({"min_accuracy": -0.1}, r"min_accuracy must be in \[0, 1\]"),
    ({"max_cost": -3}, "max_cost must be non-negative"),
    ({"prefer": "cheapest"}, "prefer must be one of"),
])
def test_parse_slo_rejects(params: dict[str, Any], fragment: str) -> None:
    with pytest.raises(RequestError, match=fragment):
        parse_slo(params)


def test_metadata_round_trip_hides_variants() -> None:
    meta = signature_to_metadata(SIG)
    assert meta["name"] == "digit-classification" and meta["platform"] == "tiermesh"
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 64]}]
    assert metadata_to_signature(json.loads(json.dumps(meta))) == SIG
    with pytest.raises(RequestError):
        metadata_to_signature({"inputs": []})


def test_response_parameters_round_trip() -> None:
    resp = InferResponse("r", {}, site="edge-a", variant="mlp.int8", accuracy=0.96, reason="forward_accuracy",
                         best_effort=True, tenant="acme", timing=Timing(1.5, 2.0, 3.25, 7.0),
                         hops=["edge-a", "core"])
    params = json.loads(json.dumps(response_parameters(resp)))
    assert all(isinstance(v, str | int | float | bool) for v in params.values())
    f = result_fields(params)
    assert (f["site"], f["variant"], f["accuracy"], f["reason"], f["best_effort"], f["tenant"]) == (
        "edge-a", "mlp.int8", 0.96, "forward_accuracy", True, "acme")
    assert f["timing"] == Timing(1.5, 2.0, 3.25, 7.0) and f["hops"] == ["edge-a", "core"]


def test_datatype_mapping_rejects_unknown() -> None:
    assert datatype_of("float32") == "FP32" and dtype_of("INT64") == np.dtype(np.int64)
    with pytest.raises(BadTensor):
        datatype_of(np.dtype(np.complex64))
    with pytest.raises(BadTensor):
        dtype_of(None)


def test_server_side_decode_without_copy_is_read_only_and_cache_safe() -> None:
    x = np.arange(64, dtype=np.float32).reshape(1, 64)
    body, hlen = codec.encode_infer_request({"x": x}, {"latency_ms": 20.0}, binary=True)
    first = codec.decode_infer_request(body, hlen, copy=False)
    assert not first.inputs["x"].flags.writeable          # a view of the body, not a copy
    np.testing.assert_array_equal(first.inputs["x"], x)
    first.parameters["latency_ms"] = 99999.0               # a caller mutating what it got back...
    again = codec.decode_infer_request(body, hlen, copy=False)
    assert again.parameters["latency_ms"] == 20.0          # ...never leaks into the header cache
    with pytest.raises((RequestError, BadTensor)):         # a cached header still checks the body
        codec.decode_infer_request(body[:-8], hlen, copy=False)
    assert codec.decode_infer_request(body, hlen).inputs["x"].flags.writeable  # default copies


@pytest.mark.parametrize("rows", [3, 2 * COPY_MAX_BYTES // 40])  # copied out, and lent as a buffer
def test_tensor_bytes_are_the_same_whether_copied_or_lent(rows: int) -> None:
    y = np.arange(rows * 10, dtype=np.float32).reshape(10, rows).T  # not C-contiguous
    want = codec.encode_infer_response("t", "r", {"y": np.ascontiguousarray(y)}, {}, True)
    assert codec.encode_infer_response("t", "r", {"y": y}, {}, True) == want
    big_endian = codec.encode_infer_response("t", "r", {"y": y.astype(">f4")}, {}, True)
    assert big_endian == want
    np.testing.assert_array_equal(codec.decode_infer_response(*want).outputs["y"], y)


def test_replies_alternating_layouts_each_read_as_they_say() -> None:
    replies = [codec.encode_infer_response("t", f"r{n}", {"y": np.full((n, 10), n, np.float32)}, {}, True)
               for n in (1, 2, 1, 3)]
    for n, (body, hlen) in zip((1, 2, 1, 3), replies, strict=True):
        np.testing.assert_array_equal(codec.decode_infer_response(body, hlen).outputs["y"],
                                      np.full((n, 10), n, np.float32))
    body, hlen = replies[-1]  # the same outputs as the last reply, but bytes missing: still refused
    with pytest.raises(BadTensor, match="truncated"):
        codec.decode_infer_response(body[:-4], hlen)


def test_kept_header_brings_its_parsed_slo_and_a_bad_slo_is_never_kept() -> None:
    x = np.ones((1, 64), dtype=np.float32)
    body, hlen = codec.encode_infer_request({"x": x}, {"latency_ms": 25.0, "min_accuracy": 0.5}, binary=True)
    first, again = (codec.decode_infer_request(body, hlen, copy=False) for _ in range(2))
    assert first.slo == again.slo == parse_slo(first.parameters) == SLO(25.0, 0.5)
    bad, blen = codec.encode_infer_request({"x": x}, {"latency_ms": -1.0}, binary=True)
    for _ in range(2):  # the second decode must not come from a kept plan that skipped the check
        dec = codec.decode_infer_request(bad, blen, copy=False)
        assert dec.slo is None
        with pytest.raises(RequestError, match="latency_ms must be positive"):
            parse_slo(dec.parameters)


def test_shared_backbone_parameters() -> None:
    from mesh.types import InferResponse
    from mesh.v2.params import backbone_tenants, response_parameters

    shared = response_parameters(InferResponse("r", {}, "edge", "head", 0.9, "local_ok", backbone_tenants=2))
    assert shared["shared_backbone"] is True and backbone_tenants(shared) == 2
    plain = response_parameters(InferResponse("r", {}, "edge", "v", 0.9, "local_ok"))
    assert "shared_backbone" not in plain and backbone_tenants(plain) == 0
    assert backbone_tenants({"backbone_batch_tenants": "2"}) == 0
