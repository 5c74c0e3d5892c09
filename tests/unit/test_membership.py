"""The membership drills' words (``--join SITE@S``, ``--revoke SITE@S``) and their report, from records."""

from __future__ import annotations

import pytest

from mesh.errors import ConfigError
from tiermesh.membership import MembershipDrill, check_drills, membership_report, parse_membership
from tiermesh.workload import QueryRecord

pytestmark = pytest.mark.unit
SITES = {"core-eu", "core-eu-2", "edge-1"}


def _rec(t: float, site: str, ok: bool = True, error: str = "") -> QueryRecord:
    return QueryRecord("c", "edge-1", 100.0, 1, ok, 5.0, 5.0, site=site, t=t, error=error)


def test_parse() -> None:
    assert parse_membership("join", "core-eu-2@4.5", SITES) == MembershipDrill("join", "core-eu-2", 4.5)
    for bad in ("core-eu-2", "@4", "nowhere@4", "core-eu@-1", "core-eu@x"):
        with pytest.raises(ConfigError):
            parse_membership("revoke", bad, SITES)


def test_check() -> None:
    join, revoke = MembershipDrill("join", "core-eu-2", 4), MembershipDrill("revoke", "core-eu", 8)
    check_drills([join, revoke], {"core-eu", "edge-1"})
    check_drills([join, MembershipDrill("revoke", "core-eu-2", 9)], {"core-eu", "edge-1"})  # joins, then revoked
    for drills in ([join, join], [MembershipDrill("revoke", "core-eu-2", 3), join],
                   [MembershipDrill("revoke", "ghost", 3)]):
        with pytest.raises(ConfigError):
            check_drills(drills, {"core-eu", "edge-1"})


def test_reports() -> None:
    recs = [_rec(1.0, "core-eu"), _rec(5.5, "core-eu-2"), _rec(7.0, "core-eu"), _rec(9.0, "core-eu"),
            _rec(12.5, "core-eu"), _rec(13.0, "edge-1", ok=False, error="deadline")]
    join = membership_report(MembershipDrill("join", "core-eu-2", 4.0), recs, ready_s=1.2)
    assert join == {"kind": "join", "site": "core-eu-2", "at_s": 4.0, "ready_s": 1.2, "first_served_s": 1.5,
                    "served": 1}
    revoke = membership_report(MembershipDrill("revoke", "core-eu", 6.0), recs, forwarded_after_grace=0)
    assert revoke["served_before"] == 1 and revoke["served_after"] == 3 and revoke["served_from_grace"] == 1
    assert revoke["last_served_s"] == 6.5 and revoke["errors_after"] == {"deadline": 1}
    assert membership_report(MembershipDrill("join", "ghost", 0.0), recs)["first_served_s"] is None
