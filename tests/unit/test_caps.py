"""Issue 14 item 1, the pure parts: each site's share of this machine, the capped hardware class, the
self-measured profiles a heartbeat carries and how a snapshot uses them, and the self-profiler's timing."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any, cast

import numpy as np
import pytest

from core_scheduler.state.heartbeat import Heartbeat, MeasuredProfile
from core_scheduler.state.snapshot import build_snapshot
from core_scheduler.state.view import MeshView
from edge_agent.selfprofile import QUIET_S, SelfProfiler, sample_inputs, time_batches
from mesh.errors import ConfigError
from mesh.types import TaskSignature, TensorSpec
from tiermesh.caps import MIN_CPU, CpuCgroups, plan_caps
from topology.schema import Hardware, Link, Site, Topology
from variant_store.hardware import capped_class
from variant_store.meta import LatencyStats, Profile, VariantMeta

pytestmark = pytest.mark.unit

SITES = {"core": ("core", 32, 131072), "mid": ("middle", 16, 65536), "edge-a": ("edge", 4, 8192),
         "edge-b": ("edge", 2, 4096)}


def _topology() -> Topology:
    sites = {n: Site(name=n, tier=t, region="r", lat=0.0, lon=0.0,  # type: ignore[arg-type]
                     hardware=Hardware(cpu_cores=c, memory_mb=m, price_per_hour=0.1))
             for n, (t, c, m) in SITES.items()}
    return Topology(sites=sites, links=(Link("edge-a", "mid", 4, 100), Link("edge-b", "mid", 4, 100),
                                        Link("mid", "core", 10, 1000)))


def test_edges_get_a_fraction_middles_more_and_cores_the_rest() -> None:
    plan = plan_caps(_topology(), list(SITES), machine_cpus=2.0, machine_memory=1 << 20)
    cpu = {n: c.cpu for n, c in plan.items()}
    assert cpu["edge-b"] == MIN_CPU                      # 2/54 x 2 = 0.07: raised to the floor
    assert cpu["edge-a"] == pytest.approx(2 * 4 / 54, abs=1e-3)
    assert cpu["mid"] == pytest.approx(2 * 16 / 54, abs=1e-3)
    assert cpu["core"] == pytest.approx(2 - cpu["edge-a"] - cpu["edge-b"] - cpu["mid"], abs=1e-3)  # type: ignore[operator]
    assert sum(cpu.values()) == pytest.approx(2.0, abs=1e-2)  # type: ignore[arg-type]
    # plenty of memory: the declared share, unscaled
    assert plan["edge-b"].model_memory_mb == 1024 and plan["core"].model_memory_mb == 32768


def test_many_small_sites_do_not_starve_the_core() -> None:
    """Twenty edges at the floor take the whole machine: the core keeps its proportional share
    (caps are limits, not reservations) instead of falling to the floor below the edges."""
    sites = {f"edge-{i}": Site(name=f"edge-{i}", tier="edge", region="r", lat=0.0, lon=0.0,
                               hardware=Hardware(cpu_cores=2, memory_mb=4096, price_per_hour=0.1))
             for i in range(20)}
    sites["core"] = Site(name="core", tier="core", region="r", lat=0.0, lon=0.0,
                         hardware=Hardware(cpu_cores=32, memory_mb=131072, price_per_hour=1.0))
    topo = Topology(sites=sites, links=tuple(Link(f"edge-{i}", "core", 10, 100) for i in range(20)))
    plan = plan_caps(topo, list(sites), machine_cpus=2.0, machine_memory=1 << 20)
    assert plan["edge-0"].cpu == MIN_CPU
    assert plan["core"].cpu == pytest.approx(2 * 32 / (32 + 40), abs=1e-3)
    assert plan["core"].cpu > plan["edge-0"].cpu  # type: ignore[operator]


def test_model_memory_is_scaled_down_to_half_the_machine() -> None:
    plan = plan_caps(_topology(), list(SITES), machine_cpus=2.0, machine_memory=8192)
    total = sum(c.model_memory_mb for c in plan.values())
    assert total <= 4096 and plan["edge-b"].model_memory_mb < plan["edge-a"].model_memory_mb
    assert "declares 4096 MiB" in plan["edge-b"].describe()


def test_bad_machine_is_refused() -> None:
    with pytest.raises(ConfigError):
        plan_caps(_topology(), list(SITES), machine_cpus=0, machine_memory=1)


def test_no_cpu_controller_means_uncapped_and_says_why() -> None:
    cg = CpuCgroups(mounts=[])
    assert not cg.available and "no cgroup" in cg.why
    with pytest.raises(ConfigError, match="no CPU caps"):
        cg.create("edge", 0.5)
    cg.close()


def test_a_capped_class_is_its_own() -> None:
    assert capped_class("cpu-x86_64", None) == "cpu-x86_64"
    assert capped_class("cpu-x86_64", 0.25) == "cpu-x86_64-cap0.25"


def test_measured_profiles_round_trip_and_bad_ones_are_refused() -> None:
    hb = Heartbeat(site="e", hardware_class="cpu-x-cap0.10", cpu_cap=0.1,
                   profiles={"v": MeasuredProfile(load_ms=3.0, p50_ms={1: 0.5, 8: 2.0})})
    assert Heartbeat.from_json(json.loads(json.dumps(hb.to_json()))) == hb
    for bad in ({"v": {"p50_ms": {}}}, {"v": {"p50_ms": {"0": 1.0}}}, {"v": {"p50_ms": {"1": -1}}}, []):
        with pytest.raises((ValueError, TypeError, KeyError)):
            Heartbeat.from_json({"site": "e", "profiles": bad})


def _view(profiles: dict[str, Any]) -> MeshView:
    topo = _topology()
    view = MeshView(cast(Any, None), "edge-a")
    for name, site in topo.sites.items():
        view._apply(f"topology/sites/{name}", site.to_dict())
    for lk in topo.links:
        view._apply(f"topology/links/{lk.a}/{lk.b}", lk.to_dict())
    prof = Profile(hardware_class="cpu-x", load_ms=5.0, latency={1: LatencyStats(1.0, 2.0)}, peak_memory_bytes=1)
    meta = VariantMeta(task="digits", family="mlp", variant_id="mlp", format="onnx", precision="fp32",
                       runtime="onnxruntime", blob_digest="ab" * 32, size_bytes=1 << 20, accuracy=0.97,
                       profiles={"cpu-x": prof})
    view._apply("catalog/digits/mlp", meta.to_json())
    for name in topo.sites:
        capped = name.startswith("edge")
        view._apply(f"live/{name}", {"hardware_class": "cpu-x-cap0.10" if capped else "cpu-x", "capacity": 2,
                                     "profiles": profiles if capped else {}})
    return view


def test_a_capped_class_runs_only_with_a_self_measured_profile() -> None:
    snap = build_snapshot(_view({}))
    assert snap is not None
    (v,) = snap.variants["digits"]
    assert not v.runs_on("cpu-x-cap0.10")                   # unprofiled class: not guessed
    snap = build_snapshot(_view({"mlp": {"load_ms": 9.0, "p50_ms": {"1": 7.5, "8": 30.0}}}))
    assert snap is not None
    (v,) = snap.variants["digits"]
    assert v.compute_at("cpu-x-cap0.10", 1) == 7.5 and v.compute_at("cpu-x", 1) == 1.0
    assert v.load_at("cpu-x-cap0.10") == 9.0


def test_sample_inputs_follow_the_signature_and_timing_is_bounded() -> None:
    sig = TaskSignature(task="t", inputs=(TensorSpec("x", "float32", (-1, 64)), TensorSpec("s", "object", (-1,))),
                        outputs=(TensorSpec("y", "float32", (-1, 10)),))
    x = sample_inputs(sig, 8)
    assert x["x"].shape == (8, 64) and x["x"].dtype == np.float32 and x["s"].shape == (8,)
    calls: list[int] = []

    def infer(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        calls.append(len(inputs["x"]))
        return {"y": inputs["x"][:, :10]}

    stats = time_batches(infer, lambda bs: sample_inputs(sig, bs), (1, 8), repeats=5, time_budget_s=1.0)
    assert set(stats) == {1, 8} and all(s.p50_ms >= 0 for s in stats.values())
    assert calls.count(1) == 6 and calls.count(8) == 6      # one warm-up + at most `repeats` each


async def test_speculative_profiling_waits_for_a_quiet_site() -> None:
    """Variants placement asks for are timed at once; the others only after QUIET_S without a query, so a
    capped site's little CPU goes to its traffic first (the demo's edges were still timing 12 variants
    when its workload began)."""
    def meta(vid: str) -> VariantMeta:
        return VariantMeta(task="digits", family="mlp", variant_id=vid, format="onnx", precision="fp32",
                           runtime="onnxruntime", blob_digest="cd" * 32, size_bytes=1, accuracy=0.9, profiles={})

    idle = [0.0]
    timed: list[str] = []

    class Probe(SelfProfiler):
        def peer_profiles(self) -> dict[str, MeasuredProfile]:
            return {}

        def missing(self) -> list[VariantMeta]:
            return [meta(v) for v in ("placed", "spare") if v not in timed]

        async def profile(self, m: VariantMeta) -> Profile:  # type: ignore[override]
            timed.append(m.variant_id)
            return Profile(hardware_class="x", load_ms=1.0, latency={1: LatencyStats(1.0, 1.0)}, peak_memory_bytes=1)

    prof = Probe("edge-a", cast(Any, None), cast(Any, None), wanted=lambda: {"placed"}, idle_s=lambda: idle[0])
    task = asyncio.create_task(prof.run())
    try:
        prof.wake()
        for _ in range(100):
            if timed:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert timed == ["placed"]          # busy site: the speculative one waits
        idle[0] = QUIET_S + 1.0
        for _ in range(int(QUIET_S * 100) + 200):
            if len(timed) == 2:
                break
            await asyncio.sleep(0.01)
        assert timed == ["placed", "spare"]  # a quiet spell: timed without any wake-up from the view
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_sites_of_one_class_split_the_profiling() -> None:
    """A variant a live peer of this class published is adopted, not timed again; the rest is walked from
    each site's own starting point, so two edges of one class start on different variants."""
    view = _view({"mlp": {"load_ms": 9.0, "p50_ms": {"1": 7.5, "8": 30.0}}})
    view._apply("live/edge-a", {"hardware_class": "cpu-x-cap0.10", "capacity": 2})  # has timed nothing yet
    view.signatures["digits"] = TaskSignature(task="digits", inputs=(TensorSpec("x", "float32", (-1, 4)),),
                                              outputs=(TensorSpec("y", "float32", (-1, 2)),))
    for i in range(4):
        meta = VariantMeta(task="digits", family="mlp", variant_id=f"v{i}", format="onnx", precision="fp32",
                           runtime="onnxruntime", blob_digest="ab" * 32, size_bytes=i + 1, accuracy=0.9,
                           profiles={"cpu-x": Profile(hardware_class="cpu-x", load_ms=1.0,
                                                      latency={1: LatencyStats(1.0, 1.0)}, peak_memory_bytes=1)})
        view._apply(f"catalog/digits/v{i}", meta.to_json())

    class Host:
        hardware_class = "cpu-x-cap0.10"

        def __init__(self, own: dict[str, Profile]) -> None:
            self.self_profiles = own
            self.class_profiles: dict[str, Profile] = {}

    def order(site: str) -> list[str]:
        timed = Profile(hardware_class="cpu-x-cap0.10", load_ms=9.0, latency={1: LatencyStats(7.5, 7.5)},
                        peak_memory_bytes=1)
        host = Host({"mlp": timed} if site == "edge-b" else {})
        prof = SelfProfiler(site, cast(Any, host), view, wanted=set)
        out = [m.variant_id for m in prof.missing()]
        assert "mlp" not in out
        if site == "edge-a":
            assert host.class_profiles["mlp"].compute_ms(1) == 7.5  # adopted from edge-b
        return out

    a, b = order("edge-a"), order("edge-b")
    assert sorted(a) == sorted(b) == ["v0", "v1", "v2", "v3"]
    assert a[0] != b[0]                                   # each starts on its own share
