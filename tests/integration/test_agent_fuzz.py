"""Hostile input at a live agent (in process, on the session etcd, serving the committed tiny MLP): for a
fixed budget hypothesis sends random and truncated ZeroMQ frames (from fresh peers and one long-lived
one) and random, truncated and lying HTTP bodies. The agent answers every HTTP body with a typed 4xx
(or, for a body that happens to be valid, an answer; never a 500, never a hang), logs garbage at a
bounded rate, its memory stays bounded, and it keeps serving real queries through both doors afterwards."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import time
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge_agent.agent import Agent
from edge_agent.agent_config import AgentConfig
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from mesh.types import SLO, InferRequest
from mesh.v2.body import HEADER_LENGTH, TENANT_HEADER
from mesh.zmq import protocol as wire
from mesh.zmq.client import ZmqClient
from tests.integration.test_quota_flood import BODY, TASK, _catalog, _topology
from topology.loader import load_topology_file
from topology.store_io import apply as apply_topology
from variant_store.blobs import BlobStore
from variant_store.catalog import Catalog
from variant_store.server import VariantStoreServer

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

SITE = "edge-fra-1"
BUDGET_S = 8.0             # per door
RSS_GROWTH_MAX = 96 << 20  # what the agent's process may grow by over the whole fuzz
MAX_BODY = 1 << 20


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _valid_frames() -> list[bytes]:
    req = InferRequest(task=TASK, inputs={"x": np.full((2, 64), 0.25, np.float32)}, slo=SLO(500.0),
                       request_id="fuzz-valid", deadline=time.monotonic() + 5.0, hops=["edge-par-1"])
    return [bytes(f) for f in wire.encode_request(req)]


VALID = _valid_frames()


@st.composite
def zmq_frames(draw: st.DrawFn) -> list[bytes]:
    kind = draw(st.sampled_from(["random", "truncated", "mutated", "frames"]))
    if kind == "random":
        return draw(st.lists(st.binary(max_size=2048), min_size=1, max_size=6))
    frames = [bytes(f) for f in VALID]
    if kind == "truncated":
        i = draw(st.integers(0, len(frames) - 1))
        frames[i] = frames[i][:draw(st.integers(0, max(0, len(frames[i]) - 1)))]
    elif kind == "mutated":
        i = draw(st.integers(0, len(frames) - 1))
        buf = bytearray(frames[i])
        for _ in range(draw(st.integers(1, 8))):
            if buf:
                buf[draw(st.integers(0, len(buf) - 1))] = draw(st.integers(0, 255))
        frames[i] = bytes(buf)
    else:  # frames dropped or added
        frames = frames[:draw(st.integers(0, len(frames)))] + draw(st.lists(st.binary(max_size=512), max_size=3))
    return frames or [b""]


@st.composite
def http_bodies(draw: st.DrawFn) -> tuple[bytes, dict[str, str]]:
    valid = json.dumps(BODY).encode()
    kind = draw(st.sampled_from(["random", "truncated", "json", "binary_header"]))
    headers = {TENANT_HEADER: "public"}
    if kind == "random":
        body = draw(st.binary(max_size=4096))
    elif kind == "truncated":
        body = valid[:draw(st.integers(0, len(valid) - 1))]
    elif kind == "json":
        shape = draw(st.lists(st.integers(-3, 1 << 40), max_size=4))
        data = draw(st.one_of(st.lists(st.floats(allow_nan=True), max_size=70), st.text(max_size=20), st.none()))
        dtype = draw(st.sampled_from(["FP32", "FP64", "INT8", "BYTES", "nope", ""]))
        params = draw(st.dictionaries(st.sampled_from(["latency_ms", "min_accuracy", "prefer", "max_cost", "trace"]),
                                      st.one_of(st.floats(allow_nan=True), st.text(max_size=8), st.booleans()),
                                      max_size=5))
        body = json.dumps({"inputs": [{"name": "x", "shape": shape, "datatype": dtype, "data": data}],
                           "parameters": params}).encode()
    else:  # the binary extension, with a header length that may lie
        header = valid[:draw(st.integers(0, len(valid)))]
        body = header + draw(st.binary(max_size=1024))
        headers[HEADER_LENGTH] = str(draw(st.integers(-5, len(body) + 10)))
    return body, headers


def _fuzz_zmq(endpoint: str, budget_s: float) -> int:
    ctx = zmq.Context()
    sent = 0
    stop_at = time.monotonic() + budget_s
    long_lived = ctx.socket(zmq.DEALER)
    long_lived.setsockopt(zmq.LINGER, 0)
    long_lived.connect(endpoint)

    @settings(max_examples=200, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(frames=zmq_frames(), fresh=st.booleans())
    def send(frames: list[bytes], fresh: bool) -> None:
        nonlocal sent
        if time.monotonic() > stop_at:
            return
        sock = long_lived
        if fresh:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
        try:
            sock.send_multipart(frames, flags=zmq.DONTWAIT)
            sent += 1
            while True:  # drain what it answered (errors for decodable ids), never block
                sock.recv_multipart(flags=zmq.DONTWAIT)
        except zmq.Again:
            pass
        finally:
            if fresh:
                sock.close(linger=0)

    try:
        while time.monotonic() < stop_at:
            send()
    finally:
        long_lived.close(linger=0)
        ctx.term()
    return sent


def _fuzz_http(url: str, budget_s: float) -> dict[int, int]:
    u = urlsplit(url)
    statuses: dict[int, int] = {}
    stop_at = time.monotonic() + budget_s

    @settings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=http_bodies())
    def post(case: tuple[bytes, dict[str, str]]) -> None:
        if time.monotonic() > stop_at:
            return
        body, headers = case
        conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=10)
        try:
            conn.request("POST", f"/v2/models/{TASK}/infer", body=body, headers=headers)
            resp = conn.getresponse()
            payload = resp.read()
        finally:
            conn.close()
        statuses[resp.status] = statuses.get(resp.status, 0) + 1
        assert resp.status < 500 or resp.status == 503, (resp.status, payload[:200], body[:200], headers)
        if resp.status >= 400:
            assert "code" in json.loads(payload), payload[:200]

    while time.monotonic() < stop_at:
        post()
    return statuses


async def _serves(agent: Agent, http_url: str) -> None:
    u = urlsplit(http_url)

    def one() -> int:
        conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=10)
        try:
            conn.request("POST", f"/v2/models/{TASK}/infer", body=json.dumps(BODY).encode(),
                         headers={TENANT_HEADER: "globex", "Content-Type": "application/json"})
            return conn.getresponse().status
        finally:
            conn.close()

    status = 0
    for _ in range(100):  # bounded: the first query loads the variant
        status = await asyncio.to_thread(one)
        if status == 200:
            break
        await asyncio.sleep(0.1)
    assert status == 200
    zc = ZmqClient()
    try:
        req = InferRequest(task=TASK, inputs={"x": np.full((1, 64), 0.25, np.float32)}, slo=SLO(1000.0),
                           tenant="globex", deadline=time.monotonic() + 5.0, hops=["edge-par-1"])
        resp = await zc.request(agent.zmq_endpoint, req)
        assert resp.site == SITE and resp.outputs
    finally:
        await zc.close()


async def test_random_frames_and_bodies_leave_the_agent_bounded_and_serving(
        store: Store, etcd_server: EmbeddedEtcd, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    await apply_topology(store, load_topology_file(_topology(tmp_path)))
    blobs = BlobStore(tmp_path / "blobs")
    await _catalog(store, blobs)
    cfg = AgentConfig(site=SITE, etcd=etcd_server.url, prefix=store.prefix, home=tmp_path / "home",
                      lease_ttl_s=2.0, max_body_bytes=MAX_BODY, insecure=True)
    async with VariantStoreServer(blobs, Catalog(store), host="127.0.0.1"), Agent(cfg) as agent:
        assert agent.zmq_server is not None
        await _serves(agent, agent.http_url)
        rss0 = _rss()
        caplog.set_level(logging.WARNING, logger="mesh.zmq")
        sent = await asyncio.to_thread(_fuzz_zmq, agent.zmq_endpoint, BUDGET_S)
        statuses = await asyncio.to_thread(_fuzz_http, agent.http_url, BUDGET_S)
        await _serves(agent, agent.http_url)
        grown = _rss() - rss0
        garbage = agent.zmq_server.garbage
        print(f"zmq: {sent} messages sent, {garbage.total} bad, {garbage.logged} logged; http statuses {statuses}; "
              f"RSS grew {grown / 2**20:.1f} MiB")
        assert sent > 200 and sum(statuses.values()) > 100
        # logged at most once per peer every 10 s: the long-lived peer's garbage mostly goes uncounted in the log
        zmq_warnings = [r for r in caplog.records if r.name == "mesh.zmq" and r.levelno >= logging.WARNING]
        assert 0 < garbage.logged < garbage.total and len(zmq_warnings) <= garbage.logged, \
            [(r.levelname, r.getMessage()) for r in zmq_warnings]
        assert grown < RSS_GROWTH_MAX, f"RSS grew {grown / 2**20:.1f} MiB"
        assert any(400 <= s < 500 for s in statuses)

