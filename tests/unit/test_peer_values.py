"""What a site believes of the values another site supplies, the pure parts: the addresses of a live record
against the certificate that vouches for it (``mesh.pki.site_names``), a forwarded query's header against its
authenticated sender (``check_sender``), and what a door may spend and load at the site it forwards to
(``edge_agent.quota``: ``PeerQuotas``, ``PeerLoads``). A compromised site, end to end on real agents:
``tests/integration/test_compromised_site.py``."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from core_scheduler.state.heartbeat import DemandSample, Heartbeat
from edge_agent.quota import PEER_HEADROOM, PEER_LOAD_BURST, PEER_LOAD_EVERY_S, PeerLoads, PeerQuotas
from edge_agent.site_dataplane import check_sender
from mesh.errors import Overloaded, PermissionDenied, Unauthenticated
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from mesh.pki.site_names import Believer, Claim, SiteNames, believe, https_base
from mesh.types import SLO, InferRequest

pytestmark = pytest.mark.unit

NAMED = SiteNames(ips=frozenset({"10.0.0.1"}))                 # a certificate naming the address it advertises
OTHER = SiteNames(ips=frozenset({"10.0.0.9"}))                 # ... naming another one
POD = SiteNames(dns=frozenset({"agent-b.tiermesh.svc"}))       # a pod's: a DNS name, no IP
E1 = "tcp://10.0.0.1:5555"


# ---------------------------------------------------------------- endpoints

@pytest.mark.parametrize(("claims", "names", "previous", "dialled"), [
    # a site whose certificate names no address claims the endpoint of one whose certificate names it: the named
    # one keeps it, the other is not dialled (before: whichever the view listed first decided, for both)
    ({"attacker": E1, "victim": E1}, {"attacker": POD, "victim": NAMED}, {}, {"victim": E1}),
    ({"victim": E1, "attacker": E1}, {"attacker": POD, "victim": NAMED}, {}, {"victim": E1}),
    # an address the certificate does not name is never dialled, claimed by another or not
    ({"attacker": E1, "victim": E1}, {"attacker": OTHER, "victim": NAMED}, {}, {"victim": E1}),
    ({"attacker": E1}, {"attacker": OTHER}, {}, {}),
    # two pods (no IP named) on one endpoint: the one dialled there before keeps it, else neither
    ({"a": E1, "b": E1}, {"a": POD, "b": POD}, {E1: "b"}, {"b": E1}),
    ({"a": E1, "b": E1}, {"a": POD, "b": POD}, {}, {}),
    # co-located sites whose certificates both name the address: the incumbent, else neither
    ({"a": E1, "b": E1}, {"a": NAMED, "b": NAMED}, {E1: "a"}, {"a": E1}),
    ({"a": E1, "b": E1}, {"a": NAMED, "b": NAMED}, {E1: "gone"}, {}),
    # no valid certificate, or not an endpoint at all: nothing
    ({"a": E1}, {}, {}, {}),
    ({"a": "ipc:///tmp/x", "b": "tcp://10.0.0.1"}, {"a": POD, "b": POD}, {}, {}),
    # a pod alone at its endpoint, and distinct endpoints of one host: each dialled
    ({"b": "tcp://10.1.2.3:5555"}, {"b": POD}, {}, {"b": "tcp://10.1.2.3:5555"}),
    ({"a": E1, "b": "tcp://10.0.0.1:5556"}, {"a": NAMED, "b": NAMED}, {}, {"a": E1, "b": "tcp://10.0.0.1:5556"}),
])
def test_who_is_dialled_where(claims: dict[str, str], names: dict[str, SiteNames], previous: dict[str, str],
                              dialled: dict[str, str]) -> None:
    out = believe({s: Claim(e, None) for s, e in claims.items()}, names, previous)
    assert {s: b.endpoint for s, b in out.items() if b.endpoint} == dialled
    for site in set(claims) - set(dialled):
        assert out[site].why, site  # every refusal says why


def test_a_conflict_is_decided_on_the_endpoint_dialled() -> None:
    # the operator's peer map routes the victim through a local proxy; the attacker claims that proxy's endpoint
    proxy = "tcp://127.0.0.1:7001"
    out = believe({"victim": Claim(E1, None, dial=proxy), "attacker": Claim(proxy, None)},
                  {"victim": NAMED, "attacker": POD})
    assert out["victim"].endpoint == proxy and out["attacker"].endpoint is None


def test_the_believer_keeps_the_incumbent_and_says_each_refusal_once(caplog: pytest.LogCaptureFixture) -> None:
    b = Believer("here")
    names = {"a": POD, "b": POD}
    assert b.update({"a": Claim(E1, None)}, names)["a"].endpoint == E1
    for _ in range(3):  # b claims a's endpoint later: a keeps it
        out = b.update({"a": Claim(E1, None), "b": Claim(E1, None)}, names)
        assert out["a"].endpoint == E1 and out["b"].endpoint is None
    assert sum("claimed by a too" in r.getMessage() for r in caplog.records) == 1


# ---------------------------------------------------------------- edge URLs

@pytest.mark.parametrize(("http", "names", "endpoint", "used"), [
    ("https://10.0.0.1:8000", NAMED, E1, True),
    ("https://10.0.0.1:8000/", NAMED, E1, True),
    ("https://10.0.0.2:8000", NAMED, E1, False),                    # another address: SSRF
    ("http://10.0.0.1:8000", NAMED, E1, False),                     # plain http: nothing proves the server
    ("https://10.0.0.1:8000/admin", NAMED, E1, False),              # a base URL only
    ("https://10.0.0.1:8000?x=1", NAMED, E1, False),
    ("https://user@10.0.0.1:8000", NAMED, E1, False),
    ("https://10.0.0.1:99999", NAMED, E1, False),
    ("https://metadata.internal", NAMED, E1, False),                # a name the certificate does not hold
    ("https://agent-b.tiermesh.svc:8000", POD, "tcp://10.1.2.3:5555", True),  # the pod's own DNS name
    ("https://10.1.2.3:8000", POD, "tcp://10.1.2.3:5555", True),    # the pod's IP: its own (uncontested) endpoint
    ("https://10.1.2.4:8000", POD, "tcp://10.1.2.3:5555", False),   # any other IP
    ("https://EVIL.example", SiteNames(), "tcp://10.1.2.3:5555", False),
    (None, NAMED, E1, False),
])
def test_which_edge_url_is_used(http: str | None, names: SiteNames, endpoint: str, used: bool) -> None:
    out = believe({"b": Claim(endpoint, http)}, {"b": names})["b"]
    assert (out.http == http) if used else out.http is None


def test_a_pods_url_at_a_contested_endpoint_is_not_used() -> None:
    out = believe({"b": Claim("tcp://10.1.2.3:5555", "https://10.1.2.3:8000"),
                   "c": Claim("tcp://10.1.2.3:5555", None)}, {"b": POD, "c": POD})
    assert out["b"].http is None and out["b"].endpoint is None


@pytest.mark.parametrize(("url", "host"), [
    ("https://[::1]:8000", "::1"), ("https://a.example", "a.example"), ("https://a.example#f", None),
    ("ftp://a.example", None), ("https://:80", None), (12, None), ("https://" + "a" * 3000, None),
])
def test_https_base(url: object, host: str | None) -> None:
    assert https_base(url) == host


def test_the_names_a_real_certificate_holds(tmp_path: Path) -> None:
    from mesh.pki.files import read_cert

    pki = LocalPki.under(tmp_path)
    pki.init()
    pki.issue(Identity("site", "a"), addresses=["10.0.0.1", "Agent-A.tiermesh.svc", "::1"])
    names = SiteNames.of(read_cert(pki.paths.cert(Identity("site", "a"))))
    assert names.ips == {"10.0.0.1", "::1"} and names.dns == {"agent-a.tiermesh.svc"}
    assert names.names("[::1]") and names.names("agent-a.tiermesh.svc.") and not names.names("10.0.0.2")
    assert not names.allows("10.0.0.2") and SiteNames(dns=names.dns).allows("10.0.0.2")


# ---------------------------------------------------------------- a forwarded query's header

def _fwd(hops: list[str], target: str | None = "core", variant: str | None = "v") -> InferRequest:
    return InferRequest(task="t", inputs={"x": np.zeros((1, 4), np.float32)}, slo=SLO(100.0), tenant="acme",
                        deadline=time.monotonic() + 1.0, hops=hops, target_site=target, target_variant=variant)


def test_a_forwarded_query_is_believed_only_as_one_hop_from_its_door() -> None:
    check_sender(_fwd(["edge"]), "edge", secured=True, here="core")          # what a door forwards
    check_sender(_fwd(["edge", "mid"]), None, secured=False, here="core")    # --insecure: nothing to check by
    with pytest.raises(Unauthenticated):
        check_sender(_fwd(["edge"]), None, secured=True, here="core")
    # a site claiming to forward what entered elsewhere: before, the last hop alone was checked, so any site
    # could send a query as if another door had admitted (and charged) it
    with pytest.raises(PermissionDenied, match="claims hops"):
        check_sender(_fwd(["edge", "mid"]), "mid", secured=True, here="core")
    with pytest.raises(PermissionDenied, match="claims hops"):
        check_sender(_fwd([]), "mid", secured=True, here="core")
    # not for a variant here: it would be routed (and forwarded) again, uncharged
    for req in (_fwd(["edge"], target=None), _fwd(["edge"], target="mid"), _fwd(["edge"], variant=None)):
        with pytest.raises(PermissionDenied, match="never forwarded again"):
            check_sender(req, "edge", secured=True, here="core")


# ---------------------------------------------------------------- what a door may spend and load elsewhere

class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _beat(site: str, acme_qps: float = 0.0) -> Heartbeat:
    demand = (DemandSample(task="t", slo_class="c", tenant="acme", qps=acme_qps, budget_ms=50.0, min_accuracy=0.9),)
    return Heartbeat(site=site, demand=demand if acme_qps else ())


def _admitted(q: PeerQuotas, door: str, tenant: str, n: int) -> int:
    ok = 0
    for _ in range(n):
        try:
            q.admit(door, tenant)
        except Overloaded as exc:
            assert exc.details["reason"] == "door_share"
            continue
        q.release(door, tenant)
        ok += 1
    return ok


def test_a_door_spends_at_most_its_own_share_of_a_tenant_here() -> None:
    clock = Clock()
    q = PeerQuotas(clock)
    quotas = {"acme": {"qps": 100.0, "max_inflight": 2.0}, "open": {}}
    q.update(quotas, {"edge": _beat("edge", 30.0), "other": _beat("other", 10.0), "core": _beat("core")})
    share = 100.0 * (0.2 / 3 + 0.8 * 30.0 / 40.0)  # what edge enforces at its own door
    assert q.limits("edge")["acme"].qps == pytest.approx(share * PEER_HEADROOM)
    burst = q.limits("edge")["acme"].burst
    assert _admitted(q, "edge", "acme", 1000) == pytest.approx(burst, abs=1)  # then refused, until time passes
    clock.t += 1.0
    assert _admitted(q, "edge", "acme", 1000) == pytest.approx(share * PEER_HEADROOM, abs=1)
    assert _admitted(q, "other", "acme", 5) == 5        # another door's share is its own
    assert _admitted(q, "edge", "open", 1000) == 1000   # a tenant without quotas: nothing to hold it to
    # a door this site does not see: its share is unknown here, and never more than the tenant's whole qps
    assert q.limits("far")["acme"].qps == pytest.approx(100.0 * PEER_HEADROOM)
    # in flight: the tenant's per-door cap
    q.admit("other", "acme")
    q.admit("other", "acme")
    with pytest.raises(Overloaded, match="over its share"):
        q.admit("other", "acme")
    q.release("other", "acme")
    q.admit("other", "acme")
    assert q.refused[("other", "acme")] == 1


def test_the_cold_loads_a_peer_causes_are_bounded() -> None:
    clock = Clock()
    loads = PeerLoads(clock)
    burst = int(PEER_LOAD_BURST)
    for i in range(burst):
        loads.charge("attacker", (f"v{i}", ""))
    loads.charge("attacker", ("v0", ""))  # still loading (or loaded meanwhile): what it paid for is not paid again
    with pytest.raises(Overloaded, match="cold loads"):
        loads.charge("attacker", ("v-next", ""))
    loads.charge("honest", ("v-next", ""))  # every peer has its own
    clock.t += PEER_LOAD_EVERY_S
    loads.charge("attacker", ("v-next", ""))
    with pytest.raises(Overloaded):
        loads.charge("attacker", ("v-after", ""))
    assert loads.refused == {"attacker": 2}
