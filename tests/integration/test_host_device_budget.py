"""``VariantHost``'s device-memory budget (issue 35 item 2) on CPU: real ONNX sessions from a real (verified) blob
cache, each made to report the device bytes a GPU runtime would measure at load (the one fake: no device here).
Loads fit, then evict the least valuable idle instance, then are refused naming the device budget; a site with
no device refuses any load that needs one; the host budget is untouched by all this."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import ClassVar

import pytest

from edge_agent.host import VariantHost
from mesh.errors import Overloaded
from variant_store.meta import VariantMeta
from variant_store.runtimes.base import Runtime

pytestmark = pytest.mark.integration

MIB = 1 << 20
DIGITS = Path(__file__).resolve().parents[2] / "variant_store" / "models" / "digits"


class DeviceHost(VariantHost):
    """A host whose runtimes say they hold ``device[file stem]`` bytes on the device; counts opens."""

    def __init__(self, *args: object, device: dict[str, int], **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.device = device
        self.opens: list[str] = []

    async def _open_runtime(self, fmt: str, path: Path, threads: int = 1) -> Runtime:
        rt = await super()._open_runtime(fmt, path, threads)
        stem = self._stems[path.name]
        self.opens.append(stem)
        nbytes = self.device.get(stem, 0)
        rt.device_memory_bytes = lambda: nbytes if rt.ready else 0  # type: ignore[method-assign]
        return rt

    _stems: ClassVar[dict[str, str]] = {}  # blob file name -> model stem (the cache names files by digest)


def _meta(stem: str) -> VariantMeta:
    data = (DIGITS / f"{stem}.onnx").read_bytes()
    return VariantMeta(task="digit-classification", family=stem, variant_id=f"{stem}.onnx.fp32", format="onnx",
                       precision="fp32", runtime="onnxruntime", blob_digest=hashlib.sha256(data).hexdigest(),
                       size_bytes=len(data), accuracy=0.97)


def _host(tmp_path: Path, budget: int | None, device: dict[str, int]) -> DeviceHost:
    cache = tmp_path / "blobs"
    cache.mkdir()
    for stem in ("mlp-tiny", "mlp-wide", "cnn-small", "cnn-large"):
        m = _meta(stem)
        shutil.copyfile(DIGITS / f"{stem}.onnx", cache / f"{m.blob_digest}.onnx")  # verified by digest on fetch
        DeviceHost._stems[f"{m.blob_digest}.onnx"] = stem
    return DeviceHost("core-test", cache, hardware_class="cpu", memory_budget_bytes=1 << 30,
                      device_budget_bytes=budget, device=device)


@pytest.fixture
async def hosts() -> AsyncIterator[list[DeviceHost]]:
    made: list[DeviceHost] = []
    yield made
    for h in made:
        await asyncio.wait_for(h.close(), 30)


async def test_loads_fit_then_evict_the_least_valuable_then_are_refused(tmp_path: Path,
                                                                        hosts: list[DeviceHost]) -> None:
    device = {"mlp-tiny": 40 * MIB, "cnn-small": 40 * MIB, "mlp-wide": 40 * MIB, "cnn-large": 150 * MIB}
    host = _host(tmp_path, 100 * MIB, device)
    hosts.append(host)
    tiny, small, wide, large = (_meta(s) for s in ("mlp-tiny", "cnn-small", "mlp-wide", "cnn-large"))
    # fit: 80 of 100 MiB
    await asyncio.wait_for(host.ensure(tiny), 60)
    await asyncio.wait_for(host.ensure(small), 60)
    assert host.device_used_bytes == 80 * MIB and host.evictions == 0
    # the oldest one is in demand: the other idle one makes room for the third (measured at load: 120 > 100)
    host.loaded[tiny.variant_id].touch(time.monotonic())
    await asyncio.wait_for(host.ensure(wide), 60)
    assert set(host.loaded) == {tiny.variant_id, wide.variant_id}
    assert host.evictions == 1 and host.device_used_bytes == 80 * MIB
    # 150 MiB cannot fit a 100 MiB budget whatever is unloaded: refused, unloaded again, nothing evicted
    with pytest.raises(Overloaded, match=r"no device memory for cnn-large\.onnx\.fp32 .*104857600-byte device budget"):
        await asyncio.wait_for(host.ensure(large), 60)
    assert set(host.loaded) == {tiny.variant_id, wide.variant_id} and host.evictions == 1
    assert host.device_used_bytes == 80 * MIB
    # the next try is refused before a session opens: the host remembers what it measured on the device
    opens = len(host.opens)
    with pytest.raises(Overloaded, match="device budget"):
        await asyncio.wait_for(host.ensure(large), 60)
    assert len(host.opens) == opens
    # the survivors still answer, and host memory was budgeted as before (measured, within its own budget)
    assert host.memory_used_bytes <= host.memory_budget_bytes and host.measured_memory()[tiny.variant_id] > 0


async def test_a_known_variant_makes_device_room_before_it_loads(tmp_path: Path, hosts: list[DeviceHost]) -> None:
    host = _host(tmp_path, 100 * MIB, {"mlp-tiny": 60 * MIB, "cnn-small": 60 * MIB})
    hosts.append(host)
    tiny, small = _meta("mlp-tiny"), _meta("cnn-small")
    await asyncio.wait_for(host.ensure(tiny), 60)
    await asyncio.wait_for(host.ensure(small), 60)   # measured 120 > 100: tiny goes after the load
    assert set(host.loaded) == {small.variant_id}
    await asyncio.wait_for(host.ensure(tiny), 60)    # known 60 MiB: small goes before tiny opens
    assert set(host.loaded) == {tiny.variant_id} and host.evictions == 2
    assert host.device_used_bytes == 60 * MIB <= host.device_budget_bytes  # type: ignore[operator]


async def test_no_device_refuses_gpu_loads_and_serves_cpu_ones(tmp_path: Path, hosts: list[DeviceHost]) -> None:
    host = _host(tmp_path, 0, {"cnn-small": 10 * MIB})   # budget 0: the site has no device
    hosts.append(host)
    await asyncio.wait_for(host.ensure(_meta("mlp-tiny")), 60)   # on the CPU: no device bytes
    with pytest.raises(Overloaded, match="device budget"):
        await asyncio.wait_for(host.ensure(_meta("cnn-small")), 60)
    assert set(host.loaded) == {"mlp-tiny.onnx.fp32"} and host.device_used_bytes == 0


async def test_an_unbudgeted_host_loads_whatever_the_device_holds(tmp_path: Path, hosts: list[DeviceHost]) -> None:
    host = _host(tmp_path, None, {"mlp-tiny": 10 * (1 << 30)})
    hosts.append(host)
    await asyncio.wait_for(host.ensure(_meta("mlp-tiny")), 60)
    assert host.device_used_bytes == 10 * (1 << 30) and host.evictions == 0
