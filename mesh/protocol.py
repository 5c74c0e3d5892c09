"""The site-to-site wire codec: multipart ZeroMQ messages, frame 0 a msgpack header, then one raw
frame per tensor.

Request header (``kind == "req"``)::

    {v: 1, kind, id, tenant, task, slo: {latency_ms, min_accuracy, max_cost, prefer},
     deadline (absolute unix seconds), hops: [site, ...], target_site, target_variant,
     tensors: [{name, dtype, shape}, ...]}

Reply header: ``{v, kind: "rep", id, site, variant, accuracy, reason, best_effort, tenant,
timing: {network_ms, queue_ms, compute_ms, total_ms}, hops, tensors}`` or
``{v, kind: "err", id, code, error}`` where ``code`` is a ``mesh.errors`` code.

Tensor bytes are little-endian, C-order, never copied on encode (frames are views of the arrays)
and never copied on decode (``np.frombuffer`` over the received frame). A tensor that is a whole
received frame (a hop forwarding or echoing what it got) is sent as that frame again, which libzmq
shares by reference count instead of copying or lending. Decoded arrays are
therefore **read-only** views that keep the frame alive; ``np.array(x)`` them before writing.
Only an unaligned frame (possible for tiny messages stored inline by libzmq) is copied.

Both directions have a fast path for the messages this codec itself writes (exact msgpack types,
native little-endian contiguous arrays): anything it does not recognise falls through to the
field-by-field validator, so hostile input still gets the precise error below.

Hostile input raises ``ProtocolError`` with a message saying what was wrong, or
``PayloadTooLarge`` when declared or actual sizes exceed ``max_bytes``; both are in
``DECODE_ERRORS``. Nothing else escapes a decoder.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, Final, TypeGuard, cast

import msgpack
import numpy as np
import zmq

from mesh.errors import BadTensor, MeshError, PayloadTooLarge, ProtocolError, error_from_code
from mesh.types import SLO, InferRequest, InferResponse, Prefer, Timing

__all__ = [
    "ALLOWED_DTYPES",
    "DECODE_ERRORS",
    "DEFAULT_MAX_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_ID_LEN",
    "VERSION",
    "FrameLike",
    "decode_reply",
    "decode_request",
    "decode_response",
    "encode_error",
    "encode_request",
    "encode_response",
    "new_request_id",
    "peek_request_id",
]

VERSION: Final = 1
DEFAULT_MAX_BYTES: Final = 64 * 1024 * 1024
MAX_HEADER_BYTES: Final = 256 * 1024
_MAX_TENSORS: Final = 256
_MAX_NDIM: Final = 32
MAX_ID_LEN: Final = 256
ALLOWED_DTYPES: Final = frozenset(
    {"float32", "float16", "float64", "int8", "uint8", "int32", "int64", "bool"}
)
_WIRE_DTYPES: Final = {n: np.dtype(n).newbyteorder("<") for n in ALLOWED_DTYPES}
# ``dtype.name`` is a Python-level property (microseconds); a dict keyed by dtype is not. Only
# dtypes that are already little-endian are keys, so a big-endian one takes the slow path.
_FAST_DTYPE_NAMES: Final = {dt: n for n, dt in _WIRE_DTYPES.items()}
_PREFER: Final = frozenset({"latency", "accuracy", "refuse"})
DECODE_ERRORS: Final = (ProtocolError, PayloadTooLarge)

# SLO is frozen, so equal ones can be shared: building a frozen dataclass costs more than a lookup
_SLOS: dict[tuple[float, float, float | None, str], SLO] = {}

FrameLike = bytes | bytearray | memoryview | zmq.Frame
Frames = list[bytes | memoryview | zmq.Frame]


# ---------------------------------------------------------------- encode

# uuid4 costs microseconds per call; a random per-process prefix plus a counter is as unique for
# matching replies and tracing, and costs a fraction of that
_ID_PREFIX: Final = os.urandom(8).hex()
_ID_COUNTER = itertools.count(1)


def new_request_id() -> str:
    """A fresh request id, unique across processes (random 64-bit prefix + counter)."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER):x}"



def _pack(header: dict[str, Any]) -> bytes:
    try:
        return cast(bytes, msgpack.packb(header, use_bin_type=True))
    except (TypeError, ValueError, OverflowError) as exc:  # surrogates, huge ints, odd types
        raise ProtocolError(f"cannot encode header: {exc}") from exc


