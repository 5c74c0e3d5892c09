"""Tensors of the Open Inference Protocol (KServe V2) codec: JSON ``data`` and the binary tensor
extension, both ways, plus the body layout (JSON header, then raw tensor bytes). Pure functions;
:mod:`mesh.v2.codec` builds requests and responses from them.

Hot paths avoid what costs microseconds each on every request: ``dtype.name`` (a Python
property), the stdlib's JSON (orjson reads and writes headers as bytes), ``bytes`` detours for
tensor data.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, cast

import numpy as np
import orjson

from mesh.bytes_tensor import bytes_items, deserialize_bytes, serialize_bytes
from mesh.cache import BoundedCache
from mesh.errors import BadTensor, PayloadTooLarge, RequestError
from mesh.v2.params import DTYPE_TO_V2, NATIVE, V2_TO_NP, datatype_of, dtype_of

__all__ = ["DESCS", "HEADER_LENGTH", "JSON_OPTS", "Spec", "arrays_at", "assemble", "binary_specs", "dumps",
           "fast_binary_tensors", "read_tensors", "split_body", "tensor_data", "tensors_json"]

HEADER_LENGTH = "Inference-Header-Content-Length"

def _shape(value: object, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value
    ):
        raise BadTensor(f"{where}: shape must be a list of non-negative integers, got {value!r}")
    return tuple(value)


def _flat_strings(data: list[Any], where: str) -> list[bytes]:
    out: list[bytes] = []
    stack = [iter(data)]
    while stack:  # nested lists are allowed (row-major), as for numbers
        for v in stack[-1]:
            if type(v) is list:
                stack.append(iter(v))
                break
            if type(v) is not str:
                raise BadTensor(f"{where}: BYTES data must be strings, got {type(v).__name__}")
            out.append(v.encode("utf-8"))
        else:
            stack.pop()
    return out


def _tensor_from_json(t: Mapping[str, Any], data: Any, where: str) -> np.ndarray:
    dt = dtype_of(t.get("datatype"))
    shape = _shape(t.get("shape"), where)
    want = math.prod(shape)
    if not isinstance(data, list):
        raise BadTensor(f"{where}: 'data' must be a list, got {type(data).__name__}")
    if dt.hasobject:
        items = _flat_strings(data, where)
        if len(items) != want:
            raise BadTensor(f"{where}: data has {len(items)} elements but shape {list(shape)} needs {want}")
        arr = np.empty(want, dtype=object)
        arr[:] = items
        return arr.reshape(shape)
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
    if dt.hasobject:
        return deserialize_bytes(raw, shape, where)
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
JSON_OPTS = orjson.OPT_SERIALIZE_NUMPY  # numpy scalars (np.float64 accuracies), as the stdlib wrote them


def dumps(head: dict[str, Any]) -> bytes:
    return orjson.dumps(head, option=JSON_OPTS)


def split_body(body: bytes, header_length: int | None, max_bytes: int) -> tuple[dict[str, Any], memoryview]:
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
Spec = tuple[str, np.dtype[Any], tuple[int, ...], int]


def binary_specs(items: object, end: int, max_bytes: int) -> tuple[Spec, ...] | None:
    """The tensors when every one is well-formed binary data filling exactly ``end`` bytes (what
    the SDK and tritonclient send); None sends the caller to ``read_tensors``, which says
    precisely what is wrong."""
    if type(items) is not list:
        return None
    specs: list[Spec] = []
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


def arrays_at(specs: tuple[Spec, ...], buf: bytes | memoryview, offset: int, copy: bool) -> dict[str, np.ndarray]:
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


def fast_binary_tensors(items: object, tail: memoryview, max_bytes: int,
                         copy: bool) -> dict[str, np.ndarray] | None:
    specs = binary_specs(items, len(tail), max_bytes)
    return None if specs is None else arrays_at(specs, tail, 0, copy)


def read_tensors(items: object, tail: memoryview, kind: str, max_bytes: int,
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
    if arr.dtype.hasobject:
        return serialize_bytes(arr)
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
        t["data"] = _strings(arr, name) if dt.hasobject else arr.reshape(-1).tolist()
        return t, None
    raw = _raw(arr, v2 is not None)
    t["parameters"] = {"binary_data_size": len(raw)}
    return t, raw


def _strings(arr: np.ndarray, name: str) -> list[str]:
    try:
        return [b.decode("utf-8") for b in bytes_items(arr, name)]
    except UnicodeDecodeError as exc:
        raise BadTensor(f"tensor {name!r}: BYTES element is not UTF-8, so it cannot be JSON: "
                        f"ask for binary data ({exc})") from exc


def assemble(head: dict[str, Any], blobs: list[bytes | memoryview | None]) -> tuple[bytes, int | None]:
    header = dumps(head)
    parts: list[bytes | memoryview] = [header]
    parts += [b for b in blobs if b is not None]
    if len(parts) == 1:
        return header, None
    return b"".join(parts), len(header)


# A binary tensor's JSON depends on its name, dtype and shape alone, which repeat reply after
# reply: it is built once and shared (orjson only reads it; nothing else sees it).
DESCS: BoundedCache[tuple[str, np.dtype[Any], tuple[int, ...]], dict[str, Any]] = BoundedCache(256)


def tensors_json(arrays: Mapping[str, np.ndarray], binary: bool | Mapping[str, bool]
             ) -> tuple[list[dict[str, Any]], list[bytes | memoryview | None]]:
    tensors: list[dict[str, Any]] = []
    blobs: list[bytes | memoryview | None] = []
    for name, arr in arrays.items():
        flag = binary if type(binary) is bool else cast(Mapping[str, bool], binary).get(name, False)
        if type(arr) is not np.ndarray:
            arr = np.asarray(arr)
        if flag and not arr.dtype.hasobject:  # a BYTES tensor's size depends on its contents
            key = (name, arr.dtype, arr.shape)
            t = DESCS.get(key)
            if t is not None:
                tensors.append(t)
                blobs.append(_raw(arr, arr.dtype in DTYPE_TO_V2))
                continue
        t, raw = _tensor_json(name, arr, flag)
        if flag and not arr.dtype.hasobject:
            DESCS.put(key, t)
        tensors.append(t)
        blobs.append(raw)
    return tensors, blobs
