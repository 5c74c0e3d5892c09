"""The batching window is bounded by the tightest deadline and the max window."""

import pytest

from edge_agent.batch_parts import batch_window_s

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("slacks", "compute", "max_window", "expected"),
    [
        ([], 0.001, 0.004, 0.0),                 # nothing queued: no window
        ([1.0], 0.001, 0.004, 0.004),            # lots of slack: the max window
        ([0.004], 0.001, 0.010, 0.002),          # slack 4 ms, compute 1 ms, safety 1 ms -> 2 ms
        ([0.050, 0.003], 0.001, 0.010, 0.001),   # the tightest request rules
        ([0.001], 0.002, 0.010, 0.0),            # already late: close now
    ],
)
def test_batch_window(slacks: list[float], compute: float, max_window: float, expected: float) -> None:
    assert batch_window_s(slacks, compute, max_window) == pytest.approx(expected)


def test_no_wait_when_no_companion_expected() -> None:
    # arrivals every 50 ms: holding a batch open for 4 ms only adds latency
    assert batch_window_s([1.0], 0.001, 0.004, expected_gap_s=0.050) == 0.0
    # arrivals every 0.5 ms: worth waiting
    assert batch_window_s([1.0], 0.001, 0.004, expected_gap_s=0.0005) == pytest.approx(0.004)