def _tensor_frames(tensors: Mapping[str, np.ndarray]) -> tuple[list[dict[str, Any]], list[memoryview | zmq.Frame]]:
    descs: list[dict[str, Any]] = []
    frames: list[memoryview | zmq.Frame] = []
    for name, arr in tensors.items():
        if type(arr) is np.ndarray and type(name) is str and name and arr.size:
            dtype_name = _FAST_DTYPE_NAMES.get(arr.dtype)
            if dtype_name is not None:
                view = memoryview(arr)  # type: ignore[arg-type]  # ndarray exports buffers
                if view.c_contiguous:
                    descs.append({"name": name, "dtype": dtype_name, "shape": list(arr.shape)})
                    # a contiguous view as long as the frame under it is all of that frame
                    base = arr.base.base if type(arr.base) is np.ndarray else arr.base
                    frames.append(base if type(base) is zmq.Frame and len(base) == view.nbytes else view.cast("B"))
                    continue
        desc, frame = _slow_tensor_frame(name, arr)
        descs.append(desc)
        frames.append(frame)
    return descs, frames


def _slow_tensor_frame(name: object, arr: object) -> tuple[dict[str, Any], memoryview]:
    if not isinstance(name, str) or not name:
        raise BadTensor(f"tensor name {name!r} must be a non-empty string")
    a = np.asarray(arr)
    if a.dtype.name not in ALLOWED_DTYPES:
        raise BadTensor(f"tensor {name!r}: dtype {a.dtype} is not allowed on the wire")
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    if not a.flags.c_contiguous:  # ascontiguousarray would turn 0-d into 1-d
        a = a.copy(order="C")
    # reshape(-1) of a contiguous array is a view; uint8 view gives a plain byte buffer
    return {"name": name, "dtype": a.dtype.name, "shape": list(a.shape)}, a.reshape(-1).view(np.uint8).data


def encode_request(req: InferRequest) -> Frames:
    """Frames for ``req``: the header, then one zero-copy view per input tensor."""
    if not req.request_id or len(req.request_id) > MAX_ID_LEN:
        raise ProtocolError(f"request id must be 1 to {MAX_ID_LEN} characters")
    descs, frames = _tensor_frames(req.inputs)
    header = {
        "v": VERSION,
        "kind": "req",
        "id": req.request_id,
        "tenant": req.tenant,
        "task": req.task,
        "slo": {
            "latency_ms": float(req.slo.latency_ms),
            "min_accuracy": float(req.slo.min_accuracy),
            "max_cost": None if req.slo.max_cost is None else float(req.slo.max_cost),
            "prefer": req.slo.prefer,
        },
        "deadline": float(req.deadline),
        "hops": list(req.hops),
        "target_site": req.target_site,
        "target_variant": req.target_variant,
        "tensors": descs,
    }
    return [_pack(header), *frames]


def encode_response(resp: InferResponse) -> Frames:
    """Frames for a successful reply: the header, then one zero-copy view per output tensor."""
    descs, frames = _tensor_frames(resp.outputs)
    t = resp.timing
    header = {
        "v": VERSION,
        "kind": "rep",
        "id": resp.request_id,
        "site": resp.site,
        "variant": resp.variant,
        "accuracy": float(resp.accuracy),
        "reason": resp.reason,
        "best_effort": bool(resp.best_effort),
        "tenant": resp.tenant,
        "timing": {
            "network_ms": float(t.network_ms),
            "queue_ms": float(t.queue_ms),
            "compute_ms": float(t.compute_ms),
            "total_ms": float(t.total_ms),
        },
        "hops": list(resp.hops),
        "tensors": descs,
    }
    return [_pack(header), *frames]


def encode_error(request_id: str, err: MeshError) -> list[bytes]:
    """One-frame error reply; the receiver rebuilds ``err``'s class from its code."""
    return [_pack({"v": VERSION, "kind": "err", "id": request_id, "code": err.code, "error": err.message})]


# ---------------------------------------------------------------- decode helpers


def _buffer(frame: object) -> memoryview:
    if isinstance(frame, zmq.Frame):
        return frame.buffer
    if isinstance(frame, bytes | bytearray | memoryview):
        view = memoryview(frame)
        if view.format == "B" and view.ndim == 1:
            return view
        if not view.c_contiguous:
            raise ProtocolError("frame buffer is not contiguous")
        if view.nbytes == 0:
            return memoryview(b"")
        try:
            return view.cast("B")
        except TypeError as exc:
            raise ProtocolError(f"frame buffer cannot be read as bytes: {exc}") from exc
    raise ProtocolError(f"frame of type {type(frame).__name__} is not a byte buffer")


