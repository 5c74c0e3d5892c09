"""The client tells its caller how late this process got to a reply (``ReplyWait``): the part of a forward's
time that was the door's own (its loop busy with other work when the reply came: a CPU quota's stall, TLS
handshakes, other requests), which ``edge_agent.paths`` takes out of the path's learnt overhead (issue 30).
Real ZeroMQ on loopback."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

from mesh.types import SLO, InferRequest, InferResponse
from mesh.zmq.client import ReplyWait, ZmqClient
from mesh.zmq.server import ZmqServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
STALL_S = 0.08


def _req() -> InferRequest:
    return InferRequest(task="echo", inputs={"x": np.ones(4, np.float32)}, slo=SLO(1000.0), tenant="acme",
                        deadline=time.monotonic() + 10.0, hops=["edge-a"])


async def _echo(req: InferRequest) -> InferResponse:
    return InferResponse(request_id=req.request_id, outputs=dict(req.inputs), site="core", variant="echo",
                         accuracy=1.0, reason="local", tenant=req.tenant, hops=[*req.hops, "core"])


async def test_the_loops_own_delay_in_getting_to_a_reply_is_measured() -> None:
    server = ZmqServer(_echo)
    await server.start()
    client = ZmqClient()
    on_reply = client._on_reply
    stall_s = [0.0]

    def busy_loop(peer: Any, msg: list[Any]) -> None:
        # other work this loop must run first, queued before the reply wakes its caller
        if stall_s[0]:
            asyncio.get_running_loop().call_soon(time.sleep, stall_s[0])
        on_reply(peer, msg)

    client._on_reply = busy_loop  # type: ignore[method-assign]
    try:
        prompt = ReplyWait()
        await client.request(server.endpoint, _req(), wait=prompt)
        stall_s[0] = STALL_S
        late = ReplyWait()
        t0 = time.monotonic()
        await client.request(server.endpoint, _req(), wait=late)
        took = time.monotonic() - t0
        assert STALL_S <= late.lag_s <= took
        assert prompt.lag_s < late.lag_s - STALL_S / 2
    finally:
        await client.close()
        await server.stop()
