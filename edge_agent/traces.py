"""Decision traces: what each hop of a traced query considered, chose and took, kept by the door that answered.

A query is traced when it asks (``parameters.trace: true``; the SDK's ``trace=True``) or falls in the
agent's sample (``trace_sample_rate``, drawn at the door). It then carries a W3C ``traceparent``
(:mod:`mesh.tracecontext`) to every hop; each hop records a :class:`HopTrace` and returns its records with
the reply (``InferResponse.trace``), so the door holds the whole trace and keeps it in a bounded
:class:`TraceStore`, where ``GET /v2/traces/{request_id}`` finds it (:mod:`edge_agent.observe`).
An untraced query builds none of this.

A trace, as served (JSON)::

    {"request_id", "trace_id", "tenant", "task", "outcome",
     "hops": [{"site", "role": "edge" | "forward" | "serve", "at_unix",
               "candidates": [{"site", "variant", "network_ms", "queue_ms", "compute_ms", "load_ms",
                               "cost", "feasible", "why_not"}],
               "choice": {"site", "variant", "reason"} | null,
               "timings_ms": {"network", "queue", "compute", "total"}}]}

A hop that decided more than once (a failed attempt re-decided without that site) has one record per
attempt, the failed one's choice reason saying how it failed (``forward failed: peer_down``). Hop
records from other sites are checked into exactly this shape when they arrive (:func:`clean_hops`).
"""

from __future__ import annotations

import math
import random
import time
from collections import OrderedDict
from typing import Any, Final, Literal

from core_scheduler.policy.explain import explain
from core_scheduler.policy.routing import Decision, Query
from mesh.types import Timing

__all__ = ["MAX_HOPS", "ROLES", "HopTrace", "TraceStore", "clean_hops", "sampled"]

Role = Literal["edge", "forward", "serve"]
ROLES: Final = ("edge", "forward", "serve")
MAX_HOPS = 16                 # hop records kept per trace (a query takes few; a peer may send junk)
_MAX_CANDIDATES = 64
_STR_MAX = 128


def sampled(rate: float) -> bool:
    """Whether a query not asking for its trace is traced anyway (``rate`` in [0, 1]; 0: never)."""
    return rate > 0.0 and random.random() < rate


class HopTrace:
    """The records of one hop of one traced query (one per decision it made)."""

    __slots__ = ("records", "role", "site")

    def __init__(self, site: str, role: Role) -> None:
        self.site, self.role = site, role
        self.records: list[dict[str, Any]] = []

    def decided(self, router: object, q: Query, d: Decision) -> None:
        self.records.append(self._record([c.to_json() for c in explain(router, q, d)],
                                         {"site": d.site, "variant": d.variant_id, "reason": d.reason}))

    def serving(self, variant: str, reason: str) -> None:
        """A hop that runs what an earlier hop decided (no candidates of its own)."""
        self.records.append(self._record([], {"site": self.site, "variant": variant, "reason": reason}))

    def failed(self, code: str) -> None:
        """The last decision's attempt failed (it will be re-decided, or the query fails)."""
        if self.records:
            rec = self.records[-1]
            if rec["choice"] is not None and " failed: " not in rec["choice"]["reason"]:  # marked once
                rec["choice"]["reason"] += f" failed: {code}"
            rec["timings_ms"]["total"] = round((time.time() - rec["at_unix"]) * 1000.0, 3)

    def timed(self, timing: Timing) -> None:
        if not self.records:
            self.records.append(self._record([], None))
        self.records[-1]["timings_ms"] = {"network": round(timing.network_ms, 3), "queue": round(timing.queue_ms, 3),
                                          "compute": round(timing.compute_ms, 3), "total": round(timing.total_ms, 3)}

    def _record(self, candidates: list[dict[str, Any]], choice: dict[str, str] | None) -> dict[str, Any]:
        return {"site": self.site, "role": self.role, "at_unix": time.time(), "candidates": candidates,
                "choice": choice, "timings_ms": {"network": 0.0, "queue": 0.0, "compute": 0.0, "total": 0.0}}


def _str(v: object, default: str = "") -> str:
    return v[:_STR_MAX] if isinstance(v, str) else default


def _num(v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return 0.0
    f = float(v)
    return f if math.isfinite(f) else -1.0


def _candidate(c: object) -> dict[str, Any] | None:
    if not isinstance(c, dict):
        return None
    why = c.get("why_not")
    return {"site": _str(c.get("site")), "variant": _str(c.get("variant")),
            **{k: _num(c.get(k)) for k in ("network_ms", "queue_ms", "compute_ms", "load_ms", "cost")},
            "feasible": c.get("feasible") is True, "why_not": _str(why) if isinstance(why, str) else None}


def clean_hops(hops: object) -> list[dict[str, Any]]:
    """Hop records from a peer's reply in exactly the served shape: fields coerced, unknown ones dropped,
    sizes bounded. Garbage becomes empty fields rather than an error: a trace is a diagnostic."""
    out: list[dict[str, Any]] = []
    for h in hops if isinstance(hops, list) else []:
        if not isinstance(h, dict) or len(out) >= MAX_HOPS:
            continue
        role, choice, timings, cands = h.get("role"), h.get("choice"), h.get("timings_ms"), h.get("candidates")
        timings = timings if isinstance(timings, dict) else {}
        cands = cands if isinstance(cands, list) else []
        out.append({
            "site": _str(h.get("site")), "role": role if role in ROLES else "serve", "at_unix": _num(h.get("at_unix")),
            "candidates": [c for c in map(_candidate, cands[:_MAX_CANDIDATES]) if c is not None],
            "choice": {k: _str(choice.get(k)) for k in ("site", "variant", "reason")}
            if isinstance(choice, dict) else None,
            "timings_ms": {k: _num(timings.get(k)) for k in ("network", "queue", "compute", "total")},
        })
    return out


class TraceStore:
    """The traces a door answered, newest last, at most ``capacity`` (the oldest goes first)."""

    def __init__(self, capacity: int = 1000) -> None:
        if capacity < 1:
            raise ValueError(f"trace store capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._traces: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._traces)

    def add(self, request_id: str, trace_id: str, tenant: str, task: str, outcome: str,
            hops: list[dict[str, Any]]) -> dict[str, Any]:
        trace = {"request_id": request_id, "trace_id": trace_id, "tenant": tenant, "task": task,
                 "outcome": outcome, "hops": hops[:MAX_HOPS]}
        self._traces.pop(request_id, None)
        self._traces[request_id] = trace
        while len(self._traces) > self.capacity:
            self._traces.popitem(last=False)
        return trace

    def get(self, request_id: str) -> dict[str, Any] | None:
        return self._traces.get(request_id)

    def recent(self, limit: int, tenant: str | None = None) -> list[dict[str, Any]]:
        """Summaries of the newest ``limit`` traces (of ``tenant`` only, if given), newest first."""
        out: list[dict[str, Any]] = []
        for t in reversed(self._traces.values()):
            if len(out) >= limit:
                break
            if tenant is None or t["tenant"] == tenant:
                at = t["hops"][0]["at_unix"] if t["hops"] else 0.0
                out.append({"request_id": t["request_id"], "tenant": t["tenant"], "task": t["task"],
                            "outcome": t["outcome"], "at_unix": at})
        return out
