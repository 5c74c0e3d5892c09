"""The scheduler's Prometheus metrics, in a registry of its own (several schedulers can share a process).

    tiermesh_scheduler_rounds_total                      placement rounds run (as leader)
    tiermesh_scheduler_placements_written_total          fenced placement writes etcd accepted
    tiermesh_scheduler_placement_refused_total           fenced writes refused (we were a stale leader)
    tiermesh_scheduler_decisions_total{action}           load / evict / prewarm / replicate ... decided and written
    tiermesh_scheduler_decision_seconds                  time to snapshot and plan one round (histogram)
    tiermesh_scheduler_leader                            1 while this replica leads
    tiermesh_scheduler_terms_total                       times this replica became leader
    tiermesh_etcd_connected                              1 while its view follows etcd

:func:`metrics_handler` serves a registry as Prometheus text; whoever mounts it (the scheduler's HTTP
server) decides who may read it (``authorize``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE", "SchedulerMetrics", "metrics_handler"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_ACTIONS = ("load", "evict", "prewarm", "replicate", "mode")


class SchedulerMetrics(Collector):
    """Counters the scheduler updates per round, plus leader/etcd state read at scrape time from ``state``
    (a callable giving (leader?, etcd connected?, terms))."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.state: Callable[[], tuple[bool, bool, int]] = lambda: (False, False, 0)
        r = self.registry
        self.rounds = Counter("tiermesh_scheduler_rounds", "Placement rounds run as leader", registry=r)
        self.written = Counter("tiermesh_scheduler_placements_written",
                               "Fenced placement writes etcd accepted", registry=r)
        self.refused = Counter("tiermesh_scheduler_placement_refused",
                               "Fenced placement writes refused (a stale leader)", registry=r)
        decisions = Counter("tiermesh_scheduler_decisions", "Placement decisions written, by action",
                            ["action"], registry=r)
        self._decisions = {a: decisions.labels(a) for a in (*_ACTIONS, "other")}
        self.duration = Histogram("tiermesh_scheduler_decision_seconds",
                                  "Time to snapshot the mesh and plan one placement round", registry=r,
                                  buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
        r.register(self)

    def decided(self, action: str) -> None:
        self._decisions.get(action, self._decisions["other"]).inc()

    def collect(self) -> Iterator[Metric]:
        leader, connected, terms = self.state()
        yield GaugeMetricFamily("tiermesh_scheduler_leader", "1 while this replica leads", value=float(leader))
        yield CounterMetricFamily("tiermesh_scheduler_terms", "Times this replica became leader", value=terms)
        yield GaugeMetricFamily("tiermesh_etcd_connected", "1 while the scheduler's view follows etcd",
                                value=float(connected))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def metrics_handler(registry: CollectorRegistry, *,
                    authorize: Callable[[web.Request], object] | None = None
                    ) -> Callable[[web.Request], Awaitable[web.Response]]:
    """An aiohttp handler serving ``registry`` as Prometheus text. ``authorize(request)`` runs first and
    raises (an ``aiohttp`` HTTP exception, or whatever the mounting app maps) to refuse a caller."""

    async def handler(request: web.Request) -> web.Response:
        if authorize is not None:
            authorize(request)
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE})

    return handler
