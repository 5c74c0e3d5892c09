"""Bind and advertised addresses: what a server listens on vs what peers dial, and the refusals."""

from __future__ import annotations

import pytest

from mesh.addresses import advertised_host, host_for_url, http_url, is_wildcard, normalise_host, tcp_endpoint
from mesh.errors import ConfigError
from mesh.settings import MeshSettings

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("bind", "advertise", "want"), [
    ("127.0.0.1", None, "127.0.0.1"),
    ("10.1.2.3", None, "10.1.2.3"),
    ("0.0.0.0", "10.1.2.3", "10.1.2.3"),
    ("::", "2001:db8::7", "2001:db8::7"),
    ("::1", None, "::1"),
    ("[::1]", None, "::1"),
    ("0.0.0.0", "edge-1.example.net", "edge-1.example.net"),
    ("10.0.0.5", "  ", "10.0.0.5"),          # blank: as if not given
])
def test_advertised_host(bind: str, advertise: str | None, want: str) -> None:
    assert advertised_host(bind, advertise) == want


@pytest.mark.parametrize(("bind", "advertise", "words"), [
    ("0.0.0.0", None, "--advertise"),
    ("::", None, "--advertise"),
    ("10.0.0.1", "0.0.0.0", "wildcard"),
    ("", None, "empty"),
    ("10.0.0.1:80", None, "port separately"),
    ("http://h", None, "neither"),
])
def test_advertised_host_refusals(bind: str, advertise: str | None, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        advertised_host(bind, advertise)


def test_ipv6_is_bracketed_in_urls_and_endpoints() -> None:
    assert tcp_endpoint("::1", 5555) == "tcp://[::1]:5555"
    assert http_url("::1", 80) == "http://[::1]:80"
    assert http_url("[fe80::1]", 80) == "http://[fe80::1]:80"
    assert tcp_endpoint("10.77.0.3", 1) == "tcp://10.77.0.3:1"
    assert host_for_url("site-a") == "site-a"
    assert normalise_host("0:0:0:0:0:0:0:1") == "::1"
    assert is_wildcard("::") and is_wildcard("0.0.0.0") and not is_wildcard("127.0.0.1")
    assert not is_wildcard("example.org")


def test_settings_bind_and_advertise_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert MeshSettings().advertised_host() == "127.0.0.1"
    monkeypatch.setenv("TIERMESH_BIND", "0.0.0.0")
    with pytest.raises(ConfigError, match="TIERMESH_ADVERTISE"):
        MeshSettings().advertised_host()
    monkeypatch.setenv("TIERMESH_ADVERTISE", "10.9.8.7")
    s = MeshSettings()
    assert (s.bind, s.advertised_host()) == ("0.0.0.0", "10.9.8.7")
    # a command line beats the environment
    assert s.advertised_host("::1", None) == "10.9.8.7"
    assert s.advertised_host("::1", "::2") == "::2"


def test_agent_command_line_wildcard_needs_advertise(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from tiermesh.cli.agent import agent_config

    monkeypatch.delenv("TIERMESH_ADVERTISE", raising=False)
    monkeypatch.delenv("TIERMESH_BIND", raising=False)
    base = dict(etcd="http://10.0.0.9:2379", site="edge-1", prefix=None, home=None, http_port=0, zmq_port=0,
                peer_map=None, lease_ttl=2.0, routing_mode="tiermesh")
    with pytest.raises(ConfigError, match="--advertise"):
        agent_config(argparse.Namespace(**base, bind="0.0.0.0", advertise=None), MeshSettings())
    cfg = agent_config(argparse.Namespace(**base, bind="0.0.0.0", advertise="10.0.0.4"), MeshSettings())
    assert (cfg.bind, cfg.advertise) == ("0.0.0.0", "10.0.0.4")
