"""Open Inference Protocol (KServe V2) codec: JSON tensors and the binary tensor extension.

Pure functions, no I/O. The HTTP front (``edge_agent.http_api``) decodes requests and encodes
responses with them; the SDK (``mesh.client``) does the reverse with the same code, so both ends
agree byte for byte. The layout matches what ``tritonclient.http`` sends and parses: a JSON
header, then the raw little-endian bytes of every tensor whose ``parameters.binary_data_size``
is set, in the order the tensors appear; ``Inference-Header-Content-Length`` gives the JSON
header's length whenever binary data follows it.

tiermesh fields ride in ``parameters``: the SLO on the request, the serving site, variant,
accuracy, decision reason and timing on the response. That mapping, the datatype table, model
metadata and input validation live in :mod:`mesh.v2_params`; every name there is re-exported here,
so callers import only this module.

Hot paths avoid what costs microseconds each on every request: ``dtype.name`` (a Python
property), a ``JSONEncoder`` built per call, ``bytes`` detours for tensor data (one copy into the
body, one copy out of it, no more).
"""

from __future__ import annotations

import json
import json.decoder
import json.encoder
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from mesh.errors import BadTensor, PayloadTooLarge, RequestError
from mesh.v2_params import (
    DEFAULT_LATENCY_MS,
    DTYPE_TO_V2,
    NATIVE,
    V2_TO_NP,
    datatype_of,
    dtype_of,
    metadata_to_signature,
    parse_slo,
    response_parameters,
    result_fields,
    signature_to_metadata,
    validate_inputs,
)

__all__ = [
    "DEFAULT_LATENCY_MS",
    "HEADER_LENGTH",
    "TENANT_HEADER",
    "DecodedRequest",
    "DecodedResponse",
    "datatype_of",
    "decode_infer_request",
    "decode_infer_response",
    "dtype_of",
    "encode_infer_request",
    "encode_infer_response",
    "metadata_to_signature",
    "parse_slo",
    "response_parameters",
    "result_fields",
    "signature_to_metadata",
    "validate_inputs",
]

HEADER_LENGTH = "Inference-Header-Content-Length"
# Names the caller's tenant until mutual TLS does (see ``edge_agent.http_api.identify``).
TENANT_HEADER = "X-Tiermesh-Tenant"

# ---------------------------------------------------------------------------- tensors


def _shape(value: object, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value
    ):
        raise BadTensor(f"{where}: shape must be a list of non-negative integers, got {value!r}")
    return tuple(value)


def _tensor_from_json(t: Mapping[str, Any], data: Any, where: str) -> np.ndarray:
    dt = dtype_of(t.get("datatype"))
    shape = _shape(t.get("shape"), where)
    want = math.prod(shape)
    if not isinstance(data, list):
        raise BadTensor(f"{where}: 'data' must be a list, got {type(data).__name__}")
    try:
        arr = np.asarray(data, dtype=dt).reshape(-1)
    except (TypeError, ValueError, OverflowError) as exc:
        raise BadTensor(f"{where}: data is not {t.get('datatype')}: {exc}") from exc
    if arr.size != want:
        raise BadTensor(f"{where}: data has {arr.size} elements but shape {list(shape)} needs {want}")
    return arr.reshape(shape)


def _tensor_from_bytes(t: Mapping[str, Any], raw: bytes | memoryview, where: str) -> np.ndarray:
    datatype = t.get("datatype")
    dt = dtype_of(datatype)
    shape = _shape(t.get("shape"), where)
    want = math.prod(shape) * dt.itemsize
    if len(raw) != want:
        raise BadTensor(f"{where}: binary_data_size is {len(raw)} bytes but shape {list(shape)} "
                        f"of {datatype} needs {want}")
    # Copy so the array owns its memory and the request body can be freed.
    return np.frombuffer(raw, dtype=dt).reshape(shape).astype(NATIVE[cast(str, datatype)], copy=True)


def _binary_size(t: Mapping[str, Any], where: str) -> int | None:
    params = t.get("parameters") or {}
    if not isinstance(params, dict):
        raise BadTensor(f"{where}: parameters must be an object")
    size = params.get("binary_data_size")
    if size is None:
        return None
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise BadTensor(f"{where}: binary_data_size must be a non-negative integer, got {size!r}")
    return size


def _loads(raw: bytes) -> Any:
    # json.loads sniffs the encoding first; a header that opens with '{' then a non-NUL byte can
    # only be UTF-8 (UTF-16/32 put a NUL or a BOM there), so decode it directly
    if len(raw) > 1 and raw[0] == 0x7B and raw[1]:
        return _DECODER.decode(raw.decode("utf-8", "surrogatepass"))
    return json.loads(raw)


