"""One chaos run: a real local mesh under the labelled workload while a profile's faults are injected on
schedule; then the invariants (:mod:`tiermesh.chaos.invariants`), a leak check, and a report (JSON, and
a plot of attainment over time with the faults marked).

Leaks, checked after the mesh has stopped: no child process of this one left (beyond those before the
run); nothing listening any more on a port the mesh used (agents' HTTP and ZeroMQ, the delay proxies,
etcd, the variant store); no more sockets open in this process than before; no cgroup left; the run's
home directory removed (unless kept for a report).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from mesh.client import AsyncClient
from mesh.errors import MeshError
from mesh.log import get_logger, kv
from tiermesh.chaos.faults import ChaosMesh, Fault
from tiermesh.chaos.invariants import LATE_S, TARGET, WINDOW_S, FaultWindow, Verdict, check, timeline
from tiermesh.harness import LocalMesh
from tiermesh.mesh_options import MeshOptions
from tiermesh.workload import DEFAULT_CLASSES, QueryRecord, SloClass, infer_one, run_workload, summarise
from variant_store.families.datasets import load_validation_npz

__all__ = ["ChaosResult", "Profile", "run_chaos"]

log = get_logger(__name__)
TASK = "digit-classification"
BURST = 300          # concurrent queries of a burst (the small topology's public tenant admits 128 in flight)
BURST_CLIENTS = 20
OVERSIZED_ROWS = 4097  # one more than a batch queue holds
BURST_CLASS = SloClass("burst", latency_ms=300, min_accuracy=0.9, share=0.0)


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    duration_s: float
    faults: tuple[Fault, ...]
    recovery_bound_s: float     # after each heal, attainment back to TARGET within this
    qps: float = 20.0
    classes: tuple[SloClass, ...] = DEFAULT_CLASSES


@dataclass(slots=True)
class ChaosResult:
    profile: str
    verdict: Verdict
    leaks: list[str]
    report: dict[str, Any]
    records: list[QueryRecord] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.verdict.ok and not self.leaks


def _children() -> set[int]:
    me = os.getpid()
    out = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            raw = Path(f"/proc/{name}/stat").read_text()
            fields = raw[raw.rindex(")") + 2:].split()
            if int(fields[1]) == me and fields[0] != "Z":
                out.add(int(name))
    return out


def _sockets() -> set[str]:
    """Inodes of the sockets this process has open."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                out.add(target[8:-1])
    return out


def _describe_sockets(inodes: set[str]) -> list[str]:
    """What each socket is (protocol, local and remote address), from /proc/self/net."""
    found: dict[str, str] = {}
    for proto in ("tcp", "tcp6", "udp", "unix"):
        with contextlib.suppress(OSError):
            lines = Path(f"/proc/self/net/{proto}").read_text().splitlines()[1:]
            for line in lines:
                cols = line.split()
                inode = cols[6] if proto == "unix" else cols[9]
                if inode in inodes:
                    found[inode] = f"{proto} {' '.join(cols[7:]) if proto == 'unix' else cols[1] + '->' + cols[2]}"
    return [found.get(i, f"socket {i}") for i in sorted(inodes)]


