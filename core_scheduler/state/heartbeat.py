"""``live/<site>``: the heartbeat record an agent writes under its lease and everyone else reads.

One typed definition for both ends: the agent builds a :class:`Heartbeat` and writes
:meth:`Heartbeat.to_json`; the cluster view parses each record once with
:meth:`Heartbeat.from_json`. A site writes its own record, so a compromised one writes anything: a
malformed record raises ``ValueError`` and nothing else, whatever it holds (each field is checked for its
type and range before it is used: ``int(inf)`` was an ``OverflowError`` that stopped the view), and the view
ignores it. Fields a reader does not know are dropped; fields a writer of an older
schema did not send take their defaults, so agents and schedulers of neighbouring versions agree.
The writer leaves out fields at their defaults (a reader fills them in), which halves an idle record.

What is worth writing when: :func:`why_publish` (pure) says whether a new record differs from the last
one written in anything a reader acts on now (routing: loaded variants, queue waits, capacity, identity;
placement: new demand, memory); the agent's liveness loop writes those at once and everything else
(counters, small drifts) at most every few seconds. The record's life is its lease's, kept by
keep-alives, so a site that writes nothing for a while is still alive and a dead one still vanishes
within its TTL.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any

__all__ = ["SCHEMA_VERSION", "DemandSample", "Heartbeat", "LoadedVariant", "MeasuredProfile", "PublishPolicy",
           "same_usage", "why_publish"]

SCHEMA_VERSION = 1
# What a reader takes, so that nothing it computes from a record overflows or fails:
_MAX_COUNT = 2**53        # counts and bytes: exact as a float64 and an int64 (numpy tables and sums take them)
_MAX_MAGNITUDE = 1e15     # times and rates: finite, and so are sums and products of a few
_MAX_TEXT = 4096          # a name, URL, key or note
_MAX_BATCH = 1 << 20      # a profiled batch size


def _num(value: Any, name: str) -> float:
    # a bool is an int to Python, never a number here; a huge int compares exactly (no float() to overflow)
    if isinstance(value, bool) or not isinstance(value, int | float) or not -_MAX_MAGNITUDE <= value <= _MAX_MAGNITUDE:
        raise ValueError(f"{name} must be a finite number within {_MAX_MAGNITUDE:g}, not this {type(value).__name__}")
    return float(value)


def _count(value: Any, name: str) -> int:
    # numbers written as floats are taken (truncated) as readers always did; only the range is new
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= _MAX_COUNT:
        raise ValueError(f"{name} must be a count in [0, 2**53], not this {type(value).__name__}")
    return int(value)


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str) or len(value) > _MAX_TEXT:
        raise ValueError(f"{name} must be a string of at most {_MAX_TEXT} characters, not this {type(value).__name__}")
    return value


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, not a {type(value).__name__}")
    return value


def _object(value: Any, name: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be an object, not a {type(value).__name__}")
    return value


def _entries(d: Mapping[str, Any], name: str) -> list[tuple[str, Any]]:
    """The entries of the object ``d[name]`` (absent or null: none), each key checked as a name."""
    value = d.get(name)
    return [] if value is None else [(_text(k, name), v) for k, v in _object(value, name).items()]


@dataclass(frozen=True, slots=True)
class LoadedVariant:
    """One variant a site holds, with its batcher's state at the time of the beat."""

    task: str
    queue_ms: float = 0.0          # expected wait of a query arriving now
    queued_rows: int = 0
    ewma_compute_ms: float = 0.0
    served: int = 0                # queries served since load (the scheduler's usage clock)
    load_ms: float = 0.0           # what the load took
    memory_bytes: int = 0          # measured when it loaded (a head's without its shared backbone)

    @classmethod
    def from_json(cls, value: Any) -> LoadedVariant:
        d = _object(value, "loaded variant")
        return cls(task=_text(d.get("task"), "task"), queue_ms=_num(d.get("queue_ms", 0.0), "queue_ms"),
                   queued_rows=_count(d.get("queued_rows", 0), "queued_rows"),
                   ewma_compute_ms=_num(d.get("ewma_compute_ms", 0.0), "ewma_compute_ms"),
                   served=_count(d.get("served", 0), "served"), load_ms=_num(d.get("load_ms", 0.0), "load_ms"),
                   memory_bytes=_count(d.get("memory_bytes", 0), "memory_bytes"))


