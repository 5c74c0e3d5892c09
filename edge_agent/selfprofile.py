"""A site measures, under its own caps, the variants its hardware class has no profile for.

Profiles are keyed by hardware class, and a site under a CPU cap is a class of its own
(``cpu-x86_64-cap0.25``): the catalog's profiles were measured elsewhere (uncapped, by the builder), and
routing does not run a variant on a class it has no timings for. Rather than leave such a site unusable
until someone reprofiles by hand, its agent profiles each such variant itself on first load: it loads it
through the host (the memory budget holds), times the very function a batch runs at batch sizes 1 and 8
(bounded runs and seconds; larger batches are extrapolated, as routing does past a profile's largest
size: a six-layer encoder at batch 32 takes seconds under an edge's cap), keeps the variant only if
placement wants it or a query used it meanwhile, and publishes the timings in its heartbeat
(``profiles``), where every snapshot builder reads them for that class until the catalog has a profile
of its own.

Sites of one class share the work: a variant some live site of this class has already published timings
for is not timed again here (its timings are adopted for this site's batch-cost estimates), and each site
takes every n-th of the class's missing variants (from its rank among the class's n live sites) before
the others' leftovers, so seventeen capped edges time seventeen different variants at once instead of the
same one seventeen times. The cheapest variant of each task goes first: the class can serve every task
soonest. A site that dies takes its timings with it: whatever no live site publishes is missing again.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable

import numpy as np

from core_scheduler.state.heartbeat import MeasuredProfile
from core_scheduler.state.view import MeshView
from edge_agent.batch_parts import InferFn
from edge_agent.host import VariantHost
from mesh.errors import MeshError, Overloaded, PermissionDenied
from mesh.log import get_logger, kv
from mesh.types import TaskSignature
from variant_store.meta import LatencyStats, Profile, VariantMeta

__all__ = ["SelfProfiler", "sample_inputs", "time_batches"]

log = get_logger(__name__)

QUIET_S = 1.0  # idle seconds before a variant placement does not ask for is profiled
DUTY = 0.5  # timing runs take at most this share of the profiler's time (it rests the rest) ...
YIELD_STEP_S = 0.005  # ... and it waits in steps of this while a query is in flight ...
MAX_YIELD_S = 2.0  # ... at most this long per batch size (a site never idle is still timed)

# a sentence for text inputs (BYTES): timing depends on its length in tokens, not on its words
_SAMPLE_TEXT = b"the central bank held interest rates steady as markets waited for new inflation figures"


def sample_inputs(sig: TaskSignature, batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs of ``sig``'s shapes for ``batch`` rows: uniform [0, 1) floats, zero integers, a sentence
    for text. Timing needs the shapes and types, not labelled data."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for spec in sig.inputs:
        shape = (batch, *(d if d > 0 else 1 for d in spec.shape[1:]))
        dtype = spec.dtype.lower()
        if dtype in ("object", "bytes", "str", "string"):
            out[spec.name] = np.full(shape, _SAMPLE_TEXT, dtype=object)
        elif dtype.startswith(("float", "bfloat")):
            out[spec.name] = rng.random(shape).astype(dtype)
        else:
            out[spec.name] = np.zeros(shape, dtype=dtype)
    return out


def time_batches(infer: InferFn, inputs_for: Callable[[int], dict[str, np.ndarray]], batch_sizes: tuple[int, ...],
                 *, repeats: int = 20, time_budget_s: float = 0.25, busy: Callable[[], bool] | None = None,
                 duty: float = DUTY, max_yield_s: float = MAX_YIELD_S,
                 sleep: Callable[[float], None] = time.sleep) -> dict[int, LatencyStats]:
    """Median and p99 ms of ``infer`` at each batch size, after one warm-up run; at most ``repeats`` runs
    and about ``time_budget_s`` seconds of runs per batch size (at least one run).

    It runs in a thread of the serving process, under the site's CPU cap: so that it never starves the site's
    traffic (a tenth of a core has no room for both), it waits before each run while ``busy()`` (a query in
    flight; at most ``max_yield_s`` in all per batch size, so a site never idle is still timed), and rests after
    each run so that runs take at most ``duty`` of its time."""
    out: dict[int, LatencyStats] = {}
    rest = max(0.0, 1.0 / duty - 1.0) if duty > 0 else 0.0
    for bs in batch_sizes:
        x = inputs_for(bs)
        infer(x)
        times: list[float] = []
        spent, yielded = 0.0, 0.0
        for _ in range(max(1, repeats)):
            while busy is not None and yielded < max_yield_s and busy():
                sleep(YIELD_STEP_S)
                yielded += YIELD_STEP_S
            t0 = time.perf_counter()
            infer(x)
            took = time.perf_counter() - t0
            times.append(took * 1000.0)
            spent += took
            if spent > time_budget_s:
                break
            if rest:
                sleep(took * rest)
        arr = np.asarray(times)
        out[bs] = LatencyStats(p50_ms=float(np.percentile(arr, 50)), p99_ms=float(np.percentile(arr, 99)))
    return out


def _cost(meta: VariantMeta) -> float:
    """How dear ``meta`` is to time, by the cheapest profile the catalog has of it (any class): its load and
    a batch of 8. Not its file's size: a head of a few kilobytes brings a 90 MB encoder with it."""
    costs = [p.load_ms + p.compute_ms(8) for p in meta.profiles.values()]
    return min(costs) if costs else math.inf  # none anywhere: last


