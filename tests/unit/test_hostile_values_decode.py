"""Issue 29, item 1: the strict JSON decode of etcd bytes raises ``ProtocolError`` and nothing else, a view reports a
key refused again and again once in a while, and the loops that read etcd run under a supervisor that restarts
them."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core_scheduler.state.records import decode_record
from core_scheduler.state.supervise import supervise
from core_scheduler.state.view import MeshView
from core_scheduler.state.view_state import ViewState
from mesh.backoff import Backoff
from mesh.errors import ProtocolError, StoreUnavailable
from mesh.etcd.keys import parse_key
from mesh.etcd.store import MAX_DEPTH, Undecodable, decode_json
from tests.unit.test_hostile_values import GOOD, HOSTILE, STRICT_JSON, good_view, hostile_bytes

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_bytes_raise_protocol_error_alone(name: str) -> None:
    if name in STRICT_JSON:
        assert decode_json(HOSTILE[name]) == json.loads(HOSTILE[name])
        return
    with pytest.raises(ProtocolError):
        decode_json(HOSTILE[name])


@pytest.mark.parametrize(("raw", "value"), [
    (b'{"a": [1, 2.5, -3e-7, null, true, "x"]}', {"a": [1, 2.5, -3e-7, None, True, "x"]}),
    (b'"\\ud83d\\ude00 \\u00e9"', "\U0001f600 \u00e9"),                  # an escaped pair is one code point
    ("\"\u00e9\u4e2d\"".encode(), "\u00e9\u4e2d"),
    (b"[" * MAX_DEPTH + b"]" * MAX_DEPTH, json.loads("[" * MAX_DEPTH + "]" * MAX_DEPTH)),
    (str(2**63 - 1).encode(), 2**63 - 1), (str(-(2**63)).encode(), -(2**63)),
    (b"1.7976931348623157e308", 1.7976931348623157e308),
])
def test_strict_json_is_taken_as_it_is(raw: bytes, value: Any) -> None:
    assert decode_json(raw) == value


@pytest.mark.parametrize("raw", [
    b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), str(2**63).encode(), str(-(2**63) - 1).encode(), b"1e309",
    b'["\\udfff"]', b'{"\\ud800": 1}', b"\xef\xbb\xbf{}",  # a UTF-8 BOM is no JSON text either
])
def test_just_past_each_limit_is_refused(raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_json(raw)


def _shape_ok(value: Any, depth: int = 1) -> bool:
    if isinstance(value, dict):
        return depth <= MAX_DEPTH and all(_shape_ok(v, depth + 1) for v in value.values())
    if isinstance(value, list):
        return depth <= MAX_DEPTH and all(_shape_ok(v, depth + 1) for v in value)
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, int):
        return -(2**63) <= value < 2**63
    return True


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=400) | st.from_regex(rb"[\[\]{}\":,0-9eE.\-+a-z\\ ]{0,200}", fullmatch=True))
def test_any_bytes_decode_or_raise_protocol_error(raw: bytes) -> None:
    try:
        value = decode_json(raw)
    except ProtocolError:
        return
    assert _shape_ok(value)


def test_generated_hostile_values_never_escape_as_another_error() -> None:
    rng = random.Random(2929)
    kinds = ["live/e", "pki/sites/e", "placement/e", "topology/sites/e", "catalog/t/v", "pki/crl", "services/x"]
    for _ in range(400):
        raw = hostile_bytes(rng)
        try:
            value: Any = decode_json(raw)
        except ProtocolError as exc:
            value = Undecodable(exc.message, len(raw))
        for key in kinds:
            parsed = parse_key(key)
            assert parsed is not None
            try:
                decode_record(*parsed, value)
            except ProtocolError:
                pass


# -- the supervisor ------------------------------------------------------------------------------------------------

def test_back_off_doubles_within_its_jitter_and_starts_over() -> None:
    b = Backoff(0.1, 0.4)
    delays = [b.next() for _ in range(5)]
    for delay, step in zip(delays, (0.1, 0.2, 0.4, 0.4, 0.4), strict=True):
        assert 0.5 * step <= delay < step
    b.reset()
    assert b.next() < 0.1


async def test_a_failing_loop_is_logged_and_run_again_until_cancelled(caplog: pytest.LogCaptureFixture) -> None:
    runs: list[int] = []
    running = asyncio.Event()

    async def body() -> None:
        runs.append(len(runs))
        if len(runs) == 1:
            raise RuntimeError("a bug")
        if len(runs) == 2:
            raise StoreUnavailable("etcd away")
        if len(runs) == 3:
            return  # a loop that ends is restarted too
        running.set()
        await asyncio.Event().wait()

    with caplog.at_level(logging.WARNING, logger="core_scheduler.state.supervise"):
        task = asyncio.create_task(supervise("test loop", body, backoff=Backoff(0.01, 0.02), site="s"))
        async with asyncio.timeout(5):
            await running.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert len(runs) == 4
    records = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert (logging.ERROR, "test loop failed, restarting it") in records  # with its traceback
    assert any(level == logging.WARNING and "etcd away" in msg for level, msg in records)
    assert (logging.WARNING, "test loop ended; running it again") in records


def test_a_key_refused_again_and_again_is_reported_once_in_a_while(caplog: pytest.LogCaptureFixture) -> None:
    view = MeshView(cast(Any, None), "e")
    with caplog.at_level(logging.WARNING, logger="core_scheduler.state.view"):
        for i in range(100):
            view._apply("live/x", {"capacity": math.inf, "n": i}, i + 1)
        view._apply("live/y", [1], 101)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and "'live/x'" in warned[0] and "'live/y'" in warned[1]  # one per key, not per value
    assert view.refused == 101 and set(view.rejected) == {"live/x", "live/y"} and not view.live
    view._apply("live/x", {"capacity": 2}, 102)
    assert "live/x" not in view.rejected and view.live["x"].capacity == 2


@pytest.mark.parametrize("key", sorted(GOOD))
def test_a_full_read_meeting_a_bad_value_keeps_the_record_in_force(key: str) -> None:
    """A re-read builds its state aside from every key read; one refused takes the record the view held."""
    view = good_view()
    held = view._held
    aside = ViewState()
    for rev, (k, value) in enumerate(GOOD.items(), start=200):
        outcome = aside.put(k, {"capacity": math.inf} if k == key else value, rev, before=held)
        assert isinstance(outcome, ProtocolError) == (k == key)
    assert aside._get(*parse_key(key)) == held._get(*parse_key(key))  # type: ignore[misc]
    assert set(aside.rejected) == {key} and aside.topology is not None and set(aside.topology.sites) == {"c", "e"}
    if key.startswith("live/"):
        assert aside.live_revision["e"] == held.live_revision["e"]
