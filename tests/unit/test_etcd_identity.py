"""etcd's own certificate is an identity kind of its own (``etcd:<name>``), not a site: issued through the CA's log
like every other (so ``tiermesh pki revoke`` can revoke it), with server and client use and no CURVE key, and no
tiermesh server admits it as a caller. It was ``site:etcd``, written beside the log (not revocable), and read every
private blob the variant store held."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography import x509

from mesh.errors import PermissionDenied, PkiError
from mesh.pki.identity import CALLER_KINDS, KINDS, Identity
from mesh.pki.local import LocalPki
from mesh.pki.policy import EKUS, USE_EKU
from mesh.pki.verify import verify_certificate
from tiermesh.cli.main import EXIT_OK, main
from tiermesh.hosts import ETCD_IDENTITY, crl_follower_command, etcd_rbac_command
from tiermesh.secure import ETCD_SERVER, MeshCredentials

pytestmark = pytest.mark.unit


def test_etcd_is_a_kind_of_its_own_that_no_server_admits() -> None:
    assert ETCD_IDENTITY == ETCD_SERVER == Identity("etcd", "etcd")
    assert ETCD_IDENTITY.common_name == "etcd:etcd" and ETCD_IDENTITY.uri == "spiffe://tiermesh/etcd/etcd"
    assert "etcd" in KINDS and "etcd" not in CALLER_KINDS
    assert set(CALLER_KINDS) == set(KINDS) - {"etcd"}
    assert EKUS["etcd"] == ("server", "client")


def test_a_local_mesh_issues_etcds_certificate_through_the_log(tmp_path: Path) -> None:
    """`tiermesh up` (MeshCredentials) issues etcd:etcd with LocalPki.issue: in issued.jsonl, and revocable."""
    creds = MeshCredentials.under(tmp_path)
    creds.issue({"edge-1": "127.0.0.1"}, ["acme"], etcd_address="10.0.0.5", store_address="127.0.0.1")
    pki = creds.pki
    issued = [r for r in pki.listing() if r.identity == ETCD_SERVER]
    assert len(issued) == 1
    tls = creds.etcd_server()
    assert tls.cert_file == pki.paths.cert(ETCD_SERVER) == pki.paths.root / "etcd" / "etcd.pem"
    assert tls.peer_cn == "etcd:etcd"
    cert = pki.certificate(ETCD_SERVER)
    ips = {str(ip) for ip in cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
           .get_values_for_type(x509.IPAddress)}
    assert ips == {"10.0.0.5", "127.0.0.1"}  # its clients' address, and loopback for a lone member's peer port
    ekus = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    assert ekus == {USE_EKU["server"], USE_EKU["client"]}
    with pytest.raises(PkiError):
        pki.paths.curve(ETCD_SERVER)  # no CURVE key: ZeroMQ never admits it
    for use in ("server", "client"):
        assert verify_certificate(cert, ca=pki.ca().cert, crl=pki.crl(), use=use, kinds=("etcd",)) == ETCD_SERVER
    with pytest.raises(PermissionDenied):  # a verifier of callers (CALLER_KINDS) refuses it
        verify_certificate(cert, ca=pki.ca().cert, crl=pki.crl(), use="client", kinds=CALLER_KINDS)
    crl, new = pki.revoke(ETCD_SERVER)
    assert new == [cert.serial_number] and crl.is_revoked(cert.serial_number)


def test_the_pki_command_issues_and_revokes_etcds_certificate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """``--etcd-server NAME`` names it (``--etcd`` names etcd's URLs in every command)."""
    monkeypatch.delenv("TIERMESH_ETCD", raising=False)
    home = str(tmp_path)
    assert main(["pki", "init", "--home", home]) == EXIT_OK
    assert main(["pki", "issue", "--etcd-server", "etcd", "--address", "etcd-0.etcd.tiermesh.svc",
                 "--home", home]) == EXIT_OK
    pki = LocalPki.under(tmp_path)
    assert pki.paths.cert(ETCD_IDENTITY).exists() and pki.paths.key(ETCD_IDENTITY).exists()
    assert main(["pki", "revoke", "--etcd-server", "etcd", "--home", home]) == EXIT_OK
    assert pki.crl().is_revoked(pki.certificate(ETCD_IDENTITY).serial_number)
    assert "revoked spiffe://tiermesh/etcd/etcd" in capsys.readouterr().out


def test_the_hosts_beside_etcd_use_its_identity() -> None:
    follower = crl_follower_command("/etc/etcd/crl/crl.pem", home="/var/lib/tiermesh", signal_process="etcd")
    assert follower.identity == ETCD_IDENTITY
    assert follower.env["TIERMESH_ETCD_CERT"] == "/var/lib/tiermesh/pki/etcd/etcd.pem"
    rbac = etcd_rbac_command("/t.yaml", etcd="https://e:2379", prefix="/p/", home="/h")
    assert rbac.args[rbac.args.index("--crl-follower") + 1] == "etcd:etcd"
