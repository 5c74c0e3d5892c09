"""The site-to-site wire codec: multipart ZeroMQ messages, frame 0 a msgpack header, then one raw
frame per tensor.

Request header (``kind == "req"``)::

    {v: 2, kind, id, tenant, task, slo: {latency_ms, min_accuracy, max_cost, prefer},
     budget_ms, sent_at, hops: [site, ...], target_site, target_variant,
     tensors: [{name, dtype, shape}, ...], traceparent?}

``traceparent`` (W3C, ``mesh.tracecontext``) is present only on a traced query, and ``trace`` (a list
of hop records, maps) only on the reply to one: both optional fields within version 2, which a peer
that predates them ignores, so no version bump was needed.

Deadlines travel as durations (version 2; version 1 carried an absolute wall-clock ``deadline``,
which only worked while every site's clock agreed, and is refused as an unsupported version).
``budget_ms`` is what the sender had left when it encoded the message (its local deadline minus
its monotonic now, less any ``reserve_ms`` it chose to keep back); the decoder sets the request's
deadline to the receiver's monotonic *arrival* instant plus that budget. The forward transit is
thus counted as budget the receiver still has: it cannot know the one-way delay without comparing
clocks, and the sender may reserve it (the site data plane reserves half the round trip it has
measured to that peer, which is what an absolute deadline on synchronised clocks amounted to).
The sender's own timer still ends the wait at its own deadline. A budget over ``protocol_check.MAX_BUDGET_MS``
(the longest SLO and a best-effort query's grace: no door hands on more) is refused as a ``ProtocolError``; a spent
one (zero or less) is answered ``DeadlineExceeded`` by the server. ``sent_at`` is the sender's wall
clock at encode, for diagnostics (logs of a late arrival) only: it is never compared with the
receiver's clock.

Reply header: ``{v, kind: "rep", id, site, variant, accuracy, reason, best_effort, tenant,
timing: {network_ms, queue_ms, compute_ms, total_ms}, hops, tensors, trace?[, backbone_tenants][, late]}`` or
``{v, kind: "err", id, code, error}`` where ``code`` is a ``mesh.errors`` code.

Tensor bytes are little-endian, C-order, never copied on encode (frames are views of the arrays)
and never copied on decode (``np.frombuffer`` over the received frame). A tensor that is a whole
received frame (a hop forwarding or echoing what it got) is sent as that frame again, which libzmq
shares by reference count instead of copying or lending. Decoded arrays are
therefore **read-only** views that keep the frame alive; ``np.array(x)`` them before writing.
Only an unaligned frame (possible for tiny messages stored inline by libzmq) is copied.

Both directions have a fast path for the messages this codec itself writes (exact msgpack types,
native little-endian contiguous arrays): anything it does not recognise falls through to the
field-by-field validator in :mod:`mesh.zmq.protocol_check` (which also holds the version, the limits,
the allowed dtypes and ``DECODE_ERRORS``), so hostile input still gets the precise error below.
The SLO is read by one function on both paths (``protocol_check.read_slo``, which is ``SLO.parse``,
the HTTP front's parser too), so both accept and refuse the same SLOs.

Hostile input raises ``ProtocolError`` with a message saying what was wrong, or
``PayloadTooLarge`` when declared or actual sizes exceed ``max_bytes``; both are in
``DECODE_ERRORS``. Nothing else escapes a decoder.

A message's envelope is bounded before anything in it is read (``protocol_check.check_envelope``: at most
``MAX_FRAMES`` frames and ``message_bytes_limit(max_bytes)`` bytes); a message a receiver cut short at those bounds
(:mod:`mesh.zmq.bounded`, ending in ``CUT``) is refused as ``PayloadTooLarge``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final, TypeGuard, cast

import msgpack
import numpy as np
import zmq

from mesh import clock
from mesh.bytes_tensor import serialize_bytes
from mesh.errors import BadTensor, MeshError, PayloadTooLarge, ProtocolError
from mesh.types import InferRequest, InferResponse, Timing, shape_fits
from mesh.zmq.bounded import CUT
from mesh.zmq.protocol_check import (
    ALLOWED_DTYPES,
    BYTES_WIRE,
    DEFAULT_MAX_BYTES,
    MAX_BUDGET_MS,
    MAX_FRAMES,
    MAX_ID_LEN,
    MAX_NDIM,
    MAX_TENSORS,
    VERSION,
    WIRE_DTYPES,
    check_envelope,
    check_reply,
    check_request,
    message_bytes_limit,
    read_bytes_tensor,
    read_id,
    read_slo,
    read_traceparent,
    unpack_header,
)

__all__ = [
    "FrameLike",
    "decode_reply",
    "decode_request",
    "decode_response",
    "encode_error",
    "encode_request",
    "encode_response",
    "peek_request_id",
]

# ``dtype.name`` is a Python-level property (microseconds); a dict keyed by dtype is not. Only
# dtypes that are already little-endian are keys, so a big-endian one takes the slow path.
_FAST_DTYPE_NAMES: Final = {dt: n for n, dt in WIRE_DTYPES.items()}

FrameLike = bytes | bytearray | memoryview | zmq.Frame
Frames = list[bytes | memoryview | zmq.Frame]


# ---------------------------------------------------------------- encode

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
    if a.dtype.hasobject:  # a BYTES tensor (text): length-prefixed elements, one copy into the frame
        return ({"name": name, "dtype": BYTES_WIRE, "shape": list(a.shape)},
                memoryview(serialize_bytes(a, f"tensor {name!r}")))
    if a.dtype.name not in ALLOWED_DTYPES:
        raise BadTensor(f"tensor {name!r}: dtype {a.dtype} is not allowed on the wire")
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    if not a.flags.c_contiguous:  # ascontiguousarray would turn 0-d into 1-d
        a = a.copy(order="C")
    # reshape(-1) of a contiguous array is a view; uint8 view gives a plain byte buffer
    return {"name": name, "dtype": a.dtype.name, "shape": list(a.shape)}, a.reshape(-1).view(np.uint8).data


def encode_request(req: InferRequest, *, now: float | None = None, reserve_ms: float = 0.0) -> Frames:
    """Frames for ``req``: the header, then one zero-copy view per input tensor. The header
    carries the budget ``req`` has left at monotonic instant ``now`` (default: now) less
    ``reserve_ms``, and this process's wall-clock time (for diagnostics)."""
    if not req.request_id or len(req.request_id) > MAX_ID_LEN:
        raise ProtocolError(f"request id must be 1 to {MAX_ID_LEN} characters")
    budget = (req.deadline - (clock.monotonic() if now is None else now)) * 1000.0 - reserve_ms
    if budget - budget != 0.0:  # inf or nan: no hop could keep it
        raise ProtocolError(f"request {req.request_id}: deadline {req.deadline!r} gives no finite budget")
    descs, frames = _tensor_frames(req.inputs)
    header = {
        "v": VERSION,
        "kind": "req",
        "id": req.request_id,
        "tenant": req.tenant,
        "task": req.task,
        # an SLO holds floats (it checks itself): no conversions here
        "slo": {
            "latency_ms": req.slo.latency_ms,
            "min_accuracy": req.slo.min_accuracy,
            "max_cost": req.slo.max_cost,
            "prefer": req.slo.prefer,
        },
        "budget_ms": budget,
        "sent_at": clock.wall(),
        "hops": list(req.hops),
        "target_site": req.target_site,
        "target_variant": req.target_variant,
        "tensors": descs,
    }
    if req.traceparent is not None:
        header["traceparent"] = req.traceparent
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
    if resp.trace is not None:
        header["trace"] = resp.trace
    if resp.backbone_tenants:
        header["backbone_tenants"] = int(resp.backbone_tenants)
    if resp.late:  # only a door sets it (a reply to a caller over ZeroMQ): absent means on time
        header["late"] = True
    return [_pack(header), *frames]


