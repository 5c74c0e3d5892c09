"""The device-memory half of :class:`~edge_agent.host.VariantHost`'s budget, kept out of host.py (size).

Why two checks around a load: a variant's device bytes are known only once it is on the device
(``Runtime.device_memory_bytes``, measured at load like host memory). Before a load, room is made for what the
variant measured last time here (nothing on a first load); after it, the measurement is kept and, when the site
is now over its device budget, idle instances holding device bytes are evicted, or the new instance is unloaded
again and the load refused with the same ``Overloaded`` a host-memory refusal raises, naming the device budget
(:func:`edge_agent.device_memory.plan_device_room`). Every method runs under the host's lock.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Protocol

from core_scheduler.policy.eviction import Resident
from edge_agent.device_memory import plan_device_room
from mesh.errors import Overloaded
from variant_store.meta import VariantMeta
from variant_store.runtimes.base import Runtime

__all__ = ["DeviceRoom"]

_Key = tuple[str, str]  # host.InstanceKey


class _Instance(Protocol):
    """What this needs of ``host.LoadedVariant`` (host imports this module, not the other way round)."""

    meta: VariantMeta
    base: _Key | None

    @property
    def key(self) -> _Key: ...

    @property
    def device_bytes(self) -> int: ...


class _Base(Protocol):
    runtime: Runtime


def _name(key: _Key) -> str:
    return f"{key[0]}@{key[1]}" if key[1] else key[0]


class DeviceRoom:
    """Mixed into ``VariantHost``: the attributes below are the host's."""

    site: str
    device_budget_bytes: int | None
    instances: Mapping[_Key, _Instance]
    bases: Mapping[_Key, _Base]
    _measured_device: dict[str, int]

    def residents(self, now: float) -> Iterator[Resident]:
        raise NotImplementedError

    async def _evict(self, victims: list[str], by_name: dict[str, _Key], variant_id: str) -> None:
        raise NotImplementedError

    async def _unload_locked(self, key: _Key) -> None:
        raise NotImplementedError

    @property
    def device_used_bytes(self) -> int:
        """Accelerator bytes the loaded instances hold (a shared backbone once)."""
        return (sum(lv.device_bytes for lv in self.instances.values())
                + sum(b.runtime.device_memory_bytes() for b in self.bases.values()))

    def _device_need(self, variant_id: str, bkey: _Key | None) -> int:
        """Device bytes a load will take, as measured here before (0 when never loaded here, or on the CPU)."""
        base = self._measured_device.get(f"base:{bkey[0]}", 0) if bkey is not None and bkey not in self.bases else 0
        return self._measured_device.get(variant_id, 0) + base

    async def _make_device_room(self, variant_id: str, need: int, protect: set[_Key]) -> None:
        """Evict idle instances until ``need`` more device bytes fit; ``Overloaded`` when they cannot."""
        if self.device_budget_bytes is None or (need <= 0 and self.device_used_bytes <= self.device_budget_bytes):
            return
        by_name = {_name(k): k for k in self.instances}
        device = {_name(k): lv.device_bytes for k, lv in self.instances.items()}
        bases = {_name(k): b.runtime.device_memory_bytes() for k, b in self.bases.items()}
        victims = plan_device_room(self.site, variant_id, self.device_budget_bytes, self.device_used_bytes, need,
                                   self.residents(time.monotonic()), device, bases, {_name(k) for k in protect})
        await self._evict(victims, by_name, variant_id)

    async def _fit_device_measured(self, lv: _Instance, protect: set[_Key]) -> None:
        """After a load: keep its device measurement; over budget, evict idle ones or unload it and refuse."""
        self._measured_device[lv.meta.variant_id] = lv.device_bytes
        if lv.base is not None and lv.base in self.bases:
            self._measured_device[f"base:{lv.base[0]}"] = self.bases[lv.base].runtime.device_memory_bytes()
        try:
            await self._make_device_room(lv.meta.variant_id, 0, protect | {lv.key})
        except Overloaded:
            await self._unload_locked(lv.key)
            raise
