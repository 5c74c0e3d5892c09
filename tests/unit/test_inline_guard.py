"""``edge_agent.inline_guard.InlineGuard``: the back-off of inline runs, as a table of timed runs."""

from __future__ import annotations

import pytest

from edge_agent.inline_guard import (
    INLINE_BACKOFF_S,
    INLINE_BLOCK_MS,
    INLINE_CLEAN_RUNS,
    INLINE_STALL_MS,
    InlineGuard,
)

pytestmark = pytest.mark.unit
FAST, SLOW, BLOCKING = INLINE_STALL_MS / 2, INLINE_STALL_MS * 3, INLINE_BLOCK_MS * 2


def test_one_blocking_run_between_fast_ones_is_a_preempted_thread() -> None:
    g = InlineGuard()
    assert [g.ran(ms, 0.0) for ms in (FAST, BLOCKING, FAST, BLOCKING, FAST)] == [0.0] * 5
    assert g.allows(0.0)


def test_two_blocking_runs_in_a_row_back_off_doubling_until_runs_stay_clean() -> None:
    g = InlineGuard()
    assert g.ran(BLOCKING, 10.0) == 0.0
    assert g.ran(BLOCKING, 10.0) == INLINE_BACKOFF_S
    assert not g.allows(10.0 + INLINE_BACKOFF_S / 2) and g.allows(10.0 + INLINE_BACKOFF_S)
    g.ran(BLOCKING, 20.0)
    assert g.ran(BLOCKING, 20.0) == 2 * INLINE_BACKOFF_S  # the next back-off is twice as long
    for _ in range(INLINE_CLEAN_RUNS):
        g.ran(FAST, 30.0)
    g.ran(BLOCKING, 40.0)
    assert g.ran(BLOCKING, 40.0) == INLINE_BACKOFF_S  # a clean spell forgave the past


def test_slow_runs_as_the_rule_back_off_after_six_in_a_row() -> None:
    g = InlineGuard()
    started = [g.ran(SLOW, 0.0) for _ in range(6)]
    assert started == [0.0] * 5 + [INLINE_BACKOFF_S]
