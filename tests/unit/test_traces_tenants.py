"""The door's trace store against a hostile tenant (issue 29): traces are keyed by (tenant, request id) and bounded
per tenant, a query refused before it was admitted leaves none, and the ids the mesh makes are random."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import numpy as np
import orjson
import pytest

from core_scheduler.policy.quota import QuotaLimit
from core_scheduler.policy.routing import RoutingTable
from edge_agent.demand import DemandMeter
from edge_agent.quota import DoorQuotas
from edge_agent.site_dataplane import SiteDataPlane
from edge_agent.traces import TraceStore
from mesh.errors import QuotaExceeded, RequestError
from mesh.tracecontext import new_traceparent
from mesh.types import MAX_REQUEST_ID, SLO, InferRequest, TaskSignature, TensorSpec, new_request_id
from tests.unit.test_paths_retry import FakeZmq
from tests.unit.test_routing import ALL, snap

pytestmark = pytest.mark.unit


def _hops(candidates: int) -> list[dict[str, Any]]:
    """One hop record holding ``candidates`` candidates (what makes a trace big)."""
    cand = {"site": "core", "variant": "big.fp32", "network_ms": 1.0, "queue_ms": 0.0, "compute_ms": 2.0,
            "load_ms": 0.0, "cost": 0.5, "feasible": True, "why_not": None}
    return [{"site": "edge", "role": "edge", "at_unix": 1.0, "candidates": [cand] * candidates,
             "choice": None, "timings_ms": {"network": 0.0, "queue": 0.0, "compute": 0.0, "total": 0.0}}]


def test_a_request_id_names_a_trace_only_within_its_tenant() -> None:
    store = TraceStore(10)
    store.add("r-1", "a" * 32, "acme", "digits", "ok", [])
    store.add("r-1", "b" * 32, "globex", "digits", "ok", [])  # globex picks acme's id: a trace of its own
    acme, globex = store.get("r-1", "acme"), store.get("r-1", "globex")
    assert acme is not None and acme["trace_id"] == "a" * 32 and acme["tenant"] == "acme"
    assert globex is not None and globex["trace_id"] == "b" * 32
    assert store.get("r-1", "initech") is None
    found = store.get("r-1")  # a reader of every tenant's (admin): the newest of that id
    assert found is not None and found["tenant"] == "globex"
    store.add("r-1", "c" * 32, "acme", "digits", "ok", [])  # a tenant replaces only its own
    assert len(store) == 2 and store.get("r-1", "acme")["trace_id"] == "c" * 32  # type: ignore[index]
    assert store.get("r-1", "globex")["trace_id"] == "b" * 32  # type: ignore[index]
    assert [t["tenant"] for t in store.recent(10)] == ["acme", "globex"]
    assert [t["tenant"] for t in store.recent(10, "globex")] == ["globex"]


def test_a_trace_is_found_by_its_trace_id_within_its_tenant() -> None:
    """A result carries ``trace_id``, and the README says to read the trace by it: it names the trace too, within
    the caller's tenant (an admin's reader any), and stops naming it once the trace is replaced or evicted."""
    store = TraceStore(3)
    store.add("r-1", "a" * 32, "acme", "digits", "ok", [])
    store.add("r-2", "b" * 32, "globex", "digits", "ok", [])
    found = store.get("a" * 32, "acme")
    assert found is not None and found["request_id"] == "r-1"
    assert store.get("a" * 32, "globex") is None  # another tenant's trace id names nothing
    assert store.get("b" * 32) is not None and store.get("b" * 32)["tenant"] == "globex"  # type: ignore[index]
    assert store.get("r-1", "acme") is found  # the request id still works
    store.add("r-1", "c" * 32, "acme", "digits", "ok", [])  # replaced: the old trace id names nothing
    assert store.get("a" * 32, "acme") is None and store.get("c" * 32, "acme") is not None
    for i in range(3):  # evicted: nor does its trace id
        store.add(f"n-{i}", f"{i}" * 32, "acme", "digits", "ok", [])
    assert store.get("c" * 32, "acme") is None and store.get("2" * 32, "acme") is not None


def test_a_flooding_tenant_evicts_its_own_traces_not_anothers() -> None:
    store = TraceStore(100)
    for i in range(5):
        store.add(f"acme-{i}", "t", "acme", "digits", "ok", [])
    for i in range(10_000):
        store.add(f"flood-{i}", "t", "mallory", "digits", "ok", [])
    assert len(store) == 100
    assert all(store.get(f"acme-{i}", "acme") is not None for i in range(5))
    assert store.get("flood-9999", "mallory") is not None and store.get("flood-0", "mallory") is None
    # a per-tenant count bound holds even while the store has room
    small = TraceStore(100, tenant_capacity=10)
    for i in range(50):
        small.add(f"r{i}", "t", "mallory", "digits", "ok", [])
    assert len(small) == 10 and [t["request_id"] for t in small.recent(1)] == ["r49"]


def test_bytes_are_bounded_in_all_and_per_tenant() -> None:
    store = TraceStore(1000, max_bytes=400_000, tenant_bytes=100_000)
    for i in range(5):
        store.add(f"acme-{i}", "t", "acme", "digits", "ok", _hops(60))
    for i in range(2000):
        store.add(f"m-{i}", "t", "mallory", "digits", "ok", _hops(60))

    def held(tenant: str) -> int:
        return sum(len(orjson.dumps(store.get(t["request_id"], tenant))) for t in store.recent(1000, tenant))

    assert 0 < held("mallory") <= 100_000 and store.nbytes == held("mallory") + held("acme") <= 400_000
    assert all(store.get(f"acme-{i}", "acme") is not None for i in range(5))
    # a trace larger than a tenant may hold, and an id longer than any the door admits, are not kept
    assert store.add("huge", "t", "acme", "digits", "ok", _hops(2000)) is None
    assert store.add("x" * (MAX_REQUEST_ID + 1), "t", "acme", "digits", "ok", []) is None
    assert store.get("huge", "acme") is None and len(store.recent(1000, "acme")) == 5


def test_the_store_tells_a_wrong_bound() -> None:
    for kwargs in ({"capacity": 0}, {"tenant_capacity": 0}, {"max_bytes": 0}, {"tenant_bytes": 0}):
        with pytest.raises(ValueError):
            TraceStore(**kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------- the door stores only what it admitted

SIG = TaskSignature("digits", (TensorSpec("x", "float32", (-1, 4)),), (TensorSpec("y", "float32", (-1,)),))


def _door(quota: DoorQuotas) -> tuple[SiteDataPlane, TraceStore]:
    # edge-b holds nothing: an admitted query is forwarded (FakeZmq answers it)
    table = RoutingTable.build(snap(ALL, site_over={"edge-b": {"memory_mb": 0}}), "edge-b")
    view = SimpleNamespace(live={s: object() for s in ("edge-a", "edge-b", "mid", "core")},
                           signatures={"digits": SIG}, variants={"digits": {}}, topology=None)
    traces = TraceStore(10)
    dp = SiteDataPlane("edge-b", view, None, FakeZmq({}), table=lambda: table,  # type: ignore[arg-type]
                       peer_endpoint=lambda s: f"tcp://{s}", demand=DemandMeter(), quota=quota, traces=traces)
    return dp, traces


def _traced(tenant: str, rid: str, x: np.ndarray | None = None) -> InferRequest:
    req = InferRequest.entering("digits", {"x": np.zeros((1, 4), np.float32) if x is None else x},
                                SLO(2000.0, 0.9), tenant, rid)
    req.traceparent = new_traceparent()  # it asked for its trace
    return req


async def test_a_query_refused_before_it_was_admitted_leaves_no_trace() -> None:
    quota = DoorQuotas()
    quota.update({"mallory": QuotaLimit(qps=0.0, burst=1.0)})  # one query, then never again
    dp, traces = _door(quota)
    await dp.infer(_traced("mallory", "first"))
    assert traces.get("first", "mallory") is not None  # admitted and served: traced
    for i in range(20):
        with pytest.raises(QuotaExceeded):
            await dp.infer(_traced("mallory", f"refused-{i}"))
    with pytest.raises(RequestError):  # inputs refused at the door, before the quota
        await dp.infer(_traced("mallory", "bad", np.zeros((1, 3), np.float32)))
    assert len(traces) == 1, traces.recent(100)
    assert dp.metrics.render().count(b"quota_exceeded") >= 1  # still counted, as every refusal is


def _shared(a: str, b: str) -> int:
    """How many leading characters ``a`` and ``b`` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_request_ids_the_mesh_makes_are_random_and_differ_in_forked_processes() -> None:
    ids = [new_request_id() for _ in range(1000)]
    assert len(set(ids)) == 1000 and all(re.fullmatch(r"[0-9a-f]{24}", i) for i in ids)
    # consecutive ids share no prefix beyond chance (a counter after a prefix did: it showed others' volume)
    assert max(_shared(a, b) for a, b in itertools.pairwise(ids)) < 8
    # agents are forked from one process (tiermesh.launcher): each child draws its own ids
    code = ("import os, sys\nfrom mesh.types import new_request_id\nnew_request_id()\nr, w = os.pipe()\n"
            "pid = os.fork()\nif pid == 0:\n    os.write(w, new_request_id().encode()); os._exit(0)\n"
            "os.waitpid(pid, 0)\nprint(os.read(r, 64).decode(), new_request_id())\n")
    child, parent = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                   timeout=60).stdout.split()
    assert _shared(child, parent) < 8, (child, parent)


def test_a_caller_chosen_id_is_bounded_where_the_query_enters() -> None:
    x = {"x": np.zeros((1, 4), np.float32)}
    assert InferRequest.entering("digits", x, SLO(10.0), "acme", "k" * MAX_REQUEST_ID).request_id == "k" * 128
    for bad in ("k" * (MAX_REQUEST_ID + 1), "line\nbreak", "x" * 1_000_000):
        with pytest.raises(RequestError, match=f"at most {MAX_REQUEST_ID} printable characters"):
            InferRequest.entering("digits", x, SLO(10.0), "acme", bad)
