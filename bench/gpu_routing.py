"""``gpu_routing``: what a measured GPU core profile changes in routing, on the example topology.

No GPU and no processes: the scheduler's own :class:`~core_scheduler.policy.routing.RoutingTable` over a
snapshot of ``examples/topology.yaml`` (its sites, tiers, prices and GPU counts, its path latencies,
bandwidths and jitter margins), with the profiles ``gpu_profile`` measured on a lent GPU machine
(``bench/results/gpu_profile.json``): every CPU site gets the CPU profile measured there (ONNX Runtime, one
thread, on that machine's CPU), and the core site either the same CPU profile (**CPU core**) or the GPU's
(**GPU core**: torch-cuda FP32 with CUDA graphs, same accuracy, its hardware class the measured GPU's). First
every variant counts as loaded everywhere, so cold starts and placement play no part: the only difference
between the two runs is the core's profile. Then (``placed``) the mesh holds what the scheduler's placement
plans (``floor_placement`` plus ``plan_placement`` over one demand per edge, class and row count, each with
its rows), and the same queries are routed over that: what a live mesh would do once demand has been seen.
``placed_rows_ignored`` plans the same demand as placement did before it knew a request's rows (every demand
one row, the 64-row demand merged into its class's): what the H200 run of ``gpu_geo`` hit.

Queries: the digits classes of ``tiermesh up`` (tight 10 ms / >= 0.90, balanced 60 ms / >= 0.97, accurate
400 ms / >= 0.985) and acme's topic classification of package descriptions (300 ms / >= 0.75: the six-layer
MiniLM encoder), each as one row and as a batch of 64 rows in one request, from every edge. The 64-row
requests are timed at the batch they bring and billed their rows (``Query.rows``). Each row of the result
says where the query goes, with which variant, at what expected latency, and whether that meets the SLO or
is a best-effort answer, for both cores.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from bench.common import REPO_ROOT, Panel, RunContext, plot_panels, target, write_result

__all__ = ["CLASSES", "decisions", "placed_decisions", "run_gpu_routing"]

PROFILE_JSON = REPO_ROOT / "bench" / "results" / "gpu_profile.json"
TOPOLOGY = REPO_ROOT / "examples" / "topology.yaml"
CPU_CONFIG = "onnxruntime cpu fp32 1 thread"
GPU_CONFIG = "torch-cuda fp32 graphs"
# (class, task, tenant, budget ms, accuracy floor)
CLASSES = (("tight", "digit-classification", "public", 10.0, 0.90),
           ("balanced", "digit-classification", "public", 60.0, 0.97),
           ("accurate", "digit-classification", "public", 400.0, 0.985),
           ("text-topic", "text-topic", "acme", 300.0, 0.75))
ROWS = (1, 64)
# bytes per row on the wire: a 64-pixel digit as float32; a package description of ~200 bytes
ROW_BYTES = {"digit-classification": 64 * 4, "text-topic": 200}


def _variants(doc: dict[str, Any], core_class: str) -> list[Any]:
    from core_scheduler.policy.snapshot import MIB, VariantInfo

    out = []
    profiles = doc["profiles"]
    for key, entry in profiles.items():
        model, config = key.split(".", 1)
        if config != CPU_CONFIG:
            continue
        gpu = profiles.get(f"{model}.{GPU_CONFIG}")
        compute = {"cpu": _latency(entry)}
        load = {"cpu": float(entry["profile"]["load_ms"])}  # measured there: what a cold start costs routing
        if gpu is not None:
            compute[core_class] = _latency(gpu)
            load[core_class] = float(gpu["profile"]["load_ms"])
        if model == "minilm-l6":  # served as acme's topic head on the encoder (the head is one MatMul)
            accuracy = float(entry["accuracy"]["text-topic"])
            out.append(VariantInfo("text-topic", "topic-minilm-l6", accuracy, 87 * MIB, owner="acme",
                                   compute_ms=compute, load_ms=load, memory_bytes=120 * MIB, max_batch=64))
        else:
            out.append(VariantInfo("digit-classification", model, float(entry["accuracy"]), MIB,
                                   compute_ms=compute, load_ms=load, memory_bytes=4 * MIB, max_batch=64))
    return out


def _latency(entry: dict[str, Any]) -> dict[int, float]:
    return {int(b): float(s["p50_ms"]) for b, s in entry["profile"]["latency"].items()}


def _snapshot(doc: dict[str, Any], *, gpu_core: bool, loaded: Mapping[str, Iterable[str]] | None) -> Any:
    """The example topology with the measured profiles; ``loaded``: what each site holds (None: everything)."""
    from core_scheduler.policy.snapshot import MeshSnapshot, SiteInfo, SiteLoad, tail_margin_ms
    from topology.loader import load_topology_file
    from topology.paths import topology_paths

    topo = load_topology_file(TOPOLOGY)
    core_class = doc["device"]["hardware_class"]
    sites = []
    for name, s in sorted(topo.sites.items()):
        is_gpu = gpu_core and s.tier == "core" and bool(s.hardware.gpus)
        sites.append(SiteInfo(name, s.tier, s.region, core_class if is_gpu else "cpu", s.hardware.cpu_cores,
                              s.hardware.memory_mb, len(s.hardware.gpus) if is_gpu else 0,
                              s.hardware.price_per_hour))
    variants = _variants(doc, core_class)
    every = frozenset(v.variant_id for v in variants)
    held = {s.name: every if loaded is None else frozenset(loaded.get(s.name, ())) for s in sites}
    size = {v.variant_id: v.memory_bytes for v in variants}
    loads = [SiteLoad(s.name, loaded=held[s.name], capacity=s.slots,
                      memory_free_bytes=s.memory_bytes - (0 if loaded is None else sum(size[v] for v in held[s.name])))
             for s in sites]
    paths = topology_paths(topo)
    order = [paths.index[s.name] for s in sites]  # the snapshot indexes sites in name order, as sites is
    rtt = paths.rtt_ms[order][:, order]
    return MeshSnapshot.from_parts(sites, variants, loads, rtt_ms=rtt,
                                   bandwidth_mbps=paths.bandwidth_mbps[order][:, order],
                                   margin_ms=tail_margin_ms(rtt, paths.jitter_rtt_ms[order][:, order]), version=1)


def _demands(snap: Any, *, rows_aware: bool) -> list[Any]:
    """One demand per (edge, class, rows), 2 qps each; without ``rows_aware`` as placement saw them before it
    knew a request's rows: one row each, the 64-row demand in its one-row class."""
    from core_scheduler.policy.placement import Demand

    edges = sorted(n for n, s in snap.sites.items() if s.tier == "edge")
    return [Demand(edge, task, name if n == 1 or not rows_aware else f"{name}-x{n}", 2.0, floor, budget, tenant,
                   rows=n if rows_aware else 1)
            for edge in edges for name, task, tenant, budget, floor in CLASSES for n in ROWS]