class SelfProfiler:
    """Profiles this site's missing variants one at a time; :meth:`run` is its loop (it never dies)."""

    def __init__(self, site: str, host: VariantHost, view: MeshView, *, wanted: Callable[[], set[str]],
                 idle_s: Callable[[], float] = lambda: math.inf,
                 batch_sizes: tuple[int, ...] = (1, 8), time_budget_s: float = 0.25,
                 published_cb: Callable[[], Awaitable[None]] | None = None) -> None:
        self.site = site
        self.host = host
        self.view = view
        self.wanted = wanted              # variants placement asks of this site (kept loaded after timing)
        # seconds since this site last served a query (0 while one is in flight): variants placement does
        # not ask for are timed only after QUIET_S of it, so speculative profiling never takes a capped
        # site's little CPU from its traffic
        self.idle_s = idle_s
        self.batch_sizes = batch_sizes
        self.time_budget_s = time_budget_s
        self.failed: dict[str, str] = {}  # variant -> why it cannot run here (not retried)
        self.unreadable: set[str] = set()  # variants whose blob the store refused: retried once placement asks
        self.no_room: set[str] = set()    # did not fit the memory budget when last tried (tried again)
        self._wake = asyncio.Event()
        self.published_cb = published_cb  # tells the mesh at once (a heartbeat) what was just timed

    @property
    def hardware_class(self) -> str:
        return self.host.hardware_class

    def published(self) -> dict[str, MeasuredProfile]:
        """What the heartbeat carries: self-measured timings the catalog still lacks for this class."""
        out = {}
        for vid, prof in self.host.self_profiles.items():
            meta = self._meta(vid)
            if meta is not None and self.hardware_class not in meta.profiles:
                out[vid] = MeasuredProfile(load_ms=round(prof.load_ms, 2),
                                           p50_ms={b: round(s.p50_ms, 4) for b, s in prof.latency.items()})
        return out

    def _meta(self, variant_id: str) -> VariantMeta | None:
        for vs in self.view.variants.values():
            if variant_id in vs:
                return vs[variant_id]
        return None

    def class_peers(self) -> list[str]:
        """Live sites of this site's hardware class, this one included, sorted by name."""
        peers = {n for n, hb in self.view.live.items() if hb.hardware_class == self.hardware_class}
        return sorted(peers | {self.site})

    def peer_profiles(self) -> dict[str, MeasuredProfile]:
        """Timings other live sites of this class publish (the first by site name per variant)."""
        out: dict[str, MeasuredProfile] = {}
        for name, hb in sorted(self.view.live.items()):
            if name != self.site and hb.hardware_class == self.hardware_class:
                for vid, prof in hb.profiles.items():
                    out.setdefault(vid, prof)
        return out

    def adopt_peer_profiles(self) -> dict[str, MeasuredProfile]:
        """The host's batch-cost estimates take the class's published timings for what this site did not
        time itself; returns those timings."""
        peers = self.peer_profiles()
        self.host.class_profiles = {
            vid: Profile(hardware_class=self.hardware_class, load_ms=p.load_ms,
                         latency={b: LatencyStats(p50_ms=ms, p99_ms=ms) for b, ms in p.p50_ms.items()},
                         peak_memory_bytes=0)
            for vid, p in peers.items() if vid not in self.host.self_profiles}
        return peers

    def wake(self) -> None:
        self._wake.set()

    @property
    def pending(self) -> int:
        """Variants still to profile here, not counting those that do not fit this site's memory."""
        return sum(1 for m in self.missing() if m.variant_id not in self.no_room)

    def missing(self) -> list[VariantMeta]:
        """Variants with no profile for this class, neither measured here nor by a live site of this class, nor
        failed here: those placement wants here first, then the rest cheapest first, this site's share
        of the class's list before the others' (see the module's docstring)."""
        peers = self.adopt_peer_profiles()
        wanted = self.wanted()
        # a variant whose blob the store refused this site (a tenant's private one, given only to the sites placement
        # asks to serve that tenant: variant_store.placed) waits until placement asks for it here; routing costs it
        # from an estimate until then
        out = [m for vs in self.view.variants.values() for m in vs.values()
               if self.hardware_class not in m.profiles and m.variant_id not in self.host.self_profiles
               and m.variant_id not in peers and m.variant_id not in self.failed and m.task in self.view.signatures
               and (m.variant_id not in self.unreadable or m.variant_id in wanted)]
        first = sorted((m for m in out if m.variant_id in wanted), key=lambda m: (m.size_bytes, m.variant_id))
        # the cheapest variant of every task first (a task the class can serve at all), then the next...
        place: dict[str, int] = {}  # variant -> its place among its task's variants, cheapest 0
        per_task: dict[str, int] = {}
        for m in sorted(out, key=lambda m: (_cost(m), m.variant_id)):
            if m.variant_id not in wanted:
                place[m.variant_id] = per_task[m.task] = per_task.get(m.task, -1) + 1
        rest = sorted((m for m in out if m.variant_id in place),
                      key=lambda m: (place[m.variant_id], _cost(m), m.variant_id))
        # this site's share (every n-th, from its rank) forward, then the others' leftovers backwards: a
        # site done early takes what its peers would reach last, not the variant a peer is timing now
        class_peers = self.class_peers()
        rank, n = class_peers.index(self.site), len(class_peers)
        mine = [m for i, m in enumerate(rest) if i % n == rank]
        theirs = [m for i, m in enumerate(rest) if i % n != rank]
        return first + mine + theirs[::-1]

    async def run(self) -> None:
        deferred = False
        while True:
            # asyncio.timeout, not wait_for: 3.11's wait_for swallows a cancel that lands as the event is set
            # (a view change during shutdown), and the agent's stop would then wait on this loop for ever
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(QUIET_S if deferred else 10.0):
                    await self._wake.wait()
            self._wake.clear()
            deferred = False
            for meta in self.missing():
                if meta.variant_id not in self.wanted() and self.idle_s() < QUIET_S:
                    deferred = True  # the rest are speculative (wanted ones sort first): after a quiet spell
                    break
                if meta.variant_id in self.peer_profiles():  # a peer published it while this one timed another
                    continue
                try:
                    await self.profile(meta)
                    self.no_room.discard(meta.variant_id)
                except asyncio.CancelledError:
                    raise
                except Overloaded as exc:  # no memory now: tried again when the view changes
                    if meta.variant_id not in self.no_room:
                        log.info("not profiled yet: %s", exc, extra=kv(site=self.site, variant=meta.variant_id))
                    self.no_room.add(meta.variant_id)
                except PermissionDenied as exc:  # not this site's to read yet: again once placement asks for it
                    if meta.variant_id not in self.unreadable:
                        log.info("not profiled until placed here: %s", exc,
                                 extra=kv(site=self.site, variant=meta.variant_id, event="self_profile_deferred"))
                    self.unreadable.add(meta.variant_id)
                except MeshError as exc:
                    self.failed[meta.variant_id] = str(exc)
                    log.warning("cannot profile %s here: %s", meta.variant_id, exc,
                                extra=kv(site=self.site, variant=meta.variant_id, event="self_profile_failed"))
                except Exception:
                    log.exception("profiling %s failed", meta.variant_id, extra=kv(site=self.site))
                    self.failed[meta.variant_id] = "error (see log)"
                else:  # timed: a failure to say so now is not the variant's (the next heartbeat says it)
                    if self.published_cb is not None:
                        await self.published_cb()

    async def profile(self, meta: VariantMeta) -> Profile:
        """Load ``meta`` (if not loaded), time it under this site's caps, record the profile."""
        was_loaded = meta.variant_id in self.host.loaded
        lv = await self.host.ensure(meta)
        served_before = lv.batcher.served
        sig = self.view.signatures[meta.task]
        sizes = tuple(b for b in self.batch_sizes if not meta.batch_sizes or b <= max(meta.batch_sizes)) or (1,)
        try:
            lv.last_used = time.monotonic()  # not idle while it is being timed
            latency = await asyncio.get_running_loop().run_in_executor(
                self.host.executor,
                lambda: time_batches(lv.batcher.infer_for(meta.variant_id), lambda bs: sample_inputs(sig, bs), sizes,
                                     time_budget_s=self.time_budget_s, busy=lambda: self.idle_s() <= 0.0))
            prof = Profile(hardware_class=self.hardware_class, load_ms=lv.load_ms, latency=latency,
                           peak_memory_bytes=lv.runtime.memory_bytes, providers=list(lv.runtime.providers_in_use),
                           measured_at=time.time())
        finally:
            keep = (was_loaded or meta.variant_id in self.wanted() or lv.batcher.served > served_before
                    or lv.batcher.queued_rows > 0)
            if not keep:
                await self.host.unload(meta.variant_id)
        self.host.self_profiles[meta.variant_id] = prof
        log.info("profiled %s on %s: %.3f ms at batch 1", meta.variant_id, self.hardware_class,
                 latency[sizes[0]].p50_ms, extra=kv(site=self.site, variant=meta.variant_id, event="self_profile"))
        return prof
