"""The Open Inference Protocol's gRPC messages (KServe V2, Triton's ``inference.GRPCInferenceService``), written
and read by :mod:`mesh.protowire`: no protobuf runtime, no grpcio (the edge's footprint, as for etcd's messages).

The classes are the ones tiermesh answers, with the names, numbers and types of Triton's ``grpc_service.proto``
and ``model_config.proto``: the KServe V2 calls (server live / ready / metadata, model ready / metadata, infer),
``ModelConfig`` (what ``tritonclient.grpc``'s ``get_model_config`` and ``perf_analyzer`` ask before a query;
only the fields a task's signature fills), ``ModelStatistics`` (``get_inference_statistics``: the fields the
REST statistics fill) and ``RepositoryModelLoad`` (``load_model``: a tenant's registration). A nested message of
the proto is a top-level class here (``ModelInferRequest.InferInputTensor`` is :class:`InferInputTensor`); the map
fields (``parameters``) are repeated :class:`ParametersEntry` on the wire (:class:`RepositoryParametersEntry` in
the repository's request), read and written as dicts of plain values with :func:`params_of` and :func:`entries`.
The attributes a caller reads are annotated (protowire sets them all at construction).
``tests/unit/test_grpc_messages.py`` checks every field against the classes
``tritonclient`` generates, and round-trips through both.

Pure data and no numpy: the SDK's gRPC transport can stand on this as the edge does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from mesh.errors import RequestError
from mesh.protowire import Message, fields

__all__ = ["DATA_TYPE", "METHODS", "PACKAGE", "SERVICE", "entries", "parameter", "params_of"]

PACKAGE = "inference"
SERVICE = "GRPCInferenceService"

# ---------------------------------------------------------------- parameters


class InferParameter(Message):
    bool_param: bool | None
    int64_param: int | None
    string_param: str | None
    double_param: float | None
    uint64_param: int | None
    FIELDS = fields((1, "bool_param", "bool", False, "", "parameter_choice"),
                    (2, "int64_param", "int64", False, "", "parameter_choice"),
                    (3, "string_param", "string", False, "", "parameter_choice"),
                    (4, "double_param", "double", False, "", "parameter_choice"),
                    (5, "uint64_param", "uint64", False, "", "parameter_choice"))


class ParametersEntry(Message):  # every map<string, InferParameter> of the proto
    key: str
    value: InferParameter | None
    FIELDS = fields((1, "key", "string"), (2, "value", "message", False, "InferParameter"))


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def parameter(value: object) -> InferParameter:
    """A plain value (bool, int, float, str) as an ``InferParameter``; ``RequestError`` for any other."""
    if type(value) is bool:
        return InferParameter(bool_param=value)
    if type(value) is int:
        if _INT64_MIN <= value <= _INT64_MAX:
            return InferParameter(int64_param=value)
        if 0 <= value < 1 << 64:
            return InferParameter(uint64_param=value)
        raise RequestError(f"parameter {value} does not fit in 64 bits")
    if type(value) is float:
        return InferParameter(double_param=value)
    if type(value) is str:
        return InferParameter(string_param=value)
    raise RequestError(f"a parameter must be a bool, int, float or string, got {type(value).__name__}")


def entries(params: Mapping[str, object]) -> list[ParametersEntry]:
    """A dict of plain values as a map field's entries."""
    return [ParametersEntry(key=k, value=parameter(v)) for k, v in params.items()]


def _plain(p: InferParameter | None) -> object:
    if p is None:
        return None
    for v in (p.bool_param, p.int64_param, p.string_param, p.double_param, p.uint64_param):
        if v is not None:
            return v
    return None  # no member set: a parameter with no value


def params_of(items: Iterable[ParametersEntry]) -> dict[str, Any]:
    """A map field's entries as a dict of plain values (the last entry of a key wins, as protobuf's maps do); an
    entry whose value is unset reads as None."""
    return {e.key: _plain(e.value) for e in items}


# ---------------------------------------------------------------- health and metadata


class ServerLiveRequest(Message):
    FIELDS = ()


class ServerLiveResponse(Message):
    FIELDS = fields((1, "live", "bool"))


class ServerReadyRequest(Message):
    FIELDS = ()


class ServerReadyResponse(Message):
    FIELDS = fields((1, "ready", "bool"))


class ModelReadyRequest(Message):
    name: str
    version: str
    FIELDS = fields((1, "name", "string"), (2, "version", "string"))


