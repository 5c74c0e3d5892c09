"""Device memory as a budget (issue 35 item 2), pure parts: the budget from the topology scaled to the device
present, which idle instances make device room and in what order, the refusal, the heartbeat and metrics fields,
and placement keeping a variant off a GPU site whose device budget cannot hold it."""

from __future__ import annotations

import glob
import subprocess
import sys
from pathlib import Path

import pytest

from core_scheduler.policy.eviction import Resident
from core_scheduler.policy.placement import Demand, plan_placement
from core_scheduler.policy.snapshot import MeshSnapshot, SiteInfo, SiteLoad, VariantInfo
from core_scheduler.state.heartbeat import Heartbeat, why_publish
from edge_agent.device_memory import DeviceBudget, FixedDeviceMemory, device_budget_bytes, plan_device_room
from edge_agent.metrics import AgentMetrics, Gauges
from mesh.errors import ConfigError, Overloaded

pytestmark = pytest.mark.unit

MIB = 1 << 20
GIB = 1 << 30
ROOT = Path(__file__).resolve().parents[2]


# -- the budget --------------------------------------------------------------------------------------------
def test_budget_is_the_declared_gpus_when_the_device_is_as_large() -> None:
    dev = FixedDeviceMemory(total=200 * GIB)
    assert device_budget_bytes([81920, 81920], dev, fraction=1.0) == 160 * GIB
    assert device_budget_bytes([81920, 81920], dev, fraction=0.5) == 80 * GIB


def test_budget_is_scaled_down_to_a_smaller_device() -> None:
    dev = FixedDeviceMemory(total=16 * GIB)
    assert device_budget_bytes([81920], dev, fraction=1.0) == 16 * GIB
    assert device_budget_bytes([81920], dev, fraction=0.9) == int(16 * GIB * 0.9)
    b = DeviceBudget.for_site([81920], dev, fraction=0.9)
    assert b.scaled and b.budget_bytes == int(16 * GIB * 0.9) and "scaled down" in b.describe()
    assert not DeviceBudget.for_site([1024], dev).scaled


def test_no_device_means_no_device_budget_and_none_declared_budgets_the_device() -> None:
    assert device_budget_bytes([81920], None) == 0
    assert "no device" in DeviceBudget.for_site([81920], None).describe()
    assert device_budget_bytes([], FixedDeviceMemory(total=8 * GIB), fraction=1.0) == 8 * GIB


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_a_fraction_outside_0_1_is_a_config_error(fraction: float) -> None:
    with pytest.raises(ConfigError, match="fraction"):
        device_budget_bytes([1024], FixedDeviceMemory(total=GIB), fraction=fraction)


