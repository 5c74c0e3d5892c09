"""The etcd RBAC plan as data: who may read and write which keys (applied on a real etcd in
tests/integration/test_etcd_rbac.py)."""

from __future__ import annotations

import pytest

from mesh.errors import ConfigError
from mesh.etcd.rbac import CRL_FOLLOWER_ROLE, ROOT_ROLE, ROOT_USER, plan
from mesh.pki.identity import Identity
from tests.helpers.topologies import EXAMPLE
from tiermesh.cli.main import EXIT_BAD_INPUT, EXIT_OK, main

pytestmark = pytest.mark.unit

P = "/tiermesh/"


def test_each_role_writes_only_its_keys() -> None:
    p = plan(P, sites=["edge-1", "edge-2"], schedulers=["s1"], admins=["op"], root_admins=["boss"])
    assert p.may("site:edge-1", "write", P + "live/edge-1")
    assert not p.may("site:edge-1", "write", P + "live/edge-2")
    assert not p.may("site:edge-1", "write", P + "live/edge-10")  # an exact key, not a prefix
    assert not p.may("site:edge-1", "write", P + "placement/edge-1")
    assert p.may("site:edge-1", "read", P + "placement/edge-1")
    assert not p.may("site:edge-1", "read", "/other/live/edge-1")  # nothing outside the prefix
    assert p.may("scheduler:s1", "write", P + "placement/edge-1")
    assert p.may("scheduler:s1", "write", P + "events/placement")
    assert p.may("scheduler:s1", "write", P + "election/scheduler")
    assert not p.may("scheduler:s1", "write", P + "topology/sites/edge-1")
    for key in ("topology/sites/x", "tenants/t", "catalog/t/v", "models/t/f", "pki/crl", "services/variant-store"):
        assert p.may("admin:op", "write", P + key)
    assert not p.may("admin:op", "write", P + "live/edge-1")
    assert not p.may("admin:op", "write", P + "placement/edge-1")
    assert ROOT_ROLE in p.users["admin:boss"] and p.users[ROOT_USER] == (ROOT_ROLE,)
    assert not any(u.startswith("tenant:") for u in p.users)  # tenants: no etcd user at all
    assert not p.may("tenant:acme", "read", P + "tenants/acme")


def test_bad_plans_are_refused() -> None:
    with pytest.raises(ConfigError, match="root admin"):
        plan(P, sites=["a"], root_admins=[])
    with pytest.raises(ConfigError, match="prefix"):
        plan("tiermesh", sites=["a"], root_admins=["boss"])
    with pytest.raises(ConfigError, match="invalid site name"):
        plan(P, sites=["Bad Name"], root_admins=["boss"])


def test_cli_dry_run_prints_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["etcd-rbac", "--topology", str(EXAMPLE), "--root-admin", "boss", "--scheduler", "s1",
                 "--dry-run"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "user site:edge-fra-1: tiermesh-site:edge-fra-1" in out
    assert "role tiermesh-site:edge-fra-1: write /tiermesh/live/edge-fra-1\n" in out
    assert "user admin:boss: root, tiermesh-operator" in out


def test_a_crl_follower_reads_pki_crl_and_nothing_else() -> None:
    etcd = Identity("etcd", "etcd")  # etcd's own certificate, an identity kind of its own
    p = plan(P, sites=["edge-1"], root_admins=["boss"], crl_followers=[etcd, etcd])
    assert p.users["etcd:etcd"] == (CRL_FOLLOWER_ROLE,)
    assert p.may("etcd:etcd", "read", P + "pki/crl")
    for key in ("pki/crl2", "pki/sites/edge-1", "topology/sites/edge-1", "live/edge-1", ""):
        assert not p.may("etcd:etcd", "read", P + key), key
    assert not p.may("etcd:etcd", "write", P + "pki/crl")
    # an identity that is also a site of the plan keeps its site role beside it
    both = plan(P, sites=["edge-1"], root_admins=["boss"], crl_followers=[Identity("site", "edge-1")])
    assert both.users["site:edge-1"] == ("tiermesh-site:edge-1", CRL_FOLLOWER_ROLE)
    assert CRL_FOLLOWER_ROLE not in plan(P, sites=["edge-1"], root_admins=["boss"]).roles


def test_cli_takes_crl_followers_as_kind_and_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["etcd-rbac", "--topology", str(EXAMPLE), "--root-admin", "boss", "--crl-follower", "etcd:etcd",
                 "--dry-run"]) == EXIT_OK
    out = capsys.readouterr().out
    assert f"user etcd:etcd: {CRL_FOLLOWER_ROLE}\n" in out
    assert f"role {CRL_FOLLOWER_ROLE}: read /tiermesh/pki/crl\n" in out
    for bad, why in (("etcd", "expected KIND:NAME"), ("robot:x", "unknown identity kind"),
                     ("site:Bad Name", "invalid site name")):
        with pytest.raises(SystemExit) as exc:
            main(["etcd-rbac", "--topology", str(EXAMPLE), "--root-admin", "boss", "--crl-follower", bad, "--dry-run"])
        assert exc.value.code == EXIT_BAD_INPUT
        assert why in capsys.readouterr().err
