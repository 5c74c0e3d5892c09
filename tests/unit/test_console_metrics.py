"""The console's reading of the agents' /metrics (issue 12 item 1's names): the text parser, the per-site
digest, histogram quantiles, counter rates across restarts, SLO attainment."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from console.digest import Sample, attainment, digest, histogram_quantile, parse_samples, rate
from edge_agent.metrics import AgentMetrics
from mesh.types import SLO, InferResponse, Timing

pytestmark = pytest.mark.unit

SAMPLE = (Path(__file__).resolve().parents[1] / "data" / "agent_metrics_sample.txt").read_text()


def test_parse_reads_every_sample_and_skips_comments() -> None:
    samples = parse_samples(SAMPLE)
    assert len(samples) == 24
    assert samples[0] == Sample("tiermesh_requests_total", {
        "task": "digit-classification", "tenant": "acme", "site": "edge-a", "variant": "mlp-tiny.onnx.int8",
        "outcome": "ok", "reason": "least_cost"}, 40.0)


@pytest.mark.parametrize(("line", "name", "labels", "value"), [
    ("up 1", "up", {}, 1.0),
    ("x_total{} 3 1700000000000", "x_total", {}, 3.0),
    ('m{a="q\\"uote",b="back\\\\slash",c="new\\nline"} -2.5e3', "m", {"a": 'q"uote', "b": "back\\slash",
                                                                     "c": "new\nline"}, -2500.0),
    ('m{le="+Inf",} +Inf', "m", {"le": "+Inf"}, math.inf),
    ('m{ a = "1" , b="2"} NaN', "m", {"a": "1", "b": "2"}, math.nan),
])
def test_parse_one_line(line: str, name: str, labels: dict[str, str], value: float) -> None:
    (s,) = parse_samples(line)
    assert s.name == name and s.labels == labels
    assert (math.isnan(s.value) and math.isnan(value)) or s.value == value


@pytest.mark.parametrize("bad", ["{a=\"1\"} 2", "m{a=1} 2", 'm{a="1" 2', "m", "m one"])
def test_parse_refuses_a_malformed_line(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_samples("ok 1\n" + bad)


def test_odd_label_values_do_not_break_a_scrape_and_decode_right() -> None:
    # \r and U+2028 end a line for str.splitlines (the hand parser's undoing), not for the format: only \n does;
    # an escaped \t is not one of the format's escapes (\\, \", \n) and stays as written, a raw tab is a tab
    text = ('# TYPE tiermesh_requests_total counter\n'
            'tiermesh_requests_total{tenant="cr\rlf",outcome="ls\u2028ps",task="a\\tb",site="tab\there",'
            'variant="n\\nl"} 7\n'
            'tiermesh_loaded_variants 2\n')
    samples = parse_samples(text)
    assert [s.name for s in samples] == ["tiermesh_requests_total", "tiermesh_loaded_variants"]
    assert samples[0].labels == {"tenant": "cr\rlf", "outcome": "ls\u2028ps", "task": "a\\tb",
                                 "site": "tab\there", "variant": "n\nl"}
    m = digest(samples)
    assert m.requests == {("cr\rlf", "ls\u2028ps"): 7.0} and m.loaded_variants == 2.0


def test_an_agents_own_exposition_round_trips() -> None:
    agent = AgentMetrics("edge-a")
    odd = "acme\r\u2028\t\\\"\n"  # a tenant name no topology allows: the exposition must survive it anyway
    agent.known(tasks=["t"], tenants=[odd], variants=["v"], sites=[])
    resp = InferResponse("r", {}, "edge-a", "v", 0.9, "local_ok", tenant=odd,
                         timing=Timing(network_ms=0.0, queue_ms=1.0, compute_ms=2.0, total_ms=4.0))
    agent.door_ok("t", odd, SLO.parse(100, 0.0, None, "latency"), resp)
    m = digest(parse_samples(agent.render().decode()))
    assert m.requests == {(odd, "ok"): 1.0} and m.p99_ms()["t"] > 0


def test_digest_of_an_agent() -> None:
    m = digest(parse_samples(SAMPLE))
    assert m.requests == {("acme", "ok"): 50.0, ("globex", "error"): 3.0}
    assert m.requests_total == 53.0
    assert m.slo[("acme", "interactive", "met")] == 45.0
    assert m.queue_depth == {"mlp-tiny.onnx.int8": 2.0}
    assert m.memory_bytes == {"mlp-tiny.onnx.int8": 1048576.0}
    assert m.loaded_variants == 1.0
    assert m.forwards == {"core": 10.0}
    assert m.peer_reachable == {"core": True, "mid": False}
    assert m.quota_rejections == {"globex": 3.0}
    # only the total component counts for p99: rank 49.5 of 50 falls in (0.05, 0.1]
    assert m.p99_ms() == {"digit-classification": pytest.approx(75.0)}
    assert {"requests_total", "slo_total", "request_latency_seconds"} <= m.seen


def test_an_agent_without_metrics_digests_to_no_data() -> None:
    m = digest(parse_samples("# nothing here\nprocess_cpu_seconds_total 1.5\n"))
    assert m.requests == {} and m.loaded_variants is None and m.p99_ms() == {} and not m.seen


@pytest.mark.parametrize(("q", "buckets", "want"), [
    (0.5, [(0.1, 10.0), (0.2, 20.0), (math.inf, 20.0)], 0.1),
    (0.75, [(0.1, 10.0), (0.2, 20.0), (math.inf, 20.0)], 0.15),
    (0.99, [(0.1, 10.0), (math.inf, 20.0)], 0.1),      # in +Inf: the highest finite bound
    (0.5, [(0.1, 0.0), (math.inf, 0.0)], None),        # no observations
    (0.5, [], None),
    (1.5, [(0.1, 1.0)], None),
])
def test_histogram_quantile(q: float, buckets: list[tuple[float, float]], want: float | None) -> None:
    got = histogram_quantile(q, buckets)
    assert got == (pytest.approx(want) if want is not None else None)


def test_rate_counts_a_restart_from_zero() -> None:
    assert rate(None, 5.0, 1.0) is None
    assert rate(10.0, 30.0, 2.0) == 10.0
    assert rate(30.0, 4.0, 2.0) == 2.0   # the agent restarted: 4 new since
    assert rate(1.0, 2.0, 0.0) is None


def test_attainment_by_tenant_and_class() -> None:
    got = attainment({("acme", "fast", "met"): 9.0, ("acme", "fast", "missed"): 1.0, ("b", "slow", "met"): 2.0,
                      ("b", "slow", "other"): 5.0})
    assert got == {"acme": {"fast": (9.0, 1.0)}, "b": {"slow": (2.0, 0.0)}}
