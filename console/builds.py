"""The console's model-builds view (issue 34: "registration, build progress ... appear in the console"): each
tenant's builds, by state, with what the variant store is doing now and, once a build is done, what each variant
measured, read from etcd (``core_scheduler.state.builds.BuildBook.views``) when the page asks:

    GET /api/builds[?tenant=NAME]
    {"tenants": [{"tenant": "acme", "counts": {"queued": 0, "running": 1, "done": 2, "failed": 1},
                  "builds": [{"id", "task", "family", "state", "stage", "progress", "error", "reason", "rows",
                              "created", "updated",
                              "variants": [{"variant", "format", "precision", "accuracy", "size_bytes",
                                            "p50_ms": {"cpu-small": 1.9}, "latency_ms": {"cpu-small": {"1": 1.9}}}],
                              "skipped": [{"kind", "reason"}]}, ...]}, ...],
     "at": <epoch seconds>}

``p50_ms`` is one figure per hardware class for the table: the p50 at batch size 1, or at the smallest batch size
the class measured; ``latency_ms`` keeps every batch size. A build with no state record yet is ``queued`` (the
store has not claimed it). Every tenant of the topology is listed (zero counts when it has no build), and any
other tenant a build names. A tenant's list holds its newest ``MAX_BUILDS``; the counts cover all of them.

Records a site tampered with never reach here (``BuildBook.views`` decodes them as hostile and skips what does
not decode); :func:`summary` still reads its input defensively (a missing state, a variant without latencies).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

from core_scheduler.state.builds import BuildView
from mesh.buildspec import BUILD_STATES, VariantResult

__all__ = ["MAX_BUILDS", "p50_by_class", "summary"]

MAX_BUILDS = 100


def p50_by_class(latency_ms: dict[str, dict[int, float]]) -> dict[str, float]:
    """hardware class -> the p50 (ms) at batch 1, or at the smallest batch size measured; classes without a
    figure are left out (no data rather than zero)."""
    out = {}
    for hw, per in sorted(latency_ms.items()):
        if per:
            out[hw] = per[1] if 1 in per else per[min(per)]
    return out


def _variant(v: VariantResult) -> dict[str, Any]:
    j = v.to_json()
    return {**j, "p50_ms": p50_by_class(v.latency_ms)}


def _build(v: BuildView) -> dict[str, Any]:
    r, st = v.request, v.state
    out: dict[str, Any] = {"id": r.build_id, "task": r.task, "family": r.family, "state": "queued", "stage": "",
                           "progress": 0.0, "error": "", "reason": "", "rows": r.rows, "created": r.created,
                           "updated": r.created, "variants": [], "skipped": []}
    if st is not None:
        out.update({"state": st.state, "stage": st.stage, "progress": st.progress, "error": st.error,
                    "reason": st.reason, "updated": max(st.updated, r.created),
                    "variants": [_variant(x) for x in st.variants],
                    "skipped": [{"kind": k, "reason": why} for k, why in st.skipped]})
    return out


def summary(views: Iterable[BuildView], tenants: Iterable[str], now: float | None = None) -> dict[str, Any]:
    """Per-tenant counts by state and builds (newest first) of ``views``; pure."""
    now = time.time() if now is None else now
    by_tenant: dict[str, list[BuildView]] = {t: [] for t in tenants}
    for v in views:
        by_tenant.setdefault(v.request.tenant, []).append(v)
    out = []
    for tenant in sorted(by_tenant):
        vs = sorted(by_tenant[tenant], key=lambda v: -v.request.created)
        counts: Counter[str] = Counter(v.state.state if v.state is not None else "queued" for v in vs)
        out.append({"tenant": tenant, "counts": {s: counts.get(s, 0) for s in BUILD_STATES},
                    "builds": [_build(v) for v in vs[:MAX_BUILDS]]})
    return {"tenants": out, "at": now}