def placed_decisions(doc: dict[str, Any], *, gpu_core: bool, rows_aware: bool = True) -> list[dict[str, Any]]:
    """:func:`decisions` over what placement plans for the demand (the warm floor kept), not everything."""
    from core_scheduler.policy.floor import floor_placement
    from core_scheduler.policy.placement import plan_placement

    floor = floor_placement(_snapshot(doc, gpu_core=gpu_core, loaded={}))
    snap = _snapshot(doc, gpu_core=gpu_core, loaded=floor)
    plan = plan_placement(snap, _demands(snap, rows_aware=rows_aware), 0.0, {}, {}, pinned=floor)
    return decisions(doc, gpu_core=gpu_core, loaded=plan.per_site)


def decisions(doc: dict[str, Any], *, gpu_core: bool,
              loaded: Mapping[str, Iterable[str]] | None = None) -> list[dict[str, Any]]:
    """One row per (class, rows, edge): the decision of that edge's routing table (``loaded``: what each site
    holds; None: every variant everywhere)."""
    from core_scheduler.policy.routing import Query, RoutingTable

    snap = _snapshot(doc, gpu_core=gpu_core, loaded=loaded)
    tiers = {n: s.tier for n, s in snap.sites.items()}
    rows = []
    for edge in sorted(n for n, s in snap.sites.items() if s.tier == "edge"):
        table = RoutingTable.build(snap, edge)
        for name, task, tenant, budget, floor in CLASSES:
            for n in ROWS:
                d = table.decide(Query(task=task, tenant=tenant, budget_ms=budget, min_accuracy=floor,
                                       nbytes=n * ROW_BYTES[task], rows=n))
                rows.append({"core": "gpu" if gpu_core else "cpu", "class": name, "rows": n, "edge": edge,
                             "site": d.site, "tier": tiers[d.site], "variant": d.variant_id,
                             "expected_ms": round(d.expected_latency_ms, 3), "budget_ms": budget,
                             "meets_slo": not d.best_effort, "reason": d.reason})
    return rows


