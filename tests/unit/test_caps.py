"""Issue 14 item 1, the pure parts: each site's share of this machine, the capped hardware class, the
self-measured profiles a heartbeat carries and how a snapshot uses them, and the self-profiler's timing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any, cast

import numpy as np
import pytest

from core_scheduler.policy.routing import Query, RoutingTable
from core_scheduler.policy.snapshot import ESTIMATE_SAFETY, VariantInfo, with_estimates
from core_scheduler.state.heartbeat import Heartbeat, MeasuredProfile
from core_scheduler.state.snapshot import build_snapshot
from core_scheduler.state.view import MeshView
from edge_agent.selfprofile import (
    DUTY,
    MAX_YIELD_S,
    QUIET_S,
    YIELD_STEP_S,
    SelfProfiler,
    sample_inputs,
    time_batches,
)
from edge_agent.traces import HopTrace
from mesh.errors import ConfigError
from mesh.types import TaskSignature, TensorSpec
from tiermesh.caps import MIN_CPU, PERIOD_US, CpuCgroups, period_for, plan_caps
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


@pytest.mark.parametrize(("cores", "period_ms"), [(0.05, 20.0), (0.1, 10.0), (0.25, 4.0), (0.5, 2.0), (2.0, 2.0)])
def test_a_cap_runs_over_the_shortest_period_that_can_express_it(cores: float, period_ms: float) -> None:
    """A quota stalls a site for the rest of its period: the shortest period with a quota of at least 1 ms
    (the kernel's least) keeps a capped site closer to a slower CPU (bench/cap_stalls.py)."""
    assert period_for(cores) == period_ms * 1000 <= PERIOD_US
    assert cores * period_for(cores) >= 1000 or period_for(cores) == PERIOD_US


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
                                     "model_memory_budget_bytes": 1 << 30, "profiles": profiles if capped else {}})
    return view


def test_a_capped_class_is_estimated_until_its_self_measured_profile_replaces_it() -> None:
    snap = build_snapshot(_view({}))
    assert snap is not None
    (v,) = snap.variants["digits"]
    # unmeasured: estimated from the uncapped machine at a tenth of its speed, and marked so (issue 30)
    assert v.runs_on("cpu-x-cap0.10") and v.estimated == {"cpu-x-cap0.10"}
    assert v.compute_at("cpu-x-cap0.10", 1) == pytest.approx(10.0) and v.load_at("cpu-x-cap0.10") == pytest.approx(50.0)
    snap = build_snapshot(_view({"mlp": {"load_ms": 9.0, "p50_ms": {"1": 7.5, "8": 30.0}}}))
    assert snap is not None
    (v,) = snap.variants["digits"]
    assert v.compute_at("cpu-x-cap0.10", 1) == 7.5 and v.compute_at("cpu-x", 1) == 1.0
    assert v.load_at("cpu-x-cap0.10") == 9.0 and not v.estimated


def test_a_variant_not_measured_on_a_class_is_routable_and_the_decision_says_estimated() -> None:
    """Issue 30: a capped edge in its first minute, before it has timed anything, is not a site without
    variants: routing costs them from the estimate, serves there what fits, and marks the decision."""
    snap = build_snapshot(_view({}), here="edge-a")
    assert snap is not None
    table = RoutingTable.build(snap, "edge-a")
    a = table.candidates("digits")
    here = a.site.index("edge-a")
    assert a.hard_ok[here] and a.estimated[here] and a.compute_ms[here] == pytest.approx(10.0)
    assert not a.estimated[a.site.index("core")]  # measured there
    # the other sites unreachable: the edge serves it itself (a cold start costed from the estimate), not NoRoute
    q = Query("digits", budget_ms=5000.0, prefer="refuse", exclude_sites=frozenset({"core", "mid", "edge-b"}))
    d = table.decide(q)
    assert (d.site, d.reason, d.estimated, d.best_effort) == ("edge-a", "cold_start", True, False)
    assert d.expected_latency_ms == pytest.approx(10.0 + 50.0)
    hop = HopTrace("edge-a", "edge")
    hop.decided(table, q, d)
    assert hop.records[0]["choice"]["estimated"] is True
    # and every candidate in the trace says whether its timings are measured or estimated
    cands = {(c["site"], c["variant"]): c["estimated"] for c in hop.records[0]["candidates"]}
    assert cands[("edge-a", "mlp")] is True and cands[("core", "mlp")] is False
    # measured at last: the same decision, no longer an estimate
    measured = build_snapshot(_view({"mlp": {"load_ms": 9.0, "p50_ms": {"1": 7.5, "8": 30.0}}}), here="edge-a")
    assert measured is not None
    d = RoutingTable.build(measured, "edge-a").decide(q)
    assert (d.site, d.estimated, d.expected_latency_ms) == ("edge-a", False, pytest.approx(7.5 + 9.0))


