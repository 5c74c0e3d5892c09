"""The variants a site holds: fetch (verified), load into a runtime, batch, unload.

Loads are deduplicated per instance (concurrent callers share one load) and run off the event loop; their
files come from the site's :class:`~edge_agent.blob_cache.BlobCache` (``blobs``: cache, nearest peer, variant
store). A query waits for a load until its deadline at most (``ensure_by``); the load goes on, owned here, for
the queries after it.

Memory. What a variant holds is measured when it loads (the process's resident growth around the
session's creation, at least the file's size: ``Runtime.memory_bytes``) and kept per variant
(:meth:`VariantHost.measured_memory`), so the next decision about it uses the measurement, not the
file. Loads and unloads change the budget under one lock: a load checks, makes room and opens while
holding it, so two loads cannot both take the last free bytes and an unload cannot close a backbone
a load is attaching a head to. A shared backbone is counted once, however many heads use it. When a
load does not fit, the least valuable idle instances are unloaded first
(``core_scheduler.policy.eviction``: by recent demand, then least recently used); only when that
cannot make room is the load refused (``Overloaded``). Device memory (a GPU runtime's
``device_memory_bytes``) is a second budget kept the same way (:mod:`edge_agent.device_memory`): checked
before the load with what the variant measured on the device last time, and again with what it measured
now; a load over it evicts idle instances holding device bytes, or is unloaded and refused.

Backbones. A backbone + head variant runs on a backbone instance shared by every head on it
(:mod:`edge_agent.backbone`), whose batcher batches across the heads' tenants. The instance lives as
long as some head holds it: its holders are a set of instance keys (not a counter), changed only
under the lock. Isolation: an instance is keyed by ``(variant_id, tenant)``, where the tenant is
empty for shared instances and names the tenant for a ``strict`` one, which then gets its own
session, batcher and backbone, and shares a batch with nobody.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from core_scheduler.policy.eviction import DEMAND_TAU_S, Resident, decayed_rate, plan_eviction
from edge_agent.backbone import BackboneBatcher, measure_compute_ms
from edge_agent.batching import Batcher
from edge_agent.blob_cache import BlobCache
from edge_agent.host_device import DeviceRoom
from mesh.errors import DeadlineExceeded, MeshError, Overloaded, RuntimeLoadError
from mesh.heap import Settler
from mesh.lifecycle import cancel_and_wait, single_flight
from mesh.log import get_logger, kv
from variant_store.hardware import serving_runtime
from variant_store.meta import Profile, VariantMeta
from variant_store.runtimes import open_runtime
from variant_store.runtimes.base import Runtime

__all__ = ["InstanceKey", "LoadedVariant", "VariantHost"]

log = get_logger(__name__)
InstanceKey = tuple[str, str]  # (variant_id, tenant it is isolated for, or "")


def _retrieve(task: asyncio.Future[LoadedVariant]) -> None:
    """A load no query waits for any more may fail: its error is read here, not reported as unretrieved."""
    if not task.cancelled():
        task.exception()


@dataclass(slots=True)
class LoadedVariant:
    meta: VariantMeta
    runtime: Runtime
    batcher: Batcher           # a head's is its backbone instance's (shared by every head on it)
    loaded_at: float
    load_ms: float
    last_used: float
    isolated_for: str = ""     # the strict tenant this instance belongs to, or "" (shared)
    base: InstanceKey | None = None  # its backbone instance: (base digest, isolated_for)
    rate: float = 0.0          # requests/s, decayed (core_scheduler.policy.eviction.decayed_rate)

    @property
    def key(self) -> InstanceKey:
        return (self.meta.variant_id, self.isolated_for)

    @property
    def memory_bytes(self) -> int:
        """What this instance holds itself (a head's backbone is counted on the backbone)."""
        return self.runtime.memory_bytes

    @property
    def device_bytes(self) -> int:
        """Accelerator bytes it holds itself (0 on the CPU), measured when it loaded."""
        return self.runtime.device_memory_bytes()

    def touch(self, now: float) -> None:
        """One request: refresh ``last_used`` and the decayed request rate."""
        self.rate = decayed_rate(self.rate, now - self.last_used) + 1.0 / DEMAND_TAU_S
        self.last_used = now


@dataclass(slots=True)
class _Backbone:
    runtime: Runtime
    batcher: BackboneBatcher
    holders: set[InstanceKey] = field(default_factory=set)


class VariantHost(DeviceRoom):
    def __init__(self, site: str, cache_dir: Path, *, hardware_class: str, memory_budget_bytes: int,
                 threads: int = 2, max_window_ms: float = 4.0, settle_heap: bool = False,
                 device_budget_bytes: int | None = None, idle_s: Callable[[], float] | None = None) -> None:
        self.site = site
        # the heap settled after loads and unloads: a serving agent's long-lived objects out of the collector's
        # full passes (mesh.heap; tests and tools that load many variants in one process leave it off)
        # (``idle_s``: seconds since this site last served a query; a thaw owed waits for a quiet moment)
        self.settler = Settler(idle_s=idle_s) if settle_heap else None
        self.cache_dir = cache_dir
        self.hardware_class = hardware_class
        self.memory_budget_bytes = memory_budget_bytes
        # accelerator bytes its models may hold (edge_agent.device_memory; 0: no device, so a load that needs one
        # is refused); None: not budgeted (tools and tests that load without an agent)
        self.device_budget_bytes = device_budget_bytes
        self.max_window_ms = max_window_ms
        self.threads = threads
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"infer-{site}")
        self.instances: dict[InstanceKey, LoadedVariant] = {}
        self._loading: dict[InstanceKey, asyncio.Future[LoadedVariant]] = {}
        self._lock = asyncio.Lock()  # every change to what is loaded, and so to the budget
        self._background: set[asyncio.Task[LoadedVariant]] = set()  # loads queries stopped waiting for
        self.blobs = BlobCache(site, cache_dir)
        # metrics hooks: (variant, prewarm?) of every load; (variant, rows) of every executed batch
        self.on_load: Callable[[str, bool], None] | None = None
        self.on_batch: Callable[[str, int], None] | None = None
        self.cold_starts = 0
        self.evictions = 0
        self.bases: dict[InstanceKey, _Backbone] = {}   # backbone instances: (blob digest, isolated_for)
        # measured at the last load in this process: variant id (or "base:<digest>") -> bytes
        self._measured_bytes: dict[str, int] = {}
        self._measured_device: dict[str, int] = {}  # the same, on the device (host_device.DeviceRoom)
        # timings this site measured itself for variants the catalog has no profile of its class for
        self.self_profiles: dict[str, Profile] = {}
        # timings other live sites of this class measured (adopted by the self-profiler), for the rest
        self.class_profiles: dict[str, Profile] = {}

    # -- what is loaded ----------------------------------------------------------------------
    @property
    def loaded(self) -> dict[str, LoadedVariant]:
        """Shared instances by variant id (a strict tenant's own instances are in ``instances``)."""
        return {vid: lv for (vid, iso), lv in self.instances.items() if not iso}

    @property
    def settling(self) -> bool:
        """A load is under way, or a heap thaw is owed (:class:`mesh.heap.Settler`): either blocks this process's
        event loop for its CPU time, up to a second and more of wall time at a tenth of a core."""
        return bool(self._loading) or (self.settler is not None and self.settler.owed)

    @property
    def memory_used_bytes(self) -> int:
        return (sum(lv.memory_bytes for lv in self.instances.values())
                + sum(b.runtime.memory_bytes for b in self.bases.values()))

    def measured_memory(self) -> dict[str, int]:
        """Bytes each variant measured when last loaded here (backbones as ``base:<digest>``)."""
        return dict(self._measured_bytes)

    def memory_by_instance(self) -> dict[str, int]:
        """Bytes each loaded instance holds now: heads without their backbone, strict instances as
        ``<variant>@<tenant>``, backbone instances as ``base:<digest>[@<tenant>]`` (counted once)."""
        out = {_name(k): lv.memory_bytes for k, lv in self.instances.items()}
        out.update({f"base:{_name(k)}": b.runtime.memory_bytes for k, b in self.bases.items()})
        return out

    def backbone_holders(self) -> dict[InstanceKey, frozenset[InstanceKey]]:
        """Which instances hold each loaded backbone instance (for tests and the console)."""
        return {k: frozenset(b.holders) for k, b in self.bases.items()}

    def _compute_fn(self, meta: VariantMeta) -> tuple[Callable[[int], float], float]:
        own = meta.profiles.get(self.hardware_class)
        if own is not None:
            return own.compute_ms, own.load_ms
        fallback = next(iter(meta.profiles.values()), None)

        def compute(n: int) -> float:  # looked up per batch: a self-measured profile may arrive later
            vid = meta.variant_id
            prof = self.self_profiles.get(vid) or self.class_profiles.get(vid) or fallback
            return prof.compute_ms(n) if prof is not None else 1.0 + 0.1 * n

        return compute, fallback.load_ms if fallback is not None else 1.0

    def _estimate(self, meta: VariantMeta) -> int:
        """Bytes a load of ``meta`` will take: measured here before, else its profile's peak, else its file."""
        if meta.variant_id in self._measured_bytes:
            return self._measured_bytes[meta.variant_id]
        peak = max((p.peak_memory_bytes for p in meta.profiles.values()), default=0)
        return max(peak, meta.size_bytes)

    # -- load --------------------------------------------------------------------------------
    async def ensure(self, meta: VariantMeta, isolated_for: str = "", *, prewarm: bool = False) -> LoadedVariant:
        """The loaded instance, loading it first if needed (a cold start). ``isolated_for``: a
        ``strict`` tenant's own instance (own session, batcher and backbone) instead of the shared one.
        ``prewarm``: a load placement asked for ahead of any query (metrics)."""
        key = (meta.variant_id, isolated_for)
        lv = self.instances.get(key)
        if lv is not None:
            return lv

        async def load() -> LoadedVariant:
            lv = await self._load(meta, isolated_for)
            if self.on_load is not None:
                self.on_load(meta.variant_id, prewarm)
            return lv

        return await single_flight(self._loading, key, load, lambda: RuntimeLoadError("load cancelled"))

    async def ensure_by(self, meta: VariantMeta, deadline: float, isolated_for: str = "") -> LoadedVariant:
        """``ensure``, waited for until ``deadline`` (a ``time.monotonic`` instant) at most: a query does not
        outlive its budget waiting for a slow load, which goes on for the queries after it."""
        lv = self.instances.get((meta.variant_id, isolated_for))
        if lv is not None:
            return lv
        task = asyncio.ensure_future(self.ensure(meta, isolated_for))
        # owned here until it ends (close() cancels what is left), so a query that stops waiting loses nothing
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_retrieve)
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                return await asyncio.shield(task)
        except TimeoutError:
            raise DeadlineExceeded(f"{self.site}: {meta.variant_id} still loading at the query's deadline") from None

    async def _load(self, meta: VariantMeta, isolated_for: str) -> LoadedVariant:
        started = time.monotonic()
        try:
            # blobs are content-addressed and land by rename: fetching outside the lock is safe
            head_path = await self.blobs.fetch(meta.blob_digest, meta.format)
            base_path = await self.blobs.fetch(meta.shared_base_digest, "onnx") if meta.shared_base_digest else None
        except MeshError:
            raise
        except Exception as exc:
            raise RuntimeLoadError(f"{self.site}: fetching {meta.variant_id} failed: {exc}") from exc
        key = (meta.variant_id, isolated_for)
        async with self._lock:
            bkey = (meta.shared_base_digest, isolated_for) if meta.shared_base_digest else None
            need = self._estimate(meta)
            if bkey is not None and bkey not in self.bases:
                need += self._measured_bytes.get(f"base:{bkey[0]}", base_path.stat().st_size if base_path else 0)
            # heads on the backbone this one joins stay: evicting them would free nothing it can use
            protect = ({h for h, lv in self.instances.items() if lv.base == bkey} if bkey in self.bases else set())
            await self._make_room(meta.variant_id, need, protect)
            await self._make_device_room(meta.variant_id, self._device_need(meta.variant_id, bkey), protect)
            try:
                lv = await self._open_instance(meta, key, head_path, base_path, bkey, started)
            except MeshError:
                raise
            except Exception as exc:
                raise RuntimeLoadError(f"{self.site}: loading {meta.variant_id} failed: {exc}") from exc
            await self._fit_device_measured(lv, protect)
        self.cold_starts += 1
        if self.settler is not None:
            self.settler.loaded(f"loading {meta.variant_id}")
        log.info("loaded %s%s in %.1f ms (%d bytes measured)", meta.variant_id,
                 f" for {isolated_for} (strict)" if isolated_for else "", lv.load_ms, lv.memory_bytes,
                 extra=kv(site=self.site, variant=meta.variant_id, event="load"))
        if self.memory_used_bytes > self.memory_budget_bytes:
            log.warning("%s took more than estimated: %d > %d bytes budget", meta.variant_id,
                        self.memory_used_bytes, self.memory_budget_bytes,
                        extra=kv(site=self.site, variant=meta.variant_id, event="over_budget"))
        return lv

    async def _open_instance(self, meta: VariantMeta, key: InstanceKey, head_path: Path,
                             base_path: Path | None, bkey: InstanceKey | None, started: float) -> LoadedVariant:
        """Open the session (and the backbone instance if it has none yet); the caller holds the lock."""
        runtime = await self._open_runtime(meta.format, head_path)
        self._measured_bytes[meta.variant_id] = runtime.memory_bytes
        max_batch = max(meta.batch_sizes) if meta.batch_sizes else 32
        batcher: Batcher
        try:
            if bkey is not None and base_path is not None:
                # the head alone, timed as the backbone is: a head's catalog or self-measured profile is its
                # latency behind the backbone (what routing needs), and adding that to the backbone's own cost
                # counted the backbone twice (a 64-row text batch looked twice its length: admission refused
                # what would have fitted, windows shut early; on a GPU site, with a CPU's profile, 300 ms)
                head_ms = await asyncio.get_running_loop().run_in_executor(self.executor, measure_compute_ms, runtime)
                bb = self.bases.get(bkey) or await self._open_backbone(bkey, base_path, max_batch)
                bb.holders.add(key)
                bb.batcher.add_head(meta.variant_id, runtime, head_ms, max_batch)
                batcher = bb.batcher
            else:
                compute, _ = self._compute_fn(meta)
                batcher = Batcher(meta.variant_id if not key[1] else f"{meta.variant_id}@{key[1]}",
                                  runtime.run_checked_sync, executor=self.executor, compute_ms=compute,
                                  max_batch=max_batch, max_window_ms=self.max_window_ms, site=self.site,
                                  on_batch=self.on_batch)
                batcher.start()
        except BaseException:
            await runtime.unload()
            raise
        now = time.monotonic()
        lv = LoadedVariant(meta, runtime, batcher, loaded_at=now, load_ms=(now - started) * 1000.0,
                           last_used=now, isolated_for=key[1], base=bkey)
        self.instances[key] = lv
        return lv

    async def _open_runtime(self, fmt: str, path: Path, threads: int = 1) -> Runtime:
        """A loaded runtime for the file (``threads`` intra-op): on a torch-served GPU an ONNX file runs through
        ``torch-cuda``, or through ONNX Runtime on the CPU when the interpreter refuses it (an op it lacks, say
        INT8's)."""
        name = serving_runtime(fmt)
        runtime = open_runtime(name, path, intra_op_threads=threads)
        try:
            await runtime.load()
        except RuntimeLoadError as exc:
            if name == fmt:
                raise
            log.warning("%s does not run on %s (%s); serving it on the CPU", path.name, name, exc,
                        extra=kv(site=self.site, event="runtime_fallback"))
            runtime = open_runtime(fmt, path, intra_op_threads=threads)
            await runtime.load()
        return runtime

    async def _open_backbone(self, bkey: InstanceKey, path: Path, max_batch: int) -> _Backbone:
        # One batch at a time on all the site's inference threads (intra-op), rather than one batch per thread:
        # the same rows per second from the backbone, each batch done in about half the time, so a batch's rows
        # wait half as long (bench.shared_backbone measures what that is worth under a tight SLO)
        base = await self._open_runtime("onnx", path, self.threads)
        self._measured_bytes[f"base:{bkey[0]}"] = base.memory_bytes
        try:
            compute = await asyncio.get_running_loop().run_in_executor(self.executor, measure_compute_ms, base)
        except BaseException:
            await base.unload()
            raise
        name = f"backbone:{bkey[0][:12]}" + (f"@{bkey[1]}" if bkey[1] else "")
        batcher = BackboneBatcher(name, base, executor=self.executor, compute_ms=compute, max_batch=max_batch,
                                  max_window_ms=self.max_window_ms, site=self.site)
        batcher.shared_backbone = not bkey[1]  # a strict tenant's own backbone is not shared
        batcher.on_batch = self.on_batch
        batcher.start()
        bb = self.bases[bkey] = _Backbone(base, batcher)
        log.info("opened backbone %s (%d bytes measured)", name, base.memory_bytes,
                 extra=kv(site=self.site, event="backbone_load"))
        return bb

    # -- room --------------------------------------------------------------------------------
    def residents(self, now: float) -> Iterator[Resident]:
        """The loaded instances as the eviction policy sees them."""
        for key, lv in self.instances.items():
            idle = max(0.0, now - lv.last_used)
            busy = bool(lv.batcher.queued_rows) or key in self._loading
            yield Resident(key=_name(key), memory_bytes=lv.memory_bytes, qps=decayed_rate(lv.rate, idle),
                           idle_s=idle, busy=busy, base=_name(lv.base) if lv.base else None)

    async def _make_room(self, variant_id: str, need: int, protect: set[InstanceKey]) -> None:
        """Unload the least valuable idle instances until ``need`` bytes fit; the caller holds the lock."""
        free = self.memory_budget_bytes - self.memory_used_bytes
        bases = {_name(k): b.runtime.memory_bytes for k, b in self.bases.items()}
        by_name = {_name(k): k for k in self.instances}
        victims = plan_eviction(self.residents(time.monotonic()), bases, need, free,
                                protect={_name(k) for k in protect})
        if victims is None:
            raise Overloaded(f"{self.site}: no memory for {variant_id} (needs {need} bytes, {max(0, free)} free "
                             f"of {self.memory_budget_bytes}, and unloading every idle variant would not "
                             f"make room)")
        await self._evict(victims, by_name, variant_id)

    async def _evict(self, victims: list[str], by_name: dict[str, InstanceKey], variant_id: str) -> None:
        for name in victims:
            lv = self.instances.get(by_name[name])
            log.info("evicting %s to make room for %s (%.2f req/s recently, idle %.0f s)", name, variant_id,
                     decayed_rate(lv.rate, time.monotonic() - lv.last_used) if lv else 0.0,
                     time.monotonic() - lv.last_used if lv else math.nan,
                     extra=kv(site=self.site, variant=name, event="evict_for_room"))
            await self._unload_locked(by_name[name])
            self.evictions += 1

    # -- unload ------------------------------------------------------------------------------
    async def unload(self, variant_id: str, isolated_for: str = "") -> None:
        async with self._lock:
            await self._unload_locked((variant_id, isolated_for))
            if self.settler is not None:
                self.settler.unloaded()

    async def _unload_locked(self, key: InstanceKey) -> None:
        lv = self.instances.pop(key, None)
        if lv is None:
            return
        if lv.base is None:
            await lv.batcher.stop()
        else:
            bb = self.bases[lv.base]
            bb.holders.discard(key)
            await bb.batcher.remove_head(key[0])  # one instance per variant on a backbone instance
            if not bb.holders:
                # the last head: nothing else can queue here (the lock is held, no load is attaching)
                del self.bases[lv.base]
                await bb.batcher.stop()
                await bb.runtime.unload()
                log.info("closed backbone %s", bb.batcher.variant_id,
                         extra=kv(site=self.site, event="backbone_unload"))
        await lv.runtime.unload()
        log.info("unloaded %s", _name(key), extra=kv(site=self.site, variant=key[0], event="evict"))

    async def close(self) -> None:
        await cancel_and_wait(*self._background)
        if self.settler is not None:
            self.settler.close()
        for key in list(self.instances):
            with contextlib.suppress(Exception):
                async with self._lock:
                    await self._unload_locked(key)
        self.executor.shutdown(wait=True, cancel_futures=True)


def _name(key: InstanceKey) -> str:
    return f"{key[0]}@{key[1]}" if key[1] else key[0]

