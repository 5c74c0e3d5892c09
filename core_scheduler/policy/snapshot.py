"""Immutable snapshots of mesh state: the only thing the policies read.

The agent (for routing) and the scheduler leader (for placement) build a :class:`MeshSnapshot`
from etcd state (topology, catalog, ``live/<site>`` heartbeats, ``placement/<site>``) each time
it changes, stamped with the etcd revision it reflects. Policies never see etcd, sockets or clocks.

Units and conventions (one place, so no two modules disagree):

* ``MeshSnapshot.rtt_ms[i, j]`` is the **round-trip** path latency in ms between sites ``i`` and
  ``j`` (twice the one-way shortest-path latency over topology links); ``inf`` when unreachable,
  ``0`` on the diagonal. The paths are those of :mod:`topology.paths` (one computation for routing,
  placement and the harness's WAN delays); its tables are cached and shared, so read-only.
* ``MeshSnapshot.margin_ms[i, j]`` is the **tail allowance** routing adds to a forward from ``i``
  to ``j`` on top of the round trip (see :func:`tail_margin_ms`); ``0`` on the diagonal and
  wherever the snapshot was built without link jitter.
* ``MeshSnapshot.store_site`` is where the variant store serves blobs from (``None``: unknown or
  local to every site); a cold start elsewhere fetches the variant's blob first, from the nearest of
  that site and the live sites that hold the variant loaded (agents serve their cached blobs to
  peers, ``edge_agent.blobs``).
* ``MeshSnapshot.bandwidth_mbps[i, j]`` is the bottleneck bandwidth (megabit/s) of that path;
  ``inf`` on the diagonal (no transfer to oneself), ``0`` when unreachable.
* Variant ids are unique mesh-wide (the catalog builder prefixes them with the task if needed),
  because placements and heartbeats name variants by id alone.
* A site is *alive* when its ``SiteInfo.alive`` is set **and** it has a ``SiteLoad`` (a heartbeat
  under a lease: a dead site's heartbeat disappears).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from mesh.errors import CatalogError, TopologyError
from topology.paths import PathTables, shortest_paths
from variant_store.hardware import split_cap

if TYPE_CHECKING:
    from variant_store.cascade_meta import CascadeMeta
    from variant_store.meta import VariantMeta

__all__ = ["ESTIMATE_SAFETY", "MIB", "Link", "MeshSnapshot", "SiteInfo", "SiteLoad", "VariantInfo",
           "class_speed", "path_jitter_ms", "path_tables", "tail_margin_ms", "with_estimates"]

MIB = 1 << 20
# (site a, site b, one-way latency ms, bandwidth Mbit/s); links are undirected
Link = tuple[str, str, float, float]


@dataclass(frozen=True, slots=True)
class SiteInfo:
    """One site of the topology. ``price_per_hour`` is for the whole machine."""

    name: str
    tier: str
    region: str
    hardware_class: str
    cpu_cores: int
    memory_mb: int
    gpus: int = 0
    price_per_hour: float = 0.0
    alive: bool = True
    # the accelerator memory its models may hold, from its heartbeat (edge_agent.device_memory: the topology's
    # GPUs scaled to the device present); 0: none known, and only host memory binds placement there
    device_budget_bytes: int = 0

    @property
    def slots(self) -> int:
        """Concurrent execution slots a query can hold: one GPU each, else one core each
        (sessions run with one intra-op thread)."""
        return self.gpus if self.gpus > 0 else max(1, self.cpu_cores)

    @property
    def memory_bytes(self) -> int:
        return self.memory_mb * MIB

    @property
    def model_memory_bytes(self) -> int:
        """What bounds the variants placed here: its memory, or on a GPU site whose device budget is known the
        smaller of that and the device budget (a variant there holds its weights on the device)."""
        if self.gpus > 0 and self.device_budget_bytes > 0:
            return min(self.memory_bytes, self.device_budget_bytes)
        return self.memory_bytes


@dataclass(frozen=True, slots=True)
class VariantInfo:
    """What routing and placement need to know about one variant (a slice of ``VariantMeta``)."""

    task: str
    variant_id: str
    accuracy: float
    size_bytes: int
    owner: str = "public"
    format: str = "onnx"
    precision: str = "fp32"
    # hardware class -> batch size -> median latency (ms)
    compute_ms: Mapping[str, Mapping[int, float]] = field(default_factory=dict)
    load_ms: Mapping[str, float] = field(default_factory=dict)
    memory_bytes: int = 0     # what loading it cold takes, its backbone included (a head's)
    max_batch: int = 1
    # the shared backbone (blob digest) a head runs on; its bytes are in memory_bytes, and placement
    # counts them once per site for all heads on it. None for a strict tenant's head: its backbone
    # instance is its own, so its whole memory is charged to it.
    base: str | None = None
    base_bytes: int = 0
    # hardware classes whose timings above are estimates (:func:`with_estimates`), not measurements
    estimated: frozenset[str] = frozenset()
    # the registration of its task it belongs to, and the share of the task's traffic that version draws
    # (VariantMeta's, issue 34 item 3: routing's version filter, core_scheduler.policy.versions)
    version: int = 1
    share: float = 1.0

    def usable_by(self, tenant: str) -> bool:
        return self.owner == "public" or self.owner == tenant

    def runs_on(self, hardware_class: str) -> bool:
        return bool(self.compute_ms.get(hardware_class))

    def compute_at(self, hardware_class: str, batch: int = 1) -> float:
        """Median ms for one batch of ``batch`` on ``hardware_class``; ``inf`` if never profiled
        there (an unprofiled variant is not run on that hardware rather than guessed)."""
        prof = self.compute_ms.get(hardware_class)
        if not prof:
            return math.inf
        sizes = sorted(prof)
        if batch <= sizes[0]:
            return float(prof[sizes[0]])
        for lo, hi in itertools.pairwise(sizes):
            if batch <= hi:
                a, b = prof[lo], prof[hi]
                return float(a + (b - a) * (batch - lo) / (hi - lo))
        top = sizes[-1]
        return float(prof[top] * batch / top)

    def load_at(self, hardware_class: str) -> float:
        """Cold-start ms on ``hardware_class``; the slowest known load time when not measured there."""
        if hardware_class in self.load_ms:
            return float(self.load_ms[hardware_class])
        return float(max(self.load_ms.values(), default=0.0))

    def own_bytes(self) -> int:
        """Memory without a shared backbone (what it adds to a site that holds the backbone already)."""
        return self.memory_bytes - self.base_bytes if self.base is not None else self.memory_bytes

    @classmethod
    def from_meta(cls, meta: VariantMeta, *, base_bytes: int = 0, isolated: bool = False) -> VariantInfo:
        """``base_bytes``: its backbone's memory (a head's); ``isolated``: its owner is a ``strict``
        tenant, whose heads get a backbone instance of their own."""
        compute = {hw: {b: s.p50_ms for b, s in p.latency.items()} for hw, p in meta.profiles.items()}
        loads = {hw: p.load_ms for hw, p in meta.profiles.items()}
        peak = max((p.peak_memory_bytes for p in meta.profiles.values()), default=0)
        base = meta.shared_base_digest if meta.shared_base_digest and not isolated else None
        return cls(task=meta.task, variant_id=meta.variant_id, accuracy=meta.accuracy,
                   size_bytes=meta.size_bytes, owner=meta.owner, format=meta.format,
                   precision=meta.precision, compute_ms=compute, load_ms=loads,
                   memory_bytes=max(peak, meta.size_bytes) + (base_bytes if meta.shared_base_digest else 0),
                   max_batch=max(meta.batch_sizes or [1]), base=base,
                   base_bytes=base_bytes if meta.shared_base_digest else 0,
                   version=meta.version, share=meta.share)


@dataclass(frozen=True, slots=True)
class SiteLoad:
    """A site's last heartbeat. ``queue_ms`` is the expected wait per loaded variant."""

    site: str
    loaded: frozenset[str] = frozenset()
    queue_ms: Mapping[str, float] = field(default_factory=dict)
    inflight: int = 0
    capacity: int = 1
    memory_free_bytes: int = 0
    degraded: bool = False

    @property
    def has_capacity(self) -> bool:
        return self.inflight < self.capacity and not self.degraded


