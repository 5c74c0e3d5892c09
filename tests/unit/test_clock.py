"""The clock seam: wall-clock skew (tests only) moves ``wall()`` and nothing else; a query's
deadline crosses the wire as a budget, so a receiver's clock origin does not matter."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from mesh import clock
from mesh.errors import ConfigError
from mesh.types import SLO, InferRequest
from mesh.zmq import protocol as wire

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _fresh_offset() -> Iterator[None]:
    clock.set_wall_offset(None)
    yield
    clock.set_wall_offset(None)


def test_offset_env_skews_wall_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(clock.CLOCK_OFFSET_ENV, "-5.5")
    assert clock.wall_offset() == -5.5
    assert clock.wall() == pytest.approx(time.time() - 5.5, abs=0.5)
    assert clock.monotonic() == pytest.approx(time.monotonic(), abs=0.5)


@pytest.mark.parametrize("raw", ["soon", "inf", "nan"])
def test_bad_offset_is_a_config_error(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(clock.CLOCK_OFFSET_ENV, raw)
    with pytest.raises(ConfigError, match=clock.CLOCK_OFFSET_ENV):
        clock.wall()


def test_the_wire_carries_a_budget_not_an_instant() -> None:
    req = InferRequest.entering("t", {"x": np.ones((1, 2), np.float32)}, SLO(250.0), now=1000.0)
    # sender's wall clock an hour ahead: only the diagnostic sent_at shows it
    clock.set_wall_offset(3600.0)
    frames = wire.encode_request(req, now=1000.1)  # 150 ms of the budget left at send
    clock.set_wall_offset(0.0)
    got = wire.decode_request(frames, now=-42.0)  # the receiver's monotonic clock has its own origin
    assert got.deadline == pytest.approx(-42.0 + 0.150)
    assert got.remaining_ms(now=-42.0) == pytest.approx(150.0)
    assert got.sent_at == pytest.approx(time.time() + 3600.0, abs=5.0)
    # a budget kept back for the forward transit is subtracted at send
    held = wire.decode_request(wire.encode_request(req, now=1000.1, reserve_ms=20.0), now=0.0)
    assert held.remaining_ms(now=0.0) == pytest.approx(130.0)
