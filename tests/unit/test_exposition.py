"""edge_agent.exposition writes what prometheus_client writes: the same families, read back by prometheus_client's
own parser, for counters, gauges and histograms with awkward label values."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from edge_agent.exposition import counter, gauge, histogram, number

pytestmark = pytest.mark.unit

AWKWARD = ('a"b', "back\\slash", "new\nline", "ünï", "")
BUCKETS = [("0.005", 1.0), ("0.05", 3.0), ("+Inf", 4.0)]


def _parsed(text: str) -> list[tuple[str, str, str, list[tuple[str, dict[str, str], float]]]]:
    return [(f.name, f.type, f.documentation, [(s.name, s.labels, s.value) for s in f.samples])
            for f in text_string_to_metric_families(text)]


class _Families:
    def __init__(self, *fams: object) -> None:
        self.fams = fams

    def collect(self) -> object:
        return iter(self.fams)


def _reference() -> str:
    c = CounterMetricFamily("req", "Queries, by \\ and\nlines", labels=["tenant", "site"])
    g = GaugeMetricFamily("up", "1 if up", labels=["peer"])
    g0 = GaugeMetricFamily("inflight", "In flight", value=3)
    h = HistogramMetricFamily("lat_seconds", "Latency", labels=["task"])
    for i, v in enumerate(AWKWARD):
        c.add_metric([v, "edge"], i + 1)
        g.add_metric([v], float(i % 2))
        h.add_metric([v], BUCKETS, 0.25 * i)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Families(c, g, g0, h))  # type: ignore[arg-type]
    return generate_latest(reg).decode()


def test_families_read_back_as_prometheus_clients_do() -> None:
    ours = "".join((
        counter("req", "Queries, by \\ and\nlines", ("tenant", "site"),
                (((v, "edge"), i + 1) for i, v in enumerate(AWKWARD))),
        gauge("up", "1 if up", ("peer",), (((v,), float(i % 2)) for i, v in enumerate(AWKWARD))),
        gauge("inflight", "In flight", (), [((), 3)]),
        histogram("lat_seconds", "Latency", ("task",), (((v,), BUCKETS, 0.25 * i) for i, v in enumerate(AWKWARD))),
    ))
    assert _parsed(ours) == _parsed(_reference())


def test_numbers_and_mistakes() -> None:
    assert (number(1), number(0.1), number(math.inf), number(-math.inf), number(math.nan)) == \
        ("1.0", "0.1", "+Inf", "-Inf", "NaN")
    with pytest.raises(ValueError, match="labels"):
        counter("x", "x", ("a", "b"), [(("only-one",), 1)])
    with pytest.raises(ValueError, match=r"\+Inf"):
        histogram("h", "h", (), [((), [("0.1", 1.0)], 0.0)])