def _measure(ctx: RunContext) -> Path:
    if not PROFILE_JSON.is_file():
        raise RuntimeError(f"{PROFILE_JSON} is missing: run `python -m bench --only gpu_profile` on a GPU host")
    doc = json.loads(PROFILE_JSON.read_text())
    cpu, gpu = decisions(doc, gpu_core=False), decisions(doc, gpu_core=True)
    placed = {"CPU core, planned": placed_decisions(doc, gpu_core=False),
              "GPU core, planned": placed_decisions(doc, gpu_core=True),
              "GPU core, planned, rows ignored": placed_decisions(doc, gpu_core=True, rows_aware=False)}
    changed = [(a, b) for a, b in zip(cpu, gpu, strict=True) if (a["site"], a["variant"]) != (b["site"], b["variant"])]
    short = {"tight": "tight", "balanced": "bal.", "accurate": "acc.", "text-topic": "topic"}
    groups = [f"{short[name]}\nx{n}" for name, *_ in CLASSES for n in ROWS]

    def count(rows: list[dict[str, Any]], what: str) -> list[float]:
        c: Counter[str] = Counter()
        for r in rows:
            if (what == "met" and r["meets_slo"]) or (what == "core" and r["tier"] == "core"):
                c[f"{short[r['class']]}\nx{r['rows']}"] += 1
        return [float(c[g]) for g in groups]

    plot_panels(ctx.results_dir / "gpu_routing.png",
                f"Routing on examples/topology.yaml with a CPU or a measured {doc['device']['gpu']} core", [
        Panel("edges whose queries meet the SLO", "edges (of 4)", groups,
              {"CPU core": count(cpu, "met"), "GPU core": count(gpu, "met")}),
        Panel("edges whose queries go to the core", "edges (of 4)", groups,
              {"CPU core": count(cpu, "core"), "GPU core": count(gpu, "core")}),
        Panel("placed by the scheduler: edges meeting the SLO", "edges (of 4)", groups,
              {name: count(rows, "met") for name, rows in placed.items()})])
    big_text = [r for r in gpu if r["class"] == "text-topic" and r["rows"] == 64]
    big_text_cpu = [r for r in cpu if r["class"] == "text-topic" and r["rows"] == 64]
    cpu_met = sum(r["meets_slo"] for r in big_text_cpu)
    big_placed = {name: sum(r["meets_slo"] for r in rows if r["class"] == "text-topic" and r["rows"] == 64)
                  for name, rows in placed.items()}
    all_placed = placed["GPU core, planned"]
    targets = [
        target("64-row topic queries within SLO with a GPU core (edges)", sum(r["meets_slo"] for r in big_text),
               len(big_text), op=">="),
        target("... served by the GPU core", sum(r["tier"] == "core" for r in big_text), len(big_text), op=">="),
        target("decisions changed by the core's profile", len(changed), 1, op=">="),
        target("64-row topic queries within SLO with a GPU core, the mesh as placement plans it (edges)",
               big_placed["GPU core, planned"], len(big_text), op=">="),
        target("every class and row count within SLO with a GPU core, as placement plans it (decisions)",
               sum(r["meets_slo"] for r in all_placed), len(all_placed), op=">="),
    ]
    for name, rows in placed.items():
        for r in rows:
            r["placement"] = name
    for r in cpu + gpu:
        r["placement"] = "every variant everywhere"
    return write_result(ctx, "gpu_routing", cpu + gpu + [r for rows in placed.values() for r in rows], targets, notes=(
        f"Profiles from bench/results/gpu_profile.json ({doc['device']['gpu']}, commit {doc['git_commit']}): CPU "
        f"sites '{CPU_CONFIG}', the GPU core '{GPU_CONFIG}' as {doc['device']['hardware_class']}. Decisions of the "
        "scheduler's RoutingTable on examples/topology.yaml; every variant loaded everywhere; a 64-row request is "
        f"timed at the batch it brings and billed its rows. {len(changed)} of {len(cpu)} decisions differ between "
        "the cores. With the CPU core, "
        f"{cpu_met} of {len(big_text_cpu)} edges' 64-row topic queries meet the SLO (the rest: best effort). "
        "Placed (rows with 'placement' planned): the warm floor plus plan_placement over one 2-qps demand per "
        "edge, class and row count, cold starts at the measured load times; 64-row topic queries within SLO: "
        + ", ".join(f"{name} {n} of {len(big_text)}" for name, n in big_placed.items())
        + " ('rows ignored': every demand planned at one row, as before placement knew a request's rows)."),
        extra={"changed": [{"class": a["class"], "rows": a["rows"], "edge": a["edge"],
                            "cpu_core": f"{a['site']} {a['variant']} {a['expected_ms']} ms",
                            "gpu_core": f"{b['site']} {b['variant']} {b['expected_ms']} ms"} for a, b in changed]})


async def run_gpu_routing(ctx: RunContext) -> Path:
    return _measure(ctx)
