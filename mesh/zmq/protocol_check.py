"""The site-to-site wire schema (version, limits, allowed dtypes) and its validating decoder.

:mod:`mesh.zmq.protocol` decodes the messages it writes itself on a fast path; anything that path
does not recognise comes here, where every header field is checked on its own so hostile input
gets a ``ProtocolError`` (or ``PayloadTooLarge``) saying precisely what was wrong. The header
itself is always unpacked here (:func:`unpack_header`): size, msgpack, version and id are
checked for every message. The message layout is described in :mod:`mesh.zmq.protocol`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

import msgpack
import numpy as np
import zmq

from mesh.bytes_tensor import deserialize_bytes
from mesh.errors import BadTensor, MeshError, PayloadTooLarge, ProtocolError, RequestError, error_from_code
from mesh.tracecontext import parse_traceparent
from mesh.types import (
    BEST_EFFORT_GRACE_MS,
    MAX_DIM,
    MAX_LATENCY_MS,
    SLO,
    InferRequest,
    InferResponse,
    Timing,
    shape_fits,
)

__all__ = [
    "ALLOWED_DTYPES",
    "BYTES_WIRE",
    "DECODE_ERRORS",
    "DEFAULT_MAX_BYTES",
    "MAX_BUDGET_MS",
    "MAX_FRAMES",
    "MAX_HEADER_BYTES",
    "MAX_ID_LEN",
    "MAX_NDIM",
    "MAX_TENSORS",
    "VERSION",
    "WIRE_DTYPES",
    "check_envelope",
    "check_reply",
    "check_request",
    "message_bytes_limit",
    "read_bytes_tensor",
    "read_id",
    "read_slo",
    "read_trace",
    "read_traceparent",
    "unpack_header",
]

VERSION: Final = 2  # 2: relative deadlines (budget_ms + sent_at) replaced v1's absolute 'deadline'
DEFAULT_MAX_BYTES: Final = 64 * 1024 * 1024
MAX_HEADER_BYTES: Final = 256 * 1024
MAX_TENSORS: Final = 256
# A message is a header and one frame per tensor: no request or reply has more frames, nor more bytes than
# message_bytes_limit. libzmq's MAXMSGSIZE bounds each frame only; these bound the message (check_envelope).
MAX_FRAMES: Final = 1 + MAX_TENSORS
MAX_NDIM: Final = 32
# The most budget a request may carry: an SLO's longest plus the grace of a best-effort query (the door's budget only
# shrinks on the way). A peer's larger one would hold this site's queue rows and quota slot past any caller's wait.
MAX_BUDGET_MS: Final = MAX_LATENCY_MS + BEST_EFFORT_GRACE_MS
MAX_ID_LEN: Final = 256
ALLOWED_DTYPES: Final = frozenset(
    {"float32", "float16", "float64", "int8", "uint8", "int32", "int64", "bool"}
)
WIRE_DTYPES: Final = {n: np.dtype(n).newbyteorder("<") for n in ALLOWED_DTYPES}
# BYTES tensors (numpy object arrays of bytes: text) travel under this dtype name, their frame in
# the length-prefixed form of ``mesh.bytes_tensor`` (what the OIP binary extension carries too)
BYTES_WIRE: Final = "bytes"
DECODE_ERRORS: Final = (ProtocolError, PayloadTooLarge)


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


def message_bytes_limit(max_bytes: int) -> int:
    """The most bytes a message may carry in all: a header and ``max_bytes`` of tensors."""
    return max_bytes + MAX_HEADER_BYTES


def check_envelope(frames: Sequence[object], max_bytes: int) -> None:
    """A message's frame count and total size within the bounds of any message (before anything in it is read):
    ``ProtocolError`` for too many frames, ``PayloadTooLarge`` for too many bytes."""
    if len(frames) > MAX_FRAMES:
        raise ProtocolError(f"a message of {len(frames)} frames: at most {MAX_FRAMES} (a header and "
                            f"{MAX_TENSORS} tensors)")
    # len() of the two types a socket hands us; a memoryview of anything else
    total = sum(len(f) if type(f) is zmq.Frame or type(f) is bytes else _buffer(f).nbytes  # type: ignore[arg-type]
                for f in frames)
    if total > message_bytes_limit(max_bytes):
        raise PayloadTooLarge(f"a message of {total} bytes: at most {message_bytes_limit(max_bytes)}")


def unpack_header(frame: object) -> dict[str, Any]:
    """The header map of any message, its version and id checked; ``ProtocolError`` otherwise."""
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
    read_id(header)
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


def _str(h: Mapping[str, Any], key: str, *, nonempty: bool = False) -> str:
    val: str = _field(h, key, str)
    if nonempty and not val:
        raise ProtocolError(f"header field {key!r} is empty")
    return val


def read_id(h: Mapping[str, Any]) -> str:
    """The message id of a header: a non-empty string of at most ``MAX_ID_LEN`` characters."""
    rid = _str(h, "id", nonempty=True)
    if len(rid) > MAX_ID_LEN:
        raise ProtocolError(f"request id longer than {MAX_ID_LEN}")
    return rid


def read_slo(slo: Mapping[str, Any]) -> SLO:
    """The SLO of a request header's ``slo`` map, checked by the one SLO validator (``SLO.parse``,
    as the HTTP front's is): both decoders call this, so they accept and refuse the same SLOs."""
    try:
        return SLO.parse(slo.get("latency_ms"), slo.get("min_accuracy"), slo.get("max_cost"), slo.get("prefer"))
    except RequestError as exc:
        raise ProtocolError(f"header field 'slo': {exc.message}") from exc


