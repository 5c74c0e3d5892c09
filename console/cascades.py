"""The console's cascades view (issue 33 item 3): each task's calibrated cascades as the catalog holds them
(``cascades/<task>/<id>``, read by :func:`variant_store.cascade_catalog.read_cascades`), joined with how often
each site's door actually escalated, from the agents' counters (``edge_agent.metrics``):

    tiermesh_cascade_queries_total{task,site,answered}   answered: local (stage 1 alone) | escalated
    tiermesh_cascade_rows_total{task,site,stage}         rows each stage answered

    GET /api/cascades
    {"tasks": [{"task": "digit-classification",
                "cascades": [{"id", "stages", "rule", "thresholds", "accuracy", "target_accuracy", "escalation",
                              "calibration_rows", "heldout_rows", "owner", "created"}],
                "sites": [{"site": "edge-a", "local": 90, "escalated": 10, "queries": 100,
                           "escalation_rate": 0.1, "rows": {"0": 95, "1": 10}}],
                "queries": 100, "escalation_rate": 0.1}],
     "broken": [{"key", "task", "name", "reason"}], "scrape_errors": {"mid": "..."}, "at": <epoch seconds>}

``escalation`` (per cascade) is the calibrated share of held-out rows that reached each later stage; the sites'
``escalation_rate`` is the measured share of *queries* a door escalated since that agent started (counters, not a
windowed rate: a restarted agent counts from zero). It is None, never a division by zero, without queries.
Counters are keyed by the site the console scraped (whose certificate it checked), not by the label the agent
wrote. A catalog entry that does not decode is listed in ``broken`` with the reason, never raised.

The pure parts (:func:`cascade_counts`, :func:`summary`) take parsed samples and decoded entries; :func:`scrape`
is the thin I/O: each live agent's ``/metrics`` at once, through the console's :class:`~console.scrape.Scraper`
session and its check that the answer comes from that site.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from console.digest import Sample
from console.scrape import Scraper
from variant_store.cascade_meta import CascadeMeta
from variant_store.catalog_check import BrokenEntry

__all__ = ["ANSWERED", "SiteCascades", "cascade_counts", "escalation_rate", "scrape", "summary"]

ANSWERED = ("local", "escalated")
_QUERIES = "tiermesh_cascade_queries_total"
_ROWS = "tiermesh_cascade_rows_total"


@dataclass(slots=True)
class SiteCascades:
    """One site's cascade counters: (task, answered) -> queries, (task, stage) -> rows."""

    queries: dict[tuple[str, str], float] = field(default_factory=dict)
    rows: dict[tuple[str, str], float] = field(default_factory=dict)

    def tasks(self) -> set[str]:
        return {t for t, _ in self.queries} | {t for t, _ in self.rows}


def cascade_counts(samples: Iterable[Sample]) -> SiteCascades:
    """The cascade counters of one agent's parsed ``/metrics``; other samples, unknown ``answered`` values,
    negative or non-finite counts are ignored."""
    out = SiteCascades()
    for s in samples:
        if not (s.value >= 0 and s.value != float("inf")):  # NaN fails the first test
            continue
        task = s.labels.get("task", "")
        if s.name == _QUERIES and s.labels.get("answered") in ANSWERED:
            key = (task, s.labels["answered"])
            out.queries[key] = out.queries.get(key, 0.0) + s.value
        elif s.name == _ROWS:
            rkey = (task, s.labels.get("stage", ""))
            out.rows[rkey] = out.rows.get(rkey, 0.0) + s.value
    return out


def escalation_rate(local: float, escalated: float) -> float | None:
    """The share of queries escalated; None without queries."""
    total = local + escalated
    return escalated / total if total > 0 else None


def _cascade(c: CascadeMeta) -> dict[str, Any]:
    return {"id": c.cascade_id, "stages": list(c.stages), "rule": c.rule, "thresholds": list(c.thresholds),
            "accuracy": c.accuracy, "target_accuracy": c.target_accuracy, "escalation": list(c.escalation),
            "calibration_rows": c.calibration_rows, "heldout_rows": c.heldout_rows, "owner": c.owner,
            "created": c.created}


def summary(cascades: Iterable[CascadeMeta], broken: Iterable[BrokenEntry], sites: Mapping[str, SiteCascades],
            scrape_errors: Mapping[str, str] | None = None, now: float = 0.0) -> dict[str, Any]:
    """Per task (sorted): its cascades and each site's measured escalation; every task that has a cascade entry or
    that some site counted cascade queries for (an entry removed since still shows its traffic); pure."""
    by_task: dict[str, list[CascadeMeta]] = {}
    for c in cascades:
        by_task.setdefault(c.task, []).append(c)
    tasks = set(by_task) | {t for sc in sites.values() for t in sc.tasks()}
    out = []
    for task in sorted(tasks):
        rows_out, local_sum, esc_sum = [], 0.0, 0.0
        for site in sorted(sites):
            sc = sites[site]
            if task not in sc.tasks():
                continue
            local, esc = sc.queries.get((task, "local"), 0.0), sc.queries.get((task, "escalated"), 0.0)
            local_sum, esc_sum = local_sum + local, esc_sum + esc
            rows_out.append({"site": site, "local": local, "escalated": esc, "queries": local + esc,
                             "escalation_rate": escalation_rate(local, esc),
                             "rows": {st: n for (t, st), n in sorted(sc.rows.items()) if t == task}})
        out.append({"task": task,
                    "cascades": [_cascade(c) for c in sorted(by_task.get(task, []), key=lambda c: c.cascade_id)],
                    "sites": rows_out, "queries": local_sum + esc_sum,
                    "escalation_rate": escalation_rate(local_sum, esc_sum)})
    return {"tasks": out, "broken": [b.to_json() for b in sorted(broken, key=lambda b: b.key)],
            "scrape_errors": dict(sorted((scrape_errors or {}).items())), "at": now}


# -- I/O -----------------------------------------------------------------------------------------------------------

async def scrape(scraper: Scraper, urls: Mapping[str, str]) -> tuple[dict[str, SiteCascades], dict[str, str]]:
    """Every live agent's cascade counters (asked at once; each call bounded by the scraper's timeout), and the
    sites that did not answer with why."""
    return await scraper.read_all(urls, cascade_counts)
