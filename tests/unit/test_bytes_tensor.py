"""BYTES tensors (text) in the Open Inference Protocol codec: JSON strings and the binary extension's
length-prefixed form, both ways, byte for byte as tritonclient writes and reads them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tritonclient.http as triton
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from mesh.bytes_tensor import as_bytes_tensor, deserialize_bytes, serialize_bytes
from mesh.errors import BadTensor
from mesh.types import TaskSignature, TensorSpec, shape_fits
from mesh.v2 import codec
from mesh.v2.params import metadata_to_signature, signature_to_metadata
from mesh.v2.tensors import datatype_of, dtype_of

pytestmark = pytest.mark.unit

TEXTS = ["Real-time strategy game of ancient warfare", "", "café ☕ 日本語", "x" * 300]


def _obj(items: list[bytes]) -> np.ndarray:
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=6))
def test_wire_form_is_tritons_both_ways(items: list[bytes]) -> None:
    arr = _obj(items)
    wire = serialize_bytes(arr)
    if items:
        assert wire == serialize_byte_tensor(arr).item()
    assert deserialize_bytes(wire, (len(items),)).tolist() == items
    if items:
        assert deserialize_bytes_tensor(wire).tolist() == items


@pytest.mark.parametrize(("wire", "shape", "fragment"), [
    (b"\x05\x00\x00\x00abc", (1,), "declares 5 bytes"),
    (b"\x01\x00", (1,), "truncated length"),
    (b"\x01\x00\x00\x00ab", (1,), "1 bytes after"),
    (b"", (2,), "truncated length"),
])
def test_malformed_wire_is_a_clear_error(wire: bytes, shape: tuple[int, ...], fragment: str) -> None:
    with pytest.raises(BadTensor, match=fragment):
        deserialize_bytes(wire, shape)


def test_datatype_names() -> None:
    assert datatype_of(np.dtype(object)) == "BYTES" and dtype_of("BYTES") == np.dtype(object)
    sig = TaskSignature("text-topic", (TensorSpec("text", "object", (-1,)),),
                        (TensorSpec("logits", "float32", (-1, 10)),))
    meta = signature_to_metadata(sig)
    assert meta["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    assert metadata_to_signature(meta) == sig


@pytest.mark.parametrize("binary", [True, False])
def test_request_round_trip(binary: bool) -> None:
    x = as_bytes_tensor(TEXTS)
    body, hlen = codec.encode_infer_request({"text": x}, {"latency_ms": 50}, binary=binary)
    got = codec.decode_infer_request(body, hlen)
    assert got.inputs["text"].dtype == object and got.inputs["text"].tolist() == [t.encode() for t in TEXTS]


def test_json_strings_as_a_raw_client_sends_them() -> None:
    body = json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2, 1],
                                   "data": [["a game"], ["an email client"]]}]}).encode()
    got = codec.decode_infer_request(body)
    assert got.inputs["text"].shape == (2, 1) and got.inputs["text"].tolist() == [[b"a game"], [b"an email client"]]


@pytest.mark.parametrize("binary", [True, False])
def test_tritonclient_request_body_decodes(binary: bool) -> None:
    inp = triton.InferInput("text", [len(TEXTS)], "BYTES")
    inp.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=object), binary_data=binary)
    body, json_size = triton.InferenceServerClient.generate_request_body([inp])
    got = codec.decode_infer_request(body, json_size)
    assert got.inputs["text"].tolist() == [t.encode() for t in TEXTS]


@pytest.mark.parametrize("binary", [True, False])
def test_response_with_bytes_output_parses_in_tritonclient(binary: bool) -> None:
    out = {"label": as_bytes_tensor(["games", "mail"]), "logits": np.ones((2, 3), np.float32)}
    body, hlen = codec.encode_infer_response("text-topic", "r1", out, {"site": "edge-a"}, binary)
    res = triton.InferResult.from_response_body(body, header_length=hlen)
    # tritonclient hands JSON BYTES back as str, binary ones as bytes
    assert [v if isinstance(v, bytes) else v.encode() for v in res.as_numpy("label").tolist()] == [b"games", b"mail"]
    back = codec.decode_infer_response(body, hlen)
    assert back.outputs["label"].tolist() == [b"games", b"mail"]


def test_non_utf8_output_cannot_be_json() -> None:
    with pytest.raises(BadTensor, match="not UTF-8"):
        codec.encode_infer_response("t", "r", {"b": _obj([b"\xff"])}, {}, False)


def test_bad_binary_bytes_request_is_refused() -> None:
    head = json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2],
                                   "parameters": {"binary_data_size": 9}}]}).encode()
    body = head + b"\x01\x00\x00\x00a\x09\x00\x00\x00"
    with pytest.raises(BadTensor, match="declares 9 bytes"):
        codec.decode_infer_request(body, len(head))



@pytest.mark.parametrize(("dims", "fits"), [
    ((), True), ((0,), True), ((3, 4), True), ((2**31 - 1,), True), ((2**31,), False), ((-1, 2), False),
    ((0, 2**29, 2**29), True), ((0, 2**30, 2**30), False), ((2**20, 2**20, 2**20, 0), False),
])
def test_shape_fits_is_what_numpy_can_hold(dims: tuple[int, ...], fits: bool) -> None:
    """The one check both wire formats' decoders make: a shape is refused unless numpy can hold it at any
    element width (numpy refuses (0, 2**30, 2**30) of FP64 though it holds nothing)."""
    assert shape_fits(dims) is fits
    if fits and 0 in dims:
        np.empty(0, dtype=np.complex128).reshape(dims)  # numpy agrees, at the widest elements too
