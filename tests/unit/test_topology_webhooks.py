"""A tenant's webhook destinations in the topology YAML (``tenants[].webhooks``, ``tenants[].webhook_ca``): a good
file loads into canonical prefixes and the CA's PEM and round-trips through its etcd JSON; a bad one is refused
with the line and the field; a hostile etcd value is a ``ProtocolError`` for the view."""

from __future__ import annotations

from pathlib import Path

import pytest

from core_scheduler.state.records import decode_record
from mesh.errors import ProtocolError, TopologyError
from mesh.pki.local import LocalPki
from topology.loader import load_topology_file, parse_topology
from topology.schema import Tenant, Topology

pytestmark = pytest.mark.unit

HEAD = """schema: 1
sites:
  - name: core-a
    tier: core
    region: r
    coordinates: {lat: 1, lon: 2}
    hardware: {cpu_cores: 4, memory_mb: 1024, price_per_hour: 1.0}
tenants:
  - name: acme
"""  # the tenant's next key is on line 10


def _yaml(tail: str) -> str:
    return HEAD + tail


def test_a_tenants_webhooks_load_canonical_and_round_trip(tmp_path: Path) -> None:
    pki = LocalPki.under(tmp_path / "pki")
    pki.init()
    (tmp_path / "hooks-ca.pem").write_bytes(pki.paths.ca_cert.read_bytes())
    path = tmp_path / "topology.yaml"
    path.write_text(_yaml('    webhooks: ["https://Hooks.Acme.example:8443/tiermesh/", "https://ops.acme.example"]\n'
                          "    webhook_ca: hooks-ca.pem\n"))  # relative to the file
    topo = load_topology_file(path)
    t = topo.tenants["acme"]
    assert t.webhooks == ("https://hooks.acme.example:8443/tiermesh/", "https://ops.acme.example/")
    assert t.webhook_ca == pki.paths.ca_cert.read_text()
    assert Tenant.from_json(t.to_json()) == t
    assert Topology.from_json(topo.to_json()) == topo
    assert decode_record("tenant", ("acme",), t.to_dict()) == t


def test_a_tenant_without_webhooks_keeps_its_json_and_digest() -> None:
    t = parse_topology(_yaml("    isolation: shared\n")).tenants["acme"]
    assert t.to_dict() == {"schema": 1, "name": "acme", "isolation": "shared", "quotas": {}}
    assert t.webhooks == () and t.webhook_ca is None


# tail of the tenant -> (line, field, message fragment)
BAD: list[tuple[str, int, str, str]] = [
    ('    webhooks: ["http://hooks.acme.example/"]\n', 10, "tenants[0].webhooks[0]", "must be an https:// URL"),
    ("    webhooks:\n      - https://hooks.acme.example/a/\n      - https://u:p@hooks.acme.example/b/\n", 12,
     "tenants[0].webhooks[1]", "user name or password"),
    ("    webhooks:\n      - https://hooks.acme.example/a/?x=1\n", 11, "tenants[0].webhooks[0]",
     "may not hold a query"),
    ("    webhooks:\n      - https://hooks.acme.example/a/#f\n", 11, "tenants[0].webhooks[0]", "fragment"),
    ("    webhooks:\n      - https://hooks.acme.example/a/../b/\n", 11, "tenants[0].webhooks[0]", "'..' segment"),
    ("    webhooks:\n      - https://hooks.acme.example/a%2Fb/\n", 11, "tenants[0].webhooks[0]", "encoded '/'"),
    ("    webhooks:\n      - https://hooks.acme.example/a/\n      - https://HOOKS.acme.example/a/\n", 12,
     "tenants[0].webhooks[1]", "duplicate webhook prefix"),
    ("    webhooks: [42]\n", 10, "tenants[0].webhooks[0]", "a string, not int"),
    ("    webhooks: https://hooks.acme.example/\n", 10, "tenants[0].webhooks", "expected a list"),
    ("    webhooks: [" + ", ".join(f'"https://h{i}.example/"' for i in range(17)) + "]\n", 10,
     "tenants[0].webhooks", "at most 16"),
    ("    webhook: [https://hooks.acme.example/]\n", 10, "tenants[0].webhook", "did you mean 'webhooks'?"),
    ("    webhook_ca: /nonexistent/ca.pem\n", 10, "tenants[0].webhook_ca", "cannot read the CA bundle"),
    ("    webhook_ca: 7\n", 10, "tenants[0].webhook_ca", "expected a non-empty string"),
]


@pytest.mark.parametrize(("tail", "line", "field", "what"), BAD)
def test_a_bad_webhook_entry_names_its_line_and_field(tail: str, line: int, field: str, what: str) -> None:
    with pytest.raises(TopologyError) as exc:
        parse_topology(_yaml(tail), file="t.yaml")
    err = exc.value
    assert (err.line, err.field) == (line, field), str(err)
    assert what in err.reason and str(err).startswith(f"t.yaml:{line}: {field}: ")


def test_a_ca_bundle_that_holds_no_certificate_is_refused(tmp_path: Path) -> None:
    (tmp_path / "ca.pem").write_text("not a certificate\n")
    path = tmp_path / "topology.yaml"
    path.write_text(_yaml("    webhook_ca: ca.pem\n"))
    with pytest.raises(TopologyError, match="no usable PEM CA certificate") as exc:
        load_topology_file(path)
    assert (exc.value.line, exc.value.field) == (10, "tenants[0].webhook_ca")


@pytest.mark.parametrize("value", [
    {"schema": 1, "name": "acme", "webhooks": ["http://evil.example/"]},
    {"schema": 1, "name": "acme", "webhooks": "https://evil.example/"},
    {"schema": 1, "name": "acme", "webhooks": [["https://evil.example/"]]},
    {"schema": 1, "name": "acme", "webhooks": ["https://e.example/"] * 17},
    {"schema": 1, "name": "acme", "webhook_ca": 5},
    {"schema": 1, "name": "acme", "webhook_ca": "x" * (64 << 10 | 1)},
])
def test_a_hostile_tenant_value_in_etcd_is_a_protocol_error(value: dict[str, object]) -> None:
    with pytest.raises(ProtocolError):
        decode_record("tenant", ("acme",), value)
