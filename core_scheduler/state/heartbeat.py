"""``live/<site>``: the heartbeat record an agent writes under its lease and everyone else reads.

One typed definition for both ends: the agent builds a :class:`Heartbeat` and writes
:meth:`Heartbeat.to_json`; the cluster view parses each record once with
:meth:`Heartbeat.from_json` (a malformed record raises ``ValueError``/``TypeError``/``KeyError``
and the view ignores it). Fields a reader does not know are dropped; fields a writer of an older
schema did not send take their defaults, so agents and schedulers of neighbouring versions agree.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

__all__ = ["SCHEMA_VERSION", "DemandSample", "Heartbeat", "LoadedVariant", "MeasuredProfile"]

SCHEMA_VERSION = 1


def _num(value: Any, name: str) -> float:
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{name} is not finite: {value!r}")
    return out


@dataclass(frozen=True, slots=True)
class LoadedVariant:
    """One variant a site holds, with its batcher's state at the time of the beat."""

    task: str
    queue_ms: float = 0.0          # expected wait of a query arriving now
    queued_rows: int = 0
    ewma_compute_ms: float = 0.0
    served: int = 0                # queries served since load (the scheduler's usage clock)
    load_ms: float = 0.0           # what the load took

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LoadedVariant:
        return cls(task=str(d["task"]), queue_ms=_num(d.get("queue_ms", 0.0), "queue_ms"),
                   queued_rows=int(d.get("queued_rows", 0)),
                   ewma_compute_ms=_num(d.get("ewma_compute_ms", 0.0), "ewma_compute_ms"),
                   served=int(d.get("served", 0)), load_ms=_num(d.get("load_ms", 0.0), "load_ms"))


@dataclass(frozen=True, slots=True)
class DemandSample:
    """Demand a site saw in its window for one (task, SLO class, tenant)."""

    task: str
    slo_class: str
    tenant: str
    qps: float
    budget_ms: float               # the tightest latency budget asked for
    min_accuracy: float            # the highest accuracy floor asked for

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> DemandSample:
        return cls(task=str(d["task"]), slo_class=str(d["slo_class"]), tenant=str(d.get("tenant", "public")),
                   qps=_num(d["qps"], "qps"), budget_ms=_num(d["budget_ms"], "budget_ms"),
                   min_accuracy=_num(d["min_accuracy"], "min_accuracy"))


@dataclass(frozen=True, slots=True)
class MeasuredProfile:
    """A variant's timings measured by the site itself, under its own caps, for its hardware class
    (published while the catalog has no profile for that class). ``p50_ms``: batch size -> median ms."""

    load_ms: float
    p50_ms: Mapping[int, float]

    def to_json(self) -> dict[str, Any]:
        return {"load_ms": self.load_ms, "p50_ms": {str(b): ms for b, ms in self.p50_ms.items()}}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> MeasuredProfile:
        p50 = {int(b): _num(ms, "p50_ms") for b, ms in dict(d["p50_ms"]).items()}
        if not p50 or any(b < 1 or ms < 0 for b, ms in p50.items()):
            raise ValueError(f"a measured profile needs batch sizes >= 1 and times >= 0, got {p50}")
        return cls(load_ms=_num(d.get("load_ms", 0.0), "load_ms"), p50_ms=p50)


@dataclass(frozen=True, slots=True)
class Heartbeat:
    site: str
    ts: float = 0.0                               # the writer's wall clock: for people, never compared
    tier: str | None = None
    hardware_class: str | None = None             # what the site really runs on
    declared_hardware_class: str | None = None    # what the topology says it has
    gpu: bool = False
    gpu_note: str = ""
    endpoint: str | None = None                   # ZeroMQ endpoint peers dial
    curve_key: str | None = None                  # its CURVE server public key (Z85), when CURVE is on
    http: str | None = None                       # edge HTTP URL
    loaded: Mapping[str, LoadedVariant] = field(default_factory=dict)
    inflight: int = 0
    capacity: int = 1
    memory_total_bytes: int = 0
    model_memory_budget_bytes: int = 0
    memory_used_bytes: int = 0
    served: int = 0
    forwarded: int = 0
    cold_starts: int = 0
    demand: tuple[DemandSample, ...] = ()
    degraded: bool = False
    degraded_total_s: float = 0.0
    degraded_episodes: int = 0
    lease_renewals: int = 0
    view_revision: int = 0
    cpu_cap: float | None = None                  # cores its cgroup allows (None: uncapped)
    profiles: Mapping[str, MeasuredProfile] = field(default_factory=dict)  # variant -> self-measured
    profiling_pending: int = 0                    # variants it has still to profile for its class

    @property
    def memory_free_bytes(self) -> int:
        return max(0, self.model_memory_budget_bytes - self.memory_used_bytes)

    def with_liveness(self, *, degraded: bool, degraded_total_s: float, degraded_episodes: int,
                      lease_renewals: int) -> Heartbeat:
        return replace(self, degraded=degraded, degraded_total_s=round(degraded_total_s, 3),
                       degraded_episodes=degraded_episodes, lease_renewals=lease_renewals)

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["loaded"] = {vid: asdict(lv) for vid, lv in self.loaded.items()}
        out["demand"] = [asdict(d) for d in self.demand]
        out["profiles"] = {vid: p.to_json() for vid, p in self.profiles.items()}
        return {"schema": SCHEMA_VERSION, **out}

    @classmethod
    def from_json(cls, d: Mapping[str, Any], *, site: str | None = None) -> Heartbeat:
        """Parse one record; ``site``: the name its key gives (``live/<site>``), which the record's
        own ``site`` field, when present, must agree with."""
        if not isinstance(d, Mapping):
            raise TypeError(f"a heartbeat is a JSON object, not {type(d).__name__}")
        if site is not None:
            if d.get("site", site) != site:
                raise ValueError(f"heartbeat of {d.get('site')!r} stored under site {site!r}")
            d = {**d, "site": site}
        schema = int(d.get("schema", SCHEMA_VERSION))
        if schema > SCHEMA_VERSION:
            raise ValueError(f"heartbeat schema {schema} is newer than this reader's {SCHEMA_VERSION}")
        loaded = d.get("loaded")
        demand = d.get("demand")
        loaded = {} if loaded is None else loaded
        demand = [] if demand is None else demand
        if not isinstance(loaded, Mapping) or not isinstance(demand, list):
            raise TypeError("heartbeat 'loaded' must be an object and 'demand' a list")
        profiles = d.get("profiles")
        profiles = {} if profiles is None else profiles
        if not isinstance(profiles, Mapping):
            raise TypeError("heartbeat 'profiles' must be an object")
        known = {f.name for f in fields(cls)} - {"loaded", "demand", "profiles"}
        scalars = {k: v for k, v in d.items() if k in known}
        hb = cls(**scalars, loaded={str(vid): LoadedVariant.from_json(v) for vid, v in loaded.items()},
                 demand=tuple(DemandSample.from_json(x) for x in demand),
                 profiles={str(vid): MeasuredProfile.from_json(p) for vid, p in profiles.items()})
        return replace(hb, capacity=max(1, int(hb.capacity)), inflight=int(hb.inflight),
                       memory_used_bytes=int(hb.memory_used_bytes),
                       model_memory_budget_bytes=int(hb.model_memory_budget_bytes),
                       ts=_num(hb.ts, "ts"), gpu=bool(hb.gpu),
                       curve_key=None if hb.curve_key is None else str(hb.curve_key),
                       cpu_cap=None if hb.cpu_cap is None else _num(hb.cpu_cap, "cpu_cap"))