def encode_error(request_id: str, err: MeshError) -> list[bytes]:
    """One-frame error reply; the receiver rebuilds ``err``'s class from its code."""
    return [_pack({"v": VERSION, "kind": "err", "id": request_id, "code": err.code, "error": err.message})]


# ---------------------------------------------------------------- decode fast path


def _finite(x: object) -> TypeGuard[float]:
    # exact float only (msgpack gives float for what encode wrote); inf - inf and nan - nan are nan
    return type(x) is float and x - x == 0.0


def _str_items(xs: object) -> TypeGuard[list[str]]:
    return type(xs) is list and all(type(x) is str for x in xs)


def _fast_tensors(descs: object, frames: Sequence[object], max_bytes: int) -> dict[str, np.ndarray] | None:
    """The tensors of a well-formed message, or None to let ``mesh.zmq.protocol_check`` say what is wrong."""
    if type(descs) is not list or len(descs) != len(frames) or len(descs) > MAX_TENSORS:
        return None
    out: dict[str, np.ndarray] = {}
    total = 0
    for d, frame in zip(descs, frames, strict=True):
        if type(d) is not dict:
            return None
        name, dtype_name, shape = d.get("name"), d.get("dtype"), d.get("shape")
        if (type(name) is not str or not name or name in out or type(dtype_name) is not str
                or type(shape) is not list or len(shape) > MAX_NDIM):
            return None
        dtype = WIRE_DTYPES.get(dtype_name)
        if dtype is None and dtype_name != BYTES_WIRE:
            return None
        count = 1
        for dim in shape:
            if type(dim) is not int:
                return None
            count *= dim
        if not shape_fits(shape):
            return None
        if dtype is None:  # BYTES: the frame's length, not the shape, says how big it is
            if type(frame) is not zmq.Frame and type(frame) is not bytes:
                return None
            total += len(frame)  # type: ignore[arg-type]
            if total > max_bytes:
                return None
            try:
                out[name] = read_bytes_tensor(frame.buffer if type(frame) is zmq.Frame else frame,  # type: ignore[arg-type,union-attr]
                                              tuple(shape), name)
            except ProtocolError:
                return None
            continue
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


