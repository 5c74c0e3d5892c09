"""``cap_stalls``: what a CPU cap does to a site's latency, scheme by scheme (issue 30, item 3).

A capped site should look like slower hardware: each piece of work taking about ``1 / share`` times as long, and no
long stalls. A CFS quota does something else: a process runs at full speed for its quota, then waits out the rest
of the period. This scenario measures that, for each CFS period and share, on a process serving an open-loop
stream of work units (a fixed pure-Python loop of about :data:`UNIT_MS` uncapped, the compute of a small model's
query, arriving at half the capped capacity):

* ``stretch``: median latency of a unit / its uncapped median. A slower CPU gives ``1 / share``;
* ``p99 / ideal`` and ``max / ideal``: the tail against ``1 / share`` x the uncapped median (a slower CPU at half
  load stays near 1-3; a stall of most of a period shows as a large ratio);
* ``stall_max_ms``: the longest gap in a tight clock-reading loop run alone in the cgroup.

The kernel's smallest quota is 1 ms, so a period shorter than ``1 ms / share`` cannot express the share (those
cells are skipped). The scheme chosen for :mod:`tiermesh.caps` is the shortest period that can: ``1 ms / share``
(at least 2 ms). Needs a writable cgroup cpu controller (root); without one it writes nothing and says why.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from bench.common import RunContext, run_standalone, target, write_result
from tiermesh.caps import CpuCgroups, period_for

__all__ = ["run_cap_stalls"]

SHARES = (0.1, 0.25, 0.5)
PERIODS_US = (20_000, 10_000, 5_000, 2_000)
MIN_QUOTA_US = 1_000
UNIT_MS = 4.0

# The child: calibrate a ~1 ms unit uncapped is done by the parent; here run units at fixed arrival times and
# report each one's latency from its scheduled arrival, then a tight loop's longest gap.
_CHILD = textwrap.dedent("""
    import json, sys, time
    iters, period_s, n, stall_s = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    def unit():
        x = 0
        for i in range(iters):
            x += i * i
        return x
    lat = []
    start = time.perf_counter() + 0.05
    for k in range(n):
        due = start + k * period_s
        now = time.perf_counter()
        if now < due:
            time.sleep(due - now)
        unit()
        lat.append(time.perf_counter() - due)
    gap, last, end = 0.0, time.perf_counter(), time.perf_counter() + stall_s
    while last < end:
        now = time.perf_counter()
        gap = max(gap, now - last)
        last = now
    print(json.dumps({"lat": lat, "gap": gap}))
""")


def _child(prefix: list[str], iters: int, period_s: float, n: int, stall_s: float) -> dict[str, Any]:
    out = subprocess.run([*prefix, sys.executable, "-c", _CHILD, str(iters), str(period_s), str(n), str(stall_s)],
                         capture_output=True, text=True, timeout=300, check=True)
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


def _calibrate() -> tuple[int, float]:
    """Loop iterations for a unit of about ``UNIT_MS`` here, and its median uncapped latency (s)."""
    iters = 20_000
    base = _median(_child([], iters, 0.02, 60, 0.0)["lat"])
    iters = max(1000, int(iters * UNIT_MS / 1000 / base))
    return iters, _median(_child([], iters, 0.02, 100, 0.0)["lat"])


def _median(v: list[float]) -> float:
    s = sorted(v)
    return s[len(s) // 2]


def _pct(v: list[float], q: float) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


async def run_cap_stalls(ctx: RunContext) -> Path:
    cg = CpuCgroups()
    if not cg.available:
        cg.close()
        raise RuntimeError(f"cap_stalls needs CPU caps: {cg.why}")
    n = ctx.pick(60, 200)
    rows: list[dict[str, Any]] = []
    try:
        iters, base = await asyncio.to_thread(_calibrate)
        for share in SHARES:
            ideal = base / share
            gap_s = ideal * 2  # arrivals at half the capped capacity
            for period in sorted({*PERIODS_US, period_for(share)}, reverse=True):
                if share * period < MIN_QUOTA_US:
                    continue
                name = f"s{int(share * 100)}-p{period}"
                cg.create(name, share, period_us=period)
                doc = await asyncio.to_thread(_child, cg.wrap(name), iters, gap_s, n, 1.0)
                cg.remove(name)
                lat = doc["lat"]
                rows.append({"share": share, "period_ms": period / 1000, "chosen": period == period_for(share),
                             "unit_ms": round(base * 1000, 3), "ideal_ms": round(ideal * 1000, 2),
                             "median_ms": round(_median(lat) * 1000, 2), "p99_ms": round(_pct(lat, 99) * 1000, 2),
                             "max_ms": round(max(lat) * 1000, 2), "stretch": round(_median(lat) / base, 2),
                             "p99_over_ideal": round(_pct(lat, 99) / ideal, 2),
                             "max_over_ideal": round(max(lat) / ideal, 2),
                             "stall_max_ms": round(doc["gap"] * 1000, 2)})
    finally:
        cg.close()
    targets = []
    for share in SHARES:
        chosen = [r for r in rows if r["share"] == share and r["chosen"]]
        old = [r for r in rows if r["share"] == share and r["period_ms"] == 20.0]
        if chosen and old and not old[0]["chosen"]:
            was = old[0]["stall_max_ms"]
            targets.append(target(f"share {share}: longest stall at the chosen period, at most 20 ms's ({was} ms)",
                                  chosen[0]["stall_max_ms"], was, unit="ms"))
    return write_result(ctx, "cap_stalls", rows, targets, notes=(
        "One process per cell in a cgroup v1/v2 CPU quota of share x period; an open-loop stream of "
        f"~{UNIT_MS:g} ms (uncapped) pure-Python units at half the capped capacity; latency from each unit's "
        "scheduled arrival. "
        "ideal = uncapped median / share (a CPU that much slower). stall_max_ms: the longest gap a tight loop "
        "saw in 1 s alone in the cgroup. Cells with share x period under the kernel's 1 ms minimum quota are "
        "skipped. chosen: tiermesh.caps.period_for(share)."))


if __name__ == "__main__":
    doc = run_standalone("cap_stalls", "--quick" in sys.argv, run_cap_stalls)
    for r in doc["rows"]:
        print(r)
