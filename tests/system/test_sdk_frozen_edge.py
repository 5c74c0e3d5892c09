"""Issue 31, Done-when: an SDK client's first edge is frozen (SIGSTOP) mid-workload; the client fails over to its
second edge, at least 95 % of its queries still meet their SLO, and no request id is answered twice.

The two edges are real ones in processes of their own (the V2 HTTP front over an ONNX data plane,
:mod:`tests.helpers_edge_proc`), so one can be stopped as a frozen host would be: alive to TCP (its kernel still
accepts connections and buffers requests), silent to everything. After SIGCONT the frozen edge's own log says what it
did with the queries it found waiting. One run of the workload (about 15 s) serves every test here.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from mesh.client import AsyncClient
from mesh.errors import MeshError
from tests.helpers_edge_proc import read_log, start_edge, stop_edge
from tests.helpers_models import trained_mlp_onnx

pytestmark = [pytest.mark.system, pytest.mark.timeout(120)]

TASK = "digit-classification"
SLO_MS = 150.0
WORKERS = 4
PACE_S = 0.02  # each worker's pause between queries: about 150 queries/s in all, not a flood of a 2-core box
# frozen from 1 s to 3.5 s; the run goes on long enough for the cool-down (doubling from ~1 s) to bring it back
FREEZE_AT_S, FROZEN_S, RUN_S = 1.0, 2.5, 9.0


@dataclass(frozen=True, slots=True)
class Record:
    request_id: str
    at_s: float
    took_ms: float
    site: str
    within_slo: bool
    error: str = ""

    @property
    def met(self) -> bool:
        return not self.error and self.within_slo and self.took_ms <= SLO_MS

    @property
    def frozen(self) -> bool:
        return FREEZE_AT_S <= self.at_s < FREEZE_AT_S + FROZEN_S


@dataclass(slots=True)
class Run:
    records: list[Record] = field(default_factory=list)
    edge_logs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # site -> what its data plane did


async def _workload(client: AsyncClient, x: np.ndarray, start: float, records: list[Record], seed: int) -> None:
    rng = np.random.default_rng(seed)
    while (now := time.monotonic()) - start < RUN_S:
        row = x[int(rng.integers(len(x)))][None, :]
        t0 = time.perf_counter()
        try:
            r = await client.infer(TASK, {"x": row}, latency_ms=SLO_MS, min_accuracy=0.9)
        except MeshError as exc:
            records.append(Record("", now - start, (time.perf_counter() - t0) * 1000.0, "", False, exc.code))
            continue
        records.append(Record(r.request_id, now - start, (time.perf_counter() - t0) * 1000.0, r.site,
                              r.within_slo))
        await asyncio.sleep(PACE_S)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def run(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Run]:
    tmp = tmp_path_factory.mktemp("sdk-failover")
    model = trained_mlp_onnx(tmp / "mlp.onnx")
    x = np.random.default_rng(0).random((64, 64)).astype(np.float32)
    logs = {name: tmp / f"{name}.jsonl" for name in ("edge-a", "edge-b")}
    out = Run()
    a, url_a = start_edge("edge-a", model, logs["edge-a"])
    try:
        b, url_b = start_edge("edge-b", model, logs["edge-b"])
    except BaseException:
        stop_edge(a)
        raise
    try:
        async with AsyncClient([url_a, url_b], timeout=5.0) as client:
            for url in (url_a, url_b):  # both edges' sessions warm
                async with AsyncClient(url, timeout=5.0) as one:
                    for _ in range(5):
                        await one.infer(TASK, {"x": x[:1]}, latency_ms=1000)
            for _ in range(5):
                await client.infer(TASK, {"x": x[:1]}, latency_ms=1000)

            async def freeze() -> None:
                await asyncio.sleep(FREEZE_AT_S)
                os.kill(a.pid, signal.SIGSTOP)
                await asyncio.sleep(FROZEN_S)
                os.kill(a.pid, signal.SIGCONT)

            start = time.monotonic()
            await asyncio.gather(freeze(), *(_workload(client, x, start, out.records, k) for k in range(WORKERS)))
        await asyncio.sleep(0.5)  # the thawed edge works through what it found waiting
    finally:
        stop_edge(a)
        stop_edge(b)
    out.edge_logs = {name: read_log(path) for name, path in logs.items()}
    recs = out.records
    frozen = [r for r in recs if r.frozen]
    print(f"\nqueries {len(recs)}, met {sum(r.met for r in recs) / max(1, len(recs)):.3f}; while frozen "
          f"{len(frozen)}, met {sum(r.met for r in frozen) / max(1, len(frozen)):.3f}, by site "
          f"{dict(Counter(r.site for r in frozen))}; errors {dict(Counter(r.error for r in recs if r.error))}; "
          f"slowest {max((r.took_ms for r in recs), default=0):.0f} ms")
    yield out


def test_a_frozen_first_edge_barely_shows(run: Run) -> None:
    recs = run.records
    frozen = [r for r in recs if r.frozen]
    assert len(recs) >= 300 and len(frozen) >= 100
    met = sum(r.met for r in recs) / len(recs)
    assert met >= 0.95, sorted((r.at_s, r.took_ms, r.site, r.error) for r in recs if not r.met)[:20]
    assert sum(r.met for r in frozen) / len(frozen) >= 0.9
    assert {r.site for r in frozen if not r.error} == {"edge-b"}
    thawed = FREEZE_AT_S + FROZEN_S
    assert "edge-a" in {r.site for r in recs if r.at_s >= thawed}  # tried again after its cool-down, and back
    # the nearest edge, while it answers: a query it was slow on (over a third of the budget: this 2-core box
    # descheduling it under a full test run) fails over as a silent one would, and costs edge-a a cool-down
    before = Counter(r.site for r in recs if r.at_s < FREEZE_AT_S and not r.error)
    assert before["edge-a"] >= 0.8 * sum(before.values()), before


def test_no_request_id_is_answered_twice(run: Run) -> None:
    answered = Counter(r.request_id for r in run.records if not r.error)
    assert answered and max(answered.values()) == 1  # the client: one answer per call, one id per query
    for site, entries in run.edge_logs.items():  # an edge never runs one id twice either
        ran = Counter(e["id"] for e in entries if e["what"] == "ran")
        assert max(ran.values()) == 1, site


def test_the_thawed_edge_does_not_run_what_its_client_abandoned(run: Run) -> None:
    # the edge charges a query that waited through its freeze from the freeze's start (edge_agent.stall_watch):
    # what its client gave up on is refused `deadline` on waking, not run. Only the freeze is asked about: a query
    # that edge-a, awake but slow (a loaded machine), was already running when its client gave up is run, as any
    # server runs what it started, and so is one sent in the instant before the SIGSTOP landed (0.1 s of margin)
    from_b = {r.request_id for r in run.records if r.site == "edge-b" and r.frozen and r.at_s >= FREEZE_AT_S + 0.1}
    late = [e for e in run.edge_logs["edge-a"] if e["what"] == "ran" and e["id"] in from_b]
    assert not late, late