@dataclass(frozen=True, slots=True)
class MeshSnapshot:
    version: int
    sites: Mapping[str, SiteInfo]
    variants: Mapping[str, tuple[VariantInfo, ...]]
    loads: Mapping[str, SiteLoad]
    rtt_ms: NDArray[np.float64]
    bandwidth_mbps: NDArray[np.float64]
    site_index: Mapping[str, int]
    placement: Mapping[str, frozenset[str]]
    margin_ms: NDArray[np.float64] | None = None
    store_site: str | None = None
    # task -> cascade id -> calibrated cascade (issue 33), only those whose every stage is in ``variants``
    # (core_scheduler.state.snapshot filters); routing weighs one as a candidate of its task
    cascades: Mapping[str, Mapping[str, CascadeMeta]] = field(default_factory=dict)
    variant_by_id: Mapping[str, VariantInfo] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.site_index)
        if self.rtt_ms.shape != (n, n) or self.bandwidth_mbps.shape != (n, n):
            raise TopologyError(f"path tables must be {n}x{n}, got {self.rtt_ms.shape} and "
                                f"{self.bandwidth_mbps.shape}", file="<snapshot>", field="rtt_ms")
        if self.margin_ms is None:
            object.__setattr__(self, "margin_ms", np.zeros((n, n)))
        elif self.margin_ms.shape != (n, n):
            raise TopologyError(f"margin table must be {n}x{n}, got {self.margin_ms.shape}",
                                file="<snapshot>", field="margin_ms")
        if set(self.site_index) != set(self.sites):
            raise TopologyError("site_index and sites name different sites", file="<snapshot>",
                                field="site_index")
        by_id: dict[str, VariantInfo] = {}
        for task, vs in self.variants.items():
            for v in vs:
                if v.variant_id in by_id:
                    raise CatalogError(f"variant id {v.variant_id!r} appears twice (task {task!r})")
                by_id[v.variant_id] = v
        object.__setattr__(self, "variant_by_id", by_id)

    def is_alive(self, site: str) -> bool:
        info = self.sites.get(site)
        return info is not None and info.alive and site in self.loads

    def rtt(self, a: str, b: str) -> float:
        return float(self.rtt_ms[self.site_index[a], self.site_index[b]])

    def fetch_ms(self, site: str, nbytes: int, holders: Iterable[str] = ()) -> float:
        """Time for ``site`` to fetch an ``nbytes`` blob from the nearest source: the variant store's
        site or one of ``holders`` (live sites holding it): a round trip for the request plus the
        transfer over the path's bottleneck (0 at a source itself; 0 with no store site known)."""
        if self.store_site is None or site == self.store_site:
            return 0.0
        i = self.site_index[site]
        best = float("inf")
        for src in (self.store_site, *holders):
            if src == site:
                return 0.0
            j = self.site_index[src]
            bw = float(self.bandwidth_mbps[i, j])
            if bw > 0:
                best = min(best, float(self.rtt_ms[i, j]) + nbytes * 8.0 / (bw * 1000.0))
        return best

    def holders(self, variant_id: str) -> tuple[str, ...]:
        """Live sites whose heartbeat says they hold ``variant_id`` loaded (and so its blob cached)."""
        return tuple(s for s, ld in self.loads.items() if variant_id in ld.loaded and self.is_alive(s))

    def placed(self, site: str) -> frozenset[str]:
        """The desired placement of ``site``, or what its heartbeat says is loaded when none."""
        if site in self.placement:
            return self.placement[site]
        load = self.loads.get(site)
        return load.loaded if load is not None else frozenset()

    @classmethod
    def from_parts(cls, sites: Iterable[SiteInfo], variants: Iterable[VariantInfo],
                   loads: Iterable[SiteLoad] = (), links: Iterable[Link] = (), *,
                   rtt_ms: NDArray[np.float64] | None = None,
                   bandwidth_mbps: NDArray[np.float64] | None = None,
                   placement: Mapping[str, Iterable[str]] | None = None,
                   margin_ms: NDArray[np.float64] | None = None,
                   store_site: str | None = None,
                   cascades: Mapping[str, Mapping[str, CascadeMeta]] | None = None,
                   version: int = 0) -> MeshSnapshot:
        """Assemble a snapshot; sites are indexed in name order. Path tables come from ``links``
        (one-way latencies) unless given. A site without a load gets an idle heartbeat holding
        its placement, so tests need only state what they vary."""
        site_map = {s.name: s for s in sorted(sites, key=lambda s: s.name)}
        index = {name: i for i, name in enumerate(site_map)}
        by_task: dict[str, list[VariantInfo]] = {}
        for v in sorted(variants, key=lambda v: (v.task, v.variant_id)):
            by_task.setdefault(v.task, []).append(v)
        if rtt_ms is None or bandwidth_mbps is None:
            rtt, bw = path_tables(index, links)
            rtt_ms = rtt if rtt_ms is None else rtt_ms
            bandwidth_mbps = bw if bandwidth_mbps is None else bandwidth_mbps
        place = {s: frozenset(vs) for s, vs in (placement or {}).items()}
        mem = {v.variant_id: v.memory_bytes for vs in by_task.values() for v in vs}
        load_map = {ld.site: ld for ld in loads}
        for name, info in site_map.items():
            if name not in load_map and info.alive:
                held = place.get(name, frozenset())
                used = sum(mem.get(v, 0) for v in held)
                load_map[name] = SiteLoad(site=name, loaded=held, capacity=info.slots,
                                          memory_free_bytes=max(0, info.memory_bytes - used))
        for name, ld in load_map.items():
            place.setdefault(name, ld.loaded)
        return cls(version=version, sites=site_map, variants={t: tuple(vs) for t, vs in by_task.items()},
                   loads=load_map, rtt_ms=np.asarray(rtt_ms, dtype=np.float64),
                   bandwidth_mbps=np.asarray(bandwidth_mbps, dtype=np.float64), site_index=index,
                   placement=place,
                   margin_ms=None if margin_ms is None else np.asarray(margin_ms, dtype=np.float64),
                   store_site=store_site if store_site in index else None, cascades=cascades or {})


