"""Which edge an SDK client asks next, and for how long: the failover policy of ``mesh.client``.

A device usually sees more than one edge (``Client([url_a, url_b])``, nearest first). A query goes to the first
edge that is not cooling down; it moves on to the next one only when the attempt's outcome says the query can be
asked again safely:

    outcome    what the client saw                                      next edge?   the edge
    REFUSED    no connection, or it was reset / refused at the TLS      yes          cools down
               handshake (``PeerUnavailable`` from the transport), or
               the edge's ``503 stalled`` (``EdgeStalled``: it was
               frozen while the query waited, and did not run it)
    SILENT     no answer within the attempt's wait (a frozen process,   yes          cools down
               a black-holed path: ``DeadlineExceeded`` from the
               transport, the client having closed the connection)
    ANSWERED   any HTTP reply, an error one included (4xx, 429, 5xx,    no           healthy again
               ``impossible_slo``, ``unknown_task``): a definite answer
               is the caller's, never asked again elsewhere

**Silence.** A query's latency budget (``latency_ms``) is its whole wait; an attempt that is not the last one
waits ``failover_share`` of it (default 1/3, :data:`FAILOVER_SHARE`), never less than :data:`MIN_SILENCE_S`, so a
failover leaves the next edge two thirds of the budget: a frozen first edge costs a query a third of its budget,
not the SLO. The last edge tried waits all that is left of the call's bound (the budget and the SDK's grace, or the
caller's ``timeout=``), as a client of one edge always did. A call without a budget (task metadata, health) takes
:data:`NO_BUDGET_S` for one. An edge is expected to answer within the budget (the mesh answers by the query's
deadline, or with an error); one that routinely answers later than a third of it (a best-effort answer, a budget
spent on a long path) is taken for silent: give such queries a larger share.

**Cool-down.** A failed edge is skipped for ``COOLDOWN_S`` x 2^(failures - 1), at most ``COOLDOWN_MAX_S``, with
equal jitter (``mesh.backoff``: half to all of it, so clients that saw one edge fail together do not all come back
at once). Then it is tried again, by one query at a time (a *probe*; concurrent queries keep to the other edges
until it answers): an answer makes it healthy, a failure cools it down for longer (the other queries that were in
flight when it failed fail with it: that is one failure, not one per query). When every edge is cooling down, a
query tries them all anyway, soonest-back first: a client never refuses to ask.

**One answer per call, one id per query.** The client sends every attempt of a query with the same request id (the
V2 ``id``: the caller's, else one it draws), abandons an attempt before it starts the next (its connection
closed), and returns the first answer: a call returns at most one answer. The retry is told only what is left of
the budget (``latency_ms`` minus the time spent), so the edge that answers routes it within the original deadline.
An abandoned edge that was frozen finds the query in its socket buffer when it wakes, and does not run it: it charges
a query that waited through its freeze from the freeze's start (``edge_agent.stall_watch``), so one whose budget the
freeze used up is refused ``stalled`` (``tests/system/test_sdk_frozen_edge.py``: none run). A fresh query that came
in just as the edge woke may get that answer too; it was not run either, and goes to the next edge.

The policy's functions are pure (no clock reads, no I/O: ``now`` and the jitter's draw are arguments) and
unit-tested as tables; :class:`EdgeHealthBook` keeps the per-edge state a client shares between its concurrent
queries, and :func:`first_answer` runs one query's attempts over it (the client supplies the attempt: the seam
to its transports, whichever protocol they speak).
"""

from __future__ import annotations

import enum
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Final, TypeVar

from mesh.backoff import Backoff
from mesh.errors import DeadlineExceeded, PeerUnavailable

__all__ = [
    "COOLDOWN_MAX_S",
    "COOLDOWN_S",
    "FAILOVER_SHARE",
    "MIN_SILENCE_S",
    "NO_BUDGET_S",
    "EdgeHealth",
    "EdgeHealthBook",
    "Outcome",
    "after",
    "attempt_wait",
    "classify",
    "first_answer",
    "order",
    "retry_budget_ms",
]

FAILOVER_SHARE: Final = 1.0 / 3.0  # of the query's latency budget, waited on an edge that is not the last one
MIN_SILENCE_S: Final = 0.005  # a budget of a few ms cannot tell silence from a scheduler's tick
# the budget of a call that has none (task metadata, health): an edge silent for its share (1 s) is passed over
NO_BUDGET_S: Final = 3.0
COOLDOWN_S: Final = 1.0  # the first cool-down of a failed edge, doubled per further failure ...
COOLDOWN_MAX_S: Final = 30.0  # ... up to this
T = TypeVar("T")


class Outcome(enum.Enum):
    ANSWERED = "answered"
    REFUSED = "refused"
    SILENT = "silent"


def classify(exc: BaseException | None) -> Outcome | None:
    """The outcome of an attempt that returned (None: ANSWERED) or raised ``exc``; None for an exception that is
    not the transport's word on the edge (a bug, a cancellation): it propagates, nothing is retried."""
    if exc is None:
        return Outcome.ANSWERED
    if isinstance(exc, PeerUnavailable):
        return Outcome.REFUSED
    if isinstance(exc, TimeoutError):  # DeadlineExceeded is one
        return Outcome.SILENT
    return None


