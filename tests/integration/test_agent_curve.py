"""The agent's CURVE switch: on when its site credentials are in the PKI directory, and the agent refuses to start
without them (fail closed: ``insecure`` is the only way to plain ZeroMQ, with a warning, and never beside edge
TLS); the live record publishes the key."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from edge_agent.agent import Agent
from edge_agent.agent_config import AgentConfig
from mesh.errors import ConfigError
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from mesh.pki.files import PkiPaths
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from mesh.settings import MeshSettings
from tiermesh.cli.agent import agent_config
from topology.loader import load_topology_file
from topology.store_io import apply as apply_topology

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

TOPOLOGY = Path(__file__).resolve().parents[1] / "data" / "topology_small.yaml"
SITE = "edge-fra-1"


def _cfg(store: Store, etcd: EmbeddedEtcd, home: Path, **kw: object) -> AgentConfig:
    return AgentConfig(site=SITE, etcd=etcd.url, prefix=store.prefix, home=home, lease_ttl_s=2.0,
                       **kw)  # type: ignore[arg-type]


def test_the_command_line_reaches_the_config(tmp_path: Path) -> None:
    args = argparse.Namespace(etcd="http://127.0.0.1:1", site=SITE, prefix=None, home=None, http_port=0,
                              zmq_port=0, peer_map=None, lease_ttl=2.0, routing_mode="tiermesh",
                              pki_dir=tmp_path, insecure=True)
    cfg = agent_config(args, MeshSettings())
    assert cfg.pki_dir == tmp_path and cfg.insecure


async def test_curve_follows_the_site_credentials(store: Store, etcd_server: EmbeddedEtcd, tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    await apply_topology(store, load_topology_file(TOPOLOGY))
    with pytest.raises(ConfigError, match="pki issue --site edge-fra-1"):
        async with Agent(_cfg(store, etcd_server, tmp_path, pki_dir=tmp_path / "nothing-here")):
            pass
    async with Agent(_cfg(store, etcd_server, tmp_path, insecure=True)) as agent:  # no credentials: said so
        assert agent.curve is None and agent._live_record().curve_key is None
    pki = LocalPki.under(tmp_path)
    pki.init()
    pki.issue(Identity("site", SITE))
    async with Agent(_cfg(store, etcd_server, tmp_path)) as agent:
        assert agent.curve is not None and agent.dataplane is not None and agent.dataplane.secured
        assert agent._live_record().curve_key == pki.curve(Identity("site", SITE)).public.decode()
    async with Agent(_cfg(store, etcd_server, tmp_path, insecure=True)) as agent:
        assert agent.curve is None and "NOT authenticated" in caplog.text


async def test_a_home_holding_another_sites_files_is_refused_with_the_reason(store: Store, etcd_server: EmbeddedEtcd,
                                                                             tmp_path: Path) -> None:
    """Files copied to the wrong host: the agent neither runs as that other site nor runs without CURVE."""
    await apply_topology(store, load_topology_file(TOPOLOGY))
    operator = LocalPki.under(tmp_path / "operator")
    operator.init()
    other = Identity("site", "core-eu")
    operator.issue(other)
    operator.bundle(other, PkiPaths.under(tmp_path / "host"))  # core-eu's files on edge-fra-1's host
    with pytest.raises(ConfigError, match="holds the files of site core-eu, not of edge-fra-1"):
        async with Agent(_cfg(store, etcd_server, tmp_path / "host")):
            pass
    # and core-eu's certificate renamed as this site's: refused for what it proves, not its file name
    paths = PkiPaths.under(tmp_path / "host")
    me = Identity("site", SITE)
    for role in ("cert", "key", "curve"):
        src, dst = paths.host_files(other)[role], paths.host_files(me)[role]
        dst.parent.mkdir(parents=True, exist_ok=True)
        src.rename(dst)
    with pytest.raises(ConfigError, match="certificate of spiffe://tiermesh/site/core-eu, not of site edge-fra-1"):
        async with Agent(_cfg(store, etcd_server, tmp_path / "host")):
            pass


async def test_an_agent_without_its_site_credentials_refuses_to_start_rather_than_serve_plain_zeromq(
        store: Store, etcd_server: EmbeddedEtcd, tmp_path: Path) -> None:
    """Fail closed: an agent started without --pki-dir whose home lacked its ``.curve`` file served ZeroMQ
    unauthenticated while its edge TLS was on, and one with no credentials at all did so with a warning."""
    await apply_topology(store, load_topology_file(TOPOLOGY))
    with pytest.raises(ConfigError, match="pass --insecure to run plain ZeroMQ"):
        async with Agent(_cfg(store, etcd_server, tmp_path / "bare")):  # the default <home>/pki, empty
            pass
    pki = LocalPki.under(tmp_path / "home")
    pki.init()
    me = Identity("site", SITE)
    pki.issue(me, addresses=["127.0.0.1"])
    pki.paths.curve(me).unlink()  # its certificate and key for the edge's TLS, and no CURVE key
    with pytest.raises(ConfigError, match=r"has no .*edge-fra-1\.curve"):
        async with Agent(_cfg(store, etcd_server, tmp_path / "home", tls=True)):
            pass
    with pytest.raises(ConfigError, match="edge TLS runs CURVE"):  # a contradiction: refused at once
        _cfg(store, etcd_server, tmp_path / "home", tls=True, insecure=True)
