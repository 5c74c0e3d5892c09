"""Accelerator memory as a budget: where a site's device bytes come from, and how much its models may take.

Why a budget of its own: a variant served on a GPU (``torch-cuda``) holds most of its bytes on the device, not
in host memory, so the host budget alone lets a GPU site load until the device runs out (a CUDA OOM in the
middle of a load, or later in a batch) instead of evicting idle variants or refusing the load as a CPU site does.

The budget is what the topology declares (``hardware.gpus[].memory_mb``, summed), scaled down to the device
actually present when it is smaller (a lent H200 standing in for two declared H100s, a small card in a
development box), times ``fraction`` (room for the CUDA context, cuBLAS workspaces and the caching allocator's
slack, which no variant's measurement includes). With no device present the budget is 0: a runtime that
reports device bytes cannot load. A topology that declares no GPU on a site that has one budgets the device
present.

The device is read through a :class:`DeviceMemorySource` (``total_bytes`` / ``free_bytes``):
:func:`detect_device_memory` returns the real one (``torch.cuda.mem_get_info``) only when a CUDA device node
exists and torch sees a device, so a CPU-only host never imports torch or CUDA; :class:`FixedDeviceMemory`
stands in for a device in tests and harnesses.

Eviction follows the host budget's rules (``core_scheduler.policy.eviction.plan_eviction``: idle only, least
demand, then least recently used), over each instance's device bytes; :func:`plan_device_room` returns the
victims or raises the same ``Overloaded`` a host-memory refusal raises, naming the device budget.
"""

from __future__ import annotations

import glob
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

from core_scheduler.policy.eviction import Resident, plan_eviction
from mesh.errors import ConfigError, Overloaded
from mesh.log import get_logger, kv

__all__ = ["DEFAULT_DEVICE_FRACTION", "DeviceBudget", "DeviceMemorySource", "FixedDeviceMemory", "TorchCudaMemory",
           "detect_device_memory", "device_budget_bytes", "plan_device_room"]

log = get_logger(__name__)
MIB = 1 << 20
# share of the (scaled) device memory models may take: the rest is the CUDA context, workspaces, allocator slack
DEFAULT_DEVICE_FRACTION = 0.9


class DeviceMemorySource(Protocol):
    """What the accelerator holds: its total and what is free now, in bytes."""

    def total_bytes(self) -> int: ...

    def free_bytes(self) -> int: ...


@dataclass(slots=True)
class FixedDeviceMemory:
    """A device of ``total`` bytes with ``used`` taken (tests and harnesses: no accelerator needed)."""

    total: int
    used: int = 0

    def total_bytes(self) -> int:
        return self.total

    def free_bytes(self) -> int:
        return max(0, self.total - self.used)


class TorchCudaMemory:
    """Every visible CUDA device, summed, read through ``torch.cuda.mem_get_info`` (build with
    :func:`detect_device_memory`, which checks a device exists first)."""

    def __init__(self) -> None:
        import torch  # only reached where detect_device_memory found a device

        self._torch = torch
        self._count = int(torch.cuda.device_count())

    def _info(self) -> list[tuple[int, int]]:
        return [tuple(int(x) for x in self._torch.cuda.mem_get_info(i)) for i in range(self._count)]  # type: ignore[misc]

    def total_bytes(self) -> int:
        return sum(total for _, total in self._info())

    def free_bytes(self) -> int:
        return sum(free for free, _ in self._info())


def detect_device_memory() -> DeviceMemorySource | None:
    """The real device's memory, or None when there is none (no ``/dev/nvidia*``, no torch, no CUDA device):
    the device nodes are looked at before torch is imported, so a CPU-only host never loads CUDA."""
    from variant_store.hardware import torch_cuda_available

    if not glob.glob("/dev/nvidia[0-9]*"):
        return None
    ok, why = torch_cuda_available()
    if not ok:
        log.info("no device memory budget: %s", why, extra=kv(event="device_memory"))
        return None
    try:
        src = TorchCudaMemory()
        return src if src.total_bytes() > 0 else None
    except Exception as exc:  # a driver that fails here would fail every load: budget nothing on it
        log.warning("device memory unreadable (%s): no device budget", exc, extra=kv(event="device_memory"))
        return None


def device_budget_bytes(declared_mb: Iterable[int], source: DeviceMemorySource | None,
                        fraction: float = DEFAULT_DEVICE_FRACTION) -> int:
    """Bytes the site's models may hold on the device: the declared GPUs' memory (summed), or the device's
    total when that is smaller (or nothing is declared), times ``fraction``; 0 without a device."""
    if not 0.0 < fraction <= 1.0:
        raise ConfigError(f"device memory fraction must be in (0, 1], got {fraction}")
    declared = sum(int(mb) for mb in declared_mb) * MIB
    if declared < 0:
        raise ConfigError(f"declared GPU memory must not be negative, got {declared // MIB} MiB")
    if source is None:
        return 0
    total = source.total_bytes()
    return math.floor((min(declared, total) if declared else total) * fraction)


@dataclass(frozen=True, slots=True)
class DeviceBudget:
    """A site's device budget and where it came from (the heartbeat and logs say both)."""

    budget_bytes: int
    declared_bytes: int = 0
    device_total_bytes: int = 0      # 0: no device present

    @classmethod
    def for_site(cls, declared_mb: Iterable[int], source: DeviceMemorySource | None,
                 fraction: float = DEFAULT_DEVICE_FRACTION) -> DeviceBudget:
        mbs = [int(mb) for mb in declared_mb]
        budget = device_budget_bytes(mbs, source, fraction)
        total = source.total_bytes() if source is not None else 0
        return cls(budget_bytes=budget, declared_bytes=sum(mbs) * MIB, device_total_bytes=total)

    @property
    def scaled(self) -> bool:
        """The device present is smaller than the topology declares."""
        return 0 < self.device_total_bytes < self.declared_bytes

    def describe(self) -> str:
        if not self.device_total_bytes:
            return "no device present: loads that need device memory are refused"
        return (f"{self.budget_bytes / MIB:.0f} MiB of a {self.device_total_bytes / MIB:.0f} MiB device"
                + (f" (topology declares {self.declared_bytes / MIB:.0f} MiB: scaled down)" if self.scaled else ""))


def plan_device_room(site: str, variant_id: str, budget: int, used: int, need: int,
                     residents: Iterable[Resident], device_bytes: Mapping[str, int], bases: Mapping[str, int],
                     protect: Iterable[str] = ()) -> list[str]:
    """Which idle instances to unload so ``need`` more device bytes fit ``budget`` (``used`` now); raises
    ``Overloaded`` naming the device budget when even every idle one would not make room.

    ``residents`` are the host's (host bytes): each is charged its ``device_bytes`` entry instead; an instance
    that frees nothing on the device (on the CPU, its backbone too) is never chosen for device room."""
    free = budget - used
    if need <= free:
        return []
    on_device = [replace(r, memory_bytes=device_bytes.get(r.key, 0)) for r in residents
                 if device_bytes.get(r.key, 0) > 0 or bases.get(r.base or "", 0) > 0]
    victims = plan_eviction(on_device, bases, need, free, protect=protect)
    if victims is None:
        raise Overloaded(f"{site}: no device memory for {variant_id} (needs {need} bytes, {max(0, free)} free "
                         f"of the {budget}-byte device budget, and unloading every idle variant would not "
                         f"make room)")
    return victims
