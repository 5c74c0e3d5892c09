"""The ``live/<site>`` record: one typed definition, written by agents and parsed once by readers."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from core_scheduler.state.heartbeat import DemandSample, Heartbeat, LoadedVariant
from core_scheduler.state.snapshot import site_load_from_record

pytestmark = pytest.mark.unit


def _beat() -> Heartbeat:
    return Heartbeat(site="edge-1", ts=1.5, tier="edge", hardware_class="cpu-x86", gpu=False,
                     endpoint="tcp://127.0.0.1:5555", curve_key="rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7",
                     http="http://127.0.0.1:8080",
                     loaded={"mlp-tiny": LoadedVariant(task="digits", queue_ms=1.25, queued_rows=3, served=7,
                                                       memory_bytes=123456)},
                     inflight=2, capacity=16, model_memory_budget_bytes=1000, memory_used_bytes=400,
                     demand=(DemandSample(task="digits", slo_class="tight-lo", tenant="acme", qps=4.0,
                                          budget_ms=20.0, min_accuracy=0.9),),
                     peer_rtt_ms={"core-1": 12.5})


def test_round_trip_through_json_is_exact() -> None:
    hb = _beat()
    wire = json.loads(json.dumps(hb.to_json()))
    assert wire["schema"] == 1 and wire["loaded"]["mlp-tiny"]["served"] == 7
    assert Heartbeat.from_json(wire) == hb


def test_demand_rows_travel_and_one_row_is_left_out() -> None:
    many = DemandSample(task="text", slo_class="loose-lo-x64", tenant="acme", qps=2.0, budget_ms=300.0,
                        min_accuracy=0.75, rows=64)
    hb = Heartbeat(site="e", demand=(*_beat().demand, many))
    wire = json.loads(json.dumps(hb.to_json()))
    assert "rows" not in wire["demand"][0] and wire["demand"][1]["rows"] == 64
    assert Heartbeat.from_json(wire).demand == hb.demand


def test_settling_travels_and_is_left_out_when_false() -> None:
    wire = json.loads(json.dumps(replace(_beat(), settling=True).to_json()))
    assert wire["settling"] is True and Heartbeat.from_json(wire).settling
    assert "settling" not in _beat().to_json() and not Heartbeat.from_json(_beat().to_json()).settling


def test_liveness_fields_are_added_without_touching_the_rest() -> None:
    hb = _beat().with_liveness(degraded=True, degraded_total_s=1.23456, degraded_episodes=2, lease_renewals=1)
    assert (hb.degraded, hb.degraded_total_s, hb.degraded_episodes, hb.lease_renewals) == (True, 1.235, 2, 1)
    assert hb.loaded == _beat().loaded


def test_unknown_fields_are_dropped_and_missing_ones_default() -> None:
    hb = Heartbeat.from_json({"site": "s", "future_field": {"x": 1}, "capacity": 0})
    assert hb.site == "s" and hb.loaded == {} and hb.demand == () and hb.curve_key is None
    assert hb.capacity == 1  # never zero: routing divides by it


@pytest.mark.parametrize("bad", [
    [],                                                    # not an object
    {"ts": 1.0},                                           # no site
    {"site": "s", "schema": 99},                           # a newer schema than this reader
    {"site": "s", "loaded": []},                           # wrong container
    {"site": "s", "loaded": {"v": {"queue_ms": 1.0}}},     # loaded variant without its task
    {"site": "s", "demand": [{"task": "t", "slo_class": "c", "qps": "many", "budget_ms": 1, "min_accuracy": 0}]},
    {"site": "s", "demand": [{"task": "t", "slo_class": "c", "qps": math.nan, "budget_ms": 1, "min_accuracy": 0}]},
    {"site": "s", "demand": [{"task": "t", "slo_class": "c", "qps": 1, "budget_ms": 1, "min_accuracy": 0,
                              "rows": 0}]},                 # a request of no rows
    {"site": "s", "demand": [{"task": "t", "slo_class": "c", "qps": 1, "budget_ms": 1, "min_accuracy": 0,
                              "rows": 2.5}]},
    {"site": "s", "inflight": "lots"},
    {"site": "s", "peer_rtt_ms": [1.0]},                   # RTTs by peer, not a list
    {"site": "s", "peer_rtt_ms": {"p": math.inf}},
])
def test_malformed_records_are_refused(bad: object) -> None:
    with pytest.raises((ValueError, TypeError, KeyError)):
        Heartbeat.from_json(bad)  # type: ignore[arg-type]


def test_site_load_reads_the_typed_record() -> None:
    load = site_load_from_record("edge-1", _beat())
    assert load.loaded == frozenset({"mlp-tiny"}) and load.queue_ms == {"mlp-tiny": 1.25}
    assert (load.inflight, load.capacity, load.memory_free_bytes) == (2, 16, 600)


def test_the_key_names_the_site_and_a_record_that_disagrees_is_refused() -> None:
    assert Heartbeat.from_json({"capacity": 4}, site="edge-2").site == "edge-2"
    with pytest.raises(ValueError, match="stored under"):
        Heartbeat.from_json({"site": "edge-1"}, site="edge-2")
