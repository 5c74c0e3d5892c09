"""Tensors and metadata of the Open Inference Protocol's gRPC messages (:mod:`mesh.v2.grpc_messages`) as numpy
arrays and tiermesh's types: what the edge's gRPC front decodes and encodes, beside :mod:`mesh.v2.codec` (REST).

Inputs come either all in ``raw_input_contents`` (one little-endian buffer per input, in order: what
``tritonclient.grpc`` sends) or each in its typed ``contents``; BYTES elements are length-prefixed in raw form
(:mod:`mesh.bytes_tensor`) and one ``bytes_contents`` item each in typed form. Outputs always go back in
``raw_output_contents``, as Triton answers. Every tensor is checked here against its own declaration (datatype,
shape, size); against the task's signature at the data plane's door, as for REST.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from mesh.bytes_tensor import deserialize_bytes
from mesh.errors import BadTensor, RequestError
from mesh.types import MAX_DIM, TaskSignature, shape_fits
from mesh.v2 import grpc_messages as oip
from mesh.v2.classify import class_count
from mesh.v2.codec import DecodedRequest
from mesh.v2.datatypes import BYTES, datatype_named
from mesh.v2.tensors import NATIVE, datatype_of, dtype_of, tensor_data
from mesh.v2.triton import signature_to_config

__all__ = ["CONTENTS_FIELD", "decode_infer_request", "encode_infer_response", "model_config", "model_metadata",
           "model_statistics"]

# V2 datatype -> the InferTensorContents field that carries it in typed form (FP16 has none: raw only)
CONTENTS_FIELD: dict[str, str] = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", BYTES: "bytes_contents",
}


_MAX_NDIM = 32  # numpy holds 64 dimensions (32 before 2.0); no task has more than a few


def _shape(dims: list[int], where: str) -> tuple[int, ...]:
    if len(dims) > _MAX_NDIM or not shape_fits(dims):
        raise BadTensor(f"{where}: shape must be non-negative integers below {MAX_DIM} that numpy can hold, got "
                        f"{dims[:40]}")
    return tuple(dims)


def _from_raw(t: oip.InferInputTensor, raw: bytes, where: str) -> np.ndarray:
    shape = _shape(t.shape, where)
    dt = dtype_of(t.datatype)
    if dt.hasobject:
        return deserialize_bytes(raw, shape, where)
    want = math.prod(shape) * dt.itemsize
    if len(raw) != want:
        raise BadTensor(f"{where}: raw contents are {len(raw)} bytes but shape {list(shape)[:40]} of {t.datatype} "
                        f"needs {want}")
    # a read-only view of the message's bytes in native order (no copy on a little-endian machine)
    return np.frombuffer(raw, dtype=dt).reshape(shape).astype(NATIVE[t.datatype], copy=False)


def _from_contents(t: oip.InferInputTensor, where: str) -> np.ndarray:
    shape = _shape(t.shape, where)
    dt = dtype_of(t.datatype)
    field = CONTENTS_FIELD.get(t.datatype)
    if field is None:
        raise BadTensor(f"{where}: {t.datatype} comes only in raw_input_contents")
    values: list[Any] = getattr(t.contents, field) if t.contents is not None else []
    want = math.prod(shape)
    if len(values) != want:
        raise BadTensor(f"{where}: {field} holds {len(values)} elements but shape {list(shape)[:40]} needs {want}")
    if dt.hasobject:
        arr = np.empty(want, dtype=object)
        arr[:] = values
        return arr.reshape(shape)
    try:
        with np.errstate(over="raise"):
            return np.asarray(values, dtype=NATIVE[t.datatype]).reshape(shape)
    except (OverflowError, ValueError, FloatingPointError) as exc:  # an int_contents value out of INT8's range
        raise BadTensor(f"{where}: {field} is not {t.datatype}: {exc}") from exc


def decode_infer_request(req: oip.ModelInferRequest) -> DecodedRequest:
    """The inputs, parameters and requested outputs of a ``ModelInferRequest`` (``BadTensor`` / ``RequestError``
    for a malformed one). Outputs asked for by name come back as a dict of name -> True (all raw), those asked
    to be classified (``classification`` k) in ``classification``."""
    raws, tensors = req.raw_input_contents, req.inputs
    if not tensors:
        raise RequestError("request has no inputs")
    if raws and len(raws) != len(tensors):
        raise RequestError(f"raw_input_contents holds {len(raws)} buffers for {len(tensors)} inputs: with raw "
                           f"contents every input must have one")
    inputs: dict[str, np.ndarray] = {}
    for i, t in enumerate(tensors):
        where = f"input {t.name!r}"
        if t.name in inputs:
            raise BadTensor(f"{where} is given twice")
        if raws and t.contents is not None:
            raise RequestError(f"{where}: both contents and raw_input_contents")
        inputs[t.name] = _from_raw(t, raws[i], where) if raws else _from_contents(t, where)
    outputs = {o.name: True for o in req.outputs} if req.outputs else None
    classification: dict[str, int] | None = None
    for o in req.outputs:  # Triton's classification extension: InferRequestedOutput(name, class_count=k)
        if (k := oip.params_of(o.parameters).get("classification")) is not None:
            classification = classification or {}
            classification[o.name] = class_count(k, o.name)
    return DecodedRequest(req.id or None, inputs, oip.params_of(req.parameters), outputs, True, None, classification)


def encode_infer_response(task: str, request_id: str, outputs: Mapping[str, np.ndarray],
                          parameters: Mapping[str, object]) -> oip.ModelInferResponse:
    """A ``ModelInferResponse`` with every output in ``raw_output_contents`` (as Triton answers)."""
    descs = [oip.InferOutputTensor(name=name, datatype=datatype_of(arr.dtype), shape=list(arr.shape))
             for name, arr in outputs.items()]
    raw = [bytes(b) for b in tensor_data(outputs)]
    return oip.ModelInferResponse(model_name=task, id=request_id, parameters=oip.entries(parameters),
                                  outputs=descs, raw_output_contents=raw)


def model_metadata(sig: TaskSignature) -> oip.ModelMetadataResponse:
    """V2 model metadata for a task: the task stands in for the model; variants stay hidden."""
    def tensor(s: Any) -> oip.TensorMetadata:
        return oip.TensorMetadata(name=s.name, datatype=datatype_named(s.dtype), shape=list(s.shape))

    return oip.ModelMetadataResponse(name=sig.task, platform="tiermesh", inputs=[tensor(s) for s in sig.inputs],
                                     outputs=[tensor(s) for s in sig.outputs])


def model_config(sig: TaskSignature) -> oip.ModelConfigResponse:
    """Triton's model configuration of a task: what REST's ``GET /v2/models/{m}/config`` answers
    (:func:`mesh.v2.triton.signature_to_config`), as its message."""
    cfg = signature_to_config(sig)

    def tensors(kind: type[oip.ModelInput] | type[oip.ModelOutput], items: list[dict[str, Any]]) -> list[Any]:
        return [kind(name=t["name"], data_type=oip.DATA_TYPE[t["data_type"]], dims=list(t["dims"])) for t in items]

    return oip.ModelConfigResponse(config=oip.ModelConfig(
        name=cfg["name"], platform=cfg["platform"], backend=cfg["backend"], max_batch_size=cfg["max_batch_size"],
        input=tensors(oip.ModelInput, cfg["input"]), output=tensors(oip.ModelOutput, cfg["output"])))


def model_statistics(entries: list[dict[str, Any]]) -> oip.ModelStatisticsResponse:
    """Triton's statistics of the REST ``model_stats`` items (:func:`mesh.v2.triton.stats_entry`), as their
    message: the same entries, field for field."""
    def stats(item: dict[str, Any]) -> oip.ModelStatistics:
        durations = {k: oip.StatisticDuration(count=d["count"], ns=d["ns"]) for k, d in item["inference_stats"].items()}
        return oip.ModelStatistics(name=item["name"], version=item["version"], last_inference=item["last_inference"],
                                   inference_count=item["inference_count"], execution_count=item["execution_count"],
                                   inference_stats=oip.InferStatistics(**durations))

    return oip.ModelStatisticsResponse(model_stats=[stats(e) for e in entries])