class ModelReadyResponse(Message):
    FIELDS = fields((1, "ready", "bool"))


class ServerMetadataRequest(Message):
    FIELDS = ()


class ServerMetadataResponse(Message):
    FIELDS = fields((1, "name", "string"), (2, "version", "string"), (3, "extensions", "string", True))


class ModelMetadataRequest(Message):
    name: str
    version: str
    FIELDS = fields((1, "name", "string"), (2, "version", "string"))


class TensorMetadata(Message):  # ModelMetadataResponse.TensorMetadata
    FIELDS = fields((1, "name", "string"), (2, "datatype", "string"), (3, "shape", "int64", True))


class ModelMetadataResponse(Message):
    FIELDS = fields((1, "name", "string"), (2, "versions", "string", True), (3, "platform", "string"),
                    (4, "inputs", "message", True, "TensorMetadata"),
                    (5, "outputs", "message", True, "TensorMetadata"))


# ---------------------------------------------------------------- inference


class InferTensorContents(Message):
    bool_contents: list[bool]
    int_contents: list[int]
    int64_contents: list[int]
    uint_contents: list[int]
    uint64_contents: list[int]
    fp32_contents: list[float]
    fp64_contents: list[float]
    bytes_contents: list[bytes]
    FIELDS = fields((1, "bool_contents", "bool", True), (2, "int_contents", "int32", True),
                    (3, "int64_contents", "int64", True), (4, "uint_contents", "uint32", True),
                    (5, "uint64_contents", "uint64", True), (6, "fp32_contents", "float", True),
                    (7, "fp64_contents", "double", True), (8, "bytes_contents", "bytes", True))


class InferInputTensor(Message):  # ModelInferRequest.InferInputTensor
    name: str
    datatype: str
    shape: list[int]
    parameters: list[ParametersEntry]
    contents: InferTensorContents | None
    FIELDS = fields((1, "name", "string"), (2, "datatype", "string"), (3, "shape", "int64", True),
                    (4, "parameters", "message", True, "ParametersEntry"),
                    (5, "contents", "message", False, "InferTensorContents"))


class InferRequestedOutputTensor(Message):  # ModelInferRequest.InferRequestedOutputTensor
    name: str
    parameters: list[ParametersEntry]
    FIELDS = fields((1, "name", "string"), (2, "parameters", "message", True, "ParametersEntry"))


class ModelInferRequest(Message):
    model_name: str
    model_version: str
    id: str
    parameters: list[ParametersEntry]
    inputs: list[InferInputTensor]
    outputs: list[InferRequestedOutputTensor]
    raw_input_contents: list[bytes]
    FIELDS = fields((1, "model_name", "string"), (2, "model_version", "string"), (3, "id", "string"),
                    (4, "parameters", "message", True, "ParametersEntry"),
                    (5, "inputs", "message", True, "InferInputTensor"),
                    (6, "outputs", "message", True, "InferRequestedOutputTensor"),
                    (7, "raw_input_contents", "bytes", True))


class InferOutputTensor(Message):  # ModelInferResponse.InferOutputTensor
    name: str
    datatype: str
    shape: list[int]
    parameters: list[ParametersEntry]
    contents: InferTensorContents | None
    FIELDS = fields((1, "name", "string"), (2, "datatype", "string"), (3, "shape", "int64", True),
                    (4, "parameters", "message", True, "ParametersEntry"),
                    (5, "contents", "message", False, "InferTensorContents"))


class ModelInferResponse(Message):
    model_name: str
    model_version: str
    id: str
    parameters: list[ParametersEntry]
    outputs: list[InferOutputTensor]
    raw_output_contents: list[bytes]
    FIELDS = fields((1, "model_name", "string"), (2, "model_version", "string"), (3, "id", "string"),
                    (4, "parameters", "message", True, "ParametersEntry"),
                    (5, "outputs", "message", True, "InferOutputTensor"),
                    (6, "raw_output_contents", "bytes", True))


# ---------------------------------------------------------------- Triton's model configuration (what a task has)


class ModelInput(Message):
    FIELDS = fields((1, "name", "string"), (2, "data_type", "enum"), (4, "dims", "int64", True))


class ModelOutput(Message):
    FIELDS = fields((1, "name", "string"), (2, "data_type", "enum"), (3, "dims", "int64", True))


