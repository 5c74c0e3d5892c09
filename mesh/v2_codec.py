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
property), the stdlib's JSON (orjson reads and writes headers as bytes), ``bytes`` detours for
tensor data (one copy into the body; out of it, one copy for the SDK's caller and none for the
server, which reads its inputs in place).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import orjson

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
    result_values,
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
    "result_values",
    "signature_to_metadata",
    "tensor_data",
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


def _tensor_from_bytes(t: Mapping[str, Any], raw: bytes | memoryview, where: str, copy: bool) -> np.ndarray:
    datatype = t.get("datatype")
    dt = dtype_of(datatype)
    shape = _shape(t.get("shape"), where)
    want = math.prod(shape) * dt.itemsize
    if len(raw) != want:
        raise BadTensor(f"{where}: binary_data_size is {len(raw)} bytes but shape {list(shape)} "
                        f"of {datatype} needs {want}")
    return np.frombuffer(raw, dtype=dt).reshape(shape).astype(NATIVE[cast(str, datatype)], copy=copy)


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


# orjson parses and writes a header in about a micro-second, bytes in and out (the stdlib needs
# five to ten, plus a str round trip). It reads a memoryview, so the header is never sliced out of
# the body. Its dialect is strict JSON: NaN/Infinity are refused on input and written as null.
_loads = orjson.loads
_OPTS = orjson.OPT_SERIALIZE_NUMPY  # numpy scalars (np.float64 accuracies), as the stdlib wrote them


def _dumps(head: dict[str, Any]) -> bytes:
    return orjson.dumps(head, option=_OPTS)


def _split_body(body: bytes, header_length: int | None, max_bytes: int) -> tuple[dict[str, Any], memoryview]:
    if len(body) > max_bytes:
        raise PayloadTooLarge(f"body of {len(body)} bytes exceeds the limit of {max_bytes}")
    if header_length is None:
        header_length = len(body)
    if header_length < 0 or header_length > len(body):
        raise RequestError(f"{HEADER_LENGTH} is {header_length} but the body has {len(body)} bytes")
    view = memoryview(body)
    try:
        head = _loads(view[:header_length] if header_length != len(body) else body)
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"body is not valid JSON: {exc}") from exc
    if type(head) is not dict:
        raise RequestError("body must be a JSON object")
    return head, view[header_length:]


# name, wire dtype, shape, byte size: one binary tensor as a well-formed header declares it
_Spec = tuple[str, np.dtype[Any], tuple[int, ...], int]