@pytest.mark.parametrize(("measured", "cls", "want"), [
    ({"cpu-x": 2.0}, "cpu-x-cap0.25", 8.0),                    # the same machine at a quarter core
    ({"cpu-x-cap0.50": 4.0}, "cpu-x-cap0.25", 8.0),            # another cap of it: by the caps' ratio
    ({"cpu-x-cap0.50": 4.0, "cpu-x": 2.5}, "cpu-x-cap2.00", 2.5),  # the fastest measured; a cap >= 1 core: 1x
    ({"cpu-y": 1.0, "cpu-z": 3.0}, "cpu-x", 3.0 * ESTIMATE_SAFETY),  # another machine: the slowest, with a margin
    ({"cpu-y": 1.0}, "cpu-x-cap0.50", 1.0 * ESTIMATE_SAFETY * 2),
    ({"gpu-a100": 1.0}, "cpu-x", None),                         # another kind: not guessed
])
def test_estimates_by_class(measured: dict[str, float], cls: str, want: float | None) -> None:
    v = VariantInfo("t", "v", 0.9, 1, compute_ms={hw: {1: ms} for hw, ms in measured.items()},
                    load_ms=dict.fromkeys(measured, 10.0))
    (e,) = with_estimates([v], [cls, *measured])
    if want is None:
        assert not e.runs_on(cls) and not e.estimated
    else:
        assert e.compute_at(cls, 1) == pytest.approx(want) and e.estimated == {cls}
    trt = VariantInfo("t", "v", 0.9, 1, format="tensorrt", compute_ms={"gpu-h100": {1: 1.0}})
    assert not with_estimates([trt], ["gpu-a100"])[0].runs_on("gpu-a100")  # an engine is built for one GPU


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


def test_timing_yields_to_traffic_and_rests_between_runs() -> None:
    """Self-profiling runs in the serving process under its cap: it waits while a query is in flight (bounded, so a
    site never idle is still timed) and rests as long as each run took (DUTY 0.5), so traffic is never starved."""
    sig = TaskSignature(task="t", inputs=(TensorSpec("x", "float32", (-1, 64)),),
                        outputs=(TensorSpec("y", "float32", (-1, 10)),))
    slept: list[float] = []
    busy = iter([True, True, True])  # a query in flight for three looks, then quiet

    def infer(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        time.sleep(0.002)
        return {"y": inputs["x"][:, :10]}

    stats = time_batches(infer, lambda bs: sample_inputs(sig, bs), (1,), repeats=4, time_budget_s=1.0,
                         busy=lambda: next(busy, False), sleep=slept.append)
    assert set(stats) == {1} and stats[1].p50_ms >= 2.0
    assert slept[:3] == [YIELD_STEP_S] * 3  # waited out the query before the first timed run
    rests = slept[3:]
    assert len(rests) == 4 and all(r >= 0.002 * (1 / DUTY - 1) * 0.9 for r in rests)  # as long as the run, each
    # a site that is never idle: it waits at most MAX_YIELD_S per batch size, then times anyway
    waited: list[float] = []
    time_batches(infer, lambda bs: sample_inputs(sig, bs), (1, 8), repeats=2, busy=lambda: True,
                 sleep=waited.append)
    assert sum(w for w in waited if w == YIELD_STEP_S) <= 2 * (MAX_YIELD_S + 2 * YIELD_STEP_S)


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


def test_a_variant_whose_blob_was_refused_is_timed_once_placement_puts_it_here() -> None:
    """The variant store gives a tenant's private blob only to the sites placement asks to serve that tenant:
    timing one speculatively elsewhere failed ("may not read blob") on every capped site of the demo."""
    view = _view({"mlp": {"load_ms": 9.0, "p50_ms": {"1": 7.5, "8": 30.0}}})
    view.signatures["digits"] = TaskSignature(task="digits", inputs=(TensorSpec("x", "float32", (-1, 4)),),
                                              outputs=(TensorSpec("y", "float32", (-1, 2)),))
    for vid, owner in (("pub", "public"), ("acme-head", "acme")):
        meta = VariantMeta(task="digits", family="mlp", variant_id=vid, format="onnx", precision="fp32",
                           runtime="onnxruntime", blob_digest="ab" * 32, size_bytes=1, accuracy=0.9, owner=owner,
                           profiles={})
        view._apply(f"catalog/digits/{vid}", meta.to_json())

    class Host:
        hardware_class = "cpu-x-cap0.10"

        def __init__(self) -> None:
            self.self_profiles: dict[str, Profile] = {}
            self.class_profiles: dict[str, Profile] = {}

    prof = SelfProfiler("edge-a", cast(Any, Host()), view, wanted=set)
    assert {m.variant_id for m in prof.missing()} >= {"pub", "acme-head"}  # on an open store, every one
    prof.unreadable.add("acme-head")  # the store refused its blob (as it does to a site not serving acme)
    assert "acme-head" not in {m.variant_id for m in prof.missing()}
    placed = SelfProfiler("edge-a", cast(Any, Host()), view, wanted=lambda: {"acme-head"})
    placed.unreadable.add("acme-head")
    assert "acme-head" in {m.variant_id for m in placed.missing()}  # placement asks: tried again
