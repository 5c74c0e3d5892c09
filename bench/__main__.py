"""``python -m bench [--quick] [--only NAME ...]``: run scenarios in turn, then regenerate BENCHMARKS.md.

A scenario that fails is reported and the others still run; the exit code says whether all passed.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench import report
from bench.common import RESULTS_DIR, Panel, RunContext, plot_panels, target, write_result

__all__ = ["SCENARIOS", "main", "run_decision"]


async def run_decision(ctx: RunContext) -> Path:
    """Routing decision time from ``bench/decision.py`` (its ``measure``), in the suite's schema."""
    from bench.decision import measure

    n = ctx.pick(3000, 20000)
    runs = [measure(c, n) for c in (100, 1000, 10000)]
    rows: list[dict[str, Any]] = [{"candidates": r["candidates"], "sites": r["sites"], "median_us": r["median_us"],
             "p99_us": r["p99_us"], "mean_us": r["mean_us"], "best_effort_median_us": r["best_effort_median_us"],
             "table_build_ms": r["build_ms"], "n": r["n"]} for r in runs]
    targets = []
    for r, limit in zip(rows[1:], (10.0, 40.0), strict=True):
        targets.append(target(f"decide() median at {r['candidates']} candidates", float(r["median_us"]), limit,
                              unit="µs"))
    groups = [str(r["candidates"]) for r in rows]
    plot_panels(ctx.results_dir / "decision.png", "Routing decision time (RoutingTable.decide)", [
        Panel("decide() per query", "µs (log)", groups,
              {"median": [float(r["median_us"]) for r in rows], "p99": [float(r["p99_us"]) for r in rows]},
              log_y=True, bar_text={"median": [f"{r['median_us']}" for r in rows]})])
    return write_result(ctx, "decision", rows, targets, notes=(
        f"{n} decide() calls per size over a synthetic snapshot (bench/decision.py: sites on a plane, "
        "edge / middle / core tiers, a digits-like family; per-tenant masks warmed). Candidates = sites x "
        "variants of the task. best_effort = a 0.5 ms budget nothing meets."))


# name -> (module, coroutine function); a module is imported only when its scenario runs, so a host that
# lacks one scenario's packages (a lent GPU machine has no ZeroMQ) still runs the others
_TABLE: dict[str, tuple[str, str]] = {
    "mesh_hop": ("bench.floor_hop", "run_mesh_hop"), "http_api": ("bench.floors", "run_http_api"),
    "grpc_api": ("bench.grpc_api", "run_grpc_api"),
    "sdk_local": ("bench.floors", "run_sdk_local"), "decision": ("bench.__main__", "run_decision"),
    "batching": ("bench.batching", "run_batching"), "geo": ("bench.geo", "run_geo"),
    "geo_hetero": ("bench.geo_hetero", "run_geo_hetero"), "coldstart": ("bench.coldstart", "run_coldstart"),
    "footprint": ("bench.footprint", "run_footprint"), "gpu_profile": ("bench.gpu_profile", "run_gpu_profile"),
    "gpu_routing": ("bench.gpu_routing", "run_gpu_routing"), "gpu_geo": ("bench.gpu_geo", "run_gpu_geo"),
    "shared_backbone": ("bench.shared_backbone", "run_shared_backbone"),
    "control_plane": ("bench.control_plane", "run_control_plane"),
    "cap_stalls": ("bench.cap_stalls", "run_cap_stalls"), "offline": ("bench.offline", "run_offline"),
    "cascade": ("bench.cascade", "run_cascade"),
}


def _scenario(name: str) -> Callable[[RunContext], Awaitable[Path]]:
    module, func = _TABLE[name]
    if module == "bench.__main__":
        return run_decision
    fn: Callable[[RunContext], Awaitable[Path]] = getattr(importlib.import_module(module), func)
    return fn


SCENARIOS = ("mesh_hop", "http_api", "grpc_api", "sdk_local", "decision", "batching", "geo", "geo_hetero",
             "coldstart", "footprint", "shared_backbone", "control_plane", "gpu_routing", "offline", "cascade")
# Run only when named (--only gpu_profile): they need a CUDA GPU, which most hosts lack.
GPU_SCENARIOS = ("gpu_profile", "gpu_geo")
# Run only when named too: it needs a writable cgroup cpu controller (root), and measures the machine, not tiermesh.
LAB_SCENARIOS = ("cap_stalls",)


async def _run(names: list[str], ctx: RunContext) -> int:
    failed = []
    for name in names:
        t0 = time.perf_counter()
        print(f"== {name} ...", flush=True)
        try:
            path = await _scenario(name)(ctx)
        except Exception:  # one broken scenario must not hide the others' numbers
            traceback.print_exc()
            failed.append(name)
            print(f"== {name} FAILED after {time.perf_counter() - t0:.1f} s", flush=True)
            continue
        print(f"== {name} done in {time.perf_counter() - t0:.1f} s -> {path}", flush=True)
        report.print_summary(path)
    if failed:
        print(f"failed scenarios: {', '.join(failed)}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds (the whole run in about 2 minutes)")
    ap.add_argument("--only", nargs="+", choices=SCENARIOS + GPU_SCENARIOS + LAB_SCENARIOS, metavar="NAME",
                    help=f"run only these scenarios: {', '.join(SCENARIOS + GPU_SCENARIOS + LAB_SCENARIOS)}")
    ap.add_argument("--results", type=Path, default=RESULTS_DIR, help="where JSON and PNG files go")
    ap.add_argument("--no-report", action="store_true", help="do not regenerate BENCHMARKS.md")
    args = ap.parse_args(argv)
    names = list(dict.fromkeys(args.only)) if args.only else list(SCENARIOS)
    command = "python -m bench" + (" --quick" if args.quick else "") + (
        f" --only {' '.join(names)}" if args.only else "")
    ctx = RunContext(quick=args.quick, results_dir=args.results, command=command)
    rc = asyncio.run(_run(names, ctx))
    if not args.no_report:
        out = report.write_report(args.results)
        print(f"wrote {out}")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
