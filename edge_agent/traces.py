"""Decision traces: what each hop of a traced query considered, chose and took, kept by the door that answered.

A query is traced when it asks (``parameters.trace: true``; the SDK's ``trace=True``) or falls in the
agent's sample (``trace_sample_rate``, drawn at the door). It then carries a W3C ``traceparent``
(:mod:`mesh.tracecontext`) to every hop; each hop records a :class:`HopTrace` and returns its records with
the reply (``InferResponse.trace``), so the door holds the whole trace and keeps it in a bounded
:class:`TraceStore`, where ``GET /v2/traces/{id}`` finds it by request id or trace id (:mod:`edge_agent.observe`).
An untraced query builds none of this, and a query refused before the door admitted it (its tenant, task,
inputs or quota) keeps none.

The request id is the caller's choice (the V2 ``id``), so the store is keyed by (tenant, request id) and
bounded per tenant as well as in all, in traces and in bytes: one tenant cannot read, overwrite or evict
another's traces, nor fill the agent's memory with its own (issue 29). A trace is found by its trace id too
(the ``trace_id`` a result carries), within the same tenant.

A candidate's ``latency_ms`` is what routing expected in all (network + queue + compute + load), judged against
the budget; its ``cost`` is in dollars per query (:mod:`core_scheduler.policy.routing_candidates`), to four
significant figures.

A trace, as served (JSON)::

    {"request_id", "trace_id", "tenant", "task", "outcome",
     "hops": [{"site", "role": "edge" | "forward" | "serve", "at_unix",
               "candidates": [{"site", "variant", "network_ms", "queue_ms", "compute_ms", "load_ms",
                               "latency_ms", "cost", "feasible", "why_not"}],
               "choice": {"site", "variant", "reason", "estimated"} | null,
               "timings_ms": {"network", "queue", "compute", "total"},
               "door_delay_ms", "late"}]}

``choice.estimated``: the chosen variant has no measured timings on its site's hardware class yet, and was
costed from an estimate (:func:`core_scheduler.policy.snapshot.with_estimates`). ``door_delay_ms`` is the door's
own delay from the query's entry to this decision (its first one; 0 elsewhere);
``late`` is set on the door's last record when the answer came past the query's budget (``timings_ms.total``
is then the whole time from its entry).

A hop that decided more than once (a failed attempt re-decided without that site) has one record per
attempt, the failed one's choice reason saying how it failed (``forward failed: peer_down``). Hop
records from other sites are checked into exactly this shape when they arrive (:func:`clean_hops`).
"""

from __future__ import annotations

import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, Final, Literal, NamedTuple

import orjson