class ModelConfig(Message):
    FIELDS = fields((1, "name", "string"), (2, "platform", "string"), (4, "max_batch_size", "int32"),
                    (5, "input", "message", True, "ModelInput"), (6, "output", "message", True, "ModelOutput"),
                    (17, "backend", "string"))


class ModelConfigRequest(Message):
    name: str
    version: str
    FIELDS = fields((1, "name", "string"), (2, "version", "string"))


class ModelConfigResponse(Message):
    FIELDS = fields((1, "config", "message", False, "ModelConfig"))


# ---------------------------------------------------------------- Triton's statistics extension


class StatisticDuration(Message):
    FIELDS = fields((1, "count", "uint64"), (2, "ns", "uint64"))


class InferStatistics(Message):
    FIELDS = fields(*((i, name, "message", False, "StatisticDuration") for i, name in enumerate(
        ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit", "cache_miss"),
        start=1)))


class ModelStatistics(Message):  # batch_stats, memory_usage and response_stats: none kept (always empty)
    FIELDS = fields((1, "name", "string"), (2, "version", "string"), (3, "last_inference", "uint64"),
                    (4, "inference_count", "uint64"), (5, "execution_count", "uint64"),
                    (6, "inference_stats", "message", False, "InferStatistics"))


class ModelStatisticsRequest(Message):
    name: str
    version: str
    FIELDS = fields((1, "name", "string"), (2, "version", "string"))


class ModelStatisticsResponse(Message):
    FIELDS = fields((1, "model_stats", "message", True, "ModelStatistics"))


# ---------------------------------------------------------------- Triton's model repository extension (a tenant's
# registration: ``load_model(task, config=..., files=...)``, edge_agent.model_register)


class ModelRepositoryParameter(Message):
    bool_param: bool | None
    int64_param: int | None
    string_param: str | None
    bytes_param: bytes | None
    FIELDS = fields((1, "bool_param", "bool", False, "", "parameter_choice"),
                    (2, "int64_param", "int64", False, "", "parameter_choice"),
                    (3, "string_param", "string", False, "", "parameter_choice"),
                    (4, "bytes_param", "bytes", False, "", "parameter_choice"))


class RepositoryParametersEntry(Message):  # RepositoryModelLoadRequest's map<string, ModelRepositoryParameter>
    key: str
    value: ModelRepositoryParameter | None
    FIELDS = fields((1, "key", "string"), (2, "value", "message", False, "ModelRepositoryParameter"))


class RepositoryModelLoadRequest(Message):
    repository_name: str
    model_name: str
    parameters: list[RepositoryParametersEntry]
    FIELDS = fields((1, "repository_name", "string"), (2, "model_name", "string"),
                    (3, "parameters", "message", True, "RepositoryParametersEntry"))


class RepositoryModelLoadResponse(Message):
    FIELDS = ()


# model_config.proto's DataType, by the name Triton's JSON config spells (``mesh.v2.triton.config_type``)
DATA_TYPE: dict[str, int] = {"TYPE_BOOL": 1, "TYPE_UINT8": 2, "TYPE_UINT16": 3, "TYPE_UINT32": 4, "TYPE_UINT64": 5,
                             "TYPE_INT8": 6, "TYPE_INT16": 7, "TYPE_INT32": 8, "TYPE_INT64": 9, "TYPE_FP16": 10,
                             "TYPE_FP32": 11, "TYPE_FP64": 12, "TYPE_STRING": 13}

# method -> (request, reply): the unary calls of ``inference.GRPCInferenceService`` that tiermesh answers (the
# others, streaming ``ModelStreamInfer`` included, answer UNIMPLEMENTED)
METHODS: dict[str, tuple[type[Message], type[Message]]] = {
    "ServerLive": (ServerLiveRequest, ServerLiveResponse),
    "ServerReady": (ServerReadyRequest, ServerReadyResponse),
    "ServerMetadata": (ServerMetadataRequest, ServerMetadataResponse),
    "ModelReady": (ModelReadyRequest, ModelReadyResponse),
    "ModelMetadata": (ModelMetadataRequest, ModelMetadataResponse),
    "ModelInfer": (ModelInferRequest, ModelInferResponse),
    "ModelConfig": (ModelConfigRequest, ModelConfigResponse),
    "ModelStatistics": (ModelStatisticsRequest, ModelStatisticsResponse),
    "RepositoryModelLoad": (RepositoryModelLoadRequest, RepositoryModelLoadResponse),
}