def _binary_specs(items: object, end: int, max_bytes: int) -> tuple[_Spec, ...] | None:
    """The tensors when every one is well-formed binary data filling exactly ``end`` bytes (what
    the SDK and tritonclient send); None sends the caller to ``_read_tensors``, which says
    precisely what is wrong."""
    if type(items) is not list:
        return None
    specs: list[_Spec] = []
    names: set[str] = set()
    offset = 0
    for t in items:
        if type(t) is not dict:
            return None
        name, datatype, shape, params = t.get("name"), t.get("datatype"), t.get("shape"), t.get("parameters")
        if (type(name) is not str or name in names or type(datatype) is not str or type(shape) is not list
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
        names.add(name)
        specs.append((name, dt, tuple(shape), size))
        offset += size
    return tuple(specs) if offset == end else None


def _arrays(specs: tuple[_Spec, ...], buf: bytes | memoryview, offset: int, copy: bool) -> dict[str, np.ndarray]:
    """The tensors ``specs`` declares, laid out in ``buf`` from ``offset``. Without ``copy``
    native-order tensors are read-only views of ``buf``."""
    out: dict[str, np.ndarray] = {}
    for name, dt, shape, size in specs:
        arr = np.ndarray(shape, dt, buf, offset)
        if dt.isnative:
            out[name] = arr.copy() if copy else arr
        else:
            out[name] = arr.astype(dt.newbyteorder("="))
        offset += size
    return out


def _fast_binary_tensors(items: object, tail: memoryview, max_bytes: int,
                         copy: bool) -> dict[str, np.ndarray] | None:
    specs = _binary_specs(items, len(tail), max_bytes)
    return None if specs is None else _arrays(specs, tail, 0, copy)


def _read_tensors(items: object, tail: memoryview, kind: str, max_bytes: int,
                  copy: bool) -> dict[str, np.ndarray]:
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
        out[t["name"]] = _tensor_from_bytes(t, tail[offset:offset + size], where, copy)
        offset += size
    if offset != len(tail):
        raise BadTensor(f"{len(tail) - offset} bytes after the declared binary tensors")
    return out


def _raw(arr: np.ndarray, little: bool) -> bytes | memoryview:
    """A tensor's bytes as the binary extension lays them out (``little``: its dtype is LE)."""
    view = memoryview(arr) if little and arr.size else None  # type: ignore[arg-type]
    if view is not None and view.c_contiguous:
        # already little-endian and contiguous: lend the bytes; the body's join copies them once
        return view.cast("B")
    return np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()


def tensor_data(arrays: Mapping[str, np.ndarray]) -> list[bytes | memoryview]:
    """What ``encode_infer_request(arrays, ...)`` puts after its header: a header kept from a
    request with the same names, dtypes and shapes joined with these is the next body."""
    return [_raw(a, a.dtype in DTYPE_TO_V2) for a in arrays.values()]


def _tensor_json(name: str, arr: np.ndarray, binary: bool) -> tuple[dict[str, Any], bytes | memoryview | None]:
    dt = arr.dtype
    v2 = DTYPE_TO_V2.get(dt)  # None for big-endian and unserved dtypes: datatype_of sorts them out
    t: dict[str, Any] = {"name": name, "datatype": v2 or datatype_of(dt), "shape": list(arr.shape)}
    if not binary:
        t["data"] = arr.reshape(-1).tolist()
        return t, None
    raw = _raw(arr, v2 is not None)
    t["parameters"] = {"binary_data_size": len(raw)}
    return t, raw


def _assemble(head: dict[str, Any], blobs: list[bytes | memoryview | None]) -> tuple[bytes, int | None]:
    header = _dumps(head)
    parts: list[bytes | memoryview] = [header]
    parts += [b for b in blobs if b is not None]
    if len(parts) == 1:
        return header, None
    return b"".join(parts), len(header)


# A binary tensor's JSON depends on its name, dtype and shape alone, which repeat reply after
# reply: it is built once and shared (orjson only reads it; nothing else sees it).
_DESCS: dict[tuple[str, np.dtype[Any], tuple[int, ...]], dict[str, Any]] = {}
_DESCS_MAX = 256


def _tensors(arrays: Mapping[str, np.ndarray], binary: bool | Mapping[str, bool]
             ) -> tuple[list[dict[str, Any]], list[bytes | memoryview | None]]:
    tensors: list[dict[str, Any]] = []
    blobs: list[bytes | memoryview | None] = []
    for name, arr in arrays.items():
        flag = binary if type(binary) is bool else cast(Mapping[str, bool], binary).get(name, False)
        if type(arr) is not np.ndarray:
            arr = np.asarray(arr)
        if flag:
            key = (name, arr.dtype, arr.shape)
            t = _DESCS.get(key)
            if t is not None:
                tensors.append(t)
                blobs.append(_raw(arr, arr.dtype in DTYPE_TO_V2))
                continue
        t, raw = _tensor_json(name, arr, flag)
        if flag:
            if len(_DESCS) >= _DESCS_MAX:
                _DESCS.clear()
            _DESCS[key] = t
        tensors.append(t)
        blobs.append(raw)
    return tensors, blobs


# ---------------------------------------------------------------------------- requests


@dataclass(slots=True)
class DecodedRequest:
    request_id: str | None
    inputs: dict[str, np.ndarray]
    parameters: dict[str, Any]
    # output name -> send as binary; None means "all outputs" with ``binary_default``
    outputs: dict[str, bool] | None = None
    binary_default: bool = False
    # the inputs' layout when the fast path decoded them: one object per header, so a server
    # may remember that it checked it
    specs: tuple[tuple[str, np.dtype[Any], tuple[int, ...], int], ...] | None = None


# A client sends the same header query after query (same tensors, same SLO, no id): its parsed
# form is kept, keyed by the header's bytes, so a repeat skips JSON and the checks. Only headers
# that passed every check are kept, copied out of the body; parameters go out as a fresh dict.
_PLAN_HEADER_MAX = 4096
_PLANS_MAX = 256
_PLANS: dict[bytes, tuple[dict[str, Any], tuple[_Spec, ...], bool, int]] = {}


def decode_infer_request(body: bytes, header_length: int | None = None, *,
                         max_bytes: int = 16 << 20, copy: bool = True) -> DecodedRequest:
    """Parse a V2 infer request body (JSON, or JSON header + binary tensors). With ``copy=False``
    binary tensors in native byte order are read-only views of ``body`` (no copy; they keep it
    alive): what a server wants, since it only reads its inputs."""
    # the length of a header that may be kept, else 0
    keep = (header_length if type(body) is bytes and header_length is not None
            and 0 < header_length <= _PLAN_HEADER_MAX else 0)
    if keep:
        plan = _PLANS.get(body[:keep])
        if plan is not None and len(body) == plan[3] and len(body) <= max_bytes:
            return DecodedRequest(None, _arrays(plan[1], body, keep, copy), dict(plan[0]), None, plan[2], plan[1])
    head, tail = _split_body(body, header_length, max_bytes)
    rid, params = head.get("id"), head.get("parameters")
    if (rid is None or type(rid) is str) and type(params) is dict and head.get("outputs") is None:
        specs = _binary_specs(head.get("inputs"), len(tail), max_bytes)
        if specs is not None:
            binary_default = params.get("binary_data_output") is True
            if keep and rid is None:
                if len(_PLANS) >= _PLANS_MAX:
                    _PLANS.clear()
                _PLANS[body[:keep]] = (dict(params), specs, binary_default, len(body))
            return DecodedRequest(rid, _arrays(specs, tail, 0, copy), params, None, binary_default, specs)
    if rid is not None and not isinstance(rid, str):
        raise RequestError(f"'id' must be a string, got {type(rid).__name__}")
    params = params or {}
    if not isinstance(params, dict):
        raise RequestError("'parameters' must be an object")
    if "inputs" not in head:
        raise RequestError("request has no 'inputs'")
    inputs = _read_tensors(head["inputs"], tail, "input", max_bytes, copy)
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
    params = dict(parameters)
    if binary:
        params["binary_data_output"] = True
    tensors, blobs = _tensors(inputs, binary)
    head: dict[str, Any] = ({"id": request_id, "parameters": params, "inputs": tensors} if request_id
                            else {"parameters": params, "inputs": tensors})
    return _assemble(head, blobs)


# ---------------------------------------------------------------------------- responses


def encode_infer_response(model_name: str, request_id: str, outputs: Mapping[str, np.ndarray],
                          parameters: Mapping[str, Any],
                          binary: bool | Mapping[str, bool]) -> tuple[bytes, int | None]:
    """Body and header length of a V2 infer response; ``binary`` picks the encoding for every
    output, or per output name (absent names go as JSON)."""
    tensors, blobs = _tensors(outputs, binary)
    head = {"model_name": model_name, "model_version": "", "id": request_id,
            "parameters": parameters if type(parameters) is dict else dict(parameters), "outputs": tensors}
    return _assemble(head, blobs)


@dataclass(slots=True)
class DecodedResponse:
    request_id: str
    outputs: dict[str, np.ndarray]
    parameters: dict[str, Any] = field(default_factory=dict)


def decode_infer_response(body: bytes, header_length: int | None = None, *,
                          max_bytes: int = 1 << 31, copy: bool = True) -> DecodedResponse:
    """Parse a V2 infer response; ``copy`` as for ``decode_infer_request`` (the SDK keeps the
    default, so callers own writable outputs)."""
    head, tail = _split_body(body, header_length, max_bytes)
    outputs = _fast_binary_tensors(head.get("outputs"), tail, max_bytes, copy)
    if outputs is None:
        outputs = _read_tensors(head.get("outputs", []), tail, "output", max_bytes, copy)
    params = head.get("parameters") or {}
    rid = head.get("id", "")
    return DecodedResponse(rid if type(rid) is str else str(rid), outputs,
                           params if isinstance(params, dict) else {})
