"""Which CURVE key a site dials a peer with while that peer rotates (edge_agent.peer_keys), on real certificates
and the real ``SiteKeys`` reading them; the live records are plain objects with a ``curve_key``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from edge_agent.peer_keys import PeerAddresses, PeerKeys, serving_keys
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from mesh.zmq.site_keys import SiteKeys
from tests.helpers.site_certs import published_certs

pytestmark = pytest.mark.unit

CORE = Identity("site", "core")
EP = "tcp://127.0.0.1:5555"


@dataclass
class Live:
    curve_key: str | None
    endpoint: str = EP


def test_serving_keys() -> None:
    assert serving_keys(b"new", b"old", b"new") == (b"new",)
    assert serving_keys(b"new", b"old", b"old") == (b"old", b"new")  # published first, then the certificate's
    assert serving_keys(b"new", None, b"other") is None                # bound by nobody: refused
    assert serving_keys(None, None, b"pub") == ()                      # etcd alone vouches for it: never dialled
    assert serving_keys(b"cert", None, None) == (b"cert",)
    assert serving_keys(None, None, None) == ()


@pytest.fixture
def pki(tmp_path: Path) -> LocalPki:
    pki = LocalPki.under(tmp_path)
    pki.init()
    pki.issue(Identity("site", "edge"))
    pki.issue(CORE)
    return pki


def _sites(pki: LocalPki) -> SiteKeys:
    sites = SiteKeys(pki.paths, site="edge", interval_s=60.0)
    sites.publish(published_certs(pki))
    return sites


def test_a_lost_key_turns_to_the_re_issued_certificates_key_and_back(pki: LocalPki) -> None:
    sites = _sites(pki)
    old = pki.curve(CORE).public
    live = {"core": Live(old.decode())}
    keys = PeerKeys("edge", sites, lambda: live, lambda site: EP if site == "core" else None)
    assert keys.server_key(EP) == old
    assert keys.server_key(EP, old) == old  # the only key there is (nothing re-issued)
    pki.issue(CORE)                         # re-issued, and published in etcd
    sites.publish(published_certs(pki))
    new = pki.curve(CORE).public
    assert keys.server_key(EP) == old       # it publishes the old one still: tried first
    assert keys.server_key(EP, old) == new  # the old one failed: the re-issued certificate's key
    assert keys.rotated() == []             # dialled with a key it may serve with: left alone
    assert keys.server_key(EP, new) == old  # and back, should the new one fail first
    live["core"] = Live(new.decode())       # its live record says it took the new key
    assert keys.rotated() == [(EP, new)]    # dialled with the old one: re-dial with the new
    assert keys.server_key(EP) == new
    assert keys.rotated() == []


def test_a_key_no_certificate_binds_is_not_dialled(pki: LocalPki) -> None:
    sites = _sites(pki)
    live = {"core": Live(pki.curve(Identity("site", "edge")).public.decode())}  # someone else's key
    keys = PeerKeys("edge", sites, lambda: live, lambda site: EP if site == "core" else None)
    assert keys.server_key(EP) is None
    assert keys.server_key("tcp://127.0.0.1:1") is None  # no live site there


def test_a_peer_known_only_from_etcd_or_at_an_address_its_certificate_does_not_name_is_not_dialled(
        tmp_path: Path) -> None:
    pki = LocalPki.under(tmp_path)
    pki.init()
    pki.issue(Identity("site", "edge"))
    pki.issue(CORE, addresses=["10.9.0.2"])
    sites = SiteKeys(pki.paths, site="edge", interval_s=60.0)  # nothing delivered yet: core's certificate unknown
    key = pki.curve(CORE).public
    live = {"core": Live(key.decode(), "tcp://10.9.0.2:5555")}
    addresses = PeerAddresses("edge", sites)  # where the agent dials each peer (what its certificate vouches for)
    sites.on_change.append(lambda: addresses.update(live))
    addresses.update(live)
    keys = PeerKeys("edge", sites, lambda: live, addresses.endpoint)
    assert keys.server_key("tcp://10.9.0.2:5555") is None  # its live record's key alone: not believed
    sites.publish(published_certs(pki))
    assert keys.server_key("tcp://10.9.0.2:5555") == key  # the CA vouches for it now
    live["core"] = Live(key.decode(), "tcp://10.9.0.66:5555")  # another site's address claimed as its own
    addresses.update(live)
    assert addresses.endpoint("core") is None and keys.server_key("tcp://10.9.0.66:5555") is None