from core_scheduler.policy.explain import explain
from core_scheduler.policy.routing import Decision, Query
from mesh.types import MAX_REQUEST_ID, Timing

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

    __slots__ = ("door_delay_ms", "records", "role", "site")

    def __init__(self, site: str, role: Role) -> None:
        self.site, self.role = site, role
        self.records: list[dict[str, Any]] = []
        self.door_delay_ms = 0.0

    def entered(self, door_delay_ms: float) -> None:
        """The door's own delay before its first decision: kept on that decision's record (or, should routing
        refuse, on the record of the failure)."""
        self.door_delay_ms = door_delay_ms

    def decided(self, router: object, q: Query, d: Decision) -> None:
        self.records.append(self._record([c.to_json() for c in explain(router, q, d)],
                                         {"site": d.site, "variant": d.variant_id, "reason": d.reason,
                                          "estimated": d.estimated}))

    def serving(self, variant: str, reason: str) -> None:
        """A hop that runs what an earlier hop decided (no candidates of its own)."""
        self.records.append(self._record([], {"site": self.site, "variant": variant, "reason": reason,
                                              "estimated": False}))

    def failed(self, code: str) -> None:
        """The last decision's attempt failed (it will be re-decided, or the query fails); with no decision (routing
        refused it), a record of the failure itself, so that the door's delay before it is kept."""
        if not self.records and self.door_delay_ms:
            self.records.append(self._record([], None))
        if self.records:
            rec = self.records[-1]
            if rec["choice"] is not None and " failed: " not in rec["choice"]["reason"]:  # marked once
                rec["choice"]["reason"] += f" failed: {code}"
            rec["timings_ms"]["total"] = round((time.time() - rec["at_unix"]) * 1000.0, 3)

    def timed(self, timing: Timing, *, late: bool = False) -> None:
        if not self.records:
            self.records.append(self._record([], None))
        rec = self.records[-1]
        rec["timings_ms"] = {"network": round(timing.network_ms, 3), "queue": round(timing.queue_ms, 3),
                             "compute": round(timing.compute_ms, 3), "total": round(timing.total_ms, 3)}
        rec["late"] = late

    def _record(self, candidates: list[dict[str, Any]], choice: dict[str, Any] | None) -> dict[str, Any]:
        return {"site": self.site, "role": self.role, "at_unix": time.time(), "candidates": candidates,
                "choice": choice, "timings_ms": {"network": 0.0, "queue": 0.0, "compute": 0.0, "total": 0.0},
                "door_delay_ms": 0.0 if self.records else round(self.door_delay_ms, 3), "late": False}


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
            **{k: _num(c.get(k)) for k in ("network_ms", "queue_ms", "compute_ms", "load_ms", "latency_ms", "cost")},
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
            "choice": {**{k: _str(choice.get(k)) for k in ("site", "variant", "reason")},
                       "estimated": choice.get("estimated") is True} if isinstance(choice, dict) else None,
            "timings_ms": {k: _num(timings.get(k)) for k in ("network", "queue", "compute", "total")},
            "door_delay_ms": _num(h.get("door_delay_ms")), "late": h.get("late") is True,
        })
    return out


class _Kept(NamedTuple):
    trace: dict[str, Any]
    nbytes: int
    seq: int  # the store's add count when it was kept: newest is highest