@pytest.mark.skipif(bool(glob.glob("/dev/nvidia[0-9]*")), reason="a CUDA device node is present here")
def test_detection_on_a_cpu_host_finds_nothing_and_never_imports_torch() -> None:
    code = ("import sys; from edge_agent.device_memory import detect_device_memory; "
            "print(detect_device_memory(), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         check=True)
    assert out.stdout.split() == ["None", "False"]


# -- device room -------------------------------------------------------------------------------------------
def _r(key: str, qps: float = 0.0, idle: float = 10.0, busy: bool = False, base: str | None = None) -> Resident:
    return Resident(key=key, memory_bytes=1, qps=qps, idle_s=idle, busy=busy, base=base)


def test_device_room_evicts_the_least_valuable_idle_instance_holding_device_bytes() -> None:
    residents = [_r("hot", qps=5.0), _r("cold-recent", idle=1.0), _r("cold-old", idle=100.0), _r("busy", busy=True),
                 _r("on-cpu", idle=1000.0)]
    device = {"hot": 40 * MIB, "cold-recent": 40 * MIB, "cold-old": 40 * MIB, "busy": 40 * MIB, "on-cpu": 0}
    # 160 of 170 MiB used, 40 more needed: the idlest cold one goes (the CPU-only one frees nothing here)
    assert plan_device_room("s", "new", 170 * MIB, 160 * MIB, 40 * MIB, residents, device, {}) == ["cold-old"]
    assert plan_device_room("s", "new", 170 * MIB, 160 * MIB, 80 * MIB, residents, device, {}) == \
        ["cold-old", "cold-recent"]
    assert plan_device_room("s", "new", 170 * MIB, 100 * MIB, 40 * MIB, residents, device, {}) == []


def test_a_shared_backbone_comes_back_only_with_its_last_head() -> None:
    residents = [_r("h1", idle=50.0, base="bb"), _r("h2", idle=40.0, base="bb")]
    device = {"h1": 1 * MIB, "h2": 1 * MIB}
    got = plan_device_room("s", "new", 100 * MIB, 100 * MIB, 50 * MIB, residents, device, {"bb": 60 * MIB})
    assert got == ["h1", "h2"]


def test_a_load_that_cannot_fit_is_refused_naming_the_device_budget_and_evicts_nothing() -> None:
    residents = [_r("a"), _r("busy", busy=True)]
    device = {"a": 10 * MIB, "busy": 50 * MIB}
    with pytest.raises(Overloaded, match=r"no device memory for big .*of the 104857600-byte device budget"):
        plan_device_room("edge-x", "big", 100 * MIB, 60 * MIB, 60 * MIB, residents, device, {})
    with pytest.raises(Overloaded, match="device budget"):  # no device: budget 0
        plan_device_room("edge-x", "gpu-variant", 0, 0, 1, [], {}, {})


# -- heartbeat and metrics -----------------------------------------------------------------------------------
def test_the_heartbeat_carries_device_memory_and_publishes_when_it_moves() -> None:
    hb = Heartbeat(site="core", device_memory_budget_bytes=10 * GIB, device_memory_used_bytes=2 * GIB)
    back = Heartbeat.from_json(hb.to_json())
    assert back.device_memory_budget_bytes == 10 * GIB and back.device_memory_free_bytes == 8 * GIB
    assert why_publish(hb, Heartbeat(site="core", device_memory_budget_bytes=10 * GIB,
                                     device_memory_used_bytes=4 * GIB)) == "memory"
    assert why_publish(hb, Heartbeat(site="core", device_memory_budget_bytes=10 * GIB,
                                     device_memory_used_bytes=2 * GIB + MIB)) is None
    assert why_publish(hb, Heartbeat(site="core", device_memory_budget_bytes=5 * GIB,
                                     device_memory_used_bytes=2 * GIB)) == "identity"


def test_metrics_report_device_memory_used_and_budget() -> None:
    m = AgentMetrics("core")
    m.gauges = lambda: Gauges(device_used_bytes=3 * MIB, device_budget_bytes=90 * MIB)
    lines = m.render().decode().splitlines()
    assert f"tiermesh_device_memory_used_bytes {float(3 * MIB)!r}" in lines
    assert f"tiermesh_device_memory_budget_bytes {float(90 * MIB)!r}" in lines


# -- placement -----------------------------------------------------------------------------------------------
def _placement(device_budget: int, variant_mib: int) -> dict[str, tuple[str, ...]]:
    sites = [SiteInfo("edge", "edge", "eu", "cpu-arm", 2, 64, 0, 0.05),
             SiteInfo("core", "core", "eu", "gpu", 8, 262144, 1, 0.1, device_budget_bytes=device_budget),
             SiteInfo("mid", "middle", "eu", "cpu-x86", 16, 4096, 0, 5.0)]
    v = VariantInfo("digits", "big.fp32", 0.99, variant_mib * MIB, compute_ms={"cpu-x86": {1: 5.0}, "gpu": {1: 1.0}},
                    memory_bytes=variant_mib * MIB)
    loads = [SiteLoad(s.name, capacity=s.slots) for s in sites]
    links = [("edge", "core", 5.0, 1000.0), ("edge", "mid", 5.0, 1000.0)]
    snap = MeshSnapshot.from_parts(sites, [v], loads, links, placement={})
    plan = plan_placement(snap, [Demand("edge", "digits", "std", 5.0, 0.95, 100.0)], 1000.0, {}, {})
    return {s: vs for s, vs in plan.per_site.items() if vs}


def test_placement_keeps_a_variant_off_a_gpu_site_whose_device_budget_cannot_hold_it() -> None:
    # the GPU core is the cheapest slot: unbudgeted (0), or with room on the device, the variant goes there
    assert _placement(0, 900) == {"core": ("big.fp32",)}
    assert _placement(2 * GIB, 900) == {"core": ("big.fp32",)}
    # 0.8 x 1 GiB of device holds no 900 MiB variant, though the core's host memory would: the CPU middle serves it
    assert _placement(GIB, 900) == {"mid": ("big.fp32",)}
    assert SiteInfo("g", "core", "eu", "gpu", 8, 4096, 1, device_budget_bytes=GIB).model_memory_bytes == GIB
    assert SiteInfo("c", "core", "eu", "cpu", 8, 4096, 0, device_budget_bytes=GIB).model_memory_bytes == 4096 * MIB
