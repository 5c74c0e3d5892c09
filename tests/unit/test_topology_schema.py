"""Typed topology objects, their JSON form, the loader on good input, and the pure diff."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mesh.errors import TopologyError
from tests.helpers.topologies import EXAMPLE
from tiermesh.cli.topology import format_diff
from topology.loader import load_topology_file, parse_topology
from topology.paths import topology_paths
from topology.schema import Gpu, Hardware, Link, Site, Tenant, Topology
from topology.store_io import desired_state, diff

pytestmark = pytest.mark.unit


SMALL = """\
schema: 1
sites:
  - name: core-a
    tier: core
    region: eu-west
    coordinates: {lat: 50.1, lon: 8.7}
    hardware:
      cpu_cores: 16
      memory_mb: 65536
      gpus: [{model: H100 SXM, memory_mb: 81920}]
      price_per_hour: 3.5
  - name: edge-a
    tier: edge
    region: eu-west
    coordinates: {lat: 49.0, lon: 8.0}
    hardware: {cpu_cores: 2, memory_mb: 4096, price_per_hour: 0.1}
links:
  - {a: edge-a, b: core-a, latency_ms: 3, bandwidth_mbps: 1000}
tenants:
  - {name: acme}
"""


def _site(name: str, tier: str = "middle", gpus: tuple[Gpu, ...] = ()) -> Site:
    return Site(name=name, tier=tier, region="r", lat=1.0, lon=2.0,  # type: ignore[arg-type]
                hardware=Hardware(cpu_cores=4, memory_mb=1024, gpus=gpus, price_per_hour=0.5))


def test_link_endpoints_are_normalised() -> None:
    lk = Link("zeta", "alpha", 3.0, 100.0)
    assert (lk.a, lk.b) == ("alpha", "zeta")
    assert lk == Link("alpha", "zeta", 3.0, 100.0)


def test_topology_equality_ignores_link_order() -> None:
    sites = {n: _site(n) for n in ("a", "b", "c")}
    links1 = (Link("a", "b", 1, 10), Link("c", "b", 2, 20))
    links2 = (Link("b", "c", 2, 20), Link("b", "a", 1, 10))
    t1, t2 = Topology(sites=sites, links=links1), Topology(sites=dict(reversed(sites.items())), links=links2)
    assert t1 == t2
    assert t1.digest() == t2.digest()
    assert t1.link("c", "b") == Link("b", "c", 2, 20)
    assert t1.link("a", "c") is None


@pytest.mark.parametrize(("gpus", "expected"), [
    ((), "cpu"),
    ((Gpu("A100", 40960),), "gpu-a100"),
    ((Gpu("H100 SXM", 81920), Gpu("A100", 40960)), "gpu-h100-sxm"),
])
def test_hardware_class(gpus: tuple[Gpu, ...], expected: str) -> None:
    assert Hardware(cpu_cores=1, memory_mb=1, gpus=gpus).hardware_class == expected


def test_json_round_trip_per_object() -> None:
    site = _site("s1", "core", (Gpu("A100", 40960),))
    link = Link("b", "a", 2.5, 300.0, jitter_ms=0.25)
    tenant = Tenant("acme", "strict", {"qps": 5.0})
    for obj in (site, link, tenant):
        text = obj.to_json()
        assert json.loads(text)["schema"] == 1
        assert type(obj).from_json(text) == obj
        assert type(obj).from_json(text.encode()) == obj
    topo = Topology(sites={"s1": site, "a": _site("a"), "b": _site("b")}, links=(link,), tenants={"acme": tenant})
    assert Topology.from_json(topo.to_json()) == topo


def test_paths_are_cached_by_content() -> None:
    # two parses are two objects but one topology: one set of path tables
    assert topology_paths(parse_topology(SMALL)) is topology_paths(parse_topology(SMALL))


def test_example_file_loads() -> None:
    topo = load_topology_file(EXAMPLE)
    tiers = sorted(s.tier for s in topo.sites.values())
    assert tiers.count("core") == 1 and tiers.count("middle") == 2 and tiers.count("edge") == 4
    assert {s.region for s in topo.sites.values()} == {"eu-west", "us-east", "ap-southeast"}
    (core,) = topo.sites_in_tier("core")
    assert core.region == "eu-west" and core.hardware.gpus
    for edge in topo.sites_in_tier("edge"):
        assert 2 <= edge.hardware.cpu_cores <= 4 and 2048 <= edge.hardware.memory_mb <= 8192
        assert edge.hardware.hardware_class == "cpu"
    assert {t.name: t.isolation for t in topo.tenants.values()} == {
        "public": "shared", "acme": "shared", "globex": "strict"}


def test_loader_fills_defaults_and_types() -> None:
    topo = parse_topology(SMALL)
    core = topo.sites["core-a"]
    assert core.hardware == Hardware(16, 65536, (Gpu("H100 SXM", 81920),), 3.5)
    assert (core.lat, core.lon) == (50.1, 8.7)
    assert topo.sites["edge-a"].hardware.gpus == ()
    (lk,) = topo.links
    assert (lk.a, lk.b, lk.latency_ms, lk.bandwidth_mbps, lk.jitter_ms) == ("core-a", "edge-a", 3.0, 1000.0, 0.0)
    assert isinstance(lk.latency_ms, float)
    assert topo.tenants["acme"] == Tenant("acme", "shared", {})


def test_same_content_different_layout_same_digest() -> None:
    text = EXAMPLE.read_text()
    lines = text.splitlines()
    start = lines.index("links:") + 1
    end = lines.index("tenants:")
    links = [ln for ln in lines[start:end] if ln.strip().startswith("- {")]
    reordered = "\n".join([*lines[:start], *reversed(links), *lines[end:]]) + "\n"
    a, b = parse_topology(text), parse_topology(reordered)
    assert a == b and a.digest() == b.digest()


def test_loader_error_carries_file_line_field() -> None:
    bad = SMALL.replace("cpu_cores: 2,", "cpu_cores: 2.5,")
    with pytest.raises(TopologyError) as ei:
        parse_topology(bad, file="inline.yaml")
    err = ei.value
    assert (err.file, err.line, err.field) == ("inline.yaml", 16, "sites[1].hardware.cpu_cores")
    assert str(err).startswith("inline.yaml:16: sites[1].hardware.cpu_cores: expected an integer")


def test_missing_file_is_a_topology_error(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match="cannot read file"):
        load_topology_file(tmp_path / "nope.yaml")


def test_desired_state_keys() -> None:
    topo = parse_topology(SMALL)
    state = desired_state(topo)
    assert sorted(state) == ["tenants/acme", "topology/links/core-a/edge-a",
                             "topology/sites/core-a", "topology/sites/edge-a"]
    assert Site.from_dict(state["topology/sites/core-a"]) == topo.sites["core-a"]


def test_diff_cases() -> None:
    cur = {"k1": {"v": 1}, "k2": {"v": 2}, "k3": {"v": 3}}
    want = {"k1": {"v": 1}, "k2": {"v": 20}, "k4": {"v": 4}}
    d = diff(cur, want)
    assert d.added == {"k4": {"v": 4}}
    assert d.removed == {"k3": {"v": 3}}
    assert d.changed == {"k2": ({"v": 2}, {"v": 20})}
    assert d.keys() == ["k2", "k3", "k4"] and len(d) == 3 and not d.empty
    assert diff(want, want).empty
    assert format_diff(d) == ["~ k2  v: 2 -> 20", "- k3", "+ k4"]


def test_format_diff_names_nested_fields() -> None:
    old = Link("a", "b", 3.0, 100.0).to_dict()
    new = Link("a", "b", 5.0, 100.0).to_dict()
    assert format_diff(diff({"x": old}, {"x": new})) == ["~ x  latency_ms: 3.0 -> 5.0"]


_vals = st.dictionaries(st.sampled_from(list("abcdef")), st.integers(0, 3), max_size=6)


@given(_vals, _vals)
def test_diff_applied_to_current_gives_desired(cur: dict[str, int], want: dict[str, int]) -> None:
    d = diff(cur, want)
    out = {k: v for k, v in cur.items() if k not in d.removed}
    out.update(d.added)
    out.update({k: new for k, (_, new) in d.changed.items()})
    assert out == want
    assert set(d.added).isdisjoint(d.removed) and set(d.changed).isdisjoint(d.added)


def test_package_exports_resolve() -> None:
    import topology

    for name in topology.__all__:
        assert getattr(topology, name) is not None, name
