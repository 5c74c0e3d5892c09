"""LinkShape is pure: delay within jitter bounds, never negative."""

import random

import pytest

from mesh.errors import ConfigError
from tiermesh.delayproxy import DelayProxy, LinkShape

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("lat", "jit"), [(0, 0), (10, 0), (10, 3), (1, 5)])
def test_delay_within_bounds(lat: float, jit: float) -> None:
    rng = random.Random(1)
    shape = LinkShape(latency_ms=lat, jitter_ms=jit)
    for _ in range(200):
        d = shape.delay_s(rng) * 1000
        assert max(0.0, lat - jit) - 1e-9 <= d <= lat + jit + 1e-9


def test_refuses_non_loopback() -> None:
    with pytest.raises(ConfigError):
        DelayProxy("10.0.0.1", 80, forward=LinkShape())
    with pytest.raises(ConfigError):
        DelayProxy("127.0.0.1", 80, forward=LinkShape(), listen_host="0.0.0.0")
