"""``tiermesh pki``: files and modes it writes, what it prints, and its exit codes (0 ok, 1 refused or failed,
2 bad input)."""

from __future__ import annotations

import asyncio
import json
import stat
from pathlib import Path

import pytest

from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from mesh.pki.files import read_curve
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from mesh.pki.verify import verify_certificate
from tiermesh.cli.main import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, main

pytestmark = pytest.mark.integration


def run(home: Path, *args: str) -> int:
    return main(["pki", args[0], "--home", str(home), *args[1:]])


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    assert run(tmp_path, "init") == EXIT_OK
    return tmp_path


def test_init_writes_the_ca_with_a_private_key(home: Path) -> None:
    pki = home / "pki"
    assert mode(pki / "ca-key.pem") == 0o600
    assert mode(pki / "ca.pem") == 0o644 and (pki / "crl.pem").exists()
    assert LocalPki.under(home).crl().entries == ()


def test_init_twice_needs_force(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = (home / "pki" / "ca.pem").read_bytes()
    assert run(home, "init") == EXIT_BAD_INPUT
    assert "--force" in capsys.readouterr().err
    assert (home / "pki" / "ca.pem").read_bytes() == before
    assert run(home, "init", "--force") == EXIT_OK
    assert (home / "pki" / "ca.pem").read_bytes() != before


@pytest.mark.parametrize(("flag", "sub"), [("--tenant", "tenants"), ("--site", "sites"), ("--admin", "admins"),
                                           ("--scheduler", "schedulers")])
def test_issue_each_kind_writes_cert_and_0600_key(home: Path, flag: str, sub: str) -> None:
    assert run(home, "issue", flag, "n1") == EXIT_OK
    d = home / "pki" / sub
    assert mode(d / "n1-key.pem") == 0o600 and mode(d / "n1.pem") == 0o644
    if sub == "sites":
        assert mode(d / "n1.curve") == 0o600
    else:
        assert not (d / "n1.curve").exists()
    assert run(home, "verify", str(d / "n1.pem"), "--kind", flag[2:]) == EXIT_OK


def test_issue_site_binds_its_curve_key_and_addresses(home: Path) -> None:
    assert run(home, "issue", "--site", "edge-1", "--address", "127.0.0.1", "--address", "edge-1.local") == EXIT_OK
    pki = LocalPki.under(home)
    pair = read_curve(home / "pki" / "sites" / "edge-1.curve")
    cert = (home / "pki" / "sites" / "edge-1.pem").read_bytes()
    assert verify_certificate(cert, ca=pki.ca().cert, crl=pki.crl(), use="server", curve_public=pair.public).name \
        == "edge-1"
    curve = str(home / "pki" / "sites" / "edge-1.curve")
    assert run(home, "verify", str(home / "pki" / "sites" / "edge-1.pem"), "--use", "server", "--curve", curve) == 0
    assert run(home, "issue", "--site", "core-1") == EXIT_OK  # another site, another CURVE key
    other = str(home / "pki" / "sites" / "core-1.curve")
    assert run(home, "verify", str(home / "pki" / "sites" / "edge-1.pem"), "--curve", other) == EXIT_FAILED


def test_hours_override_the_lifetime(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(home, "issue", "--tenant", "acme", "--hours", "2") == EXIT_OK
    cert = LocalPki.under(home).certificate(LocalPki.under(home).listing()[0].identity)
    life = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert 2 * 3600 <= life.total_seconds() <= 2 * 3600 + 300


@pytest.mark.parametrize("args", [
    ("issue", "--tenant", "Bad_Name"),
    ("issue", "--tenant", "acme", "--address", "127.0.0.1"),
    ("issue", "--tenant", "acme", "--hours", "0"),
    ("issue", "--tenant", "acme", "--hours", "-3"),
    ("issue", "--site", "s", "--address", "host:80"),
    ("revoke", "--tenant", "never-issued"),
    ("verify", "/nonexistent/cert.pem"),
])
def test_bad_input_exits_2(home: Path, args: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    assert run(home, *args) == EXIT_BAD_INPUT
    assert capsys.readouterr().err.startswith("error:")


@pytest.mark.parametrize("args", [("issue",), ("issue", "--tenant", "a", "--site", "b"), ("issue", "--robot", "x"),
                                  ("revoke", "--tenant", "a", "--reason", "boredom"), ("verify",)])
def test_usage_errors_exit_2(home: Path, args: tuple[str, ...]) -> None:
    with pytest.raises(SystemExit) as info:
        run(home, *args)
    assert info.value.code == EXIT_BAD_INPUT


def test_verify_a_file_that_is_not_a_certificate(home: Path) -> None:
    junk = home / "junk.pem"
    junk.write_text("hello")
    assert run(home, "verify", str(junk)) == EXIT_BAD_INPUT


def test_issue_before_init_fails_with_a_hint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(tmp_path, "issue", "--tenant", "acme") == EXIT_FAILED
    assert "tiermesh pki init" in capsys.readouterr().err


def test_revoke_then_list_and_verify(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(home, "issue", "--tenant", "acme") == EXIT_OK
    assert run(home, "issue", "--tenant", "acme") == EXIT_OK  # rotated: two live certificates
    assert run(home, "issue", "--tenant", "other") == EXIT_OK
    capsys.readouterr()
    assert run(home, "revoke", "--tenant", "acme", "--reason", "key_compromise") == EXIT_OK
    out = capsys.readouterr()
    assert out.out.count("revoked spiffe://tiermesh/tenant/acme") == 2
    assert "crl.pem only" in out.err  # no etcd here: says the list was not published
    assert run(home, "list", "--json") == EXIT_OK
    rows = json.loads(capsys.readouterr().out)
    assert sorted((r["identity"], r["state"]) for r in rows) == [
        ("spiffe://tiermesh/tenant/acme", "revoked"), ("spiffe://tiermesh/tenant/acme", "revoked"),
        ("spiffe://tiermesh/tenant/other", "valid")]
    crl = LocalPki.under(home).crl()
    assert {e.reason for e in crl.entries} == {"key_compromise"}
    assert run(home, "verify", str(home / "pki" / "tenants" / "acme.pem")) == EXIT_FAILED
    assert "revoked" in capsys.readouterr().err
    assert run(home, "verify", str(home / "pki" / "tenants" / "other.pem")) == EXIT_OK
    assert run(home, "list") == EXIT_OK
    table = capsys.readouterr().out
    assert "tenant/acme" in table and "revoked" in table and "valid" in table


def test_verify_checks_the_use(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(home, "issue", "--tenant", "acme") == EXIT_OK
    assert run(home, "verify", str(home / "pki" / "tenants" / "acme.pem"), "--use", "server") == EXIT_FAILED
    assert "unauthenticated" in capsys.readouterr().err
    assert run(home, "verify", str(home / "pki" / "tenants" / "acme.pem"), "--kind", "site") == EXIT_FAILED


def test_help_states_the_default_lifetimes(capsys: pytest.CaptureFixture[str]) -> None:
    for sub in ("issue", "init"):
        with pytest.raises(SystemExit):
            main(["pki", sub, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert "tenant 12 h" in out and "site 24 h" in out and "admin 8 h" in out and "CA 30 days" in out
    with pytest.raises(SystemExit):
        main(["pki", "revoke", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "etcd" in out and "gets its roles back from `tiermesh etcd-rbac`" in out
    with pytest.raises(SystemExit):
        main(["pki", "follow-crl", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--client-crl-file" in out and "--drop-connections PORT" in out and "--stagger-s" in out


def test_follow_crl_needs_the_etcd_it_serves(home: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("TIERMESH_ETCD", raising=False)
    assert run(home, "follow-crl", "--out", str(home / "etcd-crl.pem")) == EXIT_BAD_INPUT
    assert "follow-crl needs the etcd it serves" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:  # one bound at a time
        run(home, "follow-crl", "--out", "x", "--drop-connections", "2379", "--signal-process", "etcd")
    assert info.value.code == EXIT_BAD_INPUT


async def test_issue_publishes_a_site_certificate_in_etcd_and_bundle_copies_one_hosts_files(
        home: Path, store: Store, etcd_server: EmbeddedEtcd, tmp_path: Path) -> None:
    from mesh.etcd.keys import PKI_SITES, site_cert_key
    from mesh.pki.files import PkiPaths
    from mesh.pki.published import cert_pem_from_record

    def issue(*who: str) -> int:
        return main(["pki", "issue", "--home", str(home), *who, "--etcd", etcd_server.url, "--prefix", store.prefix])

    assert await asyncio.to_thread(issue, "--site", "edge-1", "--address", "10.0.0.7") == EXIT_OK
    held = await store.get(site_cert_key("edge-1"))
    assert held is not None and cert_pem_from_record(held.value) == (home / "pki/sites/edge-1.pem").read_bytes()
    assert await asyncio.to_thread(issue, "--site", "edge-1") == EXIT_OK  # re-issued: the new one is published
    held = await store.get(site_cert_key("edge-1"))
    assert held is not None and cert_pem_from_record(held.value) == (home / "pki/sites/edge-1.pem").read_bytes()
    assert await asyncio.to_thread(issue, "--tenant", "acme") == EXIT_OK
    assert [kv.key for kv in await store.get_prefix(PKI_SITES)] == [site_cert_key("edge-1")]  # tenants: nothing
    # the host's files, and only those: nothing of acme's, nor of another site's
    assert await asyncio.to_thread(run, home, "issue", "--site", "core-1") == EXIT_OK
    host = tmp_path / "edge-1-host"
    assert main(["pki", "bundle", "--home", str(home), "--site", "edge-1", "--out", str(host)]) == EXIT_OK
    files = sorted(str(p.relative_to(host)) for p in host.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(host)) for p in
                           PkiPaths.under(host).host_files(Identity("site", "edge-1")).values())
    assert mode(host / "pki/sites/edge-1-key.pem") == 0o600 and mode(host / "pki/sites/edge-1.curve") == 0o600
    LocalPki.under(home).revoke(Identity("site", "core-1"))
    assert main(["pki", "bundle", "--home", str(home), "--site", "core-1", "--out", str(tmp_path / "x")]) \
        == EXIT_BAD_INPUT  # a revoked identity is not bundled
