"""The variants a site holds: fetch (verified), load into a runtime, batch, unload.

Loads are deduplicated per variant (concurrent callers share one load) and run off the event loop.
Memory accounting is what the runtimes report, checked against the site's budget before a load.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_agent.batching import Batcher, InferFn
from mesh.errors import MeshError, Overloaded, RuntimeLoadError
from mesh.log import get_logger, kv
from variant_store.fetch import fetch_blob
from variant_store.meta import Profile, VariantMeta
from variant_store.runtimes import open_runtime
from variant_store.runtimes.base import Runtime

__all__ = ["LoadedVariant", "VariantHost"]

log = get_logger(__name__)


@dataclass(slots=True)
class LoadedVariant:
    meta: VariantMeta
    runtime: Runtime
    batcher: Batcher
    loaded_at: float
    load_ms: float
    last_used: float


class VariantHost:
    def __init__(self, site: str, cache_dir: Path, *, hardware_class: str, memory_budget_bytes: int,
                 threads: int = 2, max_window_ms: float = 4.0) -> None:
        self.site = site
        self.cache_dir = cache_dir
        self.hardware_class = hardware_class
        self.memory_budget_bytes = memory_budget_bytes
        self.max_window_ms = max_window_ms
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"infer-{site}")
        self.loaded: dict[str, LoadedVariant] = {}
        self._loading: dict[str, asyncio.Future[LoadedVariant]] = {}
        self.blob_url: str | None = None
        self.blob_ssl: ssl.SSLContext | None = None  # this site's client certificate, for an https:// store
        self.cold_starts = 0
        self.bases: dict[str, Runtime] = {}       # shared backbones by blob digest
        self.base_refs: dict[str, int] = {}
        # metrics hooks: (variant, prewarm?) of every load; (variant, rows) of every executed batch
        self.on_load: Callable[[str, bool], None] | None = None
        self.on_batch: Callable[[str, int], None] | None = None
        # timings this site measured itself for variants the catalog has no profile of its class for
        self.measured: dict[str, Profile] = {}

    @property
    def memory_used_bytes(self) -> int:
        return (sum(lv.runtime.memory_bytes for lv in self.loaded.values())
                + sum(b.memory_bytes for b in self.bases.values()))

    def _compute_fn(self, meta: VariantMeta) -> tuple[Callable[[int], float], float]:
        own = meta.profiles.get(self.hardware_class)
        if own is not None:
            return own.compute_ms, own.load_ms
        fallback = next(iter(meta.profiles.values()), None)

        def compute(n: int) -> float:  # looked up per batch: a self-measured profile may arrive later
            prof = self.measured.get(meta.variant_id) or fallback
            return prof.compute_ms(n) if prof is not None else 1.0 + 0.1 * n

        return compute, fallback.load_ms if fallback is not None else 1.0

    async def ensure(self, meta: VariantMeta, *, prewarm: bool = False) -> LoadedVariant:
        """The loaded variant, loading it first if needed (a cold start; ``prewarm``: a load placement asked
        for ahead of any query)."""
        lv = self.loaded.get(meta.variant_id)
        if lv is not None:
            return lv
        pending = self._loading.get(meta.variant_id)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[LoadedVariant] = asyncio.get_running_loop().create_future()
        self._loading[meta.variant_id] = fut
        try:
            lv = await self._load(meta)
            if self.on_load is not None:
                self.on_load(meta.variant_id, prewarm)
            fut.set_result(lv)
            return lv
        except BaseException as exc:
            fut.set_exception(exc if isinstance(exc, Exception) else RuntimeLoadError("load cancelled"))
            fut.exception()  # mark retrieved: other waiters re-raise it themselves
            raise
        finally:
            self._loading.pop(meta.variant_id, None)

    async def _load(self, meta: VariantMeta) -> LoadedVariant:
        started = time.monotonic()
        if self.memory_used_bytes + meta.size_bytes > self.memory_budget_bytes:
            raise Overloaded(f"{self.site}: no memory for {meta.variant_id} "
                             f"({self.memory_used_bytes + meta.size_bytes} > {self.memory_budget_bytes} bytes)")
        if self.blob_url is None:
            raise RuntimeLoadError(f"{self.site}: variant store not announced, cannot fetch {meta.variant_id}")
        try:
            runtime = await self._open(meta.blob_digest, meta.format)
            infer: InferFn = runtime.run_checked_sync
            if meta.shared_base_digest:
                infer = await self._compose(meta.shared_base_digest, runtime)
        except MeshError:
            raise
        except Exception as exc:
            raise RuntimeLoadError(f"{self.site}: loading {meta.variant_id} failed: {exc}") from exc
        compute, _ = self._compute_fn(meta)
        max_batch = max(meta.batch_sizes) if meta.batch_sizes else 32
        batcher = Batcher(meta.variant_id, infer, executor=self.executor, compute_ms=compute,
                          max_batch=max_batch, max_window_ms=self.max_window_ms, site=self.site,
                          on_batch=self.on_batch)
        batcher.start()
        now = time.monotonic()
        lv = LoadedVariant(meta, runtime, batcher, loaded_at=now, load_ms=(now - started) * 1000.0,
                           last_used=now)
        self.loaded[meta.variant_id] = lv
        self.cold_starts += 1
        log.info("loaded %s in %.1f ms", meta.variant_id, lv.load_ms,
                 extra=kv(site=self.site, variant=meta.variant_id, event="load"))
        return lv

    async def _open(self, digest: str, fmt: str) -> Runtime:
        assert self.blob_url is not None
        suffix = ".tflite" if fmt == "tflite" else ".onnx"
        path = self.cache_dir / f"{digest}{suffix}"
        await fetch_blob(self.blob_url, digest, path, ssl=self.blob_ssl)
        runtime = open_runtime(fmt, path, intra_op_threads=1)
        await runtime.load()
        return runtime

    async def _compose(self, base_digest: str, head: Runtime) -> InferFn:
        """Backbone + head: the backbone is loaded once per site and shared by every head on it
        (one session; ``run()`` is thread-safe), which is what makes shared base layers cheap."""
        base = self.bases.get(base_digest)
        if base is None:
            base = self.bases[base_digest] = await self._open(base_digest, "onnx")
            self.base_refs[base_digest] = 0
        self.base_refs[base_digest] += 1
        feature_out = base.output_specs[0].name
        head_in = head.input_specs[0].name

        def infer(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            feats = base.run_checked_sync(inputs)[feature_out]
            return head.run_checked_sync({head_in: feats})

        return infer

    async def unload(self, variant_id: str) -> None:
        lv = self.loaded.pop(variant_id, None)
        if lv is None:
            return
        await lv.batcher.stop()
        await lv.runtime.unload()
        base = lv.meta.shared_base_digest
        if base and base in self.base_refs:
            self.base_refs[base] -= 1
            if self.base_refs[base] <= 0:
                del self.base_refs[base]
                await self.bases.pop(base).unload()
        log.info("unloaded %s", variant_id, extra=kv(site=self.site, variant=variant_id, event="evict"))

    async def close(self) -> None:
        for vid in list(self.loaded):
            with contextlib.suppress(Exception):
                await self.unload(vid)
        self.executor.shutdown(wait=True, cancel_futures=True)
