"""The agent hands etcd's revocation list (``pki/crl``) to its trust stores until every one holds it: a store that
refuses it (a transient failure, a list its CA does not verify yet) is handed the same list again on the next view
change, and its refusal is logged once per ``CRL_REFUSED_LOG_S``, not on every change. Before, the agent marked the
list seen before handing it over, so a refused list was never tried again and the store kept the older one: a
revocation that never took effect there (issue 29)."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from edge_agent import agent_trust
from edge_agent.agent_trust import AgentTrust
from mesh.errors import PkiError
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from mesh.pki.trust import TrustStore

pytestmark = pytest.mark.unit

TENANT = Identity("tenant", "acme")


class _Refusing:
    """A trust store that refuses the first ``refusals`` lists handed to it (a transient failure), then adopts as
    a ``TrustStore`` does."""

    def __init__(self, trust: TrustStore, refusals: int) -> None:
        self.trust, self.refusals, self.calls = trust, refusals, 0

    def load_crl(self, pem: bytes) -> bool:
        self.calls += 1
        if self.refusals > 0:
            self.refusals -= 1
            raise PkiError("cannot load the revocation list: try again")
        return self.trust.load_crl(pem)


class _Agent(AgentTrust):
    """What ``_adopt_crl`` reads of an agent: its view's list and its two trust stores."""

    def __init__(self, tls: Any, curve_sites: Any) -> None:
        self.site = "edge-a"
        self.view: Any = SimpleNamespace(crl=None)
        self.http: Any = SimpleNamespace(tls=tls)
        self.curve: Any = SimpleNamespace(sites=curve_sites)
        self._crl_seen = None

    def view_changed(self, crl: bytes) -> None:
        self.view.crl = crl
        self._adopt_crl()


@pytest.fixture
def pki(tmp_path: Path) -> LocalPki:
    p = LocalPki.under(tmp_path / "home")
    p.init()
    p.issue(TENANT)
    return p


def _refused_logs(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "tm", {}).get("event") == "crl_refused"]


def test_a_list_a_store_refused_is_handed_to_it_again_on_the_next_view_change(
        pki: LocalPki, caplog: pytest.LogCaptureFixture) -> None:
    edge, curve = _Refusing(TrustStore.under(pki.paths), refusals=1), TrustStore.under(pki.paths)
    agent = _Agent(edge, curve)
    revoked, _ = pki.revoke(TENANT)
    agent.view_changed(revoked.to_pem())
    assert curve.crl is not None and curve.crl.number == revoked.number  # the other store took it
    assert edge.trust.crl is not None and edge.trust.crl.number < revoked.number  # this one still holds the old
    assert agent._crl_seen is None and len(_refused_logs(caplog)) == 1
    agent.view_changed(revoked.to_pem())  # the next view change (anything: a peer's heartbeat)
    assert edge.trust.crl is not None and edge.trust.crl.number == revoked.number
    assert agent._crl_seen == revoked.to_pem()
    calls = edge.calls
    agent.view_changed(revoked.to_pem())  # every store holds it: not handed over again
    assert edge.calls == calls


def test_a_store_holding_a_newer_list_is_done_with_an_older_one(pki: LocalPki) -> None:
    edge, curve = TrustStore.under(pki.paths), TrustStore.under(pki.paths)
    older, _ = pki.revoke(TENANT)
    newer = pki.refresh_crl()
    assert edge.load_crl(newer.to_pem())
    agent = _Agent(edge, curve)
    agent.view_changed(older.to_pem())  # edge holds a newer one (False), curve adopts: done with this list
    assert agent._crl_seen == older.to_pem() and edge.crl is not None and edge.crl.number == newer.number
    assert curve.crl is not None and curve.crl.number == older.number


def test_a_refusal_is_logged_once_per_interval_not_on_every_view_change(
        pki: LocalPki, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    edge = _Refusing(TrustStore.under(pki.paths), refusals=1_000)
    agent = _Agent(edge, None)  # an edge without CURVE: one store
    first, _ = pki.revoke(TENANT)
    for _ in range(20):
        agent.view_changed(first.to_pem())
    assert edge.calls == 20 and len(_refused_logs(caplog)) == 1
    assert "edge TLS: cannot load the revocation list" in _refused_logs(caplog)[0].getMessage()
    second = pki.refresh_crl()
    agent.view_changed(second.to_pem())  # another list: said at once
    assert len(_refused_logs(caplog)) == 2
    monkeypatch.setattr(agent_trust, "CRL_REFUSED_LOG_S", 0.0)  # the interval passed
    agent.view_changed(second.to_pem())
    assert len(_refused_logs(caplog)) == 3