def _budget(h: Mapping[str, Any]) -> float:
    """A request header's ``budget_ms``: finite and at most ``MAX_BUDGET_MS``. Zero or less is a budget spent on the
    way (the server answers ``DeadlineExceeded`` without serving it), not garbage."""
    budget = _num(h, "budget_ms")
    if budget > MAX_BUDGET_MS:
        raise ProtocolError(f"header field 'budget_ms' is {budget!r}: at most {MAX_BUDGET_MS:.0f} (the longest SLO "
                            f"latency and a best-effort query's grace)")
    return budget


def read_traceparent(value: object) -> str:
    """A request header's ``traceparent`` (present: a valid W3C version-00 value); both decoders call this."""
    if parse_traceparent(value) is None:
        raise ProtocolError(f"header field 'traceparent' is not a W3C traceparent: {str(value)[:64]!r}")
    return value  # type: ignore[return-value]  # parse_traceparent accepts only str


def read_trace(h: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """A reply header's optional ``trace``: a list of maps (hop records; their fields are checked where
    they are kept, ``edge_agent.traces``)."""
    trace: list[Any] | None = _field(h, "trace", list, optional=True)
    if trace is not None and not all(isinstance(x, dict) for x in trace):
        raise ProtocolError("header field 'trace' must be a list of maps")
    return trace


def _str_list(h: Mapping[str, Any], key: str) -> list[str]:
    val: list[str] = _field(h, key, list)
    if not all(isinstance(x, str) for x in val):
        raise ProtocolError(f"header field {key!r} must be a list of strings")
    return val


def _tensors(h: Mapping[str, Any], frames: Sequence[object], max_bytes: int) -> dict[str, np.ndarray]:
    descs: list[Any] = _field(h, "tensors", list)
    if len(descs) > MAX_TENSORS:
        raise ProtocolError(f"{len(descs)} tensors declared, at most {MAX_TENSORS}")
    if len(descs) != len(frames):
        raise ProtocolError(f"{len(descs)} tensors declared but {len(frames)} tensor frames sent")
    total = 0
    parsed: list[tuple[str, np.dtype[Any] | None, tuple[int, ...]]] = []
    for i, d in enumerate(descs):
        if not isinstance(d, dict):
            raise ProtocolError(f"tensor descriptor {i} is not a map")
        name = _str(d, "name", nonempty=True)
        dtype_name = _str(d, "dtype")
        dtype = WIRE_DTYPES.get(dtype_name)
        if dtype is None and dtype_name != BYTES_WIRE:
            raise ProtocolError(f"tensor {name!r}: dtype {dtype_name!r} not allowed")
        shape: list[Any] = _field(d, "shape", list)
        if len(shape) > MAX_NDIM:
            raise ProtocolError(f"tensor {name!r}: {len(shape)} dimensions, at most {MAX_NDIM}")
        if not all(type(s) is int and s >= 0 for s in shape):
            raise ProtocolError(f"tensor {name!r}: shape must be non-negative integers, got {str(shape)[:200]}")
        # Python ints: a hostile shape cannot overflow; a BYTES element takes at least its 4-byte length
        total += math.prod(shape) * (dtype.itemsize if dtype is not None else 4)
        if total > max_bytes:
            raise PayloadTooLarge(f"tensors declare {total} bytes, limit is {max_bytes}")
        if not shape_fits(shape):  # zero elements, yet more than numpy can index
            raise ProtocolError(f"tensor {name!r}: a shape numpy cannot hold (a dimension of {MAX_DIM} or more, "
                                f"or too many elements), in {str(shape)[:200]}")
        parsed.append((name, dtype, tuple(shape)))
    if len({p[0] for p in parsed}) != len(parsed):
        raise ProtocolError("duplicate tensor names")
    out: dict[str, np.ndarray] = {}
    sent = sum(_buffer(f).nbytes for f in frames)
    if sent > max_bytes:
        raise PayloadTooLarge(f"tensor frames carry {sent} bytes, limit is {max_bytes}")
    for (name, dtype, dims), frame in zip(parsed, frames, strict=True):
        buf = _buffer(frame)
        if dtype is None:
            out[name] = read_bytes_tensor(buf, dims, name)
            continue
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


def read_bytes_tensor(buf: bytes | memoryview, dims: tuple[int, ...], name: str) -> np.ndarray:
    """A BYTES tensor from its frame (both decoders call this, so they agree); ``ProtocolError`` unless
    the frame holds exactly the elements its shape declares."""
    try:
        return deserialize_bytes(buf, dims, f"tensor {name!r}")
    except BadTensor as exc:
        raise ProtocolError(exc.message) from exc


def _kind(h: Mapping[str, Any], *expected: str) -> str:
    kind = _str(h, "kind")
    if kind not in expected:
        raise ProtocolError(f"message kind {kind!r}, expected {' or '.join(expected)}")
    return kind


def check_request(h: Mapping[str, Any], frames: Sequence[object], max_bytes: int, *,
                  now: float) -> InferRequest:
    """The request in header ``h`` (from :func:`unpack_header`) and its frames, every field checked.
    Its deadline is ``now`` (the monotonic arrival instant) plus the budget the sender had left."""
    _kind(h, "req")
    slo = read_slo(_field(h, "slo", dict))
    budget_ms = _budget(h)
    return InferRequest(
        task=_str(h, "task", nonempty=True),
        inputs=_tensors(h, frames[1:], max_bytes),
        slo=slo,
        tenant=_str(h, "tenant", nonempty=True),
        request_id=h["id"],  # checked by unpack_header
        deadline=now + budget_ms / 1000.0,
        hops=_str_list(h, "hops"),
        target_site=_field(h, "target_site", str, optional=True),
        target_variant=_field(h, "target_variant", str, optional=True),
        sent_at=_num(h, "sent_at"),
        traceparent=None if h.get("traceparent") is None else read_traceparent(h["traceparent"]),
    )


def check_reply(h: Mapping[str, Any], rid: str, frames: Sequence[object],
                max_bytes: int) -> InferResponse | MeshError:
    """The reply or peer error in header ``h`` and its frames; what is wrong with a broken one
    comes back as the error rather than raised (its id is known, so a caller can be told)."""
    try:
        if _kind(h, "rep", "err") == "err":
            if len(frames) != 1:
                raise ProtocolError("error reply carries tensor frames")
            return error_from_code(_str(h, "code"), _str(h, "error"))
        timing: dict[str, Any] = _field(h, "timing", dict)
        return InferResponse(
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
            trace=read_trace(h),
            backbone_tenants=_count(h.get("backbone_tenants", 0)),
            late=_field(h, "late", bool, optional=True) is True,
        )
    except DECODE_ERRORS as exc:
        return exc


def _count(v: object) -> int:
    if type(v) is not int or v < 0:
        raise ProtocolError(f"backbone_tenants must be a count, got {v!r}")
    return v