@dataclass(frozen=True, slots=True)
class DemandSample:
    """Demand a site saw in its window for one (task, SLO class, tenant)."""

    task: str
    slo_class: str
    tenant: str
    qps: float
    budget_ms: float               # the tightest latency budget asked for
    min_accuracy: float            # the highest accuracy floor asked for
    rows: int = 1                  # the most rows one request brought (its compute is that batch's)

    @classmethod
    def from_json(cls, value: Any) -> DemandSample:
        d = _object(value, "demand sample")
        rows = d.get("rows", 1)
        if not isinstance(rows, int) or isinstance(rows, bool) or not 1 <= rows <= _MAX_BATCH:
            raise ValueError(f"demand rows must be an integer in [1, {_MAX_BATCH}], not this {type(rows).__name__}")
        return cls(task=_text(d.get("task"), "task"), slo_class=_text(d.get("slo_class"), "slo_class"),
                   tenant=_text(d.get("tenant", "public"), "tenant"),
                   qps=_num(d.get("qps"), "qps"), budget_ms=_num(d.get("budget_ms"), "budget_ms"),
                   min_accuracy=_num(d.get("min_accuracy"), "min_accuracy"), rows=rows)


@dataclass(frozen=True, slots=True)
class MeasuredProfile:
    """A variant's timings measured by the site itself, under its own caps, for its hardware class
    (published while the catalog has no profile for that class). ``p50_ms``: batch size -> median ms."""

    load_ms: float
    p50_ms: Mapping[int, float]

    def to_json(self) -> dict[str, Any]:
        return {"load_ms": self.load_ms, "p50_ms": {str(b): ms for b, ms in self.p50_ms.items()}}

    @classmethod
    def from_json(cls, value: Any) -> MeasuredProfile:
        d = _object(value, "measured profile")
        p50 = {_batch(b): _num(ms, "p50_ms") for b, ms in _entries(d, "p50_ms")}
        if not p50 or any(ms < 0 for ms in p50.values()):
            raise ValueError("a measured profile needs batch sizes and times >= 0")
        return cls(load_ms=_num(d.get("load_ms", 0.0), "load_ms"), p50_ms=p50)


