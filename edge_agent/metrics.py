"""An agent's Prometheus metrics: what its door answered, what it served, and its state at scrape time.

Cheap on the query path: a query adds to plain Python counters and histogram buckets keyed by a label
tuple (a dict lookup and an add, all on the event loop's thread), and they are written as Prometheus text
only when ``/metrics`` is scraped (:meth:`AgentMetrics.render`, with :mod:`edge_agent.exposition`; each agent
has its own, so several agents can share a process). Gauges (loaded variants, memory, queues, peers, etcd) are
read from the agent at scrape time, not kept up to date per query.

Counted once per query, at the door that received it (HTTP, SDK, a ZeroMQ caller):
``tiermesh_requests_total{task,tenant,site,variant,outcome,reason}`` (outcome ``ok`` or the error code;
reason the routing reason code, ``none`` for an error), ``tiermesh_slo_total{tenant,slo_class,result}``
and ``tiermesh_request_latency_seconds{task,component}`` (``total``: the whole time from the query's entry, so a
late answer is ``missed``), and ``tiermesh_door_delay_seconds{task}``: the door's own delay from a query's entry
to its first routing decision (a busy loop, a capped CPU), which is not the path's nor the SLO's fault.
Counted where a query runs (its door or the
site it was forwarded to): ``tiermesh_served_total{task,tenant,site,variant,role}`` and the
Triton-compatible ``nv_inference_*`` counters (model = variant, version ``1``), written as Triton writes
them (no ``_total`` suffix), so existing dashboards work. Cascades (issue 33), at the door that ran one:
``tiermesh_cascade_queries_total{task,site,answered}`` (``local``: stage 1 answered every row; ``escalated``)
and ``tiermesh_cascade_rows_total{task,site,stage}`` (rows answered by each stage): the escalation rate per site.
Pipelines (issue 33), at the door that ran one: ``tiermesh_pipeline_queries_total{task,site,outcome}`` (``ok`` or the
error code) and ``tiermesh_pipeline_stage_seconds{task,stage,stage_task}``: each stage's time as the door saw it, from
its send to its answer (``StageInfo.total_ms``; a Switch's branches are stage 2, each under its own task).
Versions of tenants' tasks (issue 34 item 3), where a query runs, like ``tiermesh_served``:
``tiermesh_version_queries_total{task,tenant,site,version}``, the version of the catalogued variant that served it
(``VariantMeta.version``; the door's pick, a ``parameters.version`` pin or a split's draw, all end on one variant).
Public variants have no versions (every one is ``1``) and are not counted there; a cascade's stages run as queries
of their own, so each stage that ran counts.

Cardinality is bounded: tasks, tenants, sites and variants are those of the mesh's view (anything else
is ``other``), outcomes are error codes, reasons routing's codes; no request ids. A pipeline's task is one of the
view's (the door runs no other), its stages numbered 1 to ``MAX_STAGES``. A version is that of a variant
in the view (each catalogued variant has one), so it is bounded by the catalog; an unknown variant's is ``other``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from core_scheduler.policy.routing import REASONS
from edge_agent.cascade_exec import ESCALATED
from edge_agent.cascade_exec import REASONS as CASCADE_REASONS
from edge_agent.demand import slo_class
from edge_agent.exposition import counter, escape, gauge, histogram
from mesh.cache import BoundedCache
from mesh.errors import MeshError
from mesh.types import SLO, InferResponse
from variant_store.pipeline_meta import MAX_STAGES

__all__ = ["OTHER", "AgentMetrics", "DoorTime", "Gauges", "error_codes"]

OTHER = "other"
LATENCY_BOUNDS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BOUNDS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)
COMPONENTS = ("network", "queue", "compute", "total")


def error_codes() -> frozenset[str]:
    """Every code of the ``mesh.errors`` tree (the outcome label's values besides ``ok``)."""
    seen: set[str] = set()
    todo: list[type[MeshError]] = [MeshError]
    while todo:
        cls = todo.pop()
        seen.add(cls.code)
        todo.extend(cls.__subclasses__())
    return frozenset(seen)


_CODES = error_codes()
# errors that mean the mesh failed the query's SLO (the caller's own mistakes do not count)
_SLO_FAILURES = frozenset({"deadline", "overloaded", "no_route", "peer_down", "impossible_slo", "internal",
                           "runtime_load", "blob", "protocol"})
_REASONS = frozenset({*REASONS, *(r + "+retried" for r in REASONS), *CASCADE_REASONS, "forwarded", "none"})


class _Hist:
    """Bucket counts (the last is +Inf) and a sum; rendered cumulative at scrape time."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect_left(self.bounds, v)] += 1  # le is inclusive: the first bound >= v
        self.sum += v

    def buckets(self) -> list[tuple[str, float]]:
        out, acc = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            acc += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), float(acc)))
        return out


@dataclass(slots=True)
class _Triton:
    success: int = 0
    count: int = 0            # inferences (rows), as Triton counts a batch's items
    queue_us: float = 0.0
    compute_us: float = 0.0
    request_us: float = 0.0
    failure: dict[str, int] = field(default_factory=dict)


class DoorTime:
    """Rows and times (ms) summed over the queries of one (task, tenant, variant) answered at this door."""

    __slots__ = ("compute_ms", "queue_ms", "rows", "total_ms")

    def __init__(self) -> None:
        self.rows = 0
        self.queue_ms = self.compute_ms = self.total_ms = 0.0


@dataclass(slots=True)
class Gauges:
    """What the agent holds right now (read at scrape time)."""

    loaded: dict[str, tuple[int, int]] = field(default_factory=dict)  # variant -> (memory bytes, queued rows)
    peers: dict[str, bool] = field(default_factory=dict)              # live peer site -> reachable
    etcd_connected: bool = False
    inflight: int = 0
    device_used_bytes: int = 0    # accelerator memory the loaded variants hold (edge_agent.device_memory) ...
    device_budget_bytes: int = 0  # ... of this budget (0: no device budget)


class AgentMetrics:
    def __init__(self, site: str) -> None:
        self.site = site
        self.gauges: Callable[[], Gauges] = Gauges
        self.tasks: frozenset[str] = frozenset()
        self.tenants: frozenset[str] = frozenset({"public"})
        self.variants: frozenset[str] = frozenset()
        self.sites: frozenset[str] = frozenset({site})
        self.requests: dict[tuple[str, str, str, str, str], int] = {}
        self.slo: dict[tuple[str, str, str], int] = {}
        self.latency: dict[tuple[str, str], _Hist] = {}     # (task, component) -> histogram, for collect()
        self._latency_of: dict[str, tuple[_Hist, ...]] = {}  # task -> its COMPONENTS' histograms, in order
        self.served: dict[tuple[str, str, str, str], int] = {}
        self.versions: dict[tuple[str, str, str], int] = {}  # (task, tenant, version) -> queries served here
        self.triton: dict[str, _Triton] = {}
        self.batch: dict[str, _Hist] = {}
        self.cold_starts: dict[str, int] = {}
        self.prewarms: dict[str, int] = {}
        self.forwards: dict[str, int] = {}
        self.quota_rejections: dict[str, int] = {}
        self.door_delays: dict[str, _Hist] = {}  # task -> entry to first routing decision (seconds)
        self.cascades: dict[tuple[str, str], int] = {}       # (task, "local" | "escalated") -> queries
        self.cascade_rows: dict[tuple[str, str], int] = {}   # (task, stage) -> rows it answered
        self.pipelines: dict[tuple[str, str], int] = {}      # (pipeline task, outcome) -> queries
        self.pipeline_stages: dict[tuple[str, str, str], _Hist] = {}  # (task, stage, stage task) -> seconds
        # (task, tenant, variant) -> the rows and times of the queries answered at this door: Triton's statistics
        # extension per tenant (edge_agent.v2_extras; the counts are those of requests): 0.25-0.35 us a query here
        self.door_time: dict[tuple[str, str, str], DoorTime] = {}
        self._classes: BoundedCache[SLO, str] = BoundedCache(256)

    # -- bounded labels ----------------------------------------------------------------------
    def known(self, *, tasks: Iterable[str], tenants: Iterable[str], variants: Iterable[str],
              sites: Iterable[str]) -> None:
        """The label values the mesh's view names (on every view change); others become ``other``."""
        self.tasks, self.variants = frozenset(tasks), frozenset(variants)
        self.tenants, self.sites = frozenset({"public", *tenants}), frozenset({self.site, *sites})

    def _task(self, task: str) -> str:
        return task if task in self.tasks else OTHER

    def _tenant(self, tenant: str) -> str:
        return tenant if tenant in self.tenants else OTHER

    def _variant(self, variant: str) -> str:
        return variant if variant in self.variants else OTHER

    def _slo_class(self, slo: SLO) -> str:
        cls = self._classes.get(slo)
        return cls if cls is not None else self._classes.put(slo, slo_class(slo))

    # -- the door ------------------------------------------------------------------------------
    def door_ok(self, task: str, tenant: str, slo: SLO, resp: InferResponse) -> None:
        task = task if task in self.tasks else OTHER
        tenant = tenant if tenant in self.tenants else OTHER
        reason = resp.reason if resp.reason in _REASONS else OTHER
        variant = resp.variant if resp.variant in self.variants else OTHER
        key = (task, tenant, variant, "ok", reason)
        self.requests[key] = self.requests.get(key, 0) + 1
        t = resp.timing
        total = t.total_ms
        cls = self._classes.get(slo)
        if cls is None:
            cls = self._classes.put(slo, slo_class(slo))
        skey = (tenant, cls, "met" if total <= slo.latency_ms and resp.accuracy >= slo.min_accuracy else "missed")
        self.slo[skey] = self.slo.get(skey, 0) + 1
        hs = self._latency_of.get(task)
        if hs is None:
            hs = self._latency_of[task] = tuple(_Hist(LATENCY_BOUNDS_S) for _ in COMPONENTS)
            for comp, h in zip(COMPONENTS, hs, strict=True):
                self.latency[(task, comp)] = h
        dt = self.door_time.get((task, tenant, variant))
        if dt is None:
            dt = self.door_time[(task, tenant, variant)] = DoorTime()
        for out in resp.outputs.values():  # rows: the first output's, as every output has the batch's rows
            dt.rows += len(out) if out.ndim else 1
            break
        dt.queue_ms += t.queue_ms
        dt.compute_ms += t.compute_ms
        dt.total_ms += total
        # inline _Hist.observe (four per query): seconds into the first bucket whose bound is >= them
        for h, ms in zip(hs, (t.network_ms, t.queue_ms, t.compute_ms, total), strict=True):
            v = ms / 1000.0
            h.counts[bisect_left(LATENCY_BOUNDS_S, v)] += 1
            h.sum += v

    def cascade(self, task: str, resp: InferResponse) -> None:
        """A query this door answered by a cascade: locally (stage 1 alone) or escalated, and each stage's rows."""
        task = task if task in self.tasks else OTHER
        key = (task, "escalated" if resp.reason.startswith(ESCALATED) else "local")
        self.cascades[key] = self.cascades.get(key, 0) + 1
        for st in resp.stages:
            rkey = (task, str(st.stage))
            self.cascade_rows[rkey] = self.cascade_rows.get(rkey, 0) + st.answered

    def pipeline(self, task: str, outcome: InferResponse | BaseException) -> None:
        """A query of the pipeline ``task`` at this door: answered (each stage's time, as the door saw it) or failed
        (by the error's code)."""
        if not isinstance(outcome, InferResponse):
            code = outcome.code if isinstance(outcome, MeshError) else "internal"
            key = (task, code if code in _CODES else OTHER)
            self.pipelines[key] = self.pipelines.get(key, 0) + 1
            return
        self.pipelines[(task, "ok")] = self.pipelines.get((task, "ok"), 0) + 1
        for st in outcome.stages:
            skey = (task, str(st.stage) if 1 <= st.stage <= MAX_STAGES else OTHER, self._task(st.task))
            h = self.pipeline_stages.get(skey)
            if h is None:
                h = self.pipeline_stages[skey] = _Hist(LATENCY_BOUNDS_S)
            h.observe(st.total_ms / 1000.0)

    def door_delay(self, task: str, ms: float) -> None:
        """The door's own delay of a query: from its entry to its first routing decision."""
        task = task if task in self.tasks else OTHER
        h = self.door_delays.get(task)
        if h is None:
            h = self.door_delays[task] = _Hist(LATENCY_BOUNDS_S)
        h.observe(ms / 1000.0)

    def door_error(self, task: str, tenant: str, code: str, slo: SLO | None = None) -> None:
        tenant = self._tenant(tenant)
        key = (self._task(task), tenant, "none", code if code in _CODES else OTHER, "none")
        self.requests[key] = self.requests.get(key, 0) + 1
        if code == "quota_exceeded":
            self.quota_rejections[tenant] = self.quota_rejections.get(tenant, 0) + 1
        if slo is not None and code in _SLO_FAILURES:
            skey = (tenant, self._slo_class(slo), "missed")
            self.slo[skey] = self.slo.get(skey, 0) + 1

    # -- where queries run ---------------------------------------------------------------------
    def served_ok(self, task: str, tenant: str, variant: str, role: str, queue_ms: float, compute_ms: float,
                  total_ms: float, rows: int, *, version: int = 0) -> None:
        """A query run here on ``variant``; ``version``: the variant's (a tenant's task), 0 for a public one."""
        known = variant in self.variants
        variant = variant if known else OTHER
        task, tenant = self._task(task), self._tenant(tenant)
        key = (task, tenant, variant, role)
        self.served[key] = self.served.get(key, 0) + 1
        if version:
            vkey = (task, tenant, str(version) if known else OTHER)
            self.versions[vkey] = self.versions.get(vkey, 0) + 1
        tr = self.triton.get(variant)
        if tr is None:
            tr = self.triton[variant] = _Triton()
        tr.success += 1
        tr.count += rows
        tr.queue_us += queue_ms * 1000.0
        tr.compute_us += compute_ms * 1000.0
        tr.request_us += total_ms * 1000.0

    def served_failed(self, variant: str, code: str) -> None:
        variant = self._variant(variant)
        tr = self.triton.get(variant)
        if tr is None:
            tr = self.triton[variant] = _Triton()
        code = code if code in _CODES else OTHER
        tr.failure[code] = tr.failure.get(code, 0) + 1

    def batch_ran(self, variant: str, rows: int) -> None:
        variant = self._variant(variant)
        h = self.batch.get(variant)
        if h is None:
            h = self.batch[variant] = _Hist(BATCH_BOUNDS)
        h.observe(float(rows))

    def cold_start(self, variant: str, *, prewarm: bool) -> None:
        """A variant loaded: on a query's demand (a cold start) or ahead of it, by placement (a prewarm)."""
        counts = self.prewarms if prewarm else self.cold_starts
        variant = self._variant(variant)
        counts[variant] = counts.get(variant, 0) + 1

    def forwarded(self, destination: str) -> None:
        dest = destination if destination in self.sites else OTHER
        self.forwards[dest] = self.forwards.get(dest, 0) + 1

    # -- scrape --------------------------------------------------------------------------------
    def render(self) -> bytes:
        """The Prometheus text exposition: tiermesh's families, then Triton's, as Triton writes them."""
        return "".join((*self._families(), *self._gauges(), self._triton_text())).encode()

    def _families(self) -> Iterator[str]:
        site = self.site
        yield counter("tiermesh_requests", "Queries answered at this door, by outcome and routing reason",
                      ("task", "tenant", "site", "variant", "outcome", "reason"),
                      (((task, tenant, site, variant, outcome, reason), n)
                       for (task, tenant, variant, outcome, reason), n in sorted(self.requests.items())))
        yield counter("tiermesh_slo", "Queries answered at this door within their SLO (met) or not",
                      ("tenant", "slo_class", "result"), sorted(self.slo.items()))
        yield histogram("tiermesh_request_latency_seconds", "Latency of queries answered at this door, by component",
                        ("task", "component"),
                        ((key, h.buckets(), h.sum) for key, h in sorted(self.latency.items())))
        yield histogram("tiermesh_door_delay_seconds",
                        "Delay at this door from a query's entry to its first routing decision", ("task",),
                        (((task,), h.buckets(), h.sum) for task, h in sorted(self.door_delays.items())))
        yield counter("tiermesh_served", "Queries run at this site (role: local or forwarded here)",
                      ("task", "tenant", "site", "variant", "role"),
                      (((task, tenant, site, variant, role), n)
                       for (task, tenant, variant, role), n in sorted(self.served.items())))
        yield counter("tiermesh_version_queries", "Queries run at this site on a version of a tenant's task (the "
                      "served variant's catalogued version; public variants not counted)",
                      ("task", "tenant", "site", "version"),
                      (((task, tenant, site, version), n)
                       for (task, tenant, version), n in sorted(self.versions.items())))
        yield counter("tiermesh_cascade_queries", "Queries this door answered by a cascade: by stage 1 alone "
                      "(local) or escalated", ("task", "site", "answered"),
                      (((task, site, answered), n) for (task, answered), n in sorted(self.cascades.items())))
        yield counter("tiermesh_cascade_rows", "Rows of cascade queries answered by each stage",
                      ("task", "site", "stage"),
                      (((task, site, stage), n) for (task, stage), n in sorted(self.cascade_rows.items())))
        yield counter("tiermesh_pipeline_queries", "Queries of a pipeline at this door, by outcome (ok or the "
                      "error code)", ("task", "site", "outcome"),
                      (((task, site, outcome), n) for (task, outcome), n in sorted(self.pipelines.items())))
        yield histogram("tiermesh_pipeline_stage_seconds", "Time of each stage of a pipeline's answered queries, "
                        "from this door's send to the stage's answer", ("task", "stage", "stage_task"),
                        ((key, h.buckets(), h.sum) for key, h in sorted(self.pipeline_stages.items())))
        yield histogram("tiermesh_batch_size", "Rows per executed batch", ("variant",),
                        (((variant,), h.buckets(), h.sum) for variant, h in sorted(self.batch.items())))
        for name, doc, counts, label in (
                ("tiermesh_cold_starts", "Variant loads a query waited for", self.cold_starts, "variant"),
                ("tiermesh_prewarms", "Variant loads placement asked for ahead of demand", self.prewarms, "variant"),
                ("tiermesh_forwards", "Queries forwarded from this site, by destination", self.forwards,
                 "destination"),
                ("tiermesh_quota_rejections", "Queries refused at this door over the tenant's quota",
                 self.quota_rejections, "tenant")):
            yield counter(name, doc, (label,), (((value,), n) for value, n in sorted(counts.items())))

    def _gauges(self) -> Iterator[str]:
        g = self.gauges()
        yield gauge("tiermesh_loaded_variants", "Variants loaded at this site", (), [((), len(g.loaded))])
        loaded = sorted(g.loaded.items())
        yield gauge("tiermesh_variant_memory_bytes", "Memory a loaded variant's runtime holds", ("variant",),
                    (((self._variant(variant),), nbytes) for variant, (nbytes, _) in loaded))
        yield gauge("tiermesh_queue_depth", "Rows queued for a loaded variant", ("variant",),
                    (((self._variant(variant),), rows) for variant, (_, rows) in loaded))
        yield gauge("tiermesh_peer_reachable", "1 if the transport reaches a live peer site", ("peer",),
                    (((peer if peer in self.sites else OTHER,), 1.0 if ok else 0.0)
                     for peer, ok in sorted(g.peers.items())))
        yield gauge("tiermesh_etcd_connected", "1 while this agent's view follows etcd", (),
                    [((), 1.0 if g.etcd_connected else 0.0)])
        yield gauge("tiermesh_inflight", "Queries in flight at this site", (), [((), g.inflight)])
        yield gauge("tiermesh_device_memory_used_bytes", "Accelerator memory the loaded variants hold", (),
                    [((), g.device_used_bytes)])
        yield gauge("tiermesh_device_memory_budget_bytes", "Accelerator memory this site's models may hold "
                    "(0: no device)", (), [((), g.device_budget_bytes)])

    def _triton_text(self) -> str:
        rows: dict[str, list[str]] = {k: [] for k in _TRITON}
        for variant, tr in sorted(self.triton.items()):
            labels = f'model="{escape(variant)}",version="1"'
            for name, value in (("nv_inference_request_success", tr.success),
                                ("nv_inference_count", tr.count),
                                ("nv_inference_queue_duration_us", tr.queue_us),
                                ("nv_inference_compute_infer_duration_us", tr.compute_us),
                                ("nv_inference_request_duration_us", tr.request_us)):
                rows[name].append(f"{name}{{{labels}}} {float(value)!r}\n")
            for reason, n in sorted(tr.failure.items()):
                rows["nv_inference_request_failure"].append(
                    f'nv_inference_request_failure{{{labels},reason="{escape(reason)}"}} {float(n)!r}\n')
        out = []
        for name, doc in _TRITON.items():
            out.append(f"# HELP {name} {doc}\n# TYPE {name} counter\n")
            out.extend(rows[name])
        return "".join(out)


_TRITON = {
    "nv_inference_request_success": "Number of successful inference requests, all batch sizes",
    "nv_inference_request_failure": "Number of failed inference requests, all batch sizes",
    "nv_inference_count": "Number of inferences performed (a batch of n counts n)",
    "nv_inference_queue_duration_us": "Cumulative inference queuing duration in microseconds",
    "nv_inference_compute_infer_duration_us": "Cumulative compute inference duration in microseconds",
    "nv_inference_request_duration_us": "Cumulative inference request duration in microseconds",
}