def _default(o: object) -> Any:
    raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")


_DECODER = json.JSONDecoder()
# The C encoder json.dumps builds on every call, built once. No circular check (markers=None):
# every header is a tree this module assembles.
_c_encoder = getattr(json.encoder, "c_make_encoder", None)
_ENCODE = (_c_encoder(None, _default, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, True)
           if _c_encoder is not None else None)


def _dumps(head: dict[str, Any]) -> bytes:
    if _ENCODE is None:
        return json.dumps(head, separators=(",", ":")).encode()
    return "".join(_ENCODE(head, 0)).encode()


def _split_body(body: bytes, header_length: int | None, max_bytes: int) -> tuple[dict[str, Any], memoryview]:
    if len(body) > max_bytes:
        raise PayloadTooLarge(f"body of {len(body)} bytes exceeds the limit of {max_bytes}")
    if header_length is None:
        header_length = len(body)
    if header_length < 0 or header_length > len(body):
        raise RequestError(f"{HEADER_LENGTH} is {header_length} but the body has {len(body)} bytes")
    try:
        head = _loads(body[:header_length] if header_length != len(body) else body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(f"body is not valid JSON: {exc}") from exc
    if not isinstance(head, dict):
        raise RequestError("body must be a JSON object")
    return head, memoryview(body)[header_length:]


def _fast_binary_tensors(items: object, tail: memoryview, max_bytes: int) -> dict[str, np.ndarray] | None:
    """Tensors when every one is well-formed binary data (what the SDK and tritonclient send);
    None sends the caller to ``_read_tensors``, which says precisely what is wrong."""
    if type(items) is not list:
        return None
    out: dict[str, np.ndarray] = {}
    offset, end = 0, len(tail)
    for t in items:
        if type(t) is not dict:
            return None
        name, datatype, shape, params = t.get("name"), t.get("datatype"), t.get("shape"), t.get("parameters")
        if (type(name) is not str or name in out or type(datatype) is not str or type(shape) is not list
                or type(params) is not dict or datatype not in V2_TO_NP):
            return None
        size = params.get("binary_data_size")
        if type(size) is not int or size > max_bytes:
            return None
        count = 1
        for d in shape:
            if type(d) is not int or d < 0:
                return None
            count *= d
        dt = V2_TO_NP[datatype]
        if count * dt.itemsize != size or offset + size > end:
            return None
        # one copy, so the array owns its memory and the body can be freed
        arr = np.ndarray(shape, dt, tail, offset)
        out[name] = arr.copy() if dt.isnative else arr.astype(NATIVE[datatype])
        offset += size
    return out if offset == end else None


def _read_tensors(items: object, tail: memoryview, kind: str, max_bytes: int) -> dict[str, np.ndarray]:
    if not isinstance(items, list):
        raise RequestError(f"'{kind}' must be a list of tensors")
    out: dict[str, np.ndarray] = {}
    offset = 0
    for i, t in enumerate(items):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise BadTensor(f"{kind}[{i}] must be an object with a string 'name'")
        where = f"{kind} {t['name']!r}"
        if t["name"] in out:
            raise BadTensor(f"{where} appears twice")
        size = _binary_size(t, where)
        if size is None:
            if "data" not in t:
                raise BadTensor(f"{where} has neither 'data' nor parameters.binary_data_size")
            out[t["name"]] = _tensor_from_json(t, t["data"], where)
            continue
        if size > max_bytes:
            raise PayloadTooLarge(f"{where}: declared binary_data_size {size} exceeds "
                                  f"the limit of {max_bytes}")
        if offset + size > len(tail):
            raise BadTensor(f"{where}: truncated binary tensor: declared {size} bytes at offset {offset} "
                            f"but only {len(tail) - offset} remain")
        out[t["name"]] = _tensor_from_bytes(t, tail[offset:offset + size], where)
        offset += size
    if offset != len(tail):
        raise BadTensor(f"{len(tail) - offset} bytes after the declared binary tensors")
    return out


def _tensor_json(name: str, arr: np.ndarray, binary: bool) -> tuple[dict[str, Any], bytes | memoryview | None]:
    t: dict[str, Any] = {"name": name, "datatype": datatype_of(arr.dtype), "shape": list(arr.shape)}
    if not binary:
        t["data"] = arr.reshape(-1).tolist()
        return t, None
    raw: bytes | memoryview
    if arr.dtype in DTYPE_TO_V2 and arr.flags.c_contiguous and arr.size:
        # already little-endian and contiguous: lend the bytes; _assemble copies them once
        raw = memoryview(arr).cast("B")  # type: ignore[arg-type]
    else:
        raw = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()
    t["parameters"] = {"binary_data_size": len(raw)}
    return t, raw


def _assemble(head: dict[str, Any], blobs: Iterable[bytes | memoryview | None]) -> tuple[bytes, int | None]:
    header = _dumps(head)
    parts = [b for b in blobs if b is not None]
    if not parts:
        return header, None
    return b"".join([header, *parts]), len(header)


# ---------------------------------------------------------------------------- requests


@dataclass(slots=True)
class DecodedRequest:
    request_id: str | None
    inputs: dict[str, np.ndarray]
    parameters: dict[str, Any]
    # output name -> send as binary; None means "all outputs" with ``binary_default``
    outputs: dict[str, bool] | None = None
    binary_default: bool = False


def decode_infer_request(body: bytes, header_length: int | None = None, *,
                         max_bytes: int = 16 << 20) -> DecodedRequest:
    """Parse a V2 infer request body (JSON, or JSON header + binary tensors)."""
    head, tail = _split_body(body, header_length, max_bytes)
    rid, params = head.get("id"), head.get("parameters")
    if (rid is None or type(rid) is str) and type(params) is dict and head.get("outputs") is None:
        inputs = _fast_binary_tensors(head.get("inputs"), tail, max_bytes)
        if inputs is not None:
            return DecodedRequest(rid, inputs, params, None, params.get("binary_data_output") is True)
    rid = head.get("id")
    if rid is not None and not isinstance(rid, str):
        raise RequestError(f"'id' must be a string, got {type(rid).__name__}")
    params = head.get("parameters") or {}
    if not isinstance(params, dict):
        raise RequestError("'parameters' must be an object")
    if "inputs" not in head:
        raise RequestError("request has no 'inputs'")
    inputs = _read_tensors(head["inputs"], tail, "input", max_bytes)
    outputs: dict[str, bool] | None = None
    binary_default = params.get("binary_data_output") is True
    if head.get("outputs") is not None:
        if not isinstance(head["outputs"], list):
            raise RequestError("'outputs' must be a list")
        outputs = {}
        for o in head["outputs"]:
            if not isinstance(o, dict) or not isinstance(o.get("name"), str):
                raise RequestError("each requested output needs a string 'name'")
            oparams = o.get("parameters") or {}
            flag = oparams.get("binary_data") if isinstance(oparams, dict) else None
            outputs[o["name"]] = binary_default if flag is None else flag is True
    return DecodedRequest(rid, inputs, params, outputs, binary_default)


def encode_infer_request(inputs: Mapping[str, np.ndarray], parameters: Mapping[str, Any], *,
                         request_id: str | None = None, binary: bool = True) -> tuple[bytes, int | None]:
    """Body and header length of a V2 infer request asking for every output (binary if ``binary``)."""
    head: dict[str, Any] = {}
    if request_id:
        head["id"] = request_id
    params = dict(parameters)
    if binary:
        params["binary_data_output"] = True
    head["parameters"] = params
    tensors, blobs = [], []
    for name, arr in inputs.items():
        t, raw = _tensor_json(name, np.asarray(arr), binary)
        tensors.append(t)
        blobs.append(raw)
    head["inputs"] = tensors
    return _assemble(head, blobs)


# ---------------------------------------------------------------------------- responses


def encode_infer_response(model_name: str, request_id: str, outputs: Mapping[str, np.ndarray],
                          parameters: Mapping[str, Any],
                          binary: Mapping[str, bool]) -> tuple[bytes, int | None]:
    """Body and header length of a V2 infer response; ``binary[name]`` picks the encoding per output."""
    head: dict[str, Any] = {"model_name": model_name, "model_version": "", "id": request_id,
                            "parameters": dict(parameters)}
    tensors, blobs = [], []
    for name, arr in outputs.items():
        t, raw = _tensor_json(name, np.asarray(arr), binary.get(name, False))
        tensors.append(t)
        blobs.append(raw)
    head["outputs"] = tensors
    return _assemble(head, blobs)


@dataclass(slots=True)
class DecodedResponse:
    request_id: str
    outputs: dict[str, np.ndarray]
    parameters: dict[str, Any] = field(default_factory=dict)


def decode_infer_response(body: bytes, header_length: int | None = None, *,
                          max_bytes: int = 1 << 31) -> DecodedResponse:
    head, tail = _split_body(body, header_length, max_bytes)
    outputs = _fast_binary_tensors(head.get("outputs"), tail, max_bytes)
    if outputs is None:
        outputs = _read_tensors(head.get("outputs", []), tail, "output", max_bytes)
    params = head.get("parameters") or {}
    return DecodedResponse(str(head.get("id", "")), outputs, params if isinstance(params, dict) else {})