def _batch(key: str) -> int:
    """A batch size written as an object key: decimal digits (``int()`` would also take " 1_0"), 1.._MAX_BATCH."""
    if not (key.isascii() and key.isdigit()) or len(key) > 7 or not 1 <= int(key) <= _MAX_BATCH:
        raise ValueError(f"a profiled batch size is an integer in [1, {_MAX_BATCH}]")
    return int(key)


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
    # accelerator memory its models may hold (edge_agent.device_memory: the topology's GPUs scaled to the device
    # present; 0: no device budget) and what they hold, measured at load
    device_memory_budget_bytes: int = 0
    device_memory_used_bytes: int = 0
    served: int = 0
    forwarded: int = 0
    cold_starts: int = 0
    demand: tuple[DemandSample, ...] = ()
    degraded: bool = False
    degraded_total_s: float = 0.0
    degraded_episodes: int = 0
    lease_renewals: int = 0
    view_revision: int = 0
    # measured network round trip to each peer it forwarded to (EWMA, ms, remote time removed): the console's
    # link labels; routing keeps its own correction and does not read this
    peer_rtt_ms: Mapping[str, float] = field(default_factory=dict)
    cpu_cap: float | None = None                  # cores its cgroup allows (None: uncapped)
    profiles: Mapping[str, MeasuredProfile] = field(default_factory=dict)  # variant -> self-measured
    profiling_pending: int = 0                    # variants it has still to profile for its class
    settling: bool = False                        # loading a variant, or a heap thaw owed (edge_agent.host)

    @property
    def memory_free_bytes(self) -> int:
        return max(0, self.model_memory_budget_bytes - self.memory_used_bytes)

    @property
    def device_memory_free_bytes(self) -> int:
        return max(0, self.device_memory_budget_bytes - self.device_memory_used_bytes)

    def with_liveness(self, *, degraded: bool, degraded_total_s: float, degraded_episodes: int,
                      lease_renewals: int) -> Heartbeat:
        return replace(self, degraded=degraded, degraded_total_s=round(degraded_total_s, 3),
                       degraded_episodes=degraded_episodes, lease_renewals=lease_renewals)

    def to_json(self) -> dict[str, Any]:
        """The record as written: fields at their defaults are left out (``site`` always stays)."""
        out: dict[str, Any] = {"schema": SCHEMA_VERSION}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "site" and value == _DEFAULTS[f.name]:
                continue
            out[f.name] = value
        if self.loaded:
            out["loaded"] = {vid: _compact(asdict(lv), _LV_DEFAULTS) for vid, lv in self.loaded.items()}
        if self.demand:
            out["demand"] = [_compact(asdict(d), _DEMAND_DEFAULTS) for d in self.demand]
        if self.peer_rtt_ms:
            out["peer_rtt_ms"] = {k: round(v, 3) for k, v in self.peer_rtt_ms.items()}
        if self.profiles:
            out["profiles"] = {vid: p.to_json() for vid, p in self.profiles.items()}
        return out

    @classmethod
    def from_json(cls, value: Any, *, site: str | None = None) -> Heartbeat:
        """Parse one record; ``site``: the name its key gives (``live/<site>``), which the record's
        own ``site`` field, when present, must agree with. ``ValueError`` for anything malformed, and only that."""
        d = _object(value, "a heartbeat")
        named = _text(d.get("site", site), "site")
        if site is not None and named != site:
            raise ValueError(f"heartbeat of {named[:80]!r} stored under site {site!r}")
        schema = _count(d.get("schema", SCHEMA_VERSION), "schema")
        if schema > SCHEMA_VERSION:
            raise ValueError(f"heartbeat schema {schema} is newer than this reader's {SCHEMA_VERSION}")
        scalars = {name: parse(d[name], name) for name, parse in _SCALARS.items() if d.get(name) is not None}
        scalars["capacity"] = max(1, scalars.get("capacity", 1))  # never zero: routing divides by it
        demand = d.get("demand")
        if demand is not None and not isinstance(demand, list):
            raise ValueError(f"heartbeat 'demand' must be a list, not a {type(demand).__name__}")
        return cls(site=named, **scalars,
                   loaded={vid: LoadedVariant.from_json(v) for vid, v in _entries(d, "loaded")},
                   demand=tuple(DemandSample.from_json(x) for x in demand or ()),
                   peer_rtt_ms={peer: _num(ms, "peer_rtt_ms") for peer, ms in _entries(d, "peer_rtt_ms")},
                   profiles={vid: MeasuredProfile.from_json(p) for vid, p in _entries(d, "profiles")})


# How each scalar field of a record is read (a null is the field's default, as an absent one).
_SCALARS: dict[str, Callable[[Any, str], Any]] = {
    "ts": _num, "tier": _text, "hardware_class": _text, "declared_hardware_class": _text, "gpu": _flag,
    "gpu_note": _text, "endpoint": _text, "curve_key": _text, "http": _text, "inflight": _count,
    "capacity": _count, "memory_total_bytes": _count, "model_memory_budget_bytes": _count,
    "memory_used_bytes": _count, "device_memory_budget_bytes": _count, "device_memory_used_bytes": _count,
    "served": _count, "forwarded": _count, "cold_starts": _count, "degraded": _flag,
    "degraded_total_s": _num, "degraded_episodes": _count, "lease_renewals": _count, "view_revision": _count,
    "cpu_cap": _num, "profiling_pending": _count, "settling": _flag,
}


