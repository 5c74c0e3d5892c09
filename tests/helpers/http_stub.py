"""An aiohttp application served on a free loopback port for the length of a ``with``: the stand-in agents and doors
of the console and jobs tests (one definition: they were written out in each)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

__all__ = ["metrics_app", "serve_app"]


@contextlib.asynccontextmanager
async def serve_app(app: web.Application) -> AsyncIterator[str]:
    """``app`` on 127.0.0.1 at a port of the kernel's choosing; yields its base URL; cleaned up on exit."""
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def metrics_app(text: bytes) -> web.Application:
    """An agent that answers ``GET /metrics`` with ``text``."""
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=text, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    return app
