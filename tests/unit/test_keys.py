from __future__ import annotations

import pytest

from mesh.etcd import keys

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("func", "arg", "expected"), [
    (keys.site_key, "edge-1", "topology/sites/edge-1"),
    (keys.tenant_key, "acme", "tenants/acme"),
    (keys.live_key, "core", "live/core"),
    (keys.placement_key, "mid", "placement/mid"),
])
def test_one_level_keys(func, arg, expected):
    assert func(arg) == expected
    assert keys.last_segment(func(arg)) == arg


def test_link_key_is_undirected_and_parses_back():
    k = keys.link_key("middle", "edge-2")
    assert k == keys.link_key("edge-2", "middle") == "topology/links/edge-2/middle"
    assert keys.parse_key(k) == ("link", ("edge-2", "middle"))


def test_catalog_key_round_trip():
    k = keys.catalog_key("digit-classification", "mlp-tiny-int8")
    assert k == "catalog/digit-classification/mlp-tiny-int8"
    assert keys.parse_key(k) == ("variant", ("digit-classification", "mlp-tiny-int8"))


def test_fixed_keys_follow_the_design():
    assert keys.ELECTION_SCHEDULER == "election/scheduler"
    assert keys.blobs_key() == "services/variant-store"
    assert keys.site_key("x").startswith(keys.SITES)


@pytest.mark.parametrize("bad", ["", "a/b"])
def test_names_with_slashes_or_empty_are_refused(bad):
    with pytest.raises(ValueError):
        keys.site_key(bad)
    with pytest.raises(ValueError):
        keys.catalog_key("task", bad)


@pytest.mark.parametrize("bad", ["topology/links/a", "topology/links/a/b/c", "topology/sites/a/b",
                                 "topology/links//b"])
def test_malformed_link_keys_parse_to_none(bad):
    assert keys.parse_key(bad) is None


def test_self_link_is_refused():
    with pytest.raises(ValueError):
        keys.link_key("a", "a")


@pytest.mark.parametrize(("key", "expected"), [
    (keys.site_key("edge-1"), ("site", ("edge-1",))),
    (keys.link_key("b", "a"), ("link", ("a", "b"))),
    (keys.tenant_key("acme"), ("tenant", ("acme",))),
    (keys.task_key("digits"), ("task", ("digits",))),
    (keys.catalog_key("digits", "mlp-tiny"), ("variant", ("digits", "mlp-tiny"))),
    (keys.live_key("core"), ("live", ("core",))),
    (keys.placement_key("mid"), ("placement", ("mid",))),
    (keys.blobs_key(), ("service", ("variant-store",))),
    (keys.PKI_CRL, ("crl", ())),
    (keys.site_cert_key("edge-1"), ("site_cert", ("edge-1",))),
])
def test_every_built_key_parses_back_to_its_kind(key, expected):
    assert keys.parse_key(key) == expected


@pytest.mark.parametrize("key", [keys.TOPOLOGY_META, keys.EVENTS_PLACEMENT, keys.ELECTION_SCHEDULER + "/1",
                                 keys.model_key("digits", "mlp"), "live/", "live/a/b", "topology/sites/a/b",
                                 "topology/links/a", "catalog/t", "catalog//v", "tenants", "",
                                 keys.PKI + "ca", keys.PKI_CRL + "/x", keys.PKI_SITES, keys.PKI_SITES + "a/b",
                                 keys.PKI_SITES + "/a"])
def test_keys_no_view_follows_parse_to_none(key):
    assert keys.parse_key(key) is None