def _unpack_header(frame: object) -> dict[str, Any]:
    # the two frame types a socket hands us are read by msgpack as they are: no memoryview first
    buf: object = frame if type(frame) is zmq.Frame or type(frame) is bytes else _buffer(frame)
    size = len(buf) if type(buf) is not memoryview else buf.nbytes  # type: ignore[arg-type]
    if size > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {size} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(buf, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises a zoo of types on garbage: all mean "not a header"
        raise ProtocolError(f"header is not valid msgpack: {type(exc).__name__}: {exc}") from exc
    if not isinstance(header, dict):
        raise ProtocolError(f"header is a {type(header).__name__}, not a map")
    v = header.get("v")
    if type(v) is not int:
        raise ProtocolError("header field 'v' missing or not an integer")
    if v != VERSION:
        raise ProtocolError(f"unsupported protocol version {v} (this end speaks {VERSION})")
    _id(header)
    return header


def _field(h: Mapping[str, Any], key: str, kind: type | tuple[type, ...], *, optional: bool = False) -> Any:
    val = h.get(key)
    if val is None:
        if optional:
            return None
        raise ProtocolError(f"header field {key!r} missing")
    # bool is an int subclass: a flag must never pass as a number, nor a number as a flag
    if not isinstance(val, kind) or (val.__class__ is bool and kind is not bool):
        raise ProtocolError(f"header field {key!r} has type {type(val).__name__}")
    return val


def _num(h: Mapping[str, Any], key: str) -> float:
    out = float(_field(h, key, (int, float)))
    if not math.isfinite(out):
        raise ProtocolError(f"header field {key!r} is not finite")
    return out


def _opt_num(h: Mapping[str, Any], key: str) -> float | None:
    return None if h.get(key) is None else _num(h, key)


def _str(h: Mapping[str, Any], key: str, *, nonempty: bool = False) -> str:
    val: str = _field(h, key, str)
    if nonempty and not val:
        raise ProtocolError(f"header field {key!r} is empty")
    return val


def _id(h: Mapping[str, Any]) -> str:
    rid = _str(h, "id", nonempty=True)
    if len(rid) > MAX_ID_LEN:
        raise ProtocolError(f"request id longer than {MAX_ID_LEN}")
    return rid


def _str_list(h: Mapping[str, Any], key: str) -> list[str]:
    val: list[str] = _field(h, key, list)
    if not all(isinstance(x, str) for x in val):
        raise ProtocolError(f"header field {key!r} must be a list of strings")
    return val


def _tensors(h: Mapping[str, Any], frames: Sequence[object], max_bytes: int) -> dict[str, np.ndarray]:
    descs: list[Any] = _field(h, "tensors", list)
    if len(descs) > _MAX_TENSORS:
        raise ProtocolError(f"{len(descs)} tensors declared, at most {_MAX_TENSORS}")
    if len(descs) != len(frames):
        raise ProtocolError(f"{len(descs)} tensors declared but {len(frames)} tensor frames sent")
    total = 0
    parsed: list[tuple[str, np.dtype[Any], tuple[int, ...]]] = []
    for i, d in enumerate(descs):
        if not isinstance(d, dict):
            raise ProtocolError(f"tensor descriptor {i} is not a map")
        name = _str(d, "name", nonempty=True)
        dtype_name = _str(d, "dtype")
        dtype = _WIRE_DTYPES.get(dtype_name)
        if dtype is None:
            raise ProtocolError(f"tensor {name!r}: dtype {dtype_name!r} not allowed")
        shape: list[Any] = _field(d, "shape", list)
        if len(shape) > _MAX_NDIM:
            raise ProtocolError(f"tensor {name!r}: {len(shape)} dimensions, at most {_MAX_NDIM}")
        if not all(type(s) is int and s >= 0 for s in shape):
            raise ProtocolError(f"tensor {name!r}: shape must be non-negative integers, got {shape!r}")
        total += math.prod(shape) * dtype.itemsize  # Python ints: a hostile shape cannot overflow
        if total > max_bytes:
            raise PayloadTooLarge(f"tensors declare {total} bytes, limit is {max_bytes}")
        parsed.append((name, dtype, tuple(shape)))
    if len({p[0] for p in parsed}) != len(parsed):
        raise ProtocolError("duplicate tensor names")
    out: dict[str, np.ndarray] = {}
    for (name, dtype, dims), frame in zip(parsed, frames, strict=True):
        buf = _buffer(frame)
        expected = math.prod(dims) * dtype.itemsize
        if buf.nbytes != expected:
            raise ProtocolError(f"tensor {name!r}: {buf.nbytes} bytes for shape {list(dims)} "
                                f"{dtype.name} (expected {expected})")
        arr = np.frombuffer(buf, dtype=dtype).reshape(dims)
        if not arr.flags.aligned:
            arr = arr.copy()
        arr.flags.writeable = False  # a view of the receive buffer: writing would alias it
        out[name] = arr
    return out


def _finite(x: object) -> TypeGuard[float]:
    # exact float only (msgpack gives float for what encode wrote); inf - inf and nan - nan are nan
    return type(x) is float and x - x == 0.0


def _str_items(xs: object) -> TypeGuard[list[str]]:
    return type(xs) is list and all(type(x) is str for x in xs)


def _fast_tensors(descs: object, frames: Sequence[object], max_bytes: int) -> dict[str, np.ndarray] | None:
    """The tensors of a well-formed message, or None to let ``_tensors`` say what is wrong."""
    if type(descs) is not list or len(descs) != len(frames) or len(descs) > _MAX_TENSORS:
        return None
    out: dict[str, np.ndarray] = {}
    total = 0
    for d, frame in zip(descs, frames, strict=True):
        if type(d) is not dict:
            return None
        name, dtype_name, shape = d.get("name"), d.get("dtype"), d.get("shape")
        if (type(name) is not str or not name or name in out or type(dtype_name) is not str
                or type(shape) is not list or len(shape) > _MAX_NDIM):
            return None
        dtype = _WIRE_DTYPES.get(dtype_name)
        if dtype is None:
            return None
        count = 1
        for dim in shape:
            if type(dim) is not int or dim < 0:
                return None
            count *= dim
        nbytes = count * dtype.itemsize
        total += nbytes
        if total > max_bytes or (type(frame) is not zmq.Frame and type(frame) is not bytes):
            return None
        if len(frame) != nbytes:  # type: ignore[arg-type]
            return None
        arr = np.frombuffer(frame, dtype=dtype).reshape(shape)  # type: ignore[arg-type]
        flags = arr.flags
        if not flags.aligned:
            arr = arr.copy()
            flags = arr.flags
        flags.writeable = False  # a view of the receive buffer: writing would alias it
        out[name] = arr
    return out


def _fast_request(h: dict[str, Any], frames: Sequence[object], max_bytes: int) -> InferRequest | None:
    slo, task, tenant, deadline = h.get("slo"), h.get("task"), h.get("tenant"), h.get("deadline")
    hops, site, variant = h.get("hops"), h.get("target_site"), h.get("target_variant")
    if (h.get("kind") != "req" or type(slo) is not dict or type(task) is not str or not task
            or type(tenant) is not str or not tenant or not _finite(deadline) or not _str_items(hops)
            or (site is not None and type(site) is not str) or (variant is not None and type(variant) is not str)):
        return None
    latency, accuracy, cost, prefer = slo.get("latency_ms"), slo.get("min_accuracy"), slo.get("max_cost"), \
        slo.get("prefer")
    if (not _finite(latency) or not _finite(accuracy) or (cost is not None and not _finite(cost))
            or type(prefer) is not str or prefer not in _PREFER):
        return None
    tensors = _fast_tensors(h.get("tensors"), frames[1:], max_bytes)
    if tensors is None:
        return None
    key = (latency, accuracy, cost, prefer)
    slo_obj = _SLOS.get(key)
    if slo_obj is None:
        if len(_SLOS) >= 1024:  # callers reuse a handful of SLOs; a flood of distinct ones just resets
            _SLOS.clear()
        slo_obj = _SLOS[key] = SLO(latency, accuracy, cost, cast(Prefer, prefer))
    return InferRequest(task, tensors, slo_obj, tenant, h["id"], deadline, hops, site, variant)


def _fast_response(h: dict[str, Any], rid: str, frames: Sequence[object], max_bytes: int) -> InferResponse | None:
    site, variant, reason, tenant = h.get("site"), h.get("variant"), h.get("reason"), h.get("tenant")
    accuracy, best_effort, timing, hops = h.get("accuracy"), h.get("best_effort"), h.get("timing"), h.get("hops")
    if (h.get("kind") != "rep" or type(site) is not str or type(variant) is not str or type(reason) is not str
            or type(tenant) is not str or not tenant or not _finite(accuracy) or type(best_effort) is not bool
            or type(timing) is not dict or not _str_items(hops)):
        return None
    network, queue, compute, total = timing.get("network_ms"), timing.get("queue_ms"), timing.get("compute_ms"), \
        timing.get("total_ms")
    if not (_finite(network) and _finite(queue) and _finite(compute) and _finite(total)):
        return None
    tensors = _fast_tensors(h.get("tensors"), frames[1:], max_bytes)
    if tensors is None:
        return None
    return InferResponse(rid, tensors, site, variant, accuracy, reason, best_effort, tenant,
                         Timing(network, queue, compute, total), hops)


def _kind(h: Mapping[str, Any], *expected: str) -> str:
    kind = _str(h, "kind")
    if kind not in expected:
        raise ProtocolError(f"message kind {kind!r}, expected {' or '.join(expected)}")
    return kind


# ---------------------------------------------------------------- decode


def decode_request(frames: Sequence[FrameLike], *, max_bytes: int = DEFAULT_MAX_BYTES) -> InferRequest:
    """Rebuild a request from its frames (identity already stripped). See the module docstring."""
    if not frames:
        raise ProtocolError("empty message")
    h = _unpack_header(frames[0])
    fast = _fast_request(h, frames, max_bytes)
    if fast is not None:
        return fast
    _kind(h, "req")
    slo: dict[str, Any] = _field(h, "slo", dict)
    prefer = _str(slo, "prefer")
    if prefer not in _PREFER:
        raise ProtocolError(f"slo.prefer {prefer!r} not one of {sorted(_PREFER)}")
    return InferRequest(
        task=_str(h, "task", nonempty=True),
        inputs=_tensors(h, frames[1:], max_bytes),
        slo=SLO(
            latency_ms=_num(slo, "latency_ms"),
            min_accuracy=_num(slo, "min_accuracy"),
            max_cost=_opt_num(slo, "max_cost"),
            prefer=cast(Prefer, prefer),
        ),
        tenant=_str(h, "tenant", nonempty=True),
        request_id=h["id"],  # checked by _unpack_header
        deadline=_num(h, "deadline"),
        hops=_str_list(h, "hops"),
        target_site=_field(h, "target_site", str, optional=True),
        target_variant=_field(h, "target_variant", str, optional=True),
    )


def decode_reply(frames: Sequence[FrameLike], *,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[str, InferResponse | MeshError]:
    """(request id, response or the error the peer sent). Raises only when no id can be read;
    a reply with a readable id but a broken body comes back as ``(id, ProtocolError)``."""
    if not frames:
        raise ProtocolError("empty message")
    h = _unpack_header(frames[0])
    rid: str = h["id"]  # checked by _unpack_header
    fast = _fast_response(h, rid, frames, max_bytes)
    if fast is not None:
        return rid, fast
    try:
        if _kind(h, "rep", "err") == "err":
            if len(frames) != 1:
                raise ProtocolError("error reply carries tensor frames")
            return rid, error_from_code(_str(h, "code"), _str(h, "error"))
        timing: dict[str, Any] = _field(h, "timing", dict)
        return rid, InferResponse(
            request_id=rid,
            outputs=_tensors(h, frames[1:], max_bytes),
            site=_str(h, "site"),
            variant=_str(h, "variant"),
            accuracy=_num(h, "accuracy"),
            reason=_str(h, "reason"),
            best_effort=_field(h, "best_effort", bool),
            tenant=_str(h, "tenant", nonempty=True),
            timing=Timing(**{k: _num(timing, k)
                             for k in ("network_ms", "queue_ms", "compute_ms", "total_ms")}),
            hops=_str_list(h, "hops"),
        )
    except DECODE_ERRORS as exc:
        return rid, exc


def decode_response(frames: Sequence[FrameLike], *, max_bytes: int = DEFAULT_MAX_BYTES) -> InferResponse:
    """The reply as an ``InferResponse``; an ``err`` reply raises the matching ``MeshError``."""
    _, out = decode_reply(frames, max_bytes=max_bytes)
    if isinstance(out, MeshError):
        raise out
    return out


def peek_request_id(frames: Sequence[FrameLike]) -> str | None:
    """The id of a message if its header can be read at all (for error replies to bad input)."""
    try:
        return _id(_unpack_header(frames[0])) if frames else None
    except ProtocolError:
        return None
