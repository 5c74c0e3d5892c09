"""etcd addresses and TLS files are checked once, at the door, with errors that say what to fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from mesh.errors import ConfigError
from mesh.etcd.endpoints import parse_endpoints, split_urls
from mesh.settings import MeshSettings
from tiermesh.cli.main import EXIT_BAD_INPUT, main

pytestmark = pytest.mark.unit

PEM = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


@pytest.fixture
def pem(tmp_path: Path) -> Path:
    p = tmp_path / "x.pem"
    p.write_bytes(PEM)
    return p


def test_urls_as_list_or_comma_string() -> None:
    assert split_urls(" http://a:1, http://b:2 ,") == ["http://a:1", "http://b:2"]
    assert split_urls(["http://a:1", "http://b:2,http://c:3"]) == ["http://a:1", "http://b:2", "http://c:3"]
    ep = parse_endpoints("http://a:1,b:2,http://[::1]:2380,http://a:1,http://d")
    assert ep.targets == ("a:1", "b:2", "[::1]:2380", "d:2379") and ep.tls is None
    assert str(ep) == "http://a:1,http://b:2,http://[::1]:2380,http://d:2379"


@pytest.mark.parametrize(("urls", "message"), [
    ("", "no etcd URL"),
    ("ftp://a:1", "scheme must be http"),
    ("http://a:1/v3", "nothing after it"),
    ("http://a:99999", "(?i)port out of range"),
    ("http://a:1,https://b:2", "mix http:// and https://"),
])
def test_bad_urls(urls: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_endpoints(urls)


def test_tls_files_checked(pem: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="need the CA certificate"):
        parse_endpoints("https://a:1")
    with pytest.raises(ConfigError, match="--etcd-cert given without --etcd-key"):
        parse_endpoints("https://a:1", ca=pem, cert=pem)
    with pytest.raises(ConfigError, match="--etcd-key given without --etcd-cert"):
        parse_endpoints("https://a:1", ca=pem, key=pem)
    with pytest.raises(ConfigError, match=r"CA file not found: .*missing\.pem"):
        parse_endpoints("https://a:1", ca=tmp_path / "missing.pem")
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(ConfigError, match="not PEM"):
        parse_endpoints("https://a:1", ca=tmp_path / "junk.pem")
    with pytest.raises(ConfigError, match="URLs are http://"):
        parse_endpoints("http://a:1", ca=pem)
    ep = parse_endpoints("https://a:1,https://b:2", ca=pem, cert=pem, key=pem)
    assert ep.tls is not None and ep.tls.client_auth and ep.tls.ca == PEM
    assert ep.urls == ("https://a:1", "https://b:2")


def test_settings_take_a_comma_separated_env(monkeypatch: pytest.MonkeyPatch, pem: Path) -> None:
    monkeypatch.setenv("TIERMESH_ETCD", "https://a:1, https://b:2")
    monkeypatch.setenv("TIERMESH_ETCD_CA", str(pem))
    s = MeshSettings()
    assert s.etcd == ["https://a:1", "https://b:2"] and s.etcd_ca == pem and s.etcd_cert is None


@pytest.mark.parametrize("argv", [
    ["--etcd", "https://127.0.0.1:1"],
    ["--etcd", "http://127.0.0.1:1", "--etcd-cert", "c.pem"],
    ["--etcd-ca", "ca.pem"],
])
def test_cli_refuses_bad_etcd_options(argv: list[str], capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("TIERMESH_ETCD", raising=False)
    assert main(["topology", "show", "--home", str(tmp_path), *argv]) == EXIT_BAD_INPUT
    assert "etcd" in capsys.readouterr().err
