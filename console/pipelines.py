"""The console's pipelines view (issue 33 item 3: "a pipeline's per-stage latency"): each pipeline task as the
catalog declares it (``pipelines/<task>``, held by the console's view), joined with what the doors that ran it
counted (``edge_agent.metrics``):

    tiermesh_pipeline_queries_total{task,site,outcome}              outcome: ok | the error code
    tiermesh_pipeline_stage_seconds{task,stage,stage_task}          histogram: each stage's time as its door saw it

    GET /api/pipelines
    {"tasks": [{"task": "text-section", "kind": "sequence", "declared": ["embed", "topic"], "owner": "public",
                "accuracy": 0.75, "queries": 12, "outcomes": {"ok": 11, "deadline": 1},
                "sites": [{"site": "edge-a", "queries": 12, "outcomes": {"ok": 11, "deadline": 1}}],
                "stages": [{"stage": "1", "stage_task": "embed", "count": 11, "p50_ms": 3.1, "p95_ms": 8.7,
                            "mean_ms": 3.9}, ...]}],
     "scrape_errors": {"mid": "..."}, "at": <epoch seconds>}

``declared`` is a Sequence's stage tasks in order, or a Switch's selector then its branches (each branch is stage
2). A stage's ``p50_ms`` and ``p95_ms`` are estimated from its histogram's buckets summed over the sites, as
Prometheus' ``histogram_quantile`` does (:func:`console.digest.histogram_quantile`: linear inside a bucket, so
no finer than the agents' bounds); ``mean_ms`` is exact (the sum over the count). Everything counts since each
agent started (a restarted agent counts from zero), None without observations. Counters are keyed by the site the
console scraped (whose certificate it checked), not by the label the agent wrote. A pipeline no longer declared
that the doors still counted is listed with ``kind`` None, so its traffic stays visible.

The pure parts (:func:`pipeline_counts`, :func:`summary`) take parsed samples and decoded entries; :func:`scrape`
is the thin I/O, through the console's :class:`~console.scrape.Scraper`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from console.digest import Sample, histogram_quantile
from console.scrape import Scraper
from variant_store.pipeline_meta import PipelineMeta

__all__ = ["SitePipelines", "pipeline_counts", "scrape", "summary"]

_QUERIES = "tiermesh_pipeline_queries_total"
_STAGE = "tiermesh_pipeline_stage_seconds"
StageKey = tuple[str, str, str]  # (pipeline task, stage, stage task)


@dataclass(slots=True)
class SitePipelines:
    """One site's pipeline counters: (task, outcome) -> queries; per stage its cumulative buckets (le in seconds
    -> count) and sum of seconds."""

    queries: dict[tuple[str, str], float] = field(default_factory=dict)
    buckets: dict[StageKey, dict[float, float]] = field(default_factory=dict)
    sums: dict[StageKey, float] = field(default_factory=dict)

    def tasks(self) -> set[str]:
        return {t for t, _ in self.queries} | {k[0] for k in self.buckets}


def _le(text: str) -> float | None:
    try:
        le = float(text)  # "+Inf" reads as inf
    except ValueError:
        return None
    return None if math.isnan(le) or le < 0 else le


def pipeline_counts(samples: Iterable[Sample]) -> SitePipelines:
    """The pipeline families of one agent's parsed ``/metrics``; other samples, bucket bounds that are no number,
    negative or non-finite values are ignored."""
    out = SitePipelines()
    for s in samples:
        if not (s.value >= 0 and s.value != math.inf):  # NaN fails the first test
            continue
        lb = s.labels
        task = lb.get("task", "")
        if s.name == _QUERIES:
            qkey = (task, lb.get("outcome", ""))
            out.queries[qkey] = out.queries.get(qkey, 0.0) + s.value
            continue
        key = (task, lb.get("stage", ""), lb.get("stage_task", ""))
        if s.name == _STAGE + "_bucket" and (le := _le(lb.get("le", ""))) is not None:
            b = out.buckets.setdefault(key, {})
            b[le] = b.get(le, 0.0) + s.value
        elif s.name == _STAGE + "_sum":
            out.sums[key] = out.sums.get(key, 0.0) + s.value
    return out


def _declared(meta: PipelineMeta) -> list[str]:
    return [s.task for s in meta.stages] + [b.task for b in meta.branches]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def _stage_order(key: StageKey) -> tuple[int, str]:
    return (int(key[1]) if key[1].isdigit() else 1 << 30, key[2])


def _stages(task: str, sites: Iterable[SitePipelines]) -> list[dict[str, Any]]:
    """Each stage of ``task`` (by stage number, then stage task): its buckets and sums added over the sites."""
    buckets: dict[StageKey, dict[float, float]] = {}
    sums: dict[StageKey, float] = {}
    for sp in sites:
        for key, b in sp.buckets.items():
            if key[0] == task:
                acc = buckets.setdefault(key, {})
                for le, n in b.items():
                    acc[le] = acc.get(le, 0.0) + n
        for key, v in sp.sums.items():
            if key[0] == task:
                sums[key] = sums.get(key, 0.0) + v
    out = []
    for key in sorted(buckets, key=_stage_order):
        cum = sorted(buckets[key].items())
        count = cum[-1][1] if cum else 0.0
        out.append({"stage": key[1], "stage_task": key[2], "count": count,
                    "p50_ms": _ms(histogram_quantile(0.5, cum)), "p95_ms": _ms(histogram_quantile(0.95, cum)),
                    "mean_ms": sums.get(key, 0.0) * 1000.0 / count if count > 0 else None})
    return out


def summary(pipelines: Mapping[str, PipelineMeta], sites: Mapping[str, SitePipelines],
            scrape_errors: Mapping[str, str] | None = None, now: float = 0.0) -> dict[str, Any]:
    """Per pipeline task (sorted): its declaration, its queries by outcome per site and in all, and each stage's
    latency over all sites; every declared pipeline and every one some site counted; pure."""
    tasks = set(pipelines) | {t for sp in sites.values() for t in sp.tasks()}
    out = []
    for task in sorted(tasks):
        meta = pipelines.get(task)
        outcomes: dict[str, float] = {}
        per_site = []
        for site in sorted(sites):
            mine = {o: n for (t, o), n in sorted(sites[site].queries.items()) if t == task}
            if not mine:
                continue
            for o, n in mine.items():
                outcomes[o] = outcomes.get(o, 0.0) + n
            per_site.append({"site": site, "queries": sum(mine.values()), "outcomes": mine})
        out.append({"task": task, "kind": meta.kind if meta else None, "declared": _declared(meta) if meta else [],
                    "owner": meta.owner if meta else None, "accuracy": meta.accuracy if meta else None,
                    "queries": sum(outcomes.values()), "outcomes": dict(sorted(outcomes.items())),
                    "sites": per_site, "stages": _stages(task, sites.values())})
    return {"tasks": out, "scrape_errors": dict(sorted((scrape_errors or {}).items())), "at": now}


# -- I/O -----------------------------------------------------------------------------------------------------------

async def scrape(scraper: Scraper, urls: Mapping[str, str]) -> tuple[dict[str, SitePipelines], dict[str, str]]:
    """Every live agent's pipeline families (asked at once; each call bounded by the scraper's timeout), and the
    sites that did not answer with why."""
    return await scraper.read_all(urls, pipeline_counts)
