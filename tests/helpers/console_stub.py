"""A console over a real store with stand-in agents: each serves ``/metrics`` and has a heartbeat in etcd, so the
console scrapes it as a live site (one definition for the console tests that each wrote it out)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping

from console import ConsoleConfig, ConsoleServer
from core_scheduler.state.heartbeat import Heartbeat
from mesh.etcd.keys import live_key
from mesh.etcd.store import Store
from tests.helpers.http_stub import metrics_app, serve_app
from topology.loader import parse_topology
from topology.store_io import apply

__all__ = ["console_with_agents"]


@contextlib.asynccontextmanager
async def console_with_agents(store: Store, topology: str, token: str,
                              agents: Mapping[str, tuple[str, bytes]]) -> AsyncIterator[ConsoleServer]:
    """``topology`` applied, one stand-in agent per ``agents`` entry (site -> (tier, its /metrics text)), and a
    console serving with ``token``; everything stopped on exit."""
    await apply(store, parse_topology(topology), source=topology)
    async with contextlib.AsyncExitStack() as stack:
        for site, (tier, text) in agents.items():
            url = await stack.enter_async_context(serve_app(metrics_app(text)))
            await store.put(live_key(site), Heartbeat(site=site, http=url, tier=tier, capacity=8).to_json())
        server = ConsoleServer(store, ConsoleConfig(token=token, tick_s=0.2))
        await server.start()
        try:
            yield server
        finally:
            await server.stop()
