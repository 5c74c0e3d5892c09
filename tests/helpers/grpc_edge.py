"""The edge's gRPC front on a loop thread of its own (tritonclient's sync client blocks its caller), with the
mutual-TLS side it shares with the REST front in an agent, for tests."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from edge_agent.dataplane import DataPlane
from edge_agent.grpc_api import EdgeGrpcServer
from edge_agent.mtls import EdgeTls


@contextmanager
def grpc_in_thread(dp: DataPlane, tls: EdgeTls | None = None, **kwargs: Any) -> Iterator[EdgeGrpcServer]:
    """An ``EdgeGrpcServer`` over ``dp`` on 127.0.0.1 (and ``tls``, started and stopped here), stopped and its
    thread joined even on failure."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="edge-grpc-test", daemon=True)
    thread.start()
    server = EdgeGrpcServer(dp, "127.0.0.1", tls=tls, **kwargs)

    async def start() -> None:
        if tls is not None:
            await tls.start()
        await server.start()

    async def stop() -> None:
        try:
            await server.stop()
        finally:
            if tls is not None:
                await tls.stop()

    try:
        asyncio.run_coroutine_threadsafe(start(), loop).result(30)
        yield server
    finally:
        try:
            asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(30)
            loop.close()