def _fast_request(h: dict[str, Any], frames: Sequence[object], max_bytes: int, now: float) -> InferRequest | None:
    slo, task, tenant, budget = h.get("slo"), h.get("task"), h.get("tenant"), h.get("budget_ms")
    hops, site, variant, sent_at = h.get("hops"), h.get("target_site"), h.get("target_variant"), h.get("sent_at")
    if (h.get("kind") != "req" or type(slo) is not dict or type(task) is not str or not task
            or type(tenant) is not str or not tenant or not _finite(budget) or budget > MAX_BUDGET_MS
            or not _finite(sent_at)
            or not _str_items(hops)
            or (site is not None and type(site) is not str) or (variant is not None and type(variant) is not str)):
        return None
    tensors = _fast_tensors(h.get("tensors"), frames[1:], max_bytes)
    if tensors is None:
        return None
    tp = h.get("traceparent")
    # the one SLO parser, as on the checked path: a bad SLO is a ProtocolError on either; so for a traceparent
    return InferRequest(task, tensors, read_slo(slo), tenant, h["id"], now + budget / 1000.0, hops, site, variant,
                        sent_at, None if tp is None else read_traceparent(tp))


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
    trace = h.get("trace")
    if trace is not None and (type(trace) is not list or not all(type(x) is dict for x in trace)):
        return None
    tensors = _fast_tensors(h.get("tensors"), frames[1:], max_bytes)
    if tensors is None:
        return None
    shared, late = h.get("backbone_tenants", 0), h.get("late", False)
    if type(shared) is not int or shared < 0 or type(late) is not bool:
        return None  # the checked path says what is wrong
    return InferResponse(rid, tensors, site, variant, accuracy, reason, best_effort, tenant,
                         Timing(network, queue, compute, total), hops, trace, shared, late)


# ---------------------------------------------------------------- decode


def decode_request(frames: Sequence[FrameLike], *, max_bytes: int = DEFAULT_MAX_BYTES,
                   now: float | None = None) -> InferRequest:
    """Rebuild a request from its frames (identity already stripped). See the module docstring.
    ``now``: the monotonic instant it arrived (default: now), from which its deadline is set."""
    if now is None:
        now = clock.monotonic()
    if not frames:
        raise ProtocolError("empty message")
    _check_whole(frames, max_bytes)
    h = unpack_header(frames[0])
    fast = _fast_request(h, frames, max_bytes, now)
    if fast is not None:
        return fast
    return check_request(h, frames, max_bytes, now=now)


def decode_reply(frames: Sequence[FrameLike], *,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[str, InferResponse | MeshError]:
    """(request id, response or the error the peer sent). Raises only when no id can be read;
    a reply with a readable id but a broken body comes back as ``(id, ProtocolError)``."""
    if not frames:
        raise ProtocolError("empty message")
    _check_whole(frames, max_bytes)
    h = unpack_header(frames[0])
    rid: str = h["id"]  # checked by unpack_header
    fast = _fast_response(h, rid, frames, max_bytes)
    if fast is not None:
        return rid, fast
    return rid, check_reply(h, rid, frames, max_bytes)


def decode_response(frames: Sequence[FrameLike], *, max_bytes: int = DEFAULT_MAX_BYTES) -> InferResponse:
    """The reply as an ``InferResponse``; an ``err`` reply raises the matching ``MeshError``."""
    _, out = decode_reply(frames, max_bytes=max_bytes)
    if isinstance(out, MeshError):
        raise out
    return out


def peek_request_id(frames: Sequence[FrameLike]) -> str | None:
    """The id of a message if its header can be read at all (for error replies to bad input)."""
    try:
        return read_id(unpack_header(frames[0])) if frames else None
    except ProtocolError:
        return None



def _check_whole(frames: Sequence[object], max_bytes: int) -> None:
    if frames[-1] is CUT:
        raise PayloadTooLarge(f"a message cut short by its receiver: more than {MAX_FRAMES} frames or "
                              f"{message_bytes_limit(max_bytes)} bytes")
    check_envelope(frames, max_bytes)
