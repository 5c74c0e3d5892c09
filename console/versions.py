"""The console's versions view (issue 34 item 3: "registration, build progress and per-version traffic appear in the
console"): each tenant task's versions as the variant store records them (``versions/<task>``, a
:class:`~variant_store.versions.VersionRecord`), joined with the queries each version served, summed over the sites
from the agents' counter (``edge_agent.metrics``; public variants are not counted there, they have no versions):

    tiermesh_version_queries_total{task,tenant,site,version}   counted by the site that ran the query

    GET /api/versions[?tenant=NAME]
    {"tasks": [{"task": "my-digits", "owner": "acme", "active": 2, "traffic": {"2": 1.0}, "queries": 130,
                "versions": [{"version": 1, "family", "state", "accuracy", "share", "queries": 100,
                              "sites": {"edge-a": 100}, "retire_at" (retiring only)}, ...]}, ...],
     "broken": [{"key", "task", "name", "reason"}], "scrape_errors": {"mid": "..."}, "at": <epoch seconds>}

``share`` is the version's share of the task's traffic (:func:`variant_store.versions.shares_of`: the split when the
tenant set one, else all of it to the active version); ``queries`` count since each agent started (counters: a
restarted agent counts from zero). A version the agents counted that the record no longer holds (its task deleted
since) is listed with ``state`` None, so its traffic stays visible. Counters are keyed by the site the console
scraped (whose certificate it checked), not by the label the agent wrote; an ``other`` version (a variant the
agent's view did not know) cannot be attributed and is left out. A record that does not decode, or that names
another task than its key, is listed in ``broken`` with the reason, never raised.

The pure parts (:func:`version_counts`, :func:`decode_record`, :func:`summary`) take parsed samples and stored
values; :func:`read_records` and :func:`scrape` are the thin I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from console.digest import Sample
from console.scrape import Scraper
from mesh.etcd.keys import VERSIONS
from mesh.etcd.store import Store
from variant_store.catalog_check import BrokenEntry
from variant_store.versions import MAX_VERSIONS, VersionRecord

__all__ = ["VersionReading", "decode_record", "read_records", "scrape", "summary", "version_counts"]

_QUERIES = "tiermesh_version_queries_total"


def version_counts(samples: Iterable[Sample]) -> dict[tuple[str, str, int], float]:
    """(task, tenant, version) -> queries, from one agent's parsed ``/metrics``; other samples, versions that are no
    version number (``other``), negative or non-finite counts are ignored."""
    out: dict[tuple[str, str, int], float] = {}
    for s in samples:
        if s.name != _QUERIES or not (s.value >= 0 and s.value != float("inf")):  # NaN fails the second test
            continue
        v = s.labels.get("version", "")
        if not (v.isascii() and v.isdigit() and len(v) <= 6 and 1 <= int(v) <= MAX_VERSIONS):
            continue
        key = (s.labels.get("task", ""), s.labels.get("tenant", ""), int(v))
        out[key] = out.get(key, 0.0) + s.value
    return out


def decode_record(key: str, value: Any) -> VersionRecord:
    """The record at ``versions/<task>`` (``key`` relative to the store prefix); ``ValueError``, only that, for
    anything else (etcd may hold any bytes)."""
    try:
        rec = VersionRecord.from_json(value)
    except Exception as exc:  # hostile input: RecursionError, OverflowError, TypeError are as likely
        raise ValueError(str(exc)[:300] or type(exc).__name__) from exc
    if key != VERSIONS + rec.task:
        raise ValueError(f"the record names task {rec.task!r}, not its key's")
    return rec


@dataclass(slots=True)
class VersionReading:
    records: list[VersionRecord] = field(default_factory=list)
    broken: list[BrokenEntry] = field(default_factory=list)


def _task(rec: VersionRecord, counted: Mapping[int, dict[str, float]]) -> dict[str, Any]:
    s = rec.to_summary()
    rows = {v["version"]: v for v in s["versions"]}
    for v in counted.keys() - rows.keys():
        rows[v] = {"version": v, "family": None, "state": None, "accuracy": None, "share": 0.0}
    versions = []
    for v, row in sorted(rows.items()):
        sites = dict(sorted(counted.get(v, {}).items()))
        versions.append({**row, "queries": sum(sites.values()), "sites": sites})
    return {"task": rec.task, "owner": rec.owner, "active": s["active"], "traffic": s["traffic"],
            "queries": sum(v["queries"] for v in versions), "versions": versions}


def summary(records: Iterable[VersionRecord], broken: Iterable[BrokenEntry],
            sites: Mapping[str, Mapping[tuple[str, str, int], float]], scrape_errors: Mapping[str, str] | None = None,
            now: float = 0.0, tenant: str | None = None) -> dict[str, Any]:
    """Per task (by owner, then name): its versions and the queries each served, per site and in all; every task
    that has a record or that some site counted versions of; only ``tenant``'s when given; pure."""
    counted: dict[str, dict[int, dict[str, float]]] = {}  # task -> version -> site -> queries
    owners: dict[str, str] = {}
    for site, counts in sites.items():
        for (task, owner, v), n in counts.items():
            per = counted.setdefault(task, {}).setdefault(v, {})
            per[site] = per.get(site, 0.0) + n
            owners.setdefault(task, owner)
    by_task = {r.task: r for r in records}
    for task in counted.keys() - by_task.keys():
        by_task[task] = VersionRecord(task=task, owner=owners[task])  # deleted since: its traffic alone
    out = [_task(r, counted.get(r.task, {})) for r in sorted(by_task.values(), key=lambda r: (r.owner, r.task))
           if tenant is None or r.owner == tenant]
    return {"tasks": out, "broken": [b.to_json() for b in sorted(broken, key=lambda b: b.key)],
            "scrape_errors": dict(sorted((scrape_errors or {}).items())), "at": now}


# -- I/O -----------------------------------------------------------------------------------------------------------

async def read_records(store: Store) -> VersionReading:
    """Every version record that decodes, and every one that does not (``StoreError`` when etcd does not answer)."""
    out = VersionReading()
    for item in await store.get_prefix(VERSIONS):
        try:
            out.records.append(decode_record(item.key, item.value))
        except ValueError as exc:
            task = item.key.removeprefix(VERSIONS)
            out.broken.append(BrokenEntry(item.key, task, task, f"malformed version record: {exc}"))
    return out


async def scrape(scraper: Scraper, urls: Mapping[str, str]
                 ) -> tuple[dict[str, dict[tuple[str, str, int], float]], dict[str, str]]:
    """Every live agent's per-version counters (asked at once, each bounded by the scraper's timeout), and the sites
    that did not answer with why."""
    return await scraper.read_all(urls, version_counts)
