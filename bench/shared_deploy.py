"""The shared_backbone scenario's three deployments of N tenants' heads (see :mod:`bench.shared_backbone`), what
each holds in memory (measured in a fresh process: ``python -m bench.shared_deploy --memory MODE N ROOT CACHE``
prints its JSON), and the compute ceiling of the bare sessions.

* ``copies``: a full model per tenant on a ``VariantHost``; ``shared+batching``: the tenants' heads on one
  backbone instance of a ``VariantHost`` (its ``BackboneBatcher`` batches across them);
* ``shared``: one backbone session, each tenant its own ``Batcher`` running backbone then head.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.openloop import Submit
from bench.wide_backbone import HIDDEN
from edge_agent.batching import Batcher
from edge_agent.host import VariantHost
from variant_store.blobs import sha256_file
from variant_store.meta import LatencyStats, Profile, VariantMeta
from variant_store.runtimes import open_runtime
from variant_store.runtimes.base import Runtime, rss_bytes

__all__ = ["CEILING_BATCHES", "MAX_BATCH", "THREADS", "WINDOW_MS", "Deployment", "deploy", "measure_ceiling",
           "measure_memory"]

MAX_BATCH = 32
WINDOW_MS = 4.0   # the host's default
THREADS = 2
# The compute ceiling: rows/s of the bare ONNX Runtime sessions, THREADS threads running batches of each
# size back to back (no batcher, no generator, no Python per request): what no mode can exceed
CEILING_BATCHES = (1, 5, 10, 20, 32, 64, 128)


# ---------------------------------------------------------------- the three deployments


@dataclass(slots=True)
class Deployment:
    submits: list[Submit]
    accounted_bytes: int
    batchers: list[Batcher]
    close: Callable[[], Awaitable[None]]


def _meta(vid: str, path: Path, base: Path | None, classes: int, compute: Callable[[int], float] | None) -> VariantMeta:
    profiles = {}
    if compute is not None:
        profiles["cpu"] = Profile("cpu", 0.0, {n: LatencyStats(compute(n), compute(n)) for n in (1, MAX_BATCH)}, 0)
    return VariantMeta(task=f"t-{vid}", family=vid, variant_id=vid, format="onnx", precision="fp32",
                       runtime="onnxruntime", blob_digest=sha256_file(path), size_bytes=path.stat().st_size,
                       accuracy=0.0, batch_sizes=[1, MAX_BATCH], shared_base_digest=sha256_file(base) if base else None,
                       profiles=profiles)


async def deploy(mode: str, n: int, root: Path, cache: Path,
                 profiles: dict[str, Callable[[int], float]] | None = None) -> Deployment:
    """Tenant ``i`` gets head ``digits`` (even i) or ``parity`` (odd i)."""
    kinds = ["digits" if i % 2 == 0 else "parity" for i in range(n)]
    prof = profiles or {}
    if mode == "shared":
        return await _deploy_shared_unbatched(kinds, root, prof)
    await asyncio.get_running_loop().run_in_executor(None, _seed_cache, root, cache)
    host = VariantHost(f"bench-{mode}", cache, hardware_class="cpu", memory_budget_bytes=1 << 40, threads=THREADS,
                       max_window_ms=WINDOW_MS, settle_heap=True)  # as an agent's host (mesh.heap)
    host.blobs.store_url = "http://127.0.0.1:9"  # never dialled: every blob is in the cache already
    submits: list[Submit] = []
    for i, kind in enumerate(kinds):
        classes = 10 if kind == "digits" else 2
        if mode == "copies":
            meta = _meta(f"full-{kind}-{i}", root / f"full-{kind}.onnx", None, classes, prof.get(f"full-{kind}"))
        else:
            meta = _meta(f"head-{kind}-{i}", root / f"head-{kind}.onnx", root / "backbone.onnx", classes,
                         prof.get(f"head-{kind}"))
        lv = await host.ensure(meta)
        submits.append(_submit(lv.batcher, meta.variant_id, f"tenant{i}"))
    batchers = list({id(lv.batcher): lv.batcher for lv in host.instances.values()}.values())
    return Deployment(submits, host.memory_used_bytes, batchers, host.close)


def _seed_cache(root: Path, cache: Path) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    for f in root.glob("*.onnx"):
        dest = cache / f"{sha256_file(f)}.onnx"
        if not dest.exists():
            dest.write_bytes(f.read_bytes())


def _submit(b: Batcher, lane: str, tenant: str) -> Submit:
    return lambda x, deadline: b.submit({"x": x}, deadline, lane=lane, tenant=tenant)


async def _deploy_shared_unbatched(kinds: list[str], root: Path, prof: dict[str, Callable[[int], float]]) -> Deployment:
    pool = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="bench-shared")
    base = open_runtime("onnx", root / "backbone.onnx", intra_op_threads=1)
    await base.load()
    heads: list[Runtime] = []
    batchers: list[Batcher] = []
    base_ms = prof.get("backbone", lambda n: 1.0)
    for i, kind in enumerate(kinds):
        head = open_runtime("onnx", root / f"head-{kind}.onnx", intra_op_threads=1)
        await head.load()
        heads.append(head)

        def infer(inputs: dict[str, np.ndarray], head: Runtime = head) -> dict[str, np.ndarray]:
            return head.run_checked_sync({"features": base.run_checked_sync(inputs)["features"]})

        head_ms = prof.get(f"head-{kind}", lambda n: 0.0)

        def compute(n: int, head_ms: Callable[[int], float] = head_ms) -> float:
            return base_ms(n) + head_ms(n)

        b = Batcher(f"shared-{kind}-{i}", infer, executor=pool, compute_ms=compute,
                    max_batch=MAX_BATCH, max_window_ms=WINDOW_MS, site="bench")
        b.start()
        batchers.append(b)

    async def close() -> None:
        for b in batchers:
            await b.stop()
        for rt in [*heads, base]:
            await rt.unload()
        pool.shutdown(wait=True)

    accounted = base.memory_bytes + sum(h.memory_bytes for h in heads)
    return Deployment([_submit(b, "", f"tenant{i}") for i, b in enumerate(batchers)], accounted, batchers, close)


# ---------------------------------------------------------------- memory, in a fresh process


async def _memory_child(mode: str, n: int, root: Path, cache: Path) -> dict[str, int]:
    warm = open_runtime("onnx", root / "head-parity.onnx", intra_op_threads=1)  # ORT's own one-time setup
    warm.load_sync()
    warm.infer_sync({"features": np.zeros((MAX_BATCH, HIDDEN[-1]), np.float32)})
    before = rss_bytes()
    dep = await deploy(mode, n, root, cache)
    x = np.zeros((MAX_BATCH, 64), np.float32)
    try:
        for s in dep.submits:  # one full batch per tenant: arenas are allocated on first run
            await s(x, time.monotonic() + 30.0)
        return {"rss_growth": rss_bytes() - before, "accounted": dep.accounted_bytes}
    finally:
        await dep.close()


async def measure_memory(mode: str, n: int, root: Path, cache: Path) -> dict[str, int]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "bench.shared_deploy", "--memory", mode,
                                                str(n), str(root), str(cache), stdout=asyncio.subprocess.PIPE)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 120)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"memory child for {mode} x{n} failed: rc {proc.returncode}")
    return dict(json.loads(out.decode().strip().splitlines()[-1]))


# ---------------------------------------------------------------- the compute ceiling


def _rows_per_s(runtimes: list[Runtime], batch: int, seconds: float) -> float:
    """Rows/s of THREADS threads each running ``batch``-row batches back to back for ``seconds``,
    every thread taking the sessions in turn (a copy per tenant: their weights take turns in cache)."""
    feed = {"x": np.zeros((batch, 64), np.float32)}
    for rt in runtimes:
        rt.run_checked_sync(feed)  # warm: arenas

    def worker(offset: int) -> int:
        done, i = 0, offset
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            runtimes[i % len(runtimes)].run_checked_sync(feed)
            done += batch
            i += 1
        return done

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=THREADS) as pool:
        rows = sum(pool.map(worker, range(THREADS)))
    return rows / (time.perf_counter() - t0)


def measure_ceiling(root: Path, seconds: float) -> dict[str, dict[str, float]]:
    """Per batch size, rows/s of the bare backbone (one session, as the shared modes hold it) and of
    four full-model copies taken in turn (as the copies hold them at 4 tenants). Off the event loop."""
    out: dict[str, dict[str, float]] = {"backbone": {}, "copies x4": {}}
    backbone = open_runtime("onnx", root / "backbone.onnx", intra_op_threads=1)
    copies = [open_runtime("onnx", root / "full-digits.onnx", intra_op_threads=1) for _ in range(4)]
    try:
        for rt in [backbone, *copies]:
            rt.load_sync()
        for b in CEILING_BATCHES:
            out["backbone"][str(b)] = round(_rows_per_s([backbone], b, seconds), 1)
            out["copies x4"][str(b)] = round(_rows_per_s(copies, b, seconds), 1)
    finally:
        for rt in [backbone, *copies]:
            rt.unload_sync()
    return out


def _child_main(argv: list[str]) -> int:
    mode, n, root, cache = argv[0], int(argv[1]), Path(argv[2]), Path(argv[3])
    print(json.dumps(asyncio.run(_memory_child(mode, n, root, cache))))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--memory":
        raise SystemExit(_child_main(sys.argv[2:]))
    raise SystemExit("usage: python -m bench.shared_deploy --memory MODE N ROOT CACHE")
