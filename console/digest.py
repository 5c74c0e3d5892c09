"""What the console makes of one agent's ``/metrics``: pure functions over parsed samples, no I/O.

The agents' metric names (issue 12, item 1) are the contract read here:

    tiermesh_requests_total{task,tenant,site,variant,outcome,reason}   counter
    tiermesh_slo_total{tenant,slo_class,result}                         counter, result met | missed
    tiermesh_request_latency_seconds{task,component}                    histogram, component network|queue|compute|total
    tiermesh_queue_depth{variant}  tiermesh_variant_memory_bytes{variant}  tiermesh_loaded_variants   gauges
    tiermesh_forwards_total{destination}  tiermesh_quota_rejections_total{tenant}                       counters
    tiermesh_peer_reachable{peer}                                                                       gauge 0 / 1

Units: latencies here are milliseconds (the metrics say seconds); counters stay counts; rates are per second.
A metric an agent does not serve is simply absent from its :class:`SiteMetrics` (an older agent, or one whose
metrics are off): the console shows "no data" for it rather than zero.

The text is read by ``prometheus_client``'s parser (:func:`parse_samples`), the one the console's process already
has, not by a reader of our own: a hand-written one broke a whole scrape on a label value holding ``\r`` or U+2028
(``str.splitlines`` ends a line there) and decoded ``\t`` as ``t``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Sample", "SiteMetrics", "attainment", "digest", "histogram_quantile", "parse_samples", "rate"]

_P = "tiermesh_"


@dataclass(frozen=True, slots=True)
class Sample:
    """One sample of an exposition: its full name (``_total``, ``_bucket``, ... included), labels and value."""

    name: str
    labels: dict[str, str]
    value: float


def parse_samples(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition (0.0.4), in order; ``ValueError`` when any line is malformed:
    a scrape parses whole or is reported as failed, never half read. The text is an agent's answer, so whatever
    the parser raises on it is that one error."""
    try:
        return [Sample(s.name, dict(s.labels), float(s.value))
                for family in text_string_to_metric_families(text) for s in family.samples]
    except Exception as exc:  # untrusted text: the parser raises ValueError, and IndexError, TypeError, ... on some
        raise ValueError(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__) from exc


@dataclass(slots=True)
class SiteMetrics:
    """One scrape of one site, summed over the labels the console does not show."""

    requests: dict[tuple[str, str], float] = field(default_factory=dict)        # (tenant, outcome) -> count
    slo: dict[tuple[str, str, str], float] = field(default_factory=dict)        # (tenant, class, result) -> count
    latency_buckets: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # task -> [(le s, cum)]
    queue_depth: dict[str, float] = field(default_factory=dict)                 # variant -> rows queued
    memory_bytes: dict[str, float] = field(default_factory=dict)                # variant -> bytes
    loaded_variants: float | None = None
    forwards: dict[str, float] = field(default_factory=dict)                    # destination -> count
    peer_reachable: dict[str, bool] = field(default_factory=dict)
    quota_rejections: dict[str, float] = field(default_factory=dict)            # tenant -> count
    seen: set[str] = field(default_factory=set)                                 # metric families present

    @property
    def requests_total(self) -> float:
        return sum(self.requests.values())

    def p99_ms(self) -> dict[str, float]:
        """Per task, the 99th percentile of the total latency (ms) since the agent started."""
        out: dict[str, float] = {}
        for task, buckets in self.latency_buckets.items():
            q = histogram_quantile(0.99, buckets)
            if q is not None:
                out[task] = q * 1000.0
        return out


def _add(d: dict, key: object, v: float) -> None:  # type: ignore[type-arg]
    d[key] = d.get(key, 0.0) + v


def digest(samples: Iterable[Sample]) -> SiteMetrics:
    m = SiteMetrics()
    buckets: dict[str, dict[float, float]] = defaultdict(dict)
    for s in samples:
        if not s.name.startswith(_P) or not math.isfinite(s.value):
            continue
        name, lb = s.name[len(_P):], s.labels
        if name == "requests_total":
            _add(m.requests, (lb.get("tenant", ""), lb.get("outcome", "")), s.value)
        elif name == "slo_total":
            _add(m.slo, (lb.get("tenant", ""), lb.get("slo_class", ""), lb.get("result", "")), s.value)
        elif name == "request_latency_seconds_bucket" and lb.get("component") == "total" and "le" in lb:
            le = math.inf if lb["le"] in ("+Inf", "Inf", "inf") else float(lb["le"])
            task = buckets[lb.get("task", "")]
            task[le] = task.get(le, 0.0) + s.value
        elif name == "queue_depth":
            _add(m.queue_depth, lb.get("variant", ""), s.value)
        elif name == "variant_memory_bytes":
            _add(m.memory_bytes, lb.get("variant", ""), s.value)
        elif name == "loaded_variants":
            m.loaded_variants = s.value
        elif name == "forwards_total":
            _add(m.forwards, lb.get("destination", ""), s.value)
        elif name == "peer_reachable":
            m.peer_reachable[lb.get("peer", "")] = s.value >= 0.5
        elif name == "quota_rejections_total":
            _add(m.quota_rejections, lb.get("tenant", ""), s.value)
        else:
            continue
        m.seen.add(name.removesuffix("_bucket"))
    m.latency_buckets = {t: sorted(b.items()) for t, b in buckets.items()}
    return m


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' ``histogram_quantile`` over cumulative ``(upper bound, count)`` pairs sorted by bound:
    linear interpolation inside the bucket the rank falls in; the highest finite bound when it falls in
    ``+Inf``; None without observations."""
    if not buckets or not 0.0 <= q <= 1.0:
        return None
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le


def rate(previous: float | None, current: float, seconds: float) -> float | None:
    """Per-second increase of a counter; None without a previous value or time; a reset (the agent
    restarted) counts from zero."""
    if previous is None or seconds <= 0:
        return None
    delta = current - previous if current >= previous else current
    return delta / seconds


def attainment(slo: Mapping[tuple[str, str, str], float]) -> dict[str, dict[str, tuple[float, float]]]:
    """tenant -> SLO class -> (met, missed), from ``(tenant, class, result)`` counts."""
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for (tenant, cls, result), n in slo.items():
        met, missed = out.setdefault(tenant, {}).get(cls, (0.0, 0.0))
        if result == "met":
            met += n
        elif result == "missed":
            missed += n
        out[tenant][cls] = (met, missed)
    return out
