"""Overhead against the floors: ``mesh_hop``, the floor measured in the same run, interleaved in rounds
(the shared pieces in :mod:`bench.floors`).

* ``mesh_hop``: ``ZmqClient.request`` -> ``ZmqServer`` echoing the tensor as an ``InferResponse``
  (wire codec both ways) vs a bare ``zmq.asyncio`` DEALER -> ROUTER echo of the same bytes; and the
  same with CURVE (``mesh.zmq.curve``: site keys bound to certificates, ZAP handler, per-request peer
  check) vs a bare echo whose two sockets use CURVE keys (the cost of encryption itself is in both).

Latency is one request in flight; throughput is a closed loop at a fixed concurrency, bounded in
count and time. Both side and floor share one event loop, as they would in an agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from bench.common import RunContext, target, write_result
from bench.floors import CONCURRENCY, PAYLOADS, echo_handler, latency_row, payload, plot_rows, throughput_row
from mesh.pki.curve import CurveKeyPair
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from mesh.types import SLO, InferRequest, InferResponse
from mesh.zmq.client import ZmqClient
from mesh.zmq.curve import CurveSecurity
from mesh.zmq.server import ZmqServer
from mesh.zmq.site_keys import SiteKeys

__all__ = ["run_mesh_hop"]


class _BareZmqEcho:
    """The floor: a ROUTER that sends every message straight back, and a DEALER whose replies are
    matched first-in first-out (one ROUTER loop and one TCP stream keep them in order)."""

    def __init__(self, curve: tuple[CurveKeyPair, CurveKeyPair] | None = None) -> None:
        self.ctx = zmq.asyncio.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        if curve is not None:  # (server, client) key pairs
            self.router.setsockopt(zmq.CURVE_SERVER, 1)
            self.router.setsockopt(zmq.CURVE_SECRETKEY, curve[0].secret)
            self.dealer.setsockopt(zmq.CURVE_SERVERKEY, curve[0].public)
            self.dealer.setsockopt(zmq.CURVE_PUBLICKEY, curve[1].public)
            self.dealer.setsockopt(zmq.CURVE_SECRETKEY, curve[1].secret)
        self.router.bind("tcp://127.0.0.1:0")
        self.dealer.connect(self.router.getsockopt_string(zmq.LAST_ENDPOINT))
        self._pending: deque[asyncio.Future[list[zmq.Frame]]] = deque()
        self._tasks = [asyncio.create_task(self._echo()), asyncio.create_task(self._receive())]

    async def _echo(self) -> None:
        while True:
            msg = await self.router.recv_multipart(copy=False)
            await self.router.send_multipart(msg, copy=False)

    async def _receive(self) -> None:
        while True:
            msg = await self.dealer.recv_multipart(copy=False)
            fut = self._pending.popleft()
            if not fut.done():
                fut.set_result(msg)

    async def call(self, payload: memoryview) -> list[zmq.Frame]:
        fut: asyncio.Future[list[zmq.Frame]] = asyncio.get_running_loop().create_future()
        self._pending.append(fut)
        await self.dealer.send_multipart([payload], copy=False)
        return await asyncio.wait_for(fut, 10.0)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.ctx.destroy(linger=0)


@contextlib.asynccontextmanager
async def _curve_ends() -> AsyncIterator[tuple[ZmqServer, ZmqClient, _BareZmqEcho]]:
    """A CURVE mesh hop as an agent runs it (a CA, a site certificate binding its key, the ZAP handler, the
    per-request peer check) and the bare CURVE echo with the same keys. The site dials its own port: its
    server and client share one ``CurveSecurity`` and so one context, as the plain hop's ends share one."""
    with tempfile.TemporaryDirectory(prefix="bench-curve-") as tmp:
        pki = LocalPki.under(tmp)
        pki.init()
        site = Identity("site", "core")
        pki.issue(site)
        keys = pki.curve(site)
        security = CurveSecurity(keys, SiteKeys(pki.paths, site=site.name))  # it dials itself: its own key
        server = ZmqServer(echo_handler, security=security)
        client = ZmqClient(security=security, server_key_for=lambda _ep, _lost: keys.public)
        floor = _BareZmqEcho((keys, keys))
        try:
            await server.start()
            yield server, client, floor
        finally:
            await client.close()
            await server.stop()
            await floor.close()


async def run_mesh_hop(ctx: RunContext) -> Path:
    rows: list[dict[str, Any]] = []
    floor = _BareZmqEcho()
    server = ZmqServer(echo_handler)
    client = ZmqClient()
    try:
        await server.start()
        await _hop_rows(ctx, rows, server, client, floor, PAYLOADS)
    finally:
        await client.close()
        await server.stop()
        await floor.close()
    async with _curve_ends() as (cserver, cclient, cfloor):
        await _hop_rows(ctx, rows, cserver, cclient, cfloor, {"1 KB": 1024}, prefix="CURVE ")
    limits = {"1 KB": 1.3, "100 KB": 1.15, "CURVE 1 KB": 1.15}
    targets = [target(f"mesh hop / bare zmq echo, median latency, {r['case']}", r["ratio"], limits[r["case"]],
                      unit="x") for r in rows if r["metric"] == "latency"]
    plot_rows(ctx, "mesh_hop", "Mesh hop (ZmqClient -> ZmqServer) vs bare zmq.asyncio DEALER/ROUTER echo", rows)
    return write_result(ctx, "mesh_hop", rows, targets, notes=(
        "system = ZmqClient.request -> ZmqServer echo handler (msgpack header + raw tensor frame both ways); "
        "floor = bare zmq.asyncio DEALER -> ROUTER echo of the tensor bytes as one frame. One event loop, "
        f"latency with one request in flight, throughput at concurrency {CONCURRENCY}. 'CURVE' cases: both "
        "sides encrypt with CURVE; the mesh side also runs the ZAP handler and the per-request peer check. Both "
        "sides one context each (a site dialling its own port: an agent's server and client share one)."))


async def _hop_rows(ctx: RunContext, rows: list[dict[str, Any]], server: ZmqServer, client: ZmqClient,
                    floor: _BareZmqEcho, payloads: dict[str, int], prefix: str = "") -> None:
    rounds, per_round = ctx.pick(8, 30), ctx.pick(100, 200)
    tp_total, tp_rounds = ctx.pick(2000, 8000), ctx.pick(3, 5)
    endpoint = server.endpoint
    for label, nbytes in payloads.items():
        arr = payload(nbytes)
        raw = arr.reshape(-1).view(np.uint8).data

        async def hop(arr: np.ndarray = arr) -> InferResponse:
            req = InferRequest(task="echo", inputs={"x": arr}, slo=SLO(10_000.0),
                               deadline=time.monotonic() + 10.0)
            return await client.request(endpoint, req)

        async def bare(raw: memoryview = raw) -> list[zmq.Frame]:
            return await floor.call(raw)

        check = await hop()
        if not np.array_equal(check.outputs["y"], arr):
            raise AssertionError("mesh hop echo returned different bytes")
        case = prefix + label
        rows.append(await latency_row(case, {"floor": bare, "system": hop}, rounds, per_round))
        rows.append(await throughput_row(case, {"floor": bare, "system": hop}, tp_total, tp_rounds))
