"""The device-memory budget live (issue 35 item 2): the real device source reads the GPU, the budget scales a
declared GPU to the device present, and a ``VariantHost`` serving through ``torch-cuda`` charges each load's
measured device bytes: loads fit, then evict, then are refused naming the device budget. Skipped, with the reason,
where this host does not serve through torch-cuda (the CPU tests, tests/unit/test_device_memory.py and
tests/integration/test_host_device_budget.py, cover the same rules with a stand-in device)."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
from pathlib import Path

import pytest

from edge_agent.device_memory import DeviceBudget, detect_device_memory
from edge_agent.host import VariantHost
from mesh.errors import Overloaded
from variant_store.hardware import local_hardware_class, torch_serving
from variant_store.meta import VariantMeta

pytestmark = pytest.mark.gpu

_OK, _WHY = torch_serving()
if not _OK:
    pytest.skip(f"this host does not serve through torch-cuda: {_WHY}", allow_module_level=True)

DIGITS = Path(__file__).resolve().parents[2] / "variant_store" / "models" / "digits"
MIB = 1 << 20


def _meta(stem: str) -> VariantMeta:
    data = (DIGITS / f"{stem}.onnx").read_bytes()
    return VariantMeta(task="digit-classification", family=stem, variant_id=f"{stem}.onnx.fp32", format="onnx",
                       precision="fp32", runtime="onnxruntime", blob_digest=hashlib.sha256(data).hexdigest(),
                       size_bytes=len(data), accuracy=0.97)


def test_the_real_source_reads_the_device_and_scales_a_larger_declared_gpu() -> None:
    src = detect_device_memory()
    assert src is not None
    total = src.total_bytes()
    assert total > 0 and 0 < src.free_bytes() <= total
    big = DeviceBudget.for_site([total // MIB * 4], src, fraction=1.0)  # a declared GPU 4x the one present
    assert big.scaled and big.budget_bytes == total
    small = DeviceBudget.for_site([1024], src, fraction=1.0)
    assert not small.scaled and small.budget_bytes == 1024 * MIB


async def test_torch_cuda_loads_are_charged_their_device_bytes(tmp_path: Path) -> None:
    cache = tmp_path / "blobs"
    cache.mkdir()
    metas = [_meta(s) for s in ("cnn-large", "cnn-small")]
    for m in metas:
        shutil.copyfile(DIGITS / f"{m.family}.onnx", cache / f"{m.blob_digest}.onnx")
    large, small = metas
    # unbudgeted first: what each measures on the device here
    probe = VariantHost("gpu-probe", cache, hardware_class=local_hardware_class(), memory_budget_bytes=1 << 34)
    try:
        for m in metas:
            await asyncio.wait_for(probe.ensure(m), 120)
        dev = {m.variant_id: probe.instances[(m.variant_id, "")].device_bytes for m in metas}
    finally:
        await asyncio.wait_for(probe.close(), 60)
    assert all(b > 0 for b in dev.values()), dev
    # a budget that holds either but not both: the second load evicts the first
    budget = max(dev.values()) + min(dev.values()) - 1
    host = VariantHost("gpu-budget", cache, hardware_class=local_hardware_class(), memory_budget_bytes=1 << 34,
                       device_budget_bytes=budget)
    try:
        await asyncio.wait_for(host.ensure(large), 120)
        await asyncio.wait_for(host.ensure(small), 120)
        assert set(host.loaded) == {small.variant_id} and host.evictions == 1
        assert 0 < host.device_used_bytes <= budget
        # a budget smaller than the large one: refused, naming the device budget, and the small one stays
        host.device_budget_bytes = dev[large.variant_id] - 1
        with pytest.raises(Overloaded, match="device budget"):
            await asyncio.wait_for(host.ensure(large), 120)
        assert set(host.loaded) == {small.variant_id}
    finally:
        await asyncio.wait_for(host.close(), 60)