@dataclass(frozen=True, slots=True)
class EdgeHealth:
    """One edge as a client sees it. ``down_until``: a monotonic instant (seconds) before which it is skipped;
    ``probing``: a query is trying it after a cool-down, and the others leave it alone until it knows."""

    failures: int = 0
    down_until: float = 0.0
    probing: bool = False

    def ready(self, now: float) -> bool:
        return self.down_until <= now and not self.probing


def after(health: EdgeHealth, outcome: Outcome, now: float, cooldown_s: float) -> EdgeHealth:
    """An edge's state after an attempt ended in ``outcome`` at ``now``; ``cooldown_s``: how long a failed edge is
    skipped (its ``Backoff``'s next delay)."""
    if outcome is Outcome.ANSWERED:
        return EdgeHealth()
    return EdgeHealth(health.failures + 1, now + cooldown_s)


def order(health: Sequence[EdgeHealth], now: float) -> list[int]:
    """The edges to try, in order: those not cooling down as the caller listed them (nearest first), then the
    rest by when their cool-down ends (a probe in flight counts as cooling)."""
    ready = [i for i, h in enumerate(health) if h.ready(now)]
    cooling = sorted((i for i, h in enumerate(health) if not h.ready(now)), key=lambda i: (health[i].down_until, i))
    return ready + cooling


def attempt_wait(left_s: float, budget_s: float, share: float, last: bool) -> float:
    """How long one attempt may wait for an answer: all that is ``left_s`` of the call's bound on the last edge,
    else ``share`` of the query's latency budget ``budget_s`` (at least :data:`MIN_SILENCE_S`), within what is
    left."""
    if last:
        return left_s
    return min(left_s, max(MIN_SILENCE_S, share * budget_s))


def retry_budget_ms(latency_ms: float, spent_s: float) -> float:
    """The latency budget a retry is sent with: what is left of the query's (at least 1 ms: the edge judges a
    spent budget and answers best effort or refuses, the client does not guess)."""
    return max(1.0, latency_ms - spent_s * 1000.0)


class EdgeHealthBook:
    """The health of a client's edges, shared by its concurrent queries (one event loop: no lock needed).

    ``plan(now)`` orders the edges for a query; ``claim(i, now)`` marks a cooled-down edge as being probed by
    this query (False when another query probes it already: skip it); ``record(i, outcome, now)`` after every
    attempt; ``release(i)`` when a query stops before its attempt on a claimed edge ended (cancelled)."""

    def __init__(self, n: int, *, draw: Callable[[], float] = random.random) -> None:
        if n < 1:
            raise ValueError("an SDK client needs at least one edge")
        self.health: list[EdgeHealth] = [EdgeHealth()] * n
        self._cooldowns = [Backoff(COOLDOWN_S, COOLDOWN_MAX_S, jitter="equal", rand=draw) for _ in range(n)]

    def plan(self, now: float) -> list[int]:
        return order(self.health, now)

    def claim(self, i: int, now: float) -> bool:
        h = self.health[i]
        if h.failures == 0:
            return True
        if h.probing:
            return False
        if h.down_until <= now:
            self.health[i] = replace(h, probing=True)
        return True

    def record(self, i: int, outcome: Outcome, now: float) -> None:
        h, cooldown = self.health[i], self._cooldowns[i]
        if outcome is Outcome.ANSWERED:
            cooldown.reset()
            self.health[i] = after(h, outcome, now, 0.0)
        elif h.down_until <= now:
            self.health[i] = after(h, outcome, now, cooldown.next())
        # else: one more of the queries that were in flight when it failed: the same failure, not a longer one

    def release(self, i: int) -> None:
        h = self.health[i]
        if h.probing:
            self.health[i] = replace(h, probing=False)


Attempt = Callable[[int, float, int], Awaitable[T]]


async def first_answer(book: EdgeHealthBook, attempt: Attempt[T], *, bound_s: float, budget_s: float, share: float,
                       what: str, clock: Callable[[], float] = time.monotonic) -> T:
    """Ask the edges in ``book``'s order until one answers: ``attempt(edge, wait_s, number)`` sends the query to
    ``edge`` and returns its reply, or raises ``PeerUnavailable`` / ``TimeoutError`` (``DeadlineExceeded``) when
    it refused or stayed silent for ``wait_s``; anything else it raises propagates. The call's whole wait is
    ``bound_s``; ``budget_s`` is the query's latency budget, of which a non-last attempt waits ``share``. Raises
    the last refusal when no edge answered and the last one refused, else ``DeadlineExceeded``."""
    start = clock()
    plan = book.plan(start)
    last_exc: BaseException | None = None
    tried = 0
    for n, i in enumerate(plan):
        now = clock()
        left = bound_s - (now - start)
        if left <= 0:
            break
        final = n == len(plan) - 1
        if not book.claim(i, now) and (tried or not final):
            continue  # another query is probing it: unless it is all there is left, keep to the others
        tried += 1
        try:
            out = await attempt(i, attempt_wait(left, budget_s, share, final), tried - 1)
        except BaseException as exc:
            outcome = classify(exc)
            if outcome is None:
                book.release(i)
                raise
            book.record(i, outcome, clock())
            last_exc = exc
            continue
        book.record(i, Outcome.ANSWERED, clock())
        return out
    if isinstance(last_exc, PeerUnavailable):
        raise last_exc
    raise DeadlineExceeded(f"{what}: no edge answered within {bound_s:.3f} s") from last_exc
