"""Drill specs of ``tiermesh up`` (--kill, --cut, --blackhole), which paths a link drill fails, its
report from query records, and the refusal reasons of --netns."""

from __future__ import annotations

import pytest

from mesh.errors import ConfigError
from tests.helpers.topologies import EXAMPLE
from tiermesh import netns
from tiermesh.drills import LinkDrill, crosses_link, drill_report, parse_kill, parse_link_drill
from tiermesh.workload import QueryRecord
from topology.loader import load_topology_file

pytestmark = pytest.mark.unit

SITES = {"core-eu", "mid-eu", "mid-us", "edge-fra-1", "edge-par-1", "edge-nyc-1", "edge-sin-1"}


@pytest.mark.parametrize(("kind", "spec", "want"), [
    ("cut", "mid-eu-core-eu@10", LinkDrill("cut", "mid-eu", "core-eu", 10.0)),
    ("blackhole", "core-eu-mid-us@2.5", LinkDrill("blackhole", "core-eu", "mid-us", 2.5)),
    ("cut", "edge-fra-1-edge-sin-1@0", LinkDrill("cut", "edge-fra-1", "edge-sin-1", 0.0)),
])
def test_link_drills_split_on_site_names(kind: str, spec: str, want: LinkDrill) -> None:
    assert parse_link_drill(kind, spec, SITES) == want  # type: ignore[arg-type]
    assert want.link == spec.rpartition("@")[0]


@pytest.mark.parametrize(("spec", "words"), [
    ("mid-eu-core-eu", "A-B@SECONDS"),          # no time
    ("mid-eu-core-eu@soon", "A-B@SECONDS"),
    ("mid-eu-core-eu@-1", ">= 0"),
    ("mid-eu-core-eu@nan", ">= 0"),
    ("@10", "A-B@SECONDS"),
    ("mid-eu@10", "not two sites"),
    ("mid-eu-nowhere@10", "not two sites"),
    ("mid-eu-mid-eu@3", "two different sites"),
])
def test_bad_link_drills_are_refused(spec: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        parse_link_drill("cut", spec, SITES)


def test_ambiguous_split_is_refused() -> None:
    with pytest.raises(ConfigError, match="more than one way"):
        parse_link_drill("cut", "a-b-c@1", {"a", "b-c", "a-b", "c"})


def test_kill_spec() -> None:
    assert parse_kill(None) is None
    assert parse_kill("mid-eu@4") == ("mid-eu", 4.0)
    for bad in ("mid-eu", "@4", "mid-eu@x", "mid-eu@-2"):
        with pytest.raises(ConfigError, match="--kill"):
            parse_kill(bad)


def test_a_link_drill_fails_every_path_over_that_link() -> None:
    crosses = crosses_link(load_topology_file(EXAMPLE), "mid-eu", "core-eu")
    assert crosses("mid-eu", "core-eu") and crosses("core-eu", "mid-eu")
    assert crosses("edge-fra-1", "core-eu") and crosses("core-eu", "edge-par-1")  # via mid-eu
    assert not crosses("edge-fra-1", "mid-eu") and not crosses("edge-nyc-1", "core-eu")  # via mid-us
    assert not crosses("edge-fra-1", "edge-fra-1") and not crosses("edge-fra-1", "")
    # two sites without a link between them: the drill is about that pair only
    pair = crosses_link(load_topology_file(EXAMPLE), "edge-fra-1", "edge-nyc-1")
    assert pair("edge-nyc-1", "edge-fra-1") and not pair("edge-fra-1", "mid-eu")


def _rec(t: float, edge: str, site: str, *, ok: bool = True, total: float = 20.0, client: float = 25.0,
         cls: str = "balanced", error: str = "") -> QueryRecord:
    return QueryRecord(cls, edge, 60.0, 1, ok, client, total_ms=total, site=site, error=error, t=t)


def test_drill_report_counts_routed_around_hangs_and_detection() -> None:
    crosses = crosses_link(load_topology_file(EXAMPLE), "mid-eu", "core-eu")
    records = [
        _rec(1.0, "edge-fra-1", "core-eu"),                      # crossed before the drill
        _rec(2.0, "edge-nyc-1", "mid-us", cls="tight"),          # never concerned
        _rec(10.2, "edge-fra-1", "", ok=False, client=61.0, error="deadline"),   # paid for the dead link
        _rec(10.9, "edge-fra-1", "core-eu", total=80.0, client=1200.0),          # late, and hung
        _rec(11.5, "edge-fra-1", "mid-eu"),                      # routed around
        _rec(12.0, "edge-fra-1", "edge-fra-1"),                  # routed around (served locally)
        _rec(12.5, "edge-nyc-1", "mid-us", cls="tight"),
    ]
    rep = drill_report(LinkDrill("blackhole", "mid-eu", "core-eu", 10.0), records, crosses, lost=0,
                       failed_pairs=[("mid-eu", "core-eu")])
    assert rep["after"] == 5 and rep["errors"] == {"deadline": 1}
    assert rep["past_deadline_1s"] == 1
    assert (rep["crossing_before"], rep["crossing_after"], rep["routed_around"]) == (1, 1, 2)
    assert rep["detection_s"] == pytest.approx(1.5) and rep["last_miss_s"] == pytest.approx(0.9)
    assert rep["affected_misses"] == 2
    assert rep["failed_paths"] == ["mid-eu->core-eu"]


def test_netns_refusal_names_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert "not root" in (netns.unavailable_reason() or "")
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda name: None if name == "iptables" else f"/sbin/{name}")
    assert netns.unavailable_reason() is None
    assert "iptables" in (netns.unavailable_reason(firewall=True) or "")
    monkeypatch.setattr(netns.shutil, "which", lambda name: None)
    assert "`ip`" in (netns.unavailable_reason() or "")


async def test_require_netns_refuses_with_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(ConfigError, match="--netns is unavailable: not root"):
        await netns.require_netns()