def _in_index_order(index: Mapping[str, int], links: Iterable[tuple[str, str, float, float, float]],
                    pick: Callable[[PathTables], NDArray[np.float64]]) -> NDArray[np.float64]:
    """One table of :func:`topology.paths.shortest_paths` with rows and columns in ``index``'s
    order (the shared, read-only table itself when that order is the tables' sorted one)."""
    tables = shortest_paths(index, links)
    table = pick(tables)
    order = [tables.index[name] for name in sorted(index, key=index.__getitem__)]
    if order == list(range(len(order))):
        return table
    return table[np.ix_(order, order)]


def path_tables(index: Mapping[str, int], links: Iterable[Link]
                ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Round-trip latency and bottleneck bandwidth along the lowest-latency path between all pairs
    (the paths of :mod:`topology.paths`, the same ones the harness shapes its WAN delays on)."""
    five = [(a, b, lat, mbps, 0.0) for a, b, lat, mbps in links]
    return (_in_index_order(index, five, lambda t: t.rtt_ms),
            _in_index_order(index, five, lambda t: t.bandwidth_mbps))


# What an estimate from another kind of machine is multiplied by (see with_estimates): a profile measured on a
# different CPU (or GPU) says little about this one, so the estimate errs slow: routing then sends such a class
# only what has room to spare, until the class's own timings (self-profiled, edge_agent.selfprofile) replace it.
ESTIMATE_SAFETY = 2.0
# formats whose artefact is built for one machine (a TensorRT engine for one GPU model): never estimated elsewhere
_NOT_PORTABLE = frozenset({"tensorrt"})


def class_speed(hardware_class: str) -> float:
    """How fast one query runs on ``hardware_class`` relative to its uncapped base class: a CPU cap of ``c`` cores
    (``cpu-x86_64-cap0.25``) runs a one-thread session at ``min(1, c)`` of the machine's speed (CFS gives it that
    share of each period); uncapped, 1."""
    cap = split_cap(hardware_class)[1]
    return 1.0 if cap is None else max(1e-3, min(1.0, cap))


def _estimate_from(v: VariantInfo, hw: str) -> tuple[str, float] | None:
    """The measured class to estimate ``v`` on ``hw`` from and the factor to scale its timings by; None when
    nothing can be said (no profile of that kind, or an artefact bound to its machine)."""
    if v.format in _NOT_PORTABLE:
        return None
    base, kind = split_cap(hw)[0], hw.split("-", 1)[0]
    measured = sorted(m for m in v.compute_ms if m not in v.estimated and v.compute_ms[m])
    same = [m for m in measured if split_cap(m)[0] == base]
    if same:  # the same machine under another cap (or none): scaled by the caps' shares, the fastest measured
        src = max(same, key=class_speed)
        return src, class_speed(src) / class_speed(hw)
    alike = [m for m in measured if m.split("-", 1)[0] == kind]
    if not alike:
        return None
    # another machine of the same kind: the slowest of them, as if uncapped, with a safety factor
    src = max(alike, key=lambda m: v.compute_at(m, 1) * class_speed(m))
    return src, ESTIMATE_SAFETY * class_speed(src) / class_speed(hw)


def with_estimates(variants: Iterable[VariantInfo], classes: Iterable[str]) -> list[VariantInfo]:
    """``variants`` with a timing estimate for each of ``classes`` (the sites' hardware classes) they have no
    profile for, so that a variant not yet measured on a class is routed there as slow, never as absent:

    * the same machine under another CPU cap (``cpu-x86_64`` for ``cpu-x86_64-cap0.25``): its profile scaled by
      the ratio of the classes' speeds (:func:`class_speed`: 4x for a quarter of a core);
    * else a machine of the same kind (CPU from CPU, GPU from GPU): the slowest such profile, at its uncapped
      speed, times ``ESTIMATE_SAFETY``, scaled to this class's cap;
    * else (only another kind measured, or a TensorRT engine) none: it does not run there.

    Load times are scaled alike. Each such class is named in ``VariantInfo.estimated`` (routing marks a decision
    taken on one; ``explain`` and traces show it), and a measurement, the catalog's or a site's own
    (``core_scheduler.state.snapshot``), replaces it."""
    wanted = sorted(set(classes))
    out = []
    for v in variants:
        add: dict[str, tuple[str, float]] = {}
        for hw in wanted:
            if hw not in v.compute_ms or not v.compute_ms[hw]:
                src = _estimate_from(v, hw)
                if src is not None:
                    add[hw] = src
        if add:
            v = replace(v, compute_ms={**v.compute_ms, **{hw: {b: ms * f for b, ms in v.compute_ms[m].items()}
                                                          for hw, (m, f) in add.items()}},
                        load_ms={**v.load_ms, **{hw: v.load_at(m) * f for hw, (m, f) in add.items()}},
                        estimated=v.estimated | frozenset(add))
        out.append(v)
    return out


# Tail allowance of a forward (see tail_margin_ms): a proportional share of the round trip, at
# least TAIL_MIN_MS, on top of the links' declared jitter.
TAIL_FRAC = 0.10
TAIL_MIN_MS = 1.0


def path_jitter_ms(index: Mapping[str, int], links: Iterable[tuple[str, str, float, float, float]]
                   ) -> NDArray[np.float64]:
    """Round-trip jitter bound between all pairs: twice the sum of the declared jitter of the links
    on the lowest-latency path (the path :func:`path_tables` takes; ``links``: ``(a, b, latency_ms,
    mbps, jitter_ms)``); 0 when unreachable."""
    return _in_index_order(index, list(links), lambda t: t.jitter_rtt_ms)


def tail_margin_ms(rtt_ms: NDArray[np.float64], jitter_rtt_ms: NDArray[np.float64]) -> NDArray[np.float64]:
    """What routing adds to a forward's planned latency so that the path's tail, not its mean,
    fits the budget: the declared round-trip jitter plus ``max(TAIL_MIN_MS, TAIL_FRAC x rtt)``.

    Planning a remote site on the mean round trip accepts forwards whose slack is thinner than the
    path's own variation (a 40 ms query sent over a 34 ms path), and a share of them then miss;
    serving where the query arrived carries no network risk, so the diagonal stays 0. Unreachable
    pairs (``inf``) are left to the round trip to exclude."""
    finite = np.isfinite(rtt_ms)
    margin = np.where(finite, jitter_rtt_ms + np.maximum(TAIL_MIN_MS, TAIL_FRAC * np.where(finite, rtt_ms, 0.0)),
                      0.0)
    np.fill_diagonal(margin, 0.0)
    return margin
