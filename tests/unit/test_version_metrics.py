"""Queries per version of a tenant's task (issue 34 item 3): the site that runs a query counts it under its variant's
catalogued version (``tiermesh_version_queries_total``), public variants are not counted, a variant the view does
not know is ``other``; the exposition parses with prometheus_client's parser. The console reads those counters
(``console.versions``) and joins them with the version records: summed over sites, a version no record holds kept."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from console.digest import Sample, parse_samples
from console.versions import decode_record, summary, version_counts
from edge_agent.batch_parts import BatchResult
from edge_agent.demand import DemandMeter
from edge_agent.metrics import AgentMetrics
from edge_agent.site_dataplane import SiteDataPlane
from mesh.types import SLO, InferRequest
from tests.unit.test_paths_retry import FakeZmq
from variant_store.meta import VariantMeta
from variant_store.versions import VersionInfo, VersionRecord

pytestmark = pytest.mark.unit
FAMILY = "tiermesh_version_queries"


def _versions(m: AgentMetrics) -> dict[tuple[str, str, str, str], float]:
    fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    assert fams[FAMILY].type == "counter"
    return {(s.labels["task"], s.labels["tenant"], s.labels["site"], s.labels["version"]): s.value
            for s in fams[FAMILY].samples if s.name == FAMILY + "_total"}


def test_served_queries_are_counted_per_version_with_bounded_labels() -> None:
    m = AgentMetrics("edge-a")
    m.known(tasks=["mine", "digits"], tenants=["acme"], variants=["m1", "m2", "pub"], sites=[])
    assert _versions(m) == {}  # the family is there, empty, before any query
    for variant, version in (("m1", 1), ("m2", 2), ("m2", 2), ("m2", 2)):
        m.served_ok("mine", "acme", variant, "local", 1.0, 2.0, 4.0, rows=1, version=version)
    m.served_ok("mine", "acme", "m2", "forwarded", 1.0, 2.0, 4.0, rows=1, version=2)  # forwarded here: ran here
    m.served_ok("digits", "acme", "pub", "local", 1.0, 2.0, 4.0, rows=1)              # public: no version
    m.served_ok("gone", "mallory", "m9", "local", 1.0, 2.0, 4.0, rows=1, version=77)  # unknown: other
    assert _versions(m) == {("mine", "acme", "edge-a", "1"): 1, ("mine", "acme", "edge-a", "2"): 4,
                            ("other", "other", "edge-a", "other"): 1}


def _meta(vid: str, owner: str, version: int) -> VariantMeta:
    return VariantMeta(task="mine", family="fam", variant_id=vid, format="onnx", precision="fp32",
                       runtime="onnxruntime", blob_digest="a" * 64, size_bytes=1, accuracy=0.9, owner=owner,
                       version=version)


async def test_the_serving_site_counts_the_version_of_the_variant_it_ran() -> None:
    metas = {"t2": _meta("t2", "acme", 2), "pub": _meta("pub", "public", 1)}

    class Loaded:
        batcher = SimpleNamespace(submit=lambda *a, **kw: _result())

        def touch(self, now: float) -> None:
            pass

    async def _result() -> BatchResult:
        return BatchResult({"y": np.zeros((1, 2), np.float32)}, 0.5, 1.0, 1)

    view: Any = SimpleNamespace(variant=lambda task, vid: metas.get(vid), topology=None)
    host: Any = SimpleNamespace(instances={(vid, ""): Loaded() for vid in metas})
    metrics = AgentMetrics("core")
    metrics.known(tasks=["mine"], tenants=["acme"], variants=list(metas), sites=[])
    dp = SiteDataPlane("core", view, host, FakeZmq({}), table=lambda: None,  # type: ignore[arg-type]
                       peer_endpoint=lambda s: None, demand=DemandMeter(), metrics=metrics)
    for vid in ("t2", "t2", "pub"):
        req = InferRequest.entering("mine", {"x": np.zeros((1, 2), np.float32)}, SLO(1000.0, 0.5), "acme")
        await dp._serve_local(req, vid, "forwarded", False, time.monotonic())
    assert _versions(metrics) == {("mine", "acme", "core", "2"): 2}


def _sample(task: str, version: str, value: float, tenant: str = "acme") -> Sample:
    return Sample(FAMILY + "_total", {"task": task, "tenant": tenant, "site": "x", "version": version}, value)


def test_the_console_reads_the_counters_and_skips_what_it_cannot_attribute() -> None:
    m = AgentMetrics("edge-a")
    m.known(tasks=["mine"], tenants=["acme"], variants=["m1"], sites=[])
    m.served_ok("mine", "acme", "m1", "local", 1.0, 2.0, 4.0, rows=1, version=3)
    m.served_ok("mine", "acme", "m1", "local", 1.0, 2.0, 4.0, rows=1, version=3)
    m.served_ok("mine", "acme", "zz", "local", 1.0, 2.0, 4.0, rows=1, version=3)  # other: not attributable
    assert version_counts(parse_samples(m.render().decode())) == {("mine", "acme", 3): 2.0}
    odd = [_sample("t", "0", 1), _sample("t", "-1", 1), _sample("t", "1e3", 1), _sample("t", "٣", 1),
           _sample("t", "1", float("nan")), _sample("t", "1", -1), _sample("t", "1", float("inf")),
           _sample("t", "9999999", 1), Sample("tiermesh_served_total", {"task": "t", "version": "1"}, 1)]
    assert version_counts(odd) == {}


def test_the_console_summary_joins_records_with_the_sites_counts() -> None:
    rec = VersionRecord(task="mine", owner="acme", active=2, weights={2: 0.75, 3: 0.25},
                        versions={1: VersionInfo("f1", "retiring", 0.91, retire_at=1e9),
                                  2: VersionInfo("f2", "active", 0.95), 3: VersionInfo("f3", "held", 0.93),
                                  4: VersionInfo("f4", "building")})
    sites = {"edge-a": {("mine", "acme", 2): 6.0, ("mine", "acme", 3): 2.0, ("old", "globex", 1): 5.0},
             "core": {("mine", "acme", 2): 4.0, ("mine", "acme", 1): 1.0}}
    out = summary([rec], [], sites, {"mid": "HTTP 404"}, now=5.0)
    assert [t["task"] for t in out["tasks"]] == ["mine", "old"]  # by owner: acme, then globex
    mine, old = out["tasks"]
    assert (mine["owner"], mine["active"], mine["queries"], mine["traffic"]) == ("acme", 2, 13.0,
                                                                                 {"2": 0.75, "3": 0.25})
    rows = {v["version"]: v for v in mine["versions"]}
    assert {v: (r["state"], r["family"], r["accuracy"], r["share"], r["queries"]) for v, r in rows.items()} == {
        1: ("retiring", "f1", 0.91, 0.0, 1.0), 2: ("active", "f2", 0.95, 0.75, 10.0),
        3: ("held", "f3", 0.93, 0.25, 2.0), 4: ("building", "f4", 0.0, 0.0, 0.0)}
    assert rows[2]["sites"] == {"core": 4.0, "edge-a": 6.0} and rows[1]["retire_at"] == 1e9
    # a task whose record is gone keeps its traffic, owned by the tenant the counter names
    assert (old["owner"], old["active"], old["queries"]) == ("globex", None, 5.0)
    assert [(v["version"], v["state"], v["queries"]) for v in old["versions"]] == [(1, None, 5.0)]
    assert out["scrape_errors"] == {"mid": "HTTP 404"} and out["at"] == 5.0
    assert [t["task"] for t in summary([rec], [], sites, tenant="globex")["tasks"]] == ["old"]


@pytest.mark.parametrize(("key", "value", "why"), [
    ("versions/mine", {"task": "other", "owner": "acme"}, "not its key"),
    ("versions/mine", {"task": "mine", "owner": "acme", "active": 3, "versions": {}}, "active"),
    ("versions/mine", [1, 2], "object"),
    ("versions/mine", {"task": "mine", "owner": "acme", "versions": {"1": {"family": "f", "state": "odd"}}}, "state"),
])
def test_a_record_that_does_not_decode_is_one_value_error(key: str, value: Any, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        decode_record(key, value)
