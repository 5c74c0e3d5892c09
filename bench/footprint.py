"""Footprint: how light tiermesh is where it runs on small boxes, beside floors measured in the same run.

* **SDK base install**: bytes on disk of a fresh venv holding ``pip install tiermesh`` with no extra
  (:mod:`bench.sdk_venv`: the wheel of this tree and its base dependencies, bytecode included), per distribution.
* **edge agent RSS**: one standalone agent process (``tiermesh agent``, as a site's box runs it, real etcd) on an edge
  site of the 20-site topology, *idle* (no placement: nothing loaded, no traffic) and *with the digits family
  loaded* (a placement naming every ONNX / TFLite variant of the task, waited for in its heartbeat).
  Beside the **floor**: a bare Python process that imports ONNX Runtime and opens one session of the family's
  smallest model (``mlp-tiny.onnx``), the least a process serving that model can hold.
* **20-site up**: ``tiermesh up --topology examples/topology-20.yaml`` as a subprocess, from spawn to its
  "mesh up" line (every agent ready and the first placement loaded), on a home whose catalog (the digits and the
  text family, as ``up`` builds them) was built beforehand (a second ``up`` on one home, as a developer runs it; the
  build is once per home).

RSS is ``VmRSS`` from ``/proc`` (shared library pages included, as ``ps`` shows); PSS is beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import MODELS_DIR, REPO_ROOT, RunContext, run_standalone, target, write_result
from bench.geo import prebuild_home
from bench.sdk_venv import make_sdk_venv

__all__ = ["TOPOLOGY_20", "floor_rss", "prebuild_catalog", "run_footprint"]

TOPOLOGY_20 = REPO_ROOT / "examples" / "topology-20.yaml"
EDGE = "edge-eu-1"
TASK = "digit-classification"
MB = 1024 * 1024

_FLOOR = """
import numpy as np, onnxruntime as ort, sys
opts = ort.SessionOptions(); opts.intra_op_num_threads = 1
s = ort.InferenceSession(sys.argv[1], opts, providers=["CPUExecutionProvider"])
s.run(None, {s.get_inputs()[0].name: np.zeros((1, 64), np.float32)})
status = open("/proc/self/status").read()
print(int(status.split("VmRSS:")[1].split()[0]) * 1024)
"""


def _mem(pid: int) -> tuple[int, int]:
    """(RSS, PSS) bytes of a process."""
    rss = pss = 0
    with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("Rss:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("Pss:"):
                pss = int(line.split()[1]) * 1024
    return rss, pss


def prebuild_catalog(dst: Path) -> None:
    """The whole catalog `tiermesh up` builds on a fresh home (the digits family, then the text family's heads)
    into ``dst``, so the timed ``up`` finds it all there as a second ``up`` on one home does. Synchronous."""
    from mesh.etcd.server import EmbeddedEtcd
    from mesh.etcd.store import Store
    from variant_store.blobs import BlobStore
    from variant_store.build_text import ensure_text_family
    from variant_store.catalog import Catalog

    async def text() -> None:
        etcd = EmbeddedEtcd(dst / "etcd")
        await etcd.start()
        try:
            store = await Store.connect(etcd.url, "/tiermesh/")
            try:
                await ensure_text_family(Catalog(store), BlobStore(dst / "blobs"), progress=False)
            finally:
                await store.close()
        finally:
            await etcd.stop()

    prebuild_home(dst, TOPOLOGY_20)
    asyncio.run(text())


def floor_rss(model: Path = MODELS_DIR / "mlp-tiny.onnx", runs: int = 3) -> int:
    """Median RSS (bytes) of bare Python + ONNX Runtime with one session of ``model`` open (one inference run)."""
    out = [int(subprocess.run([sys.executable, "-c", _FLOOR, str(model)], capture_output=True, text=True,
                              timeout=120, check=True).stdout) for _ in range(runs)]
    return int(statistics.median(out))


def sdk_install() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tiermesh-sdk-venv-") as tmp:
        t0 = time.perf_counter()
        venv = make_sdk_venv(Path(tmp) / "sdk")
        sizes = venv.site_packages_bytes()
        return {"total": sum(sizes.values()), "per_dist": dict(sorted(sizes.items(), key=lambda kv: -kv[1])),
                "seconds": time.perf_counter() - t0, "downloaded": venv.downloaded}


async def agent_rss(prebuilt: Path, workdir: Path) -> dict[str, Any]:
    """RSS / PSS of one edge agent, idle and then with the digits family loaded."""
    from mesh.etcd.keys import live_key, placement_key
    from tiermesh.harness import LocalMesh
    from tiermesh.mesh_options import MeshOptions
    from variant_store.catalog import Catalog

    home = workdir / "agent-home"
    shutil.copytree(prebuilt, home)
    # a standalone `tiermesh agent` process, as a small box runs it: a child forked from `up`'s launcher would show
    # a smaller RSS only because it has not yet touched the shared pages it inherited
    mesh = LocalMesh(MeshOptions(topology=TOPOLOGY_20, home=home, sites=[EDGE], wan=False, scheduler=False,
                                 fork_agents=False))
    try:
        await mesh.start()
        assert mesh.store is not None
        proc = mesh.sites[EDGE].proc
        assert proc is not None
        await asyncio.sleep(3.0)  # past start-up: first heartbeats, view settled
        idle = _mem(proc.pid)
        metas = [m for m in await Catalog(mesh.store).list_variants(TASK) if m.format in ("onnx", "tflite")]
        await mesh.store.put(placement_key(EDGE), {"schema": 1, "site": EDGE, "leader": "bench-footprint",
                                                   "variants": [{"task": TASK, "variant_id": m.variant_id}
                                                                for m in metas]})
        want = {m.variant_id for m in metas}
        deadline = time.monotonic() + 120
        loaded: set[str] = set()
        while time.monotonic() < deadline:
            live = await mesh.store.get(live_key(EDGE))
            loaded = set((live.value.get("loaded") or {}) if live else {})
            if want <= loaded:
                break
            await asyncio.sleep(0.25)
        await asyncio.sleep(2.0)
        family = _mem(proc.pid)
        return {"idle": idle, "family": family, "variants": sorted(loaded & want), "asked": len(want)}
    finally:
        await mesh.stop()


def up_ready(prebuilt: Path, workdir: Path, timeout_s: float = 240.0) -> dict[str, Any]:
    """``tiermesh up`` on the 20-site topology: seconds from spawn to its 'mesh up' line, and the time it prints."""
    home = workdir / "up-home"
    shutil.copytree(prebuilt, home)
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep),
           "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "tiermesh", "up", "--topology", str(TOPOLOGY_20), "--home", str(home)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    seen: list[str] = []
    ready_s = printed = None
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        for line in proc.stdout:
            seen.append(line)
            m = re.search(r"mesh up.* in ([0-9.]+) s", line)
            if m:
                ready_s, printed = time.perf_counter() - t0, float(m.group(1))
                break
            if time.monotonic() > deadline:
                break
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)  # its clean stop: agents, proxies, etcd
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    if ready_s is None:
        raise RuntimeError("tiermesh up did not report 'mesh up':\n" + "".join(seen[-30:]))
    return {"ready_s": ready_s, "printed_s": printed}


async def run_footprint(ctx: RunContext) -> Path:
    rounds = ctx.pick(1, 3)
    install = await asyncio.to_thread(sdk_install)
    floor = await asyncio.to_thread(floor_rss)
    with tempfile.TemporaryDirectory(prefix="tiermesh-footprint-", ignore_cleanup_errors=True) as tmp:
        prebuilt = Path(tmp) / "prebuilt"
        await asyncio.to_thread(prebuild_catalog, prebuilt)
        agents = []
        for i in range(rounds):
            agents.append(await agent_rss(prebuilt, Path(tmp) / f"agent-{i}"))
        ups = [await asyncio.to_thread(up_ready, prebuilt, Path(tmp) / f"up-{i}") for i in range(rounds)]
    idle_rss = statistics.median(a["idle"][0] for a in agents)
    idle_pss = statistics.median(a["idle"][1] for a in agents)
    fam_rss = statistics.median(a["family"][0] for a in agents)
    fam_pss = statistics.median(a["family"][1] for a in agents)
    ready = statistics.median(u["ready_s"] for u in ups)
    printed = statistics.median(u["printed_s"] for u in ups)
    biggest = next(iter(install["per_dist"].items()), ("nothing", 0))
    rows: list[dict[str, Any]] = [
        {"measure": "SDK base install (fresh venv)", "value": install["total"] / MB, "unit": "MiB",
         "floor": None, "ratio": None,
         "note": ", ".join(f"{k} {v / MB:.1f}" for k, v in install["per_dist"].items() if v >= MB / 2)},
        {"measure": "bare Python + ONNX Runtime, one session (floor)", "value": floor / MB, "unit": "MiB RSS",
         "floor": floor / MB, "ratio": 1.0, "note": "mlp-tiny.onnx, one inference"},
        {"measure": "edge agent, idle", "value": idle_rss / MB, "unit": "MiB RSS", "floor": floor / MB,
         "ratio": idle_rss / floor, "note": f"PSS {idle_pss / MB:.1f} MiB; no variant loaded"},
        {"measure": "edge agent, digits family loaded", "value": fam_rss / MB, "unit": "MiB RSS",
         "floor": floor / MB, "ratio": fam_rss / floor,
         "note": f"PSS {fam_pss / MB:.1f} MiB; {len(agents[-1]['variants'])}/{agents[-1]['asked']} variants"},
        {"measure": "tiermesh up, 20 sites, spawn to 'mesh up'", "value": ready, "unit": "s", "floor": None,
         "ratio": None, "note": f"it prints {printed:.1f} s (after its own imports); {rounds} run(s), median"},
    ]
    targets = [
        target("SDK base install on disk", install["total"] / MB, 40.0, unit="MiB"),
        target("idle edge agent RSS", idle_rss / MB, 60.0, unit="MiB"),
        target("idle edge agent RSS / bare Python + ONNX Runtime floor", idle_rss / floor, 1.3, unit="x"),
        target("tiermesh up, 20 sites ready", ready, 5.0, unit="s"),
    ]
    return write_result(ctx, "footprint", rows, targets, notes=(
        f"SDK: `pip install tiermesh` (no extra: no numpy, no cryptography) into a fresh venv without pip, from this "
        f"tree's wheel; its largest distribution is {biggest[0]} ({biggest[1] / MB:.1f} MiB). Agent: a standalone "
        f"`tiermesh agent` process on {EDGE} of examples/topology-20.yaml against a real etcd, idle after 3 s, then "
        f"with every ONNX/TFLite digits variant placed and loaded. Floor: a bare Python process with ONNX Runtime and "
        f"one session open. Up: `tiermesh up --topology examples/topology-20.yaml` (secured by default: TLS "
        f"certificates per site), home with the catalog (digits and text families) prebuilt, agents forked from one "
        f"launcher that imported their code once; this machine's 2 cores are shared, so the start time moves with "
        f"whatever else runs."),
        extra={"install": install, "agents": agents, "ups": ups})


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    run_standalone("footprint", ap.parse_args().quick, run_footprint)
