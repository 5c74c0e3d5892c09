"""mesh.backoff: the one back-off of the retry loops, as tables of delays under a replayed draw."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from mesh.backoff import Backoff, Jitter

pytestmark = pytest.mark.unit


def _draws(*values: float) -> Callable[[], float]:
    it: Iterator[float] = iter(values)
    return lambda: next(it)


@pytest.mark.parametrize(("jitter", "draws", "want"), [
    ("none", (), [0.1, 0.2, 0.4, 0.5, 0.5]),
    ("full", (0.5, 0.5, 0.5, 0.0, 0.999), [0.05, 0.1, 0.2, 0.0, 0.4995]),
    ("equal", (0.0, 0.0, 0.5, 1.0 - 1e-9, 0.0), [0.05, 0.1, 0.3, 0.5, 0.25]),
    # base + u x (3 x last - base), capped: 0.1 + 0.5 x 0.2 = 0.2; 0.1 + 0.5 x 0.5 = 0.35; then the cap
    ("decorrelated", (0.5, 0.5, 1.0, 0.0, 0.0), [0.2, 0.35, 0.5, 0.1, 0.1]),
])
def test_delays_by_jitter(jitter: Jitter, draws: tuple[float, ...], want: list[float]) -> None:
    b = Backoff(0.1, 0.5, jitter=jitter, rand=_draws(*draws))
    assert [b.next() for _ in want] == pytest.approx(want)
    assert b.attempts == len(want)


def test_reset_starts_over_and_factor_sets_the_growth() -> None:
    b = Backoff(1.0, 100.0, factor=3.0, jitter="none")
    assert [b.next() for _ in range(4)] == [1.0, 3.0, 9.0, 27.0]
    b.reset()
    assert b.attempts == 0 and b.next() == 1.0
    steady = Backoff(2.0, 2.0, jitter="none")
    assert {steady.next() for _ in range(5)} == {2.0}


def test_every_jitter_stays_within_zero_and_the_cap_whatever_the_draw() -> None:
    for jitter in ("full", "equal", "decorrelated", "none"):
        for u in (0.0, 0.25, 0.999999):
            b = Backoff(0.05, 2.0, jitter=jitter, rand=lambda u=u: u)  # type: ignore[misc]
            for _ in range(20):
                assert 0.0 <= b.next() <= 2.0


def test_the_default_draw_spreads_a_crowd() -> None:
    firsts = {Backoff(0.1, 1.0).next() for _ in range(50)}
    assert len(firsts) > 40 and all(0.05 <= d < 0.1 for d in firsts)  # equal jitter: half to all of the step


@pytest.mark.parametrize(("args", "kwargs", "match"), [
    ((0.0, 1.0), {}, "0 < base_s"),
    ((2.0, 1.0), {}, "0 < base_s"),
    ((0.1, 1.0), {"factor": 0.5}, "factor"),
    ((0.1, 1.0), {"jitter": "gaussian"}, "unknown jitter"),
])
def test_bad_settings_are_refused(args: tuple[float, float], kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Backoff(*args, **kwargs)  # type: ignore[arg-type]
