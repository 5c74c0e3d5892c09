"""The variant store's data area follows the tenants' ``storage_mb`` in the topology on a real etcd: read at start,
followed as the topology is applied again, a hostile tenant value ignored (the quota in force kept), and an upload
over the quota refused."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from mesh.errors import PayloadTooLarge
from mesh.etcd.keys import tenant_key
from mesh.etcd.store import Store
from tests.helpers.waiting import eventually
from topology.loader import parse_topology
from topology.schema import Topology
from topology.store_io import apply as apply_topology
from variant_store.data_area import DataArea
from variant_store.data_quotas import MIB, DataQuotaFollower

pytestmark = pytest.mark.integration
DEFAULT = 3 * MIB


def _topology(acme_mb: float) -> Topology:
    return parse_topology(f"""schema: 1
sites:
  - name: core-a
    tier: core
    region: r
    coordinates: {{lat: 1, lon: 2}}
    hardware: {{cpu_cores: 4, memory_mb: 1024, price_per_hour: 1.0}}
tenants:
  - {{name: acme, quotas: {{qps: 10, storage_mb: {acme_mb}}}}}
  - {{name: globex, quotas: {{qps: 10}}}}
""")


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    step = 256 << 10
    for i in range(0, len(data), step):
        yield data[i:i + step]


async def test_the_data_area_follows_the_topologys_storage_quotas(store: Store, tmp_path: Path) -> None:
    await apply_topology(store, _topology(1))
    area = DataArea(tmp_path / "data", quota_bytes=DEFAULT)
    async with DataQuotaFollower(store, area) as follower:
        assert area.quota("acme") == MIB  # read before start returns
        assert area.quota("globex") == DEFAULT and area.quota("initech") == DEFAULT

        blob = b"x" * (MIB + 1)
        with pytest.raises(PayloadTooLarge, match="over quota") as over:
            await area.receive("acme", hashlib.sha256(blob).hexdigest(), _chunks(blob))
        assert over.value.details["quota_bytes"] == MIB
        assert area.used("acme") == 0

        await apply_topology(store, _topology(2))

        async def followed() -> bool:
            return area.quota("acme") == 2 * MIB

        await eventually(followed, 10, "acme's quota at 2 MiB")
        size, created = await area.receive("acme", hashlib.sha256(blob).hexdigest(), _chunks(blob))
        assert (size, created) == (MIB + 1, True)

        # a hostile value (a writer past the loader) keeps the quota in force; the follower lives on
        await store.put(tenant_key("acme"), {"name": "acme", "quotas": {"storage_mb": "lots"}})
        await store.put(tenant_key("globex"), {"name": "globex", "quotas": {"storage_mb": 1e300}})
        await store.put(tenant_key("initech"), {"name": "initech", "quotas": {"storage_mb": 4}})

        async def initech() -> bool:
            return area.quota("initech") == 4 * MIB

        await eventually(initech, 10, "initech's quota at 4 MiB")
        assert area.quota("acme") == 2 * MIB and area.quota("globex") == DEFAULT
        assert follower.connected

        # a tenant removed from the topology falls back to the default
        await apply_topology(store, _topology(2))

        async def removed() -> bool:
            return "initech" not in area.quotas

        await eventually(removed, 10, "initech's quota gone with its tenant")
        assert area.quota("initech") == DEFAULT and area.quota("acme") == 2 * MIB
    assert follower.state.value == "stopped"