class TraceStore:
    """The traces a door answered, each keyed by (tenant, request id), bounded in count and bytes, in all and per
    tenant. A request id is the caller's choice, so it names a trace only within its tenant: another tenant using
    the same id keeps a trace of its own, and cannot overwrite or read this one.

    Bounds: ``capacity`` traces and ``max_bytes`` (their size as served, JSON) in all; ``tenant_capacity`` traces
    and ``tenant_bytes`` per tenant; a trace over ``tenant_bytes`` on its own, or whose id is over
    ``MAX_REQUEST_ID``, is not kept. A tenant over its own bounds loses its oldest traces. When the store as a
    whole is over, the tenant holding the most (traces, or bytes if that is what is over) loses its oldest: a
    tenant that floods the store evicts its own traces first, and another tenant loses traces only while it holds
    as many as the flooder."""

    def __init__(self, capacity: int = 1000, *, tenant_capacity: int | None = None,
                 max_bytes: int = 64 << 20, tenant_bytes: int = 16 << 20) -> None:
        tenant_capacity = capacity if tenant_capacity is None else tenant_capacity
        for name, v in (("capacity", capacity), ("tenant capacity", tenant_capacity), ("bytes", max_bytes),
                        ("tenant bytes", tenant_bytes)):
            if v < 1:
                raise ValueError(f"trace store {name} must be >= 1, got {v}")
        self.capacity, self.tenant_capacity = capacity, tenant_capacity
        self.max_bytes, self.tenant_bytes = max_bytes, tenant_bytes
        self._tenants: dict[str, OrderedDict[str, _Kept]] = {}  # tenant -> request id -> trace, oldest first
        self._tenant_bytes: dict[str, int] = {}
        self._order: OrderedDict[tuple[str, str], None] = OrderedDict()  # every (tenant, id), oldest first
        self._trace_ids: dict[str, dict[str, str]] = {}  # tenant -> trace id -> request id (the newest of it)
        self._bytes = 0
        self._seq = 0

    def __len__(self) -> int:
        return len(self._order)

    @property
    def nbytes(self) -> int:
        """The size of every trace kept, as served (JSON bytes)."""
        return self._bytes

    def add(self, request_id: str, trace_id: str, tenant: str, task: str, outcome: str,
            hops: list[dict[str, Any]]) -> dict[str, Any] | None:
        """Keep a trace (replacing the tenant's own trace of that id, if any); None if it is not kept."""
        trace = {"request_id": request_id, "trace_id": trace_id, "tenant": tenant, "task": task,
                 "outcome": outcome, "hops": hops[:MAX_HOPS]}
        nbytes = len(orjson.dumps(trace))  # only traced queries pay it: tens of µs for a large trace
        if len(request_id) > MAX_REQUEST_ID or nbytes > self.tenant_bytes or nbytes > self.max_bytes:
            return None
        self._drop(tenant, request_id)
        self._seq += 1
        self._tenants.setdefault(tenant, OrderedDict())[request_id] = _Kept(trace, nbytes, self._seq)
        self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) + nbytes
        self._order[(tenant, request_id)] = None
        if trace_id:
            self._trace_ids.setdefault(tenant, {})[trace_id] = request_id
        self._bytes += nbytes
        own = self._tenants[tenant]
        while len(own) > self.tenant_capacity or self._tenant_bytes[tenant] > self.tenant_bytes:
            self._drop(tenant, next(iter(own)))
        while len(self._order) > self.capacity:
            self._evict(self._largest(lambda t: len(self._tenants[t])))
        while self._bytes > self.max_bytes:
            self._evict(self._largest(lambda t: self._tenant_bytes[t]))
        return trace

    def get(self, key: str, tenant: str | None = None) -> dict[str, Any] | None:
        """``tenant``'s trace whose request id is ``key`` or, failing that, whose trace id is; with no tenant (a
        reader of every tenant's), the newest of any tenant's."""
        found = [k for t in ([tenant] if tenant is not None else list(self._tenants))
                 if (k := self._find(t, key)) is not None]
        return max(found, key=lambda k: k.seq).trace if found else None

    def _find(self, tenant: str, key: str) -> _Kept | None:
        own = self._tenants.get(tenant)
        if own is None:
            return None
        kept = own.get(key)
        if kept is None and (rid := self._trace_ids.get(tenant, {}).get(key)) is not None:
            kept = own.get(rid)
        return kept

    def recent(self, limit: int, tenant: str | None = None) -> list[dict[str, Any]]:
        """Summaries of the newest ``limit`` traces (of ``tenant`` only, if given), newest first."""
        own = self._tenants.get(tenant) if tenant is not None else None
        keys: Iterable[tuple[str, str]] = (reversed(self._order) if tenant is None
                                           else ((tenant, rid) for rid in reversed(own or {})))
        out: list[dict[str, Any]] = []
        for t, rid in keys:
            if len(out) >= limit:
                break
            trace = self._tenants[t][rid].trace
            at = trace["hops"][0]["at_unix"] if trace["hops"] else 0.0
            out.append({"request_id": rid, "tenant": t, "task": trace["task"], "outcome": trace["outcome"],
                        "at_unix": at})
        return out

    def _largest(self, size: Callable[[str], int]) -> str:
        """The tenant holding the most by ``size``; of equals, the one whose oldest trace is oldest."""
        return max(self._tenants, key=lambda t: (size(t), -next(iter(self._tenants[t].values())).seq))

    def _evict(self, tenant: str) -> None:
        self._drop(tenant, next(iter(self._tenants[tenant])))

    def _drop(self, tenant: str, request_id: str) -> None:
        own = self._tenants.get(tenant)
        kept = own.pop(request_id, None) if own is not None else None
        if kept is None:
            return
        del self._order[(tenant, request_id)]
        self._bytes -= kept.nbytes
        self._tenant_bytes[tenant] -= kept.nbytes
        ids = self._trace_ids.get(tenant, {})
        if ids.get(kept.trace["trace_id"]) == request_id:
            del ids[kept.trace["trace_id"]]
        if not own:
            del self._tenants[tenant], self._tenant_bytes[tenant]
            self._trace_ids.pop(tenant, None)
