"""Issue 14 item 1 on a real local mesh: every agent runs inside a CPU cgroup of its share of this
machine, reports the capped hardware class it reads back from its own cgroup, profiles the variants
its class has no profile for on first load (and publishes them), serves queries, and every cgroup is
gone once the mesh stops."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import numpy as np
import pytest

from mesh.client import AsyncClient
from mesh.etcd.keys import live_key
from tests.system.conftest import TASK, Holdout, catalog_variants, mesh_running
from tiermesh.caps import CpuCgroups

pytestmark = [pytest.mark.system, pytest.mark.slow, pytest.mark.asyncio]

_CAPS, _WHY = CpuCgroups.probe()
if not _CAPS:
    pytest.skip(f"no writable cgroup cpu controller here: {_WHY}", allow_module_level=True)


def _quota(cgroup: Path) -> float:
    if (cgroup / "cpu.max").exists():
        quota, period = (cgroup / "cpu.max").read_text().split()
    else:
        quota = (cgroup / "cpu.cfs_quota_us").read_text().strip()
        period = (cgroup / "cpu.cfs_period_us").read_text().strip()
    return int(quota) / int(period)


async def test_capped_sites_profile_themselves_serve_and_clean_up(holdout: Holdout) -> None:
    parent: Path | None = None
    async with mesh_running(caps=True) as mesh:
        assert mesh.cgroups is not None and mesh.cgroups.available
        parent = mesh.cgroups.parent
        caps = mesh.site_caps
        assert caps["edge-par-1"].cpu is not None and caps["core-eu"].cpu is not None
        assert caps["edge-par-1"].cpu < caps["mid-eu"].cpu < caps["core-eu"].cpu  # type: ignore[operator]
        assert sum(c.cpu or 0 for c in caps.values()) <= len(os.sched_getaffinity(0)) + 1e-6
        for name, sp in mesh.sites.items():
            assert sp.proc is not None
            group = mesh.cgroups.sites[name]
            assert str(sp.proc.pid) in (group / "cgroup.procs").read_text().split(), name
            assert _quota(group) == pytest.approx(caps[name].cpu, abs=0.01)
        report = mesh.caps_report()
        assert report["capped"] and set(report["sites"]) == set(mesh.sites)

        variants = await catalog_variants(mesh)
        assert mesh.store is not None
        edge = "edge-par-1"
        deadline = time.monotonic() + 120
        hb: dict = {}
        while time.monotonic() < deadline:
            kv = await mesh.store.get(live_key(edge))
            hb = kv.value if kv is not None else {}
            budget = hb.get("model_memory_budget_bytes", 0)
            fits = {v for v, m in variants.items() if m.size_bytes <= budget and m.format == "onnx"}
            if fits and fits <= set(hb.get("profiles") or {}):
                break
            await asyncio.sleep(0.5)
        assert hb.get("hardware_class", "").endswith(f"-cap{caps[edge].cpu:.2f}"), hb.get("hardware_class")
        assert hb.get("cpu_cap") == pytest.approx(caps[edge].cpu, abs=0.01)
        assert hb["model_memory_budget_bytes"] == caps[edge].model_memory_mb * 1024 * 1024
        missing = fits - set(hb.get("profiles") or {})
        assert not missing, f"{edge} did not profile {sorted(missing)} in 120 s"
        for prof in hb["profiles"].values():
            assert all(ms > 0 for ms in prof["p50_ms"].values())

        async with AsyncClient(mesh.sites[edge].http or "", timeout=10.0) as client:
            served = 0
            for i in range(20):
                reply = await client.infer(TASK, np.asarray(holdout.x[i:i + 1]), latency_ms=500, min_accuracy=0.9)
                served += int(reply.outputs is not None)
            assert served == 20
    assert parent is not None and not parent.exists(), "the mesh's cgroups were not removed"
