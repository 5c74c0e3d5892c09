"""Wire codec: round trips of arbitrary messages, and hostile input only ever raises the codec's errors."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from mesh.errors import BadTensor, MeshError, PayloadTooLarge, ProtocolError, UnknownTask
from mesh.tracecontext import new_traceparent
from mesh.types import BEST_EFFORT_GRACE_MS, MAX_LATENCY_MS, PREFERS, SLO, InferRequest, InferResponse, Timing
from mesh.zmq import protocol as p
from mesh.zmq.protocol_check import (
    ALLOWED_DTYPES,
    DECODE_ERRORS,
    MAX_BUDGET_MS,
    MAX_HEADER_BYTES,
    MAX_ID_LEN,
    check_request,
    unpack_header,
)

pytestmark = pytest.mark.unit

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
names = st.text(min_size=1, max_size=12)
arrays = st.sampled_from(sorted(ALLOWED_DTYPES)).flatmap(
    lambda dt: hnp.arrays(np.dtype(dt), hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5))
)

def _bytes_array(shape: tuple[int, ...]) -> st.SearchStrategy[np.ndarray]:
    n = int(np.prod(shape))
    return st.lists(st.binary(max_size=8), min_size=n, max_size=n).map(
        lambda items: np.array([*items, None], dtype=object)[:-1].reshape(shape))  # None: keep bytes unsplit


bytes_arrays = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4).flatmap(_bytes_array)
tensors = st.dictionaries(names, arrays | bytes_arrays, max_size=4)
slos = st.builds(SLO, latency_ms=st.floats(min_value=1e-6, max_value=MAX_LATENCY_MS),
                 min_accuracy=st.floats(min_value=0.0, max_value=1.0),
                 max_cost=st.none() | st.floats(min_value=0.0, max_value=1e12), prefer=st.sampled_from(PREFERS))
requests = st.builds(
    InferRequest, task=names, inputs=tensors, slo=slos, tenant=names,
    # encoded at now=0: the budget on the wire is the deadline, at most MAX_BUDGET_MS (spent ones too: negative)
    request_id=st.text(min_size=1, max_size=40), deadline=st.floats(min_value=-1e9, max_value=MAX_BUDGET_MS / 1000),
    hops=st.lists(names, max_size=5), target_site=st.none() | names, target_variant=st.none() | names,
    traceparent=st.none() | st.builds(new_traceparent),
)
responses = st.builds(
    InferResponse, request_id=st.text(min_size=1, max_size=40), outputs=tensors, site=st.text(),
    variant=st.text(), accuracy=finite, reason=st.text(max_size=20), best_effort=st.booleans(),
    tenant=names, timing=st.builds(Timing, finite, finite, finite, finite), hops=st.lists(names, max_size=5),
    trace=st.none() | st.lists(st.dictionaries(st.text(max_size=8), st.none() | finite | st.text(max_size=8),
                                               max_size=4), max_size=3),
)


def _wire(frames: list[Any]) -> list[bytes]:
    return [bytes(f) for f in frames]


def _same_tensors(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert list(a) == list(b)
    for k in a:
        # bitwise: NaN payloads and -0.0 must survive too
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        if a[k].dtype.hasobject:
            assert a[k].reshape(-1).tolist() == b[k].reshape(-1).tolist()
            continue
        assert np.ascontiguousarray(a[k]).tobytes() == b[k].tobytes()


def _valid_frames() -> list[bytes]:
    req = InferRequest(task="digits", inputs={"x": np.arange(12, dtype=np.float32).reshape(3, 4),
                                              "m": np.array([True, False])},
                       slo=SLO(20.0, 0.9), tenant="acme", request_id="r-1", deadline=1e9, hops=["edge-a"])
    return _wire(p.encode_request(req, now=1e9 - 60.0))  # a minute's budget


def _decode_any(frames: list[Any]) -> None:
    """Decoding hostile frames either succeeds or raises a codec error; anything else fails the test."""
    for decode in (p.decode_request, p.decode_response):
        try:
            decode(frames, max_bytes=1 << 20)
        except DECODE_ERRORS:
            pass
        except MeshError as exc:  # an "err" reply legitimately raises the error it carries
            assert decode is p.decode_response, exc
    p.peek_request_id(frames)  # never raises


# ---------------------------------------------------------------- round trips


@FUZZ
@given(requests)
def test_request_round_trip(req: InferRequest) -> None:
    frames = p.encode_request(req, now=0.0)
    assert len(frames) == 1 + len(req.inputs)
    for wire in (frames, _wire(frames), [zmq.Frame(bytes(f)) for f in frames]):
        got = p.decode_request(wire, now=0.0)
        assert (got.task, got.tenant, got.request_id, got.hops) == (req.task, req.tenant, req.request_id,
                                                                    req.hops)
        # the budget left at send (deadline - 0) becomes the receiver's deadline from arrival (0)
        assert got.slo == req.slo and got.deadline == pytest.approx(req.deadline, rel=1e-12, abs=1e-9)
        assert (got.target_site, got.target_variant) == (req.target_site, req.target_variant)
        assert got.traceparent == req.traceparent
        _same_tensors(req.inputs, got.inputs)


@FUZZ
@given(responses)
def test_response_round_trip(resp: InferResponse) -> None:
    got = p.decode_response(_wire(p.encode_response(resp)))
    assert (got.request_id, got.site, got.variant, got.reason, got.best_effort, got.tenant, got.hops) == (
        resp.request_id, resp.site, resp.variant, resp.reason, resp.best_effort, resp.tenant, resp.hops)
    assert got.accuracy == resp.accuracy and got.timing == resp.timing and got.trace == resp.trace
    _same_tensors(resp.outputs, got.outputs)


def test_tensor_frames_are_views_and_decoded_arrays_read_only() -> None:
    x = np.arange(1000, dtype=np.float32)
    frames = p.encode_request(InferRequest("t", {"x": x}, SLO(10), request_id="a", deadline=1.0))
    view = frames[1]
    assert isinstance(view, memoryview) and view.nbytes == x.nbytes
    x[0] = 42.0  # zero-copy: the frame sees the caller's memory
    assert np.frombuffer(view, np.float32)[0] == 42.0
    got = p.decode_request(_wire(frames)).inputs["x"]
    assert not got.flags.writeable
    with pytest.raises(ValueError):
        got[0] = 1.0


def test_encode_refuses_missing_or_overlong_id() -> None:
    for rid in ("", "x" * (MAX_ID_LEN + 1)):
        with pytest.raises(ProtocolError, match="request id"):
            p.encode_request(InferRequest("t", {}, SLO(10), request_id=rid, deadline=1.0))


def test_non_contiguous_and_big_endian_inputs_are_normalised() -> None:
    base = np.arange(24, dtype=np.int64).reshape(4, 6)
    inputs = {"t": base.T, "s": base[:, ::2], "be": np.arange(5, dtype=">f4")}
    got = p.decode_request(_wire(p.encode_request(
        InferRequest("t", inputs, SLO(10), request_id="a", deadline=1.0)))).inputs
    np.testing.assert_array_equal(got["t"], base.T)
    np.testing.assert_array_equal(got["s"], base[:, ::2])
    np.testing.assert_array_equal(got["be"], np.arange(5, dtype=np.float32))
    assert got["be"].dtype == np.dtype("<f4")


@pytest.mark.parametrize("bad", [np.array([object()], dtype=object), np.array(["a"]),
                                 np.zeros(2, np.complex64)])
def test_encode_refuses_dtypes_outside_the_allow_list(bad: np.ndarray) -> None:
    with pytest.raises(BadTensor):
        p.encode_request(InferRequest("t", {"x": bad}, SLO(10), request_id="a", deadline=1.0))


def test_error_reply_raises_matching_error() -> None:
    frames = p.encode_error("r-9", UnknownTask("no task 'nope'"))
    with pytest.raises(UnknownTask, match="nope"):
        p.decode_response(frames)
    rid, err = p.decode_reply(frames)
    assert rid == "r-9" and isinstance(err, UnknownTask)
    rid, err = p.decode_reply(p.encode_error("r-8", MeshError("boom")))
    assert isinstance(err, MeshError) and err.code == "internal"


# ---------------------------------------------------------------- hostile input, case by case


def _header(**changes: Any) -> dict[str, Any]:
    h: dict[str, Any] = msgpack.unpackb(_valid_frames()[0])
    for k, v in changes.items():
        if v is _DROP:
            del h[k]
        else:
            h[k] = v
    return h


_DROP = object()


@pytest.mark.parametrize(("changes", "pattern"), [
    ({"v": 1}, "version 1"),  # v1 carried an absolute wall-clock deadline: refused, not misread
    ({"v": True}, "'v'"),
    ({"kind": "rep"}, "kind"),
    ({"id": 7}, "'id'"),
    ({"id": ""}, "'id' is empty"),
    ({"task": _DROP}, "'task' missing"),
    ({"slo": [1, 2]}, "'slo'"),
    ({"slo": {"latency_ms": "fast", "min_accuracy": 0, "prefer": "latency"}}, "latency_ms"),
    ({"slo": {"latency_ms": 5, "min_accuracy": 0, "prefer": "cheap"}}, "prefer"),
    ({"slo": {"latency_ms": -5.0, "min_accuracy": 0.0, "prefer": "latency"}}, "latency_ms must be positive"),
    ({"slo": {"latency_ms": 5.0, "min_accuracy": 1.5, "prefer": "latency"}}, "min_accuracy"),
    ({"budget_ms": math.inf}, "not finite"),
    ({"budget_ms": math.nan}, "not finite"),
    ({"budget_ms": MAX_BUDGET_MS + 1.0}, "'budget_ms' is 600501.0: at most 600500"),  # held a hop's rows for ever
    ({"budget_ms": 10**12}, "'budget_ms' is 1000000000000.0: at most"),  # an int: the checked path alone
    ({"budget_ms": _DROP}, "'budget_ms' missing"),
    ({"budget_ms": True}, "'budget_ms'"),
    ({"sent_at": "noon"}, "'sent_at'"),
    ({"sent_at": _DROP}, "'sent_at' missing"),
    ({"hops": ["a", 3]}, "hops"),
    ({"target_site": 5}, "target_site"),
    ({"traceparent": "00-abc-def-01"}, "traceparent"),
    ({"traceparent": 7}, "traceparent"),
    ({"traceparent": "00-" + "0" * 32 + "-" + "1" * 16 + "-01"}, "traceparent"),
    ({"tensors": "x"}, "tensors"),
    ({"tensors": [{"name": "x", "dtype": "float32", "shape": [3, 4]}]}, "2 tensor frames"),
    ({"tensors": [{"name": "x", "dtype": "object", "shape": [12]}, {"name": "m", "dtype": "bool",
                                                                      "shape": [2]}]}, "not allowed"),
    ({"tensors": [{"name": "x", "dtype": "float32", "shape": [-3, -4]}, {"name": "m", "dtype": "bool",
                                                                         "shape": [2]}]}, "non-negative"),
    ({"tensors": [{"name": "x", "dtype": "float32", "shape": [4, 4]}, {"name": "m", "dtype": "bool",
                                                                       "shape": [2]}]}, "expected 64"),
    # zero elements, but more than numpy can index (was a ValueError out of the decoder)
    ({"tensors": [{"name": "x", "dtype": "float32", "shape": [2**40, 2**40, 2**40, 0]},
                  {"name": "m", "dtype": "bool", "shape": [2]}]}, "a dimension of"),
    ({"tensors": [{"name": "x", "dtype": "float64", "shape": [0, 2**30, 2**30]},
                  {"name": "m", "dtype": "bool", "shape": [2]}]}, "numpy cannot hold"),
    ({"tensors": [{"name": "x", "dtype": "float32", "shape": [12]}, {"name": "x", "dtype": "bool",
                                                                     "shape": [2]}]}, "duplicate"),
])
def test_hostile_header_is_protocol_error(changes: dict[str, Any], pattern: str) -> None:
    frames = _valid_frames()
    frames[0] = msgpack.packb(_header(**changes))
    with pytest.raises(ProtocolError, match=pattern):
        p.decode_request(frames)


def test_a_forwarded_budget_is_at_most_the_longest_slo_and_its_grace() -> None:
    """A door hands on at most an SLO's longest budget plus a best-effort query's grace; a peer's longer one would
    hold this hop's queue rows and quota slot for as long as it says (issue 29). Both decoders draw the line there;
    a spent (negative) budget still decodes, to be answered ``DeadlineExceeded``."""
    assert MAX_BUDGET_MS == MAX_LATENCY_MS + BEST_EFFORT_GRACE_MS
    for budget_ms, ok in ((MAX_BUDGET_MS, True), (MAX_BUDGET_MS * (1 + 1e-12), False), (-5.0, True)):
        frames = p.encode_request(InferRequest("t", {}, SLO(MAX_LATENCY_MS), request_id="r",
                                               deadline=budget_ms / 1000.0), now=0.0)
        if ok:
            assert p.decode_request(frames, now=0.0).deadline == budget_ms / 1000.0
            continue
        with pytest.raises(ProtocolError, match=r"'budget_ms' is .*: at most 600500"):
            p.decode_request(frames, now=0.0)
        with pytest.raises(ProtocolError, match="'budget_ms'"):
            check_request(unpack_header(frames[0]), frames, 1024, now=0.0)


def test_a_peer_that_predates_traces_is_understood_both_ways() -> None:
    # the optional fields are absent from an untraced message, so an older v2 peer's messages decode
    # as before and ours carry nothing it would not know
    assert "traceparent" not in msgpack.unpackb(_valid_frames()[0])
    got = p.decode_request(_valid_frames())
    assert got.traceparent is None
    resp = InferResponse("r", {}, "s", "v", 0.9, "local")
    assert "trace" not in msgpack.unpackb(p.encode_response(resp)[0])
    frames = _valid_frames()
    h = msgpack.unpackb(frames[0])
    h["kind"], h["site"], h["variant"], h["accuracy"], h["reason"] = "rep", "s", "v", 0.5, "local"
    h["best_effort"], h["timing"] = False, {k: 0.0 for k in ("network_ms", "queue_ms", "compute_ms", "total_ms")}
    for trace, ok in ([{"site": "s"}], True), ([1, 2], False), ("x", False):
        h["trace"] = trace
        frames[0] = msgpack.packb(h)
        _, out = p.decode_reply(frames)
        assert isinstance(out, InferResponse) == ok and (not ok or out.trace == trace), out


def test_huge_declared_size_is_payload_too_large() -> None:
    frames = _valid_frames()
    frames[0] = msgpack.packb(_header(tensors=[{"name": "x", "dtype": "float64", "shape": [2**40, 2**40]},
                                               {"name": "m", "dtype": "bool", "shape": [2]}]))
    with pytest.raises(PayloadTooLarge):
        p.decode_request(frames)
    with pytest.raises(PayloadTooLarge):  # a real payload over a caller-set cap
        p.decode_request(_valid_frames(), max_bytes=16)


@pytest.mark.parametrize("frames", [
    [], [b""], [b"\xc1"], [msgpack.packb([1, 2, 3])], [msgpack.packb({1: 2})],
    [b"\x91" * 5000], [b"\x00" * (MAX_HEADER_BYTES + 1)], [12345], ["text"],
])
def test_garbage_is_protocol_error(frames: list[Any]) -> None:
    with pytest.raises(ProtocolError):
        p.decode_request(frames)
    with pytest.raises(ProtocolError):
        p.decode_response(frames)
    assert p.peek_request_id(frames) is None


def test_extra_and_missing_frames() -> None:
    frames = _valid_frames()
    with pytest.raises(ProtocolError, match="3 tensor frames"):
        p.decode_request([*frames, b"x"])
    with pytest.raises(ProtocolError, match="1 tensor frames"):
        p.decode_request(frames[:2])
    assert p.peek_request_id(frames[:1]) == "r-1"


def test_broken_reply_body_keeps_its_id() -> None:
    resp = InferResponse("r-2", {"y": np.ones(3, np.float32)}, "core", "v", 0.9, "local_ok")
    frames = _wire(p.encode_response(resp))
    rid, err = p.decode_reply([frames[0], frames[1][:-1]])
    assert rid == "r-2" and isinstance(err, ProtocolError)


# ---------------------------------------------------------------- fuzzing


@FUZZ
@given(st.data())
def test_truncation_and_bit_flips(data: st.DataObject) -> None:
    frames = _valid_frames()
    i = data.draw(st.integers(0, len(frames) - 1))
    if data.draw(st.booleans()):
        frames[i] = frames[i][: data.draw(st.integers(0, max(0, len(frames[i]) - 1)))]
    else:
        buf = bytearray(frames[i])
        for _ in range(data.draw(st.integers(1, 8))):
            bit = data.draw(st.integers(0, len(buf) * 8 - 1))
            buf[bit // 8] ^= 1 << (bit % 8)
        frames[i] = bytes(buf)
    _decode_any(frames)
    _decode_any(frames[: data.draw(st.integers(0, len(frames)))])


@FUZZ
@given(st.lists(st.binary(max_size=300), max_size=4))
def test_random_bytes(frames: list[bytes]) -> None:
    _decode_any(frames)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=10)
    | st.binary(max_size=10),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=12,
)


@FUZZ
@given(st.data())
def test_wrong_types_in_any_field(data: st.DataObject) -> None:
    frames = _valid_frames()
    h = _header()
    key = data.draw(st.sampled_from([*h, "slo.latency_ms", "slo.prefer", "tensor.shape", "tensor.dtype"]))
    value = data.draw(msgpack_values)
    if key.startswith("slo."):
        h["slo"][key[4:]] = value
    elif key.startswith("tensor."):
        h["tensors"][0][key[7:]] = value
    else:
        h[key] = value
    frames[0] = msgpack.packb(h)
    _decode_any(frames)


# ---------------------------------------------------------------- BYTES: the fast and checked decoders agree


def _both(frames: list[Any]) -> tuple[Any, Any]:
    """(fast decoder's result or None, checked decoder's result or its error)."""
    h = unpack_header(frames[0])
    fast = p._fast_request(h, frames, 1 << 20, 0.0)
    try:
        checked: Any = check_request(h, frames, 1 << 20, now=0.0)
    except DECODE_ERRORS as exc:
        checked = exc
    return fast, checked


@FUZZ
@given(requests)
def test_fast_and_checked_decoders_agree(req: InferRequest) -> None:
    fast, checked = _both(_wire(p.encode_request(req, now=0.0)))
    assert fast is not None and not isinstance(checked, Exception)
    for got in (fast, checked):
        _same_tensors(req.inputs, got.inputs)
    assert (fast.task, fast.tenant, fast.slo, fast.deadline) == (checked.task, checked.tenant, checked.slo,
                                                                 checked.deadline)


@FUZZ
@given(st.data())
def test_decoders_agree_on_hostile_bytes_frames(data: st.DataObject) -> None:
    """A BYTES frame cut, padded or with a length prefix rewritten: the fast path either decodes it
    exactly as the checked path does, or leaves it to the checked path, which refuses it precisely."""
    texts = data.draw(st.lists(st.binary(max_size=6), min_size=1, max_size=4))
    arr = np.array([*texts, None], dtype=object)[:-1]
    frames = _wire(p.encode_request(InferRequest("t", {"text": arr}, SLO(10), request_id="r", deadline=1.0),
                                    now=0.0))
    buf = bytearray(frames[1])
    how = data.draw(st.sampled_from(["cut", "pad", "prefix"]))
    if how == "cut":
        buf = buf[: data.draw(st.integers(0, len(buf)))]
    elif how == "pad":
        buf += data.draw(st.binary(min_size=1, max_size=5))
    else:
        buf[0:4] = data.draw(st.integers(0, 2**32 - 1)).to_bytes(4, "little")
    frames[1] = bytes(buf)
    fast, checked = _both(frames)
    if isinstance(checked, Exception):
        assert fast is None and isinstance(checked, ProtocolError)
    else:
        assert fast is not None
        assert fast.inputs["text"].tolist() == checked.inputs["text"].tolist()


def test_bytes_tensor_frame_is_tritons_layout() -> None:
    from tritonclient.utils import serialize_byte_tensor

    arr = np.array([b"hello", "w\u00f6rld".encode(), b""], dtype=object)
    frames = _wire(p.encode_request(InferRequest("t", {"text": arr}, SLO(10), request_id="r", deadline=1.0)))
    assert frames[1] == serialize_byte_tensor(arr).item()
    assert unpack_header(frames[0])["tensors"] == [{"name": "text", "dtype": "bytes", "shape": [3]}]
    got = p.decode_request(frames)
    assert got.inputs["text"].tolist() == [b"hello", "w\u00f6rld".encode(), b""]


def test_bytes_elements_must_be_bytes_or_text() -> None:
    with pytest.raises(BadTensor, match="bytes or str"):
        p.encode_request(InferRequest("t", {"text": np.array([1, b"a"], dtype=object)}, SLO(10), request_id="a",
                                      deadline=1.0))


def test_shared_backbone_count_crosses_the_wire_and_a_bad_one_is_refused() -> None:
    resp = InferResponse("r-3", {"y": np.ones(3, np.float32)}, "edge", "head", 0.9, "local_ok", backbone_tenants=3)
    frames = _wire(p.encode_response(resp))
    assert p.decode_response(frames).backbone_tenants == 3
    plain = InferResponse("r-4", {"y": np.ones(3, np.float32)}, "edge", "v", 0.9, "local_ok")
    head = msgpack.unpackb(_wire(p.encode_response(plain))[0])
    assert "backbone_tenants" not in head  # replies without a shared backbone are unchanged on the wire
    assert p.decode_response(_wire(p.encode_response(plain))).backbone_tenants == 0
    bad = msgpack.unpackb(frames[0])
    bad["backbone_tenants"] = -1
    rid, err = p.decode_reply([msgpack.packb(bad), *frames[1:]])
    assert rid == "r-3" and isinstance(err, ProtocolError) and "backbone_tenants" in str(err)
