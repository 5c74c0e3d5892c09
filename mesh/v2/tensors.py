"""Tensors of the Open Inference Protocol (KServe V2) codec as numpy arrays: JSON ``data`` and the binary
tensor extension, both ways, and the numpy dtypes of the V2 datatypes. Pure functions; :mod:`mesh.v2.codec`
builds requests and responses from them in the layout of :mod:`mesh.v2.body`. (:mod:`mesh.v2.plain` is the same
encoding without numpy, for the SDK's base install.)

Hot paths avoid what costs microseconds each on every request: ``dtype.name`` (a Python
property), ``bytes`` detours for tensor data.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, cast

import numpy as np

from mesh.bytes_tensor import bytes_items, deserialize_bytes, serialize_bytes
from mesh.cache import BoundedCache
from mesh.errors import BadTensor, PayloadTooLarge, RequestError
from mesh.types import MAX_DIM, shape_fits
from mesh.v2.datatypes import BYTES, FIXED, check_datatype, datatype_named

__all__ = ["BYTES_DTYPE", "DESCS", "DTYPE_TO_V2", "NATIVE", "V2_TO_NP", "Spec", "arrays_at", "binary_specs",
           "datatype_of", "dtype_of", "read_tensors", "tensor_data", "tensors_json"]

# V2 datatype -> numpy dtype (explicitly little-endian: the binary extension is LE on the wire), from the one
# table (mesh.v2.datatypes). BYTES is a numpy object array of bytes elements (``mesh.bytes_tensor``).
V2_TO_NP: dict[str, np.dtype[Any]] = {v2: np.dtype("<" + fmt) for v2, (fmt, _) in FIXED.items()}
BYTES_DTYPE: np.dtype[Any] = np.dtype(object)
# keyed by dtype: a dict lookup instead of the ``dtype.name`` property; big-endian dtypes miss
DTYPE_TO_V2: dict[np.dtype[Any], str] = {dt: v2 for v2, dt in V2_TO_NP.items()}
# the same types in this machine's byte order: what decoded tensors are converted to
NATIVE: dict[str, np.dtype[Any]] = {v2: dt.newbyteorder("=") for v2, dt in V2_TO_NP.items()}


def dtype_of(datatype: object) -> np.dtype[Any]:
    """numpy dtype of a V2 datatype string (``object`` for BYTES); ``BadTensor`` for anything else."""
    return BYTES_DTYPE if check_datatype(datatype) == BYTES else V2_TO_NP[datatype]  # type: ignore[index]


def datatype_of(dtype: np.dtype[Any] | str) -> str:
    """V2 datatype string of a numpy dtype (or dtype name such as ``"float32"``)."""
    if isinstance(dtype, np.dtype) and (v2 := DTYPE_TO_V2.get(dtype)) is not None:
        return v2
    return datatype_named(np.dtype(dtype).name)

def _shape(value: object, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in value) \
            or not shape_fits(value):
        raise BadTensor(f"{where}: shape must be a list of non-negative integers below {MAX_DIM} that numpy can "
                        f"hold, got {str(value)[:200]}")
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


def _reshape(arr: np.ndarray, shape: tuple[int, ...], where: str) -> np.ndarray:
    try:
        return arr.reshape(shape)
    except ValueError as exc:  # e.g. more dimensions than numpy holds
        raise BadTensor(f"{where}: shape {list(shape)[:40]} is not a tensor numpy can hold: {exc}") from exc


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
        with np.errstate(over="raise"):  # 1e39 is no FP32: the caller's error, not an inf
            arr = np.asarray(data, dtype=dt).reshape(-1)
    except (TypeError, ValueError, OverflowError, FloatingPointError) as exc:
        raise BadTensor(f"{where}: data is not {t.get('datatype')}: {exc}") from exc
    if arr.size != want:
        raise BadTensor(f"{where}: data has {arr.size} elements but shape {list(shape)[:40]} needs {want}")
    return _reshape(arr, shape, where)


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
    return _reshape(np.frombuffer(raw, dtype=dt), shape, where).astype(NATIVE[cast(str, datatype)], copy=copy)


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


# Up to this size a little-endian tensor's bytes are copied out in one call rather than lent through a
# buffer export: exporting, checking and casting a memoryview costs more than copying a few KB twice (once
# here, once into the body); the two cross near 24 KB on this machine.
COPY_MAX_BYTES = 16 << 10


def _raw(arr: np.ndarray, little: bool) -> bytes | memoryview:
    """A tensor's bytes as the binary extension lays them out (``little``: its dtype is LE)."""
    if arr.dtype.hasobject:
        return serialize_bytes(arr)
    if little and arr.nbytes <= COPY_MAX_BYTES:
        return arr.tobytes()  # C order whatever the array's layout
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
