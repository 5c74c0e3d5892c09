"""A mixed, labelled workload through the SDK, and its report.

SLO classes differ in latency budget and minimum accuracy; each query sends one real digits image
from the held-out set, so the accuracy *delivered* is measured against its label. Every sending
loop is bounded in count and in time. Latency for SLO attainment is the edge-measured end-to-end
time (``timing.total_ms``: from the edge's receipt to its reply, which is what the SLO promises);
client-observed latency (adds the SDK's loopback HTTP) is reported beside it.

Each SLO class speaks as its tenant: one SDK client per (edge, tenant). Against mutual-TLS edges
``credentials(tenant)`` gives that tenant's ``cert``/``key``/``ca`` files (``LocalMesh.tenant_files``);
without it the tenant rides in the header (``--insecure`` agents).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mesh.client import AsyncClient
from mesh.errors import MeshError
from mesh.types import DEFAULT_PREFER

if TYPE_CHECKING:  # rich is not in every install that runs a workload
    from tiermesh.tables import FitTable

__all__ = ["DEFAULT_CLASSES", "TEXT_CLASS", "QueryRecord", "SdkClients", "SloClass", "WarmUp", "by_edge", "infer_one",
           "render_edges", "render_table", "run_workload", "summarise", "warm_up"]


@dataclass(frozen=True, slots=True)
class SloClass:
    name: str
    latency_ms: float
    min_accuracy: float
    share: float                  # fraction of the offered queries
    prefer: str = DEFAULT_PREFER
    tenant: str = "public"
    task: str = "digit-classification"   # any other task draws its rows from ``run_workload(data=...)``
    rows: int = 1                 # rows per request (a batch in one query); its first row's answer is scored


DEFAULT_CLASSES = (
    SloClass("tight", latency_ms=10, min_accuracy=0.90, share=0.4),
    SloClass("balanced", latency_ms=60, min_accuracy=0.97, share=0.3),
    SloClass("accurate", latency_ms=400, min_accuracy=0.985, share=0.3),
)
# acme's topic classification of package descriptions (the text family: a MiniLM encoder shared with
# globex's head); 0.70 admits the 6-layer encoders only (the 2-3-layer ones measure 0.66-0.68)
TEXT_CLASS = SloClass("text", latency_ms=300, min_accuracy=0.70, share=0.2, tenant="acme", task="text-topic")


@dataclass(slots=True)
class QueryRecord:
    slo_class: str
    edge: str
    budget_ms: float
    label: int
    ok: bool
    client_ms: float
    total_ms: float = 0.0
    site: str = ""
    variant: str = ""
    accuracy: float = 0.0         # what the mesh promised for the variant that served it
    predicted: int = -1
    best_effort: bool = False
    reason: str = ""
    error: str = ""
    t: float = 0.0
    min_accuracy: float = 0.0     # the class's accuracy floor
    request_id: str = ""          # what the query was sent as ...
    reply_id: str = ""            # ... and what its answer said it answered ("" when it failed)
    # the answering edge's account of ``total_ms`` (mesh.types.Timing): time on the network, in a queue, computing
    network_ms: float = 0.0
    queue_ms: float = 0.0
    compute_ms: float = 0.0

    @property
    def met(self) -> bool:
        """Its SLO was met: answered within the budget, not as best effort (which keeps no promise)."""
        return self.ok and self.total_ms <= self.budget_ms and not self.best_effort


@dataclass(slots=True)
class WorkloadResult:
    records: list[QueryRecord] = field(default_factory=list)
    duration_s: float = 0.0


async def infer_one(client: AsyncClient, cls: SloClass, edge: str, x: Any, label: int, t0: float,
                    request_id: str | None = None) -> QueryRecord:
    """One query of ``cls`` (``x``: its rows — digits, or texts; the first row's answer is scored) and what became
    of it."""
    start = time.perf_counter()
    rid = request_id or ""
    try:
        res = await client.infer(cls.task, x, latency_ms=cls.latency_ms,
                                 min_accuracy=cls.min_accuracy, prefer=cls.prefer, request_id=request_id)
    except MeshError as exc:
        return QueryRecord(cls.name, edge, cls.latency_ms, label, False,
                           (time.perf_counter() - start) * 1000, error=exc.code, t=start - t0,
                           min_accuracy=cls.min_accuracy, request_id=rid)
    out = res.output()
    return QueryRecord(cls.name, edge, cls.latency_ms, label, True, (time.perf_counter() - start) * 1000,
                       total_ms=res.timing.total_ms, site=res.site, variant=res.variant,
                       accuracy=res.accuracy, predicted=int(np.argmax(out[0])), best_effort=res.best_effort,
                       reason=res.reason, t=start - t0, min_accuracy=cls.min_accuracy, request_id=rid,
                       reply_id=res.request_id, network_ms=res.timing.network_ms, queue_ms=res.timing.queue_ms,
                       compute_ms=res.timing.compute_ms)


def _client(url: str, tenant: str, credentials: Callable[[str], Mapping[str, Path]] | None) -> AsyncClient:
    if credentials is None:
        return AsyncClient(url, timeout=10, tenant=tenant)
    files = credentials(tenant)
    return AsyncClient(url, timeout=10, cert=files["cert"], key=files["key"], ca=files["ca"])


class SdkClients:
    """One SDK client per (edge, tenant). Passed to :func:`warm_up` and then to the :func:`run_workload` it warms,
    the run starts on the warm-up's connections and task metadata, as a long-lived application would; closed by
    ``aclose`` (or ``async with``)."""

    def __init__(self, edges: Mapping[str, str], tenants: Iterable[str],
                 credentials: Callable[[str], Mapping[str, Path]] | None = None) -> None:
        names = sorted(set(tenants))
        self._clients = {(e, t): _client(url, t, credentials) for e, url in edges.items() for t in names}

    def __getitem__(self, edge_tenant: tuple[str, str]) -> AsyncClient:
        return self._clients[edge_tenant]

    @classmethod
    def given_or_own(cls, clients: SdkClients | None, edges: Mapping[str, str], classes: tuple[SloClass, ...],
                     credentials: Callable[[str], Mapping[str, Path]] | None) -> tuple[SdkClients, bool]:
        """``clients`` (checked to cover every edge and class's tenant), else new ones; and whether they are new
        (the caller's to close)."""
        if clients is None:
            return cls(edges, (c.tenant for c in classes), credentials), True
        missing = sorted({(e, c.tenant) for e in edges for c in classes} - set(clients._clients))
        if missing:
            raise ValueError(f"no SDK client for (edge, tenant) {missing}")
        return clients, False

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()

    async def __aenter__(self) -> SdkClients:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


Labelled = tuple[np.ndarray, np.ndarray]  # rows and their labels


def _labelled_rows(x: np.ndarray, y: np.ndarray, classes: tuple[SloClass, ...],
                   data: Mapping[str, Labelled] | None) -> dict[str, Labelled]:
    rows = {"digit-classification": (x, y), **(data or {})}
    missing = sorted({c.task for c in classes} - set(rows))
    if missing:
        raise ValueError(f"no labelled rows for task(s) {missing}: pass them in data=")
    return rows


@dataclass(frozen=True, slots=True)
class WarmUp:
    """What warming one SLO class took: ``queries`` sent over ``seconds`` until every edge had answered one within
    the class's SLO (``ready``; False: the timeout came first), and the errors met on the way."""
    queries: int
    seconds: float
    ready: bool
    errors: dict[str, int]


async def warm_up(edges: dict[str, str], x: np.ndarray, y: np.ndarray, *, classes: tuple[SloClass, ...],
                  credentials: Callable[[str], Mapping[str, Path]] | None = None,
                  data: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
                  timeout_s: float = 30.0, interval_s: float = 0.25,
                  clients: SdkClients | None = None) -> dict[str, WarmUp]:
    """Before a measured run: one query per (class, edge) per round, ``interval_s`` apart, until every edge has
    answered each class within its SLO (not best effort), or ``timeout_s``. A tenant's private task is placed
    when its first demand arrives; this is that demand, and the connections' set-up, kept out of the measure
    (and reported: what each class took). Bounded: at most one query per class and edge per round."""
    rows = _labelled_rows(x, y, classes, data)
    sdk, own = SdkClients.given_or_own(clients, edges, classes, credentials)
    waiting = {(c.name, e) for c in classes for e in edges}
    sent: Counter[str] = Counter()
    errors: dict[str, Counter[str]] = {c.name: Counter() for c in classes}
    done_at: dict[str, float] = {}
    t0 = time.perf_counter()
    try:
        while waiting and time.perf_counter() - t0 < timeout_s:
            round_start = time.perf_counter()
            jobs = [(c, e) for c in classes for e in sorted(edges) if (c.name, e) in waiting]
            recs = await asyncio.gather(*(
                infer_one(sdk[(e, c.tenant)], c, e, rows[c.task][0][:c.rows], int(rows[c.task][1][0]), t0)
                for c, e in jobs))
            for (c, e), rec in zip(jobs, recs, strict=True):
                sent[c.name] += 1
                if not rec.ok:
                    errors[c.name][rec.error] += 1
                elif rec.met:
                    waiting.discard((c.name, e))
            for c in classes:
                if c.name not in done_at and not any(n == c.name for n, _ in waiting):
                    done_at[c.name] = time.perf_counter() - t0
            if waiting:
                await asyncio.sleep(max(0.0, interval_s - (time.perf_counter() - round_start)))
    finally:
        if own:
            await sdk.aclose()
    elapsed = time.perf_counter() - t0
    return {c.name: WarmUp(sent[c.name], done_at.get(c.name, elapsed), c.name in done_at, dict(errors[c.name]))
            for c in classes}


async def run_workload(edges: dict[str, str], x: np.ndarray, y: np.ndarray, *, duration_s: float,
                       qps: float, classes: tuple[SloClass, ...] = DEFAULT_CLASSES, seed: int = 7,
                       max_queries: int = 20_000, max_inflight: int = 64, on_tick: Any = None,
                       credentials: Callable[[str], Mapping[str, Path]] | None = None,
                       data: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
                       request_ids: bool = False, clients: SdkClients | None = None) -> WorkloadResult:
    """Open-loop arrivals at ``qps`` spread over ``edges`` for ``duration_s`` (bounded by ``max_queries``).
    ``x``, ``y`` are the digits rows; ``data`` gives other tasks' labelled rows (``task -> (x, y)``).
    ``request_ids``: send each query under an id of its own (``w<seed>-<n>``) and record the id its answer
    names, so that an answer to the wrong query shows (the SDK then encodes each request in full).
    ``clients``: the SDK clients to send through (a warm-up's; the caller closes them), else the run's own."""
    rows = _labelled_rows(x, y, classes, data)
    rng = random.Random(seed)
    weights = [c.share for c in classes]
    sdk, own = SdkClients.given_or_own(clients, edges, classes, credentials)
    sem = asyncio.Semaphore(max_inflight)
    result = WorkloadResult()
    tasks: set[asyncio.Task[None]] = set()
    t0 = time.perf_counter()

    async def fire(cls: SloClass, edge: str, i: int, n: int) -> None:
        async with sem:
            cx, cy = rows[cls.task]
            j = i % max(1, len(cx) - cls.rows + 1)
            rec = await infer_one(sdk[(edge, cls.tenant)], cls, edge, cx[j:j + cls.rows], int(cy[j]), t0,
                                  f"w{seed}-{n}" if request_ids else None)
            result.records.append(rec)

    try:
        n = 0
        next_at = t0
        while n < max_queries and (now := time.perf_counter()) - t0 < duration_s:
            if now < next_at:
                await asyncio.sleep(next_at - now)
            next_at += rng.expovariate(qps)
            cls = rng.choices(classes, weights)[0]
            edge = rng.choice(sorted(edges))
            i = rng.randrange(len(x))
            t = asyncio.create_task(fire(cls, edge, i, n))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            n += 1
            if on_tick is not None:
                on_tick(n, time.perf_counter() - t0)
        if tasks:
            await asyncio.wait(tasks, timeout=30)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if own:
            await sdk.aclose()
    result.duration_s = time.perf_counter() - t0
    return result


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarise(records: list[QueryRecord], tiers: Mapping[str, str]) -> dict[str, Any]:
    """Per SLO class: where served, by which variants, latency percentiles, attainment, accuracy."""
    out: dict[str, Any] = {}
    for name in sorted({r.slo_class for r in records}):
        rs = [r for r in records if r.slo_class == name]
        ok = [r for r in rs if r.ok]
        met = [r for r in ok if r.met]
        out[name] = {
            "queries": len(rs),
            "budget_ms": rs[0].budget_ms,
            "errors": dict(Counter(r.error for r in rs if not r.ok)),
            "served_at_tier": dict(Counter(tiers.get(r.site, "?") for r in ok)),
            "served_locally_at_edge": sum(1 for r in ok if r.site == r.edge),
            "variants": dict(Counter(r.variant for r in ok).most_common()),
            "p50_ms": _pct([r.total_ms for r in ok], 50),
            "p99_ms": _pct([r.total_ms for r in ok], 99),
            "client_p50_ms": _pct([r.client_ms for r in ok], 50),
            "client_p99_ms": _pct([r.client_ms for r in ok], 99),
            "slo_attainment": len(met) / len(rs) if rs else 0.0,
            "best_effort": sum(1 for r in ok if r.best_effort),
            "accuracy": (sum(1 for r in ok if r.predicted == r.label) / len(ok)) if ok else 0.0,
        }
    return out


def by_edge(records: list[QueryRecord]) -> dict[str, dict[str, Any]]:
    """Per edge the queries arrived at, per SLO class: how many, SLO attainment, p99 of the answered, errors
    (which edge a class suffers at: a capped edge, or one far from where its class is served)."""
    out: dict[str, dict[str, Any]] = {}
    for edge in sorted({r.edge for r in records}):
        out[edge] = {}
        for name in sorted({r.slo_class for r in records if r.edge == edge}):
            rs = [r for r in records if r.edge == edge and r.slo_class == name]
            ok = [r for r in rs if r.ok]
            met = sum(1 for r in ok if r.met)
            out[edge][name] = {"queries": len(rs), "slo_attainment": met / len(rs),
                               "p99_ms": _pct([r.total_ms for r in ok], 99),
                               "best_effort": sum(1 for r in ok if r.best_effort),
                               "errors": dict(Counter(r.error for r in rs if not r.ok))}
    return out


def render_edges(edges: dict[str, dict[str, Any]]) -> FitTable:
    """SLO met per edge (rows) and class (columns); a cell is ``attainment (queries)``."""
    from tiermesh.tables import FitTable

    classes = sorted({c for per in edges.values() for c in per})
    rows = [[edge, *(f"{100 * per[c]['slo_attainment']:.1f} % ({per[c]['queries']})" if c in per else None
                     for c in classes)] for edge, per in edges.items()]
    return FitTable("SLO met per edge", ["edge", *classes], rows)


def render_table(summary: dict[str, Any]) -> FitTable:
    """Per SLO class: what it asked, where it was served, how fast, how often within its SLO."""
    from tiermesh.tables import FitTable

    rows = []
    for name, s in summary.items():
        tiers = ", ".join(f"{k}:{v}" for k, v in sorted(s["served_at_tier"].items()))
        variants = ", ".join(f"{k}:{v}" for k, v in list(s["variants"].items())[:2])
        errors = ", ".join(f"{k}:{v}" for k, v in s["errors"].items()) or None
        rows.append([name, f"{s['budget_ms']:.0f} ms", str(s["queries"]), tiers, variants, f"{s['p50_ms']:.1f}",
                     f"{s['p99_ms']:.1f}", f"{100 * s['slo_attainment']:.1f} %", f"{100 * s['accuracy']:.1f} %",
                     errors])
    return FitTable("tiermesh workload, per SLO class",
                    ["class", "budget", "queries", "served at", "top variants", "p50 ms", "p99 ms", "SLO met",
                     "accuracy", "errors"], rows)
