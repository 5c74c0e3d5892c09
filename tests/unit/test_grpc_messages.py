"""mesh.v2.grpc_messages against the classes ``tritonclient.grpc`` generates from Triton's protos (a dev
dependency; never imported by the agent): every field's number, type and cardinality, the service's method paths,
bytes each side reads back as the other meant them; then the tensors (mesh.v2.grpc_codec) and the status table
(mesh.v2.grpc_status)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from mesh import errors
from mesh.errors import BadTensor, MeshError, RequestError
from mesh.protowire import Field, Message
from mesh.types import TaskSignature, TensorSpec
from mesh.v2 import grpc_messages as oip
from mesh.v2.grpc_codec import decode_infer_request, encode_infer_response, model_config, model_metadata
from mesh.v2.grpc_status import STATUS_OF_CODE, status_of

pytestmark = pytest.mark.unit

service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")
model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
FD = pytest.importorskip("google.protobuf.descriptor").FieldDescriptor
_KIND = {FD.TYPE_INT64: "int64", FD.TYPE_UINT64: "uint64", FD.TYPE_INT32: "int32", FD.TYPE_UINT32: "uint32",
         FD.TYPE_ENUM: "enum", FD.TYPE_BOOL: "bool", FD.TYPE_BYTES: "bytes", FD.TYPE_STRING: "string",
         FD.TYPE_MESSAGE: "message", FD.TYPE_DOUBLE: "double", FD.TYPE_FLOAT: "float"}

# ours -> theirs (a nested message of the proto is a top-level class here; map entries are all one class)
THEIRS: dict[str, Any] = {
    **{n: getattr(service_pb2, n) for n in (
        "InferParameter", "InferTensorContents", "ServerLiveRequest", "ServerLiveResponse", "ServerReadyRequest",
        "ServerReadyResponse", "ModelReadyRequest", "ModelReadyResponse", "ServerMetadataRequest",
        "ServerMetadataResponse", "ModelMetadataRequest", "ModelMetadataResponse", "ModelInferRequest",
        "ModelInferResponse", "ModelConfigRequest", "ModelConfigResponse", "StatisticDuration", "InferStatistics",
        "ModelStatistics", "ModelStatisticsRequest", "ModelStatisticsResponse", "ModelRepositoryParameter",
        "RepositoryModelLoadRequest", "RepositoryModelLoadResponse")},
    "ParametersEntry": service_pb2.ModelInferRequest.ParametersEntry,
    "RepositoryParametersEntry": service_pb2.RepositoryModelLoadRequest.ParametersEntry,
    "TensorMetadata": service_pb2.ModelMetadataResponse.TensorMetadata,
    "InferInputTensor": service_pb2.ModelInferRequest.InferInputTensor,
    "InferRequestedOutputTensor": service_pb2.ModelInferRequest.InferRequestedOutputTensor,
    "InferOutputTensor": service_pb2.ModelInferResponse.InferOutputTensor,
    "ModelInput": model_config_pb2.ModelInput, "ModelOutput": model_config_pb2.ModelOutput,
    "ModelConfig": model_config_pb2.ModelConfig,
}
OURS = sorted(n for n, c in vars(oip).items() if isinstance(c, type) and issubclass(c, Message) and c is not Message)
PARTIAL = {"ModelInput", "ModelOutput", "ModelConfig",  # only the fields a task's signature fills
           "ModelStatistics"}  # only the fields the REST statistics fill


def _repeated(f: Any) -> bool:
    rep = getattr(f, "is_repeated", None)
    return bool(f.label == FD.LABEL_REPEATED) if rep is None else bool(rep() if callable(rep) else rep)


def test_every_class_is_checked() -> None:
    assert set(OURS) == set(THEIRS)


@pytest.mark.parametrize("name", OURS)
def test_every_field_is_tritons(name: str) -> None:
    ours, desc = getattr(oip, name), THEIRS[name].DESCRIPTOR
    theirs = {f.name: f for f in desc.fields}
    if name not in PARTIAL:
        assert [f.name for f in ours.FIELDS] == [f.name for f in desc.fields], name
    for f in ours.FIELDS:
        t = theirs[f.name]
        assert (f.number, f.kind, f.repeated) == (t.number, _KIND[t.type], _repeated(t)), (name, f.name)
        if f.kind == "message":
            their_msg = t.message_type.name
            assert f.message == their_msg or (f.message, their_msg) in {("ParametersEntry", "ParametersEntry"),
                                                                ("RepositoryParametersEntry", "ParametersEntry")}
        assert (f.oneof or None) == (t.containing_oneof.name if t.containing_oneof else None), (name, f.name)


def test_the_methods_are_tritons() -> None:
    service = service_pb2.DESCRIPTOR.services_by_name[oip.SERVICE]
    assert service_pb2.DESCRIPTOR.package == oip.PACKAGE
    for method, (req, reply) in oip.METHODS.items():
        m = service.methods_by_name[method]
        assert not m.client_streaming and not m.server_streaming
        assert THEIRS[req.__name__].DESCRIPTOR is m.input_type and THEIRS[reply.__name__].DESCRIPTOR is m.output_type


def test_the_data_types_are_tritons() -> None:
    enum = model_config_pb2.DESCRIPTOR.enum_types_by_name["DataType"]
    assert {n: enum.values_by_name[n].number for n in oip.DATA_TYPE} == oip.DATA_TYPE


def _value(f: Field, rng: random.Random, depth: int) -> Any:
    if f.kind == "message":
        return _random(getattr(oip, f.message), rng, depth + 1)
    return {"bool": lambda: True, "bytes": lambda: rng.randbytes(rng.randint(1, 30)),
            "string": lambda: "".join(rng.choice("abé/\U0001f600") for _ in range(rng.randint(1, 9))),
            "uint64": lambda: rng.choice([1, 2**64 - 1, rng.randrange(1, 2**64)]),
            "uint32": lambda: rng.choice([1, 2**32 - 1]), "int32": lambda: rng.choice([-1, 2**31 - 1, -(2**31)]),
            "int64": lambda: rng.choice([-1, 2**63 - 1, -(2**63), 300]), "enum": lambda: rng.randint(1, 13),
            "double": lambda: rng.choice([0.0, -1.5, 1e300]), "float": lambda: rng.choice([0.0, -1.5, 0.25])}[f.kind]()


def _random(cls: type[Message], rng: random.Random, depth: int = 0) -> Message:
    values: dict[str, Any] = {}
    oneof_done: set[str] = set()
    for f in cls.FIELDS:
        if (f.kind == "message" and depth > 2) or rng.random() < 0.3:
            continue
        if f.oneof:
            if f.oneof in oneof_done:
                continue
            oneof_done.add(f.oneof)
        values[f.name] = [_value(f, rng, depth) for _ in range(rng.randint(1, 3))] if f.repeated \
            else _value(f, rng, depth)
    return cls(**values)


@pytest.mark.parametrize("name", OURS)
def test_bytes_round_trip_through_tritons_classes(name: str) -> None:
    cls, gen = getattr(oip, name), THEIRS[name]
    rng = random.Random(name)
    for _ in range(30):
        msg = _random(cls, rng)
        data = msg.SerializeToString()
        theirs = gen.FromString(data)                      # protobuf reads what we wrote ...
        assert theirs.SerializeToString(deterministic=True) == gen.FromString(
            theirs.SerializeToString()).SerializeToString(deterministic=True)
        # ... and we read what protobuf wrote (a map as a map: protobuf orders and dedupes its entries)
        assert _norm(cls.FromString(theirs.SerializeToString())) == _norm(msg)
        assert cls.FromString(data) == msg


def _norm(value: Any) -> Any:
    """A message as plain data, with each map (repeated ParametersEntry) as a dict."""
    if isinstance(value, list):
        if value and isinstance(value[0], oip.ParametersEntry):
            return {e.key: _norm(e.value or oip.InferParameter()) for e in value}
        if value and isinstance(value[0], oip.RepositoryParametersEntry):
            return {e.key: _norm(e.value or oip.ModelRepositoryParameter()) for e in value}
        return [_norm(v) for v in value]
    if isinstance(value, Message):
        return {f.name: _norm(getattr(value, f.name)) for f in value.FIELDS}
    return value


def test_a_load_model_request_as_tritonclient_writes_it() -> None:
    req = service_pb2.RepositoryModelLoadRequest(model_name="acme-digits")  # as tritonclient.grpc's load_model
    req.parameters["config"].string_param = '{"family": "logreg"}'
    req.parameters["file:model.onnx"].bytes_param = b"\x08\x07onnx"
    req.parameters["file:empty"].bytes_param = b""
    ours = oip.RepositoryModelLoadRequest.FromString(req.SerializeToString())
    got = {e.key: e.value for e in ours.parameters}
    assert ours.model_name == "acme-digits" and got["config"] is not None and got["file:empty"] is not None
    assert got["config"].string_param == '{"family": "logreg"}' and got["config"].bytes_param is None
    assert got["file:model.onnx"].bytes_param == b"\x08\x07onnx" and got["file:empty"].bytes_param == b""


def test_parameters_as_tritonclient_writes_them() -> None:
    req = service_pb2.ModelInferRequest(model_name="digits")
    req.parameters["latency_ms"].double_param = 20.0
    req.parameters["prefer"].string_param = "latency"
    req.parameters["trace"].bool_param = False
    req.parameters["n"].int64_param = -3
    ours = oip.ModelInferRequest.FromString(req.SerializeToString())
    assert oip.params_of(ours.parameters) == {"latency_ms": 20.0, "prefer": "latency", "trace": False, "n": -3}
    back = service_pb2.ModelInferResponse.FromString(oip.ModelInferResponse(parameters=oip.entries(
        {"site": "edge-1", "accuracy": 0.97, "late": False, "hops": 2, "big": 2**64 - 1})).SerializeToString())
    assert back.parameters["site"].string_param == "edge-1" and back.parameters["accuracy"].double_param == 0.97
    assert back.parameters["late"].HasField("bool_param") and back.parameters["hops"].int64_param == 2
    assert back.parameters["big"].uint64_param == 2**64 - 1
    with pytest.raises(RequestError):
        oip.parameter([1])


# -- tensors -----------------------------------------------------------------------------------------------------

def _request(**kw: Any) -> oip.ModelInferRequest:
    return oip.ModelInferRequest.FromString(service_pb2.ModelInferRequest(model_name="t", **kw).SerializeToString())


def test_raw_inputs_are_read_as_tritonclient_sends_them() -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    text = b"".join(len(s).to_bytes(4, "little") + s for s in (b"hi", b"\xc3\xa9t\xc3\xa9"))
    dec = decode_infer_request(_request(
        id="q1", inputs=[{"name": "x", "datatype": "FP32", "shape": [2, 3]},
                         {"name": "t", "datatype": "BYTES", "shape": [2]}],
        raw_input_contents=[x.tobytes(), text], outputs=[{"name": "y"}]))
    np.testing.assert_array_equal(dec.inputs["x"], x)
    assert dec.inputs["t"].tolist() == [b"hi", "été".encode()]
    assert dec.request_id == "q1" and dec.outputs == {"y": True}


def test_typed_contents_are_read() -> None:
    dec = decode_infer_request(_request(inputs=[
        {"name": "a", "datatype": "FP32", "shape": [2], "contents": {"fp32_contents": [1.5, 2.5]}},
        {"name": "b", "datatype": "INT8", "shape": [1, 2], "contents": {"int_contents": [-3, 4]}},
        {"name": "c", "datatype": "BYTES", "shape": [1], "contents": {"bytes_contents": [b"x"]}},
        {"name": "d", "datatype": "BOOL", "shape": [1], "contents": {"bool_contents": [True]}}]))
    assert dec.inputs["a"].dtype == np.float32 and dec.inputs["a"].tolist() == [1.5, 2.5]
    assert dec.inputs["b"].dtype == np.int8 and dec.inputs["b"].tolist() == [[-3, 4]]
    assert dec.inputs["c"].tolist() == [b"x"] and dec.inputs["d"].tolist() == [True]


@pytest.mark.parametrize(("kw", "error", "words"), [
    ({}, RequestError, "no inputs"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2]}], "raw_input_contents": [b"\0" * 7]},
     BadTensor, "needs 8"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2]}] * 2, "raw_input_contents": [b"\0" * 8] * 2},
     BadTensor, "twice"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2]}, {"name": "y", "datatype": "FP32", "shape": [1]}],
      "raw_input_contents": [b"\0" * 8]}, RequestError, "every input"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [3], "contents": {"fp32_contents": [1.0]}}]},
     BadTensor, "needs 3"),
    ({"inputs": [{"name": "x", "datatype": "INT8", "shape": [1], "contents": {"int_contents": [300]}}]},
     BadTensor, "not INT8"),
    ({"inputs": [{"name": "x", "datatype": "FP16", "shape": [1], "contents": {"fp32_contents": [1.0]}}]},
     BadTensor, "raw_input_contents"),
    ({"inputs": [{"name": "x", "datatype": "BF16", "shape": [1]}], "raw_input_contents": [b"\0\0"]},
     BadTensor, "unsupported datatype"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1 << 40, 1 << 40]}], "raw_input_contents": [b""]},
     BadTensor, "shape"),
    ({"inputs": [{"name": "x", "datatype": "BYTES", "shape": [2]}], "raw_input_contents": [b"\1\0\0\0a"]},
     BadTensor, "BYTES"),
])
def test_malformed_tensors_are_the_callers_error(kw: dict[str, Any], error: type[MeshError], words: str) -> None:
    with pytest.raises(error, match=words):
        decode_infer_request(_request(**kw))


def test_outputs_go_back_raw_as_tritonclient_reads_them() -> None:
    y = np.array([[0.5, -1.0]], np.float32)
    t = np.array([b"ab", b""], dtype=object)
    msg = encode_infer_response("digits", "r9", {"y": y, "t": t}, {"site": "e1", "accuracy": 0.9})
    theirs = service_pb2.ModelInferResponse.FromString(msg.SerializeToString())
    assert theirs.model_name == "digits" and theirs.id == "r9"
    assert [(o.name, o.datatype, list(o.shape)) for o in theirs.outputs] == [("y", "FP32", [1, 2]), ("t", "BYTES", [2])]
    np.testing.assert_array_equal(np.frombuffer(theirs.raw_output_contents[0], np.float32).reshape(1, 2), y)
    assert theirs.raw_output_contents[1] == b"\2\0\0\0ab\0\0\0\0"
    assert theirs.parameters["accuracy"].double_param == 0.9


def test_metadata_and_config_of_a_task() -> None:
    sig = TaskSignature("digits", (TensorSpec("x", "float32", (-1, 64)),), (TensorSpec("logits", "float32", (-1, 10)),))
    meta = service_pb2.ModelMetadataResponse.FromString(model_metadata(sig).SerializeToString())
    assert meta.name == "digits" and meta.inputs[0].datatype == "FP32" and list(meta.inputs[0].shape) == [-1, 64]
    cfg = service_pb2.ModelConfigResponse.FromString(model_config(sig).SerializeToString()).config
    assert cfg.name == "digits" and cfg.max_batch_size > 0 and list(cfg.input[0].dims) == [64]
    assert cfg.input[0].data_type == model_config_pb2.TYPE_FP32 and cfg.output[0].name == "logits"


# -- status ------------------------------------------------------------------------------------------------------

def _codes() -> set[str]:
    return {c.code for c in vars(errors).values() if isinstance(c, type) and issubclass(c, MeshError)}


def test_every_error_code_has_a_grpc_status() -> None:
    assert _codes() <= set(STATUS_OF_CODE), _codes() - set(STATUS_OF_CODE)


@pytest.mark.parametrize(("code", "status"), [
    ("bad_request", "INVALID_ARGUMENT"), ("bad_tensor", "INVALID_ARGUMENT"), ("unknown_task", "NOT_FOUND"),
    ("impossible_slo", "FAILED_PRECONDITION"), ("deadline", "DEADLINE_EXCEEDED"), ("overloaded", "RESOURCE_EXHAUSTED"),
    ("quota_exceeded", "RESOURCE_EXHAUSTED"), ("too_large", "RESOURCE_EXHAUSTED"),
    ("unauthenticated", "UNAUTHENTICATED"),
    ("forbidden", "PERMISSION_DENIED"), ("unknown_tenant", "PERMISSION_DENIED"), ("no_route", "UNAVAILABLE"),
    ("nonsense", "INTERNAL"),
])
def test_status_numbers_are_grpcs(code: str, status: str) -> None:
    from grpclib.const import Status

    assert Status(status_of(code)).name == status
