"""An agent whose own site certificate is revoked refuses to start, with the reason, even when its host's ``crl.pem``
predates the revocation: it takes etcd's list (``pki/crl``) before it checks its own certificate. Before, it checked
its certificate against its stale file, published it at ``pki/sites/<site>`` and ran as a site no peer admits."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.agent import Agent
from edge_agent.agent_config import AgentConfig
from mesh.errors import ConfigError
from mesh.etcd.keys import site_cert_key
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from mesh.pki.files import PkiPaths
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from tiermesh.pki_etcd import publish_crl
from topology.loader import load_topology_file
from topology.store_io import apply as apply_topology

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

TOPOLOGY = Path(__file__).resolve().parents[1] / "data" / "topology_small.yaml"
SITE = Identity("site", "edge-fra-1")


async def test_an_agent_revoked_in_etcd_refuses_to_start(store: Store, etcd_server: EmbeddedEtcd,
                                                         tmp_path: Path) -> None:
    await apply_topology(store, load_topology_file(TOPOLOGY))
    pki = LocalPki.under(tmp_path / "operator")
    pki.init()
    pki.issue(SITE, addresses=["127.0.0.1"])
    home = tmp_path / "agent"
    pki.bundle(SITE, PkiPaths.under(home))  # its crl.pem from before the revocation, never updated
    stale = (home / "pki" / "crl.pem").read_bytes()
    revoked, _ = pki.revoke(SITE)
    assert (await publish_crl(store, revoked, pki.ca().cert))[0]
    cfg = AgentConfig(site=SITE.name, etcd=etcd_server.url, prefix=store.prefix, home=home, lease_ttl_s=2.0)
    with pytest.raises(ConfigError, match=r"the certificate of site edge-fra-1 .* is revoked"):
        async with Agent(cfg):
            pass
    assert (home / "pki" / "crl.pem").read_bytes() == stale  # it was etcd's list that said so
    assert await store.get(site_cert_key(SITE.name)) is None  # and nothing of it was published