_DEFAULTS: dict[str, Any] = {f.name: (f.default_factory() if f.default_factory is not MISSING else f.default)
                             for f in fields(Heartbeat)}
_LV_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(LoadedVariant) if f.name != "task"}
_DEMAND_DEFAULTS: dict[str, Any] = {"rows": 1}


def _compact(d: dict[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k not in defaults or v != defaults[k]}


@dataclass(frozen=True, slots=True)
class PublishPolicy:
    """When the liveness loop writes a new record (see :func:`why_publish`)."""

    queue_abs_ms: float = 2.0     # a variant's expected wait moved by more than this ...
    queue_rel: float = 0.25       # ... and by more than this share of the larger of the two
    demand_rel: float = 0.25      # a demand key's qps moved by more than this share (and 0.1 qps)
    memory_rel: float = 0.05      # memory used moved by more than this share of the model budget
    usage_interval_s: float = 2.0  # other changes (counters, small drifts, view revision) wait at most this long
    max_interval_s: float = 30.0  # and an unchanged record is written again after this long (ts, revision)


def _moved(a: float, b: float, rel: float, floor: float) -> bool:
    d = abs(a - b)
    return d > floor and d > rel * max(abs(a), abs(b))


def _identity(h: Heartbeat) -> tuple[Any, ...]:
    return (h.tier, h.hardware_class, h.declared_hardware_class, h.gpu, h.gpu_note, h.endpoint, h.curve_key,
            h.http, h.capacity, h.model_memory_budget_bytes, h.memory_total_bytes, h.degraded, h.cpu_cap,
            h.profiling_pending, h.settling, tuple(sorted(h.profiles)), h.device_memory_budget_bytes)


def why_publish(last: Heartbeat | None, new: Heartbeat, policy: PublishPolicy = PublishPolicy()) -> str | None:
    """Why ``new`` must be written now rather than at the next usage refresh: a short reason, or ``None``
    when it differs from ``last`` (the record last written) only in counters and small drifts.

    Routing reads the loaded set, queue waits and whether the site has capacity; placement reads demand
    and free memory; peers dial the endpoint and key. Anything else waits for ``usage_interval_s``."""
    if last is None:
        return "first"
    if _identity(last) != _identity(new):
        return "identity"
    if set(last.loaded) != set(new.loaded):
        return "loaded"
    if (last.inflight >= last.capacity) != (new.inflight >= new.capacity):
        return "capacity"
    for vid, lv in new.loaded.items():
        if _moved(last.loaded[vid].queue_ms, lv.queue_ms, policy.queue_rel, policy.queue_abs_ms):
            return "queue"
    if new.model_memory_budget_bytes and abs(new.memory_used_bytes - last.memory_used_bytes) > \
            policy.memory_rel * new.model_memory_budget_bytes:
        return "memory"
    if new.device_memory_budget_bytes and abs(new.device_memory_used_bytes - last.device_memory_used_bytes) > \
            policy.memory_rel * new.device_memory_budget_bytes:
        return "memory"
    before = {(d.task, d.slo_class, d.tenant): d for d in last.demand}
    after = {(d.task, d.slo_class, d.tenant): d for d in new.demand}
    if set(before) != set(after):
        return "demand"
    for key, d in after.items():
        b = before[key]
        if _moved(b.qps, d.qps, policy.demand_rel, 0.1) or (b.budget_ms, b.min_accuracy) != (d.budget_ms,
                                                                                            d.min_accuracy):
            return "demand"
    return None


def same_usage(last: Heartbeat, new: Heartbeat) -> bool:
    """Whether ``new`` says nothing ``last`` did not, apart from the writer's clock."""
    return replace(new, ts=last.ts) == last