def _listening(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def _ports(mesh: LocalMesh) -> set[tuple[str, int]]:
    out: set[tuple[str, int]] = set()
    for sp in mesh.sites.values():
        for url in (sp.http, sp.zmq):
            u = urlsplit(url or "")
            if u.hostname and u.port:
                out.add((u.hostname, u.port))
    for proxy in mesh.proxies.proxies.values():
        out.add((mesh.proxies.listen_host, proxy.port))
    for url in (mesh.etcd_url, mesh.store_url or ""):
        for part in url.split(","):
            u = urlsplit(part)
            if u.hostname and u.port:
                out.add((u.hostname, u.port))
    return out


async def _burst(url: str, x: np.ndarray, y: np.ndarray, t0: float, tag: str) -> list[QueryRecord]:
    """``BURST`` queries at once at one edge (from ``BURST_CLIENTS`` clients: one client keeps at most 16
    connections), plus one larger than any batch queue: past every cap."""
    clients = [AsyncClient(url, timeout=10) for _ in range(BURST_CLIENTS)]
    try:
        jobs = [infer_one(clients[i % BURST_CLIENTS], BURST_CLASS, "burst", x[i % len(x)][None, :],
                          int(y[i % len(y)]), t0, f"{tag}-{i}") for i in range(BURST)]
        recs = list(await asyncio.gather(*jobs))
        big = np.repeat(x[:1], OVERSIZED_ROWS, axis=0)
        start = time.perf_counter()
        rec = QueryRecord("burst", "burst", BURST_CLASS.latency_ms, -1, False, 0.0, t=start - t0, min_accuracy=0.9,
                          request_id=f"{tag}-big")
        try:
            res = await clients[0].infer(TASK, big, latency_ms=BURST_CLASS.latency_ms,
                                         min_accuracy=BURST_CLASS.min_accuracy, request_id=f"{tag}-big")
            rec.ok, rec.reply_id, rec.accuracy, rec.best_effort = True, res.request_id, res.accuracy, res.best_effort
        except MeshError as exc:
            rec.error = exc.code
        rec.client_ms = (time.perf_counter() - start) * 1000.0
        recs.append(rec)
    finally:
        for c in clients:
            await c.aclose()
    return recs


async def _warm(mesh: LocalMesh, x: np.ndarray, y: np.ndarray, classes: Sequence[SloClass]) -> None:
    await mesh.wait_live(timeout=60)
    await mesh.wait_placed(timeout=60)
    # cold starts, first connections and the scheduler's first demand-driven placement behind us
    for _ in range(2):
        await run_workload(mesh.edge_urls(), x, y, duration_s=4, qps=20, classes=tuple(classes), seed=1)
        await mesh.wait_placed(timeout=30)


async def run_chaos(profile: Profile, *, topology: Path, home: Path | None = None,
                    out_dir: Path | None = None) -> ChaosResult:
    """Run ``profile``; write ``chaos-<profile>.json`` (and ``.png``) under ``out_dir`` when given."""
    data = load_validation_npz()
    x, y = data.x[data.calib_count:], data.y[data.calib_count:]
    children_before, sockets_before = _children(), _sockets()
    tmp = tempfile.mkdtemp(prefix="tiermesh-chaos-") if home is None else None
    root = Path(tmp) if tmp is not None else home
    assert root is not None
    mesh = LocalMesh(MeshOptions(topology=topology, home=root, scheduler=False, lease_ttl_s=3.0))
    chaos = ChaosMesh(mesh)
    windows: list[FaultWindow] = []
    injected: list[dict[str, Any]] = []
    bursts: list[QueryRecord] = []
    fired = 0
    ports: set[tuple[str, int]] = set()
    try:
        await mesh.start()
        await chaos.start_schedulers()
        await _warm(mesh, x, y, profile.classes)
        ports = _ports(mesh)
        edges = mesh.edge_urls()
        t0 = time.perf_counter()

        def tick(n: int, _elapsed: float) -> None:
            nonlocal fired
            fired = n

        async def schedule() -> None:
            for k, f in enumerate(profile.faults):
                await asyncio.sleep(max(0.0, t0 + f.at_s - time.perf_counter()))
                start = injected_at = time.perf_counter() - t0
                if f.kind == "burst":
                    bursts.extend(await _burst(edges[f.target], x, y, t0, f"burst{k}"))
                    info: dict[str, Any] = {"queries": BURST + 1}
                else:
                    info = await chaos.inject(f)
                    injected_at = time.perf_counter() - t0
                    await asyncio.sleep(f.duration_s)
                    await chaos.heal(f)
                end = time.perf_counter() - t0
                # an edge's agent not running: killed until healed, restarted (corrupt_blob, load_error) until
                # the restart is done; the queries sent to it meanwhile cannot be served by it
                restarts = f.kind in ("agent_kill", "corrupt_blob", "load_error")
                down = f.target if f.target in edges and restarts else None
                until = None if f.kind == "agent_kill" or down is None else round(injected_at, 3)
                windows.append(FaultWindow(f.label, round(start, 3), round(end, 3), down, until))
                injected.append({**asdict(f), "start_s": round(start, 3), "end_s": round(end, 3), "info": info})
                log.warning("chaos: %s from %.1f s to %.1f s", f.label, start, end, extra=kv(event="chaos_fault"))

        faults = asyncio.create_task(schedule(), name="chaos-schedule")
        try:
            result = await run_workload(edges, x, y, duration_s=profile.duration_s, qps=profile.qps,
                                        classes=profile.classes, seed=11,
                                        max_queries=int(profile.qps * profile.duration_s * 2), on_tick=tick,
                                        request_ids=True)
            async with asyncio.timeout(120):
                await faults
        finally:
            if not faults.done():
                faults.cancel()
            await asyncio.gather(faults, return_exceptions=True)
        if faults.exception() is not None:
            raise faults.exception()  # type: ignore[misc]
        records = result.records
    finally:
        with contextlib.suppress(Exception):
            await chaos.stop()
        await mesh.stop()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    verdict = check([*records, *bursts], fired + len(bursts), windows, end_s=profile.duration_s,
                    recovery_bound_s=profile.recovery_bound_s)
    # attainment only from the workload's own queries (a burst is meant to exceed the caps)
    line = timeline(records, windows, profile.duration_s)
    leaks = _leaks(children_before, sockets_before, ports, root if tmp is not None else None)
    report = {
        "profile": profile.name, "duration_s": profile.duration_s, "qps": profile.qps,
        "queries": len(records), "burst_queries": len(bursts),
        "bounds": {"late_s": LATE_S, "target_attainment": TARGET, "window_s": WINDOW_S,
                   "recovery_bound_s": profile.recovery_bound_s},
        "faults": injected, "verdict": verdict.as_dict(), "leaks": leaks,
        "errors": dict(sorted(_count(r.error for r in [*records, *bursts] if not r.ok).items())),
        # when they happened: per error code, the count per 5 s of the workload (by the second each bin starts)
        "errors_over_time": _errors_over_time([*records, *bursts]),
        "classes": summarise(records, {n: s.tier for n, s in mesh.topology.sites.items()}),
        "timeline": [{"t": t, "attainment": a, "queries": n} for t, a, n in line],
    }
    if out_dir is not None:
        from tiermesh.chaos.report import write_report
        write_report(report, out_dir / f"chaos-{profile.name}")
    return ChaosResult(profile.name, verdict, leaks, report, records)


def _errors_over_time(records: Sequence[QueryRecord], bin_s: float = 5.0) -> dict[str, dict[int, int]]:
    out: dict[str, dict[int, int]] = {}
    for r in records:
        if not r.ok:
            b = int(r.t // bin_s * bin_s)
            per = out.setdefault(r.error, {})
            per[b] = per.get(b, 0) + 1
    return {code: dict(sorted(bins.items())) for code, bins in sorted(out.items())}


def _count(codes: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in codes:
        out[c] = out.get(c, 0) + 1
    return out


def _leaks(children_before: set[int], sockets_before: set[str], ports: set[tuple[str, int]],
           home: Path | None) -> list[str]:
    leaks = []
    gc.collect()
    deadline = time.monotonic() + 5.0
    left = _children() - children_before
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = _children() - children_before
    if left:
        leaks.append(f"child processes left: {sorted(left)}")
    listening = sorted(p for p in ports if _listening(*p))
    if listening:
        leaks.append(f"still listening: {listening}")
    # anonymous unix sockets are left out: the event loop's self-pipe and the like are socket pairs that live
    # as long as the process; both ends are ours, nothing reaches out
    extra = [d for d in _describe_sockets(_sockets() - sockets_before) if d.strip() != "unix"]
    if extra:
        leaks.append(f"sockets opened by the run and still open: {extra}")
    cgroups = [p.name for p in Path("/sys/fs/cgroup/cpu").glob("tiermesh-chaos-*")]
    if cgroups:
        leaks.append(f"cgroups left: {cgroups}")
    if home is not None and home.exists():
        leaks.append(f"home directory left: {home}")
    return leaks
