"""A tenant's ``quotas.storage_mb`` in the topology YAML: a good value loads and round-trips through its etcd JSON, a
bad one is refused with the line and the field like the other quotas, and the variant store's decoder of the etcd
value (``variant_store.data_quotas.storage_quota``) turns it into bytes or a ``ProtocolError``, nothing else."""

from __future__ import annotations

from typing import Any

import pytest

from mesh.errors import ProtocolError, TopologyError
from mesh.etcd.store import Undecodable
from tests.unit.test_topology_webhooks import HEAD as ONE_TENANT
from topology.loader import parse_topology
from topology.schema import QUOTA_KEYS, Tenant
from variant_store.data_quotas import MIB, STORAGE_QUOTA_KEY, storage_quota

pytestmark = pytest.mark.unit

HEAD = ONE_TENANT + "    quotas:\n"  # the first quota is on line 11


def test_the_store_spells_the_key_the_topology_knows() -> None:
    assert STORAGE_QUOTA_KEY in QUOTA_KEYS


def test_a_storage_quota_loads_and_round_trips() -> None:
    t = parse_topology(HEAD + "      qps: 10\n      storage_mb: 1.5\n").tenants["acme"]
    assert t.quotas == {"qps": 10.0, "storage_mb": 1.5}
    assert Tenant.from_json(t.to_json()) == t
    assert storage_quota(t.to_dict()) == int(1.5 * MIB)


@pytest.mark.parametrize(("value", "message"), [
    ("-1", "must be >= 0, got -1"),
    ("lots", "expected a number, got string 'lots'"),
    ("true", "expected a number, got boolean"),
    (".inf", "expected a finite number"),
])
def test_a_bad_storage_quota_names_its_line_and_field(value: str, message: str) -> None:
    with pytest.raises(TopologyError) as ei:
        parse_topology(HEAD + f"      storage_mb: {value}\n", "t.yaml")
    err = str(ei.value)
    assert "t.yaml:11" in err and "tenants[0].quotas.storage_mb" in err and message in err, err


def test_a_misspelt_storage_quota_is_named() -> None:
    with pytest.raises(TopologyError, match=r"unknown key 'storage_mib' \(did you mean 'storage_mb'\?\)"):
        parse_topology(HEAD + "      storage_mib: 5\n")


@pytest.mark.parametrize(("value", "bytes_"), [
    ({"name": "acme", "quotas": {"storage_mb": 1}}, MIB),
    ({"name": "acme", "quotas": {"storage_mb": 0}}, 0),
    ({"name": "acme", "quotas": {"qps": 5}}, None),
    ({"name": "acme"}, None),
    ({"name": "acme", "quotas": {"storage_mb": None}}, None),
])
def test_the_store_decodes_a_tenant_value(value: Any, bytes_: int | None) -> None:
    assert storage_quota(value) == bytes_


@pytest.mark.parametrize("value", [
    Undecodable("not JSON", 3), [], "acme", 7, {"quotas": []}, {"quotas": {"storage_mb": "1"}},
    {"quotas": {"storage_mb": True}}, {"quotas": {"storage_mb": -1}}, {"quotas": {"storage_mb": 1e300}},
    {"quotas": {"storage_mb": float("nan")}}, {"quotas": {"storage_mb": float("inf")}},
])
def test_a_hostile_tenant_value_is_a_protocol_error(value: Any) -> None:
    with pytest.raises(ProtocolError):
        storage_quota(value)
