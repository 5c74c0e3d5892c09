"""One validator per value: the SLO checks itself, and every decoder (the fast and the checked
ZeroMQ decoders, the HTTP parameters) accepts and refuses exactly what ``SLO`` does."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from mesh.errors import ProtocolError, RequestError
from mesh.tracecontext import new_traceparent
from mesh.types import MAX_LATENCY_MS, PREFERS, SLO, TIER_RANK, TIERS, InferRequest
from mesh.v2 import params as v2_params
from mesh.zmq import protocol as fast
from mesh.zmq import protocol_check as checked

pytestmark = pytest.mark.unit

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MAX = checked.DEFAULT_MAX_BYTES
BUDGET_S = checked.MAX_BUDGET_MS / 1000.0  # the longest budget a request carries, in seconds


def test_vocabularies_have_one_spelling() -> None:
    assert PREFERS == ("latency", "accuracy", "refuse")
    assert TIERS == ("edge", "middle", "core")
    assert TIER_RANK == {"edge": 0, "middle": 1, "core": 2}


@pytest.mark.parametrize("args", [(20,), (0.5, 1), (20.0, 0.97, 2, "accuracy"), (MAX_LATENCY_MS, 0.0, 0.0, "refuse"),
                                  (600_000,)])
def test_valid_slo_is_stored_as_floats(args: tuple[Any, ...]) -> None:
    slo = SLO(*args)
    assert type(slo.latency_ms) is float and type(slo.min_accuracy) is float
    assert slo.max_cost is None or type(slo.max_cost) is float
    assert SLO.parse(slo.latency_ms, slo.min_accuracy, slo.max_cost, slo.prefer) == slo


@pytest.mark.parametrize(("args", "fragment"), [
    ((-5.0,), "latency_ms must be positive"),
    ((0,), "latency_ms must be positive"),
    ((math.inf,), "latency_ms must be a finite number"),
    ((math.nan,), "latency_ms must be a finite number"),
    ((True,), "latency_ms must be a finite number"),
    (("20",), "latency_ms must be a finite number"),
    ((10**400,), "latency_ms must be a finite number"),
    ((MAX_LATENCY_MS + 1.0,), r"latency_ms must be at most 600000 \(ten minutes\), got 600001.0"),
    ((1e300,), "latency_ms must be at most 600000"),
    ((10**12,), "latency_ms must be at most 600000"),
    ((20.0, 1.5), r"min_accuracy must be in \[0, 1\]"),
    ((20.0, -0.1), r"min_accuracy must be in \[0, 1\]"),
    ((20.0, math.nan), r"min_accuracy must be in \[0, 1\]"),
    ((20.0, None), "min_accuracy must be a finite number"),
    ((20.0, 0.0, -1.0), "max_cost must be non-negative"),
    ((20.0, 0.0, math.inf), "max_cost must be non-negative and finite"),
    ((20.0, 0.0, None, "cheapest"), "prefer must be one of"),
    ((20.0, 0.0, None, None), "prefer must be one of"),
])
def test_invalid_slo_cannot_be_built(args: tuple[Any, ...], fragment: str) -> None:
    with pytest.raises(RequestError, match=fragment):
        SLO(*args)
    full = (*args, *(0.0, None, "latency")[len(args) - 1:])
    with pytest.raises(RequestError, match=fragment):
        SLO.parse(*full)


def test_parse_does_not_confuse_equal_values_of_other_types() -> None:
    assert SLO.parse(1.0, 1.0, None, "latency") == SLO(1.0, 1.0)
    with pytest.raises(RequestError):
        SLO.parse(True, 1.0, None, "latency")  # True == 1.0 and hashes alike: never from the cache


# ---------------------------------------------------------------- fast and checked decoders agree

finite = st.floats(allow_nan=False, allow_infinity=False)
valid_slos = st.builds(SLO, latency_ms=st.floats(min_value=1e-6, max_value=MAX_LATENCY_MS),
                       min_accuracy=st.floats(min_value=0.0, max_value=1.0),
                       max_cost=st.none() | st.floats(min_value=0.0, max_value=1e12),
                       prefer=st.sampled_from(PREFERS))
names = st.text(min_size=1, max_size=8)
arrays = st.sampled_from(sorted(checked.ALLOWED_DTYPES)).flatmap(
    lambda dt: hnp.arrays(np.dtype(dt), hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)))
requests = st.builds(
    InferRequest, task=names, inputs=st.dictionaries(names, arrays, max_size=3), slo=valid_slos, tenant=names,
    # encoded at now=0: the budget on the wire is the deadline, at most what a hop accepts (spent ones too)
    request_id=st.text(min_size=1, max_size=20), deadline=st.floats(min_value=-1e9, max_value=BUDGET_S),
    hops=st.lists(names, max_size=3), target_site=st.none() | names, target_variant=st.none() | names,
    sent_at=finite, traceparent=st.none() | st.builds(new_traceparent))
# what a peer might put in an SLO field: every kind of number, and things that are not numbers
slo_numbers = (st.floats() | st.integers(-(2**63), 2**64 - 1) | st.sampled_from([0.0, -0.0, 1.0, -5.0, 1.5])
               | st.booleans() | st.none() | st.text(max_size=4))
slo_prefers = st.sampled_from([*PREFERS, "cheap", "", "Latency"]) | st.none() | st.integers(0, 3)
_ABSENT = object()


def _same_request(a: InferRequest, b: InferRequest) -> None:
    for f in dataclasses.fields(InferRequest):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "inputs":
            assert list(x) == list(y)
            for k in x:  # bitwise: NaN payloads and -0.0 must survive too
                assert x[k].dtype == y[k].dtype and x[k].shape == y[k].shape
                assert np.ascontiguousarray(x[k]).tobytes() == y[k].tobytes()
        else:
            assert x == y and type(x) is type(y), f.name


def _outcome(decode: Any, *args: Any, **kwargs: Any) -> InferRequest | type[Exception] | None:
    try:
        return decode(*args, **kwargs)
    except ProtocolError:
        return ProtocolError


@FUZZ
@given(requests, st.floats(min_value=-1e6, max_value=1e6), st.floats(min_value=-1e6, max_value=1e6),
       st.floats(min_value=-1e6, max_value=BUDGET_S - 1e-3))
def test_fast_and_checked_decoders_agree_on_every_field(req: InferRequest, sent: float, arrived: float,
                                                         left: float) -> None:
    # sent and arrived are instants on two different monotonic clocks: only the budget crosses (``left`` seconds,
    # within what a hop accepts less a millisecond for rounding at these magnitudes)
    req = dataclasses.replace(req, deadline=sent + left)
    frames = [bytes(f) for f in fast.encode_request(req, now=sent)]
    h = checked.unpack_header(frames[0])
    by_fast = fast._fast_request(h, frames, MAX, arrived)
    by_check = checked.check_request(h, frames, MAX, now=arrived)
    assert by_fast is not None  # what the codec writes, the fast path reads
    _same_request(by_fast, by_check)
    _same_request(by_fast, fast.decode_request(frames, now=arrived))
    assert by_fast.deadline == pytest.approx(arrived + (req.deadline - sent), rel=1e-9, abs=1e-6)
    assert by_fast.sent_at == h["sent_at"]
    _same_request(by_fast, dataclasses.replace(req, deadline=by_fast.deadline, sent_at=by_fast.sent_at))


@FUZZ
@given(requests, st.fixed_dictionaries({"latency_ms": slo_numbers | st.just(_ABSENT),
                                        "min_accuracy": slo_numbers | st.just(_ABSENT),
                                        "max_cost": slo_numbers | st.just(_ABSENT),
                                        "prefer": slo_prefers | st.just(_ABSENT)}))
def test_fast_and_checked_decoders_reject_the_same_slos(req: InferRequest, slo: dict[str, Any]) -> None:
    frames = [bytes(f) for f in fast.encode_request(req, now=0.0)]
    h = msgpack.unpackb(frames[0])
    h["slo"] = {k: v for k, v in slo.items() if v is not _ABSENT}
    frames[0] = msgpack.packb(h)
    h = checked.unpack_header(frames[0])
    by_fast = _outcome(fast._fast_request, h, frames, MAX, 0.0)
    by_check = _outcome(checked.check_request, h, frames, MAX, now=0.0)
    by_decode = _outcome(fast.decode_request, frames, now=0.0)
    got = h["slo"]
    try:  # what the type itself says of these values (an absent one is None on the wire)
        expected: SLO | None = SLO(got.get("latency_ms"), got.get("min_accuracy"), got.get("max_cost"),
                                   got.get("prefer"))
    except RequestError:
        expected = None
    if expected is None:
        assert by_fast is ProtocolError and by_check is ProtocolError and by_decode is ProtocolError
    else:
        assert isinstance(by_fast, InferRequest) and isinstance(by_check, InferRequest)
        assert by_fast.slo == by_check.slo == expected
        _same_request(by_fast, by_check)
    if all(v is not _ABSENT for v in slo.values()):
        # the HTTP front reads the SLO with the same parser: it refuses exactly these too
        try:
            over_http: SLO | None = v2_params.parse_slo(slo)
        except RequestError:
            over_http = None
        assert over_http == expected


@pytest.mark.parametrize("bad", [
    {"latency_ms": -5.0}, {"latency_ms": 0.0}, {"latency_ms": 0}, {"latency_ms": math.nan},
    {"latency_ms": math.inf}, {"min_accuracy": 1.01}, {"min_accuracy": -0.5}, {"max_cost": -1.0},
    {"max_cost": math.inf}, {"prefer": "cheapest"}, {"latency_ms": True},
])
def test_a_peer_cannot_send_a_bad_slo(bad: dict[str, Any]) -> None:
    req = InferRequest("t", {"x": np.ones((1, 2), np.float32)}, SLO(20.0), "acme", "r-1", 10.0)
    frames = [bytes(f) for f in fast.encode_request(req, now=0.0)]
    h = msgpack.unpackb(frames[0])
    h["slo"].update(bad)
    frames[0] = msgpack.packb(h)
    with pytest.raises(ProtocolError, match="slo"):
        fast.decode_request(frames)
    with pytest.raises(ProtocolError, match="slo"):
        checked.check_request(checked.unpack_header(frames[0]), frames, MAX, now=0.0)


@pytest.mark.parametrize(("raw", "want"), [({}, None), ({"version": 2}, 2), ({"version": "3"}, 3),
                                           ({"version": 1_000_000}, 1_000_000)])
def test_a_pinned_version_is_read_from_the_parameters(raw: dict[str, object], want: int | None) -> None:
    from mesh.v2.params import parse_version

    assert parse_version(raw) == want


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "two", "", "1e3", 1_000_001, [1], "٣"])
def test_a_bad_version_is_refused_saying_so(bad: object) -> None:
    from mesh.errors import RequestError
    from mesh.v2.params import parse_version

    with pytest.raises(RequestError, match="version"):
        parse_version({"version": bad})
