"""A geo trace (several tenants, edges in different regions, a compressed diurnal day, a spike at
one region with a ramp before its cliff, mixed SLO classes) and an open-loop replay of it through
the SDK.

The trace is a deterministic tuple of :class:`TraceEvent` (time, edge, SLO class, holdout sample)
drawn from a seed, bounded in count, so every system under test is offered exactly the same
queries at the same offsets. Arrivals are non-homogeneous Poisson (thinning): each edge follows
``base + (peak - base) x (1 - cos 2pi (t / day - phase)) / 2`` with its region's phase, and the
spike adds one class at one edge, rising linearly from ``ramp_start_s`` to ``cliff_s`` (what a
forecaster can see coming), then jumping to ``cliff_qps`` until ``spike_end_s``. A
:class:`DailyPeak` instead adds one class at one edge for a fixed window of every day (what a
seasonal forecaster can learn from the days before; the cold-start benchmark).

The replay sends each event at its offset (never waits on replies: open loop), with at most
``max_inflight`` outstanding; every record keeps its wall-clock send time so it can be matched
with agents' load events.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mesh.client import AsyncClient
from mesh.errors import MeshError
from tiermesh.workload import SloClass

__all__ = ["GEO_CLASSES", "DailyPeak", "Replayed", "Spike", "Trace", "TraceEvent", "TraceSpec", "make_trace",
           "open_loop", "peak_windows", "replay"]

TASK = "digit-classification"

# tight: only an edge meets it; balanced: an edge only with a better-than-floor variant, else a
# near middle; accurate: anywhere but needs the large CNN; acme's class can use its private head;
# accurate-first states prefer="accuracy" so a miss is served best-effort by the best model.
GEO_CLASSES: tuple[SloClass, ...] = (
    SloClass("tight", latency_ms=10, min_accuracy=0.90, share=0.35),
    SloClass("balanced", latency_ms=60, min_accuracy=0.97, share=0.25),
    SloClass("accurate", latency_ms=400, min_accuracy=0.985, share=0.2),
    SloClass("acme-balanced", latency_ms=40, min_accuracy=0.97, share=0.1, tenant="acme"),
    SloClass("acme-accurate-first", latency_ms=150, min_accuracy=0.985, share=0.1, prefer="accuracy",
             tenant="acme"),
)


@dataclass(frozen=True, slots=True)
class TraceEvent:
    t: float          # seconds from the start of the replay
    edge: str
    slo_class: str
    sample: int       # row of the holdout set sent (its label scores the answer)


@dataclass(frozen=True, slots=True)
class Spike:
    edge: str
    slo_class: str
    ramp_start_s: float
    cliff_s: float
    spike_end_s: float
    ramp_qps: float   # reached at the cliff
    cliff_qps: float


@dataclass(frozen=True, slots=True)
class DailyPeak:
    """One class at one edge that arrives once per compressed day: from ``start_s`` into each day,
    ``qps`` for ``length_s``, nothing the rest of the day (a morning rush at one region). The peak
    opens with ``burst`` extra queries ``burst_gap_s`` apart (a fleet of devices waking at the same
    minute): what a cold start at the onset costs is then visible beyond the single first query."""

    edge: str
    slo: SloClass
    start_s: float
    length_s: float
    qps: float
    burst: int = 0
    burst_gap_s: float = 0.01


def peak_windows(spec: TraceSpec) -> list[tuple[float, float]]:
    """(start, end) of every daily peak of ``spec`` that begins within the trace."""
    pk = spec.peaks
    if pk is None:
        return []
    out: list[tuple[float, float]] = []
    k = 0
    while k * spec.day_s + pk.start_s < spec.duration_s:
        start = k * spec.day_s + pk.start_s
        out.append((start, min(spec.duration_s, start + pk.length_s)))
        k += 1
    return out


@dataclass(frozen=True, slots=True)
class TraceSpec:
    edges: tuple[str, ...]
    duration_s: float
    day_s: float
    base_qps: float          # per edge, at night
    peak_qps: float          # per edge, at its noon
    spike: Spike | None = None
    classes: tuple[SloClass, ...] = GEO_CLASSES
    phases: dict[str, float] = field(default_factory=dict)  # edge -> fraction of a day; default spread
    seed: int = 11
    max_events: int = 20_000
    # classes the diurnal base offers at the spike's edge (None: all); leaving the spike's class
    # (and any class whose variants would also serve it) out makes the spike land on cold variants
    spike_edge_classes: tuple[str, ...] | None = None
    peaks: DailyPeak | None = None  # a class recurring once per day at one edge (cold-start bench)


@dataclass(frozen=True, slots=True)
class Trace:
    spec: TraceSpec
    events: tuple[TraceEvent, ...]

    def classes(self) -> dict[str, SloClass]:
        out = {c.name: c for c in self.spec.classes}
        if self.spec.peaks is not None:
            out[self.spec.peaks.slo.name] = self.spec.peaks.slo
        return out


def _phase(spec: TraceSpec, i: int, edge: str) -> float:
    return spec.phases.get(edge, i / max(1, len(spec.edges)))


def edge_rate(spec: TraceSpec, edge: str, t: float) -> float:
    """Diurnal arrival rate (qps) at ``edge`` at time ``t``."""
    i = spec.edges.index(edge)
    x = t / spec.day_s - _phase(spec, i, edge)
    return spec.base_qps + (spec.peak_qps - spec.base_qps) * (1.0 - math.cos(2.0 * math.pi * x)) / 2.0


def spike_rate(spike: Spike, t: float) -> float:
    if t < spike.ramp_start_s or t >= spike.spike_end_s:
        return 0.0
    if t < spike.cliff_s:
        span = max(1e-9, spike.cliff_s - spike.ramp_start_s)
        return spike.ramp_qps * (t - spike.ramp_start_s) / span
    return spike.cliff_qps


def _thin(rng: np.random.Generator, peak: float, duration: float, rate_at: object) -> list[float]:
    """Non-homogeneous Poisson arrivals by thinning a rate-``peak`` process."""
    assert callable(rate_at)
    out: list[float] = []
    if peak <= 0:
        return out
    t = 0.0
    while True:
        t += float(rng.exponential(1.0 / peak))
        if t >= duration:
            return out
        if rng.random() * peak <= rate_at(t):
            out.append(t)


def make_trace(spec: TraceSpec, n_samples: int) -> Trace:
    """The deterministic trace of ``spec``; samples index ``range(n_samples)`` (the caller's holdout)."""
    rng = np.random.default_rng(spec.seed)
    events: list[TraceEvent] = []
    for edge in spec.edges:
        offered = [c for c in spec.classes if spec.spike is None or edge != spec.spike.edge
                   or spec.spike_edge_classes is None or c.name in spec.spike_edge_classes]
        names = [c.name for c in offered]
        shares = np.array([c.share for c in offered], dtype=float)
        shares /= shares.sum()
        for t in _thin(rng, max(spec.base_qps, spec.peak_qps), spec.duration_s,
                       lambda t, e=edge: edge_rate(spec, e, t)):
            cls = names[int(rng.choice(len(names), p=shares))]
            events.append(TraceEvent(round(t, 6), edge, cls, int(rng.integers(n_samples))))
    sp = spec.spike
    if sp is not None:
        for t in _thin(rng, max(sp.ramp_qps, sp.cliff_qps), spec.duration_s, lambda t: spike_rate(sp, t)):
            events.append(TraceEvent(round(t, 6), sp.edge, sp.slo_class, int(rng.integers(n_samples))))
    pk = spec.peaks
    if pk is not None:
        for start, end in peak_windows(spec):
            onset = [pk.burst_gap_s * i for i in range(pk.burst)]
            for t in onset + _thin(rng, pk.qps, end - start, lambda t: pk.qps):
                events.append(TraceEvent(round(start + t, 6), pk.edge, pk.slo.name, int(rng.integers(n_samples))))
    events.sort(key=lambda e: (e.t, e.edge, e.slo_class, e.sample))
    return Trace(spec, tuple(events[: spec.max_events]))


@dataclass(slots=True)
class Replayed:
    """One query's outcome. ``sent_wall`` is ``time.time()`` at send (matches agents' log clocks)."""

    event: TraceEvent
    tenant: str
    budget_ms: float
    label: int
    sent_wall: float
    ok: bool = False
    error: str = ""
    total_ms: float = math.nan
    client_ms: float = math.nan
    compute_ms: float = 0.0
    site: str = ""
    variant: str = ""
    reason: str = ""
    best_effort: bool = False
    correct: bool = False

    @property
    def slo_met(self) -> bool:
        """Served within the budget by a variant that met the accuracy floor (not best effort)."""
        return self.ok and not self.best_effort and self.total_ms <= self.budget_ms


async def replay(trace: Trace, edges: dict[str, str], x: np.ndarray, y: np.ndarray | Sequence[int], *,
                 max_inflight: int = 64, timeout_s: float = 10.0, drain_s: float = 20.0,
                 data: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None) -> list[Replayed]:
    """Offer every event of ``trace`` to its edge's HTTP URL at its offset; bounded in flight.

    ``x``, ``y``: the digits holdout; ``data``: (inputs, labels) of other tasks, by task (a class's
    ``task``); an event's sample indexes its task's rows modulo their count. Text rows are BYTES
    (a 1-D object array): one row is sent as a one-element BYTES tensor."""
    classes = trace.classes()
    sets = {TASK: (x, np.asarray(y)), **(data or {})}
    tenants = sorted({c.tenant for c in classes.values()})
    clients = {(e, t): AsyncClient(url, tenant=t, timeout=timeout_s) for e, url in edges.items() for t in tenants}
    sem = asyncio.Semaphore(max_inflight)
    out: list[Replayed] = []

    async def one(ev: TraceEvent) -> None:
        cls = classes[ev.slo_class]
        xs, ys = sets[cls.task]
        i = ev.sample % len(xs)
        row = xs[i][None, :] if xs.ndim > 1 else np.array([xs[i]], dtype=object)
        async with sem:
            rec = Replayed(ev, cls.tenant, cls.latency_ms, int(ys[i]), time.time())
            start = time.perf_counter()
            try:
                res = await clients[(ev.edge, cls.tenant)].infer(
                    cls.task, row, latency_ms=cls.latency_ms, min_accuracy=cls.min_accuracy, prefer=cls.prefer)
            except MeshError as exc:
                rec.error = exc.code
            else:
                rec.ok = True
                rec.total_ms = res.timing.total_ms
                rec.compute_ms = res.timing.compute_ms
                rec.site, rec.variant, rec.reason = res.site, res.variant, res.reason
                rec.best_effort = res.best_effort
                rec.correct = int(np.argmax(res.output()[0])) == rec.label
            rec.client_ms = (time.perf_counter() - start) * 1000.0
            out.append(rec)

    try:
        await open_loop([ev for ev in trace.events if ev.edge in edges], one, drain_s)
    finally:
        for c in clients.values():
            await c.aclose()
    out.sort(key=lambda r: r.event.t)
    return out


async def open_loop(events: Sequence[Any], one: Callable[[Any], Coroutine[Any, Any, None]], drain_s: float) -> None:
    """Start ``one(ev)`` for each event at its offset ``ev.t`` (seconds from now), never waiting for an answer
    (open loop); then wait at most ``drain_s`` for those in flight, and cancel what is left: bounded by the trace's
    length plus ``drain_s``, every task owned."""
    tasks: set[asyncio.Task[None]] = set()
    t0 = time.perf_counter()
    try:
        for ev in events:
            delay = t0 + ev.t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(ev))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(set(tasks), timeout=drain_s)
    finally:
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
