"""The console's HTTP client to the agents: ``/metrics`` and decision traces from each site's edge API, over
HTTPS with the console's admin certificate (plain HTTP when the mesh runs ``--insecure``).

Each call has a short timeout and reports failure as a value, never an exception: one dead or slow agent
must not hold up the view of the others.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from console.digest import SiteMetrics, digest
from console.promtext import parse_text
from mesh.lifecycle import Service

__all__ = ["Scrape", "Scraper"]

_TRACE_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:")


@dataclass(frozen=True, slots=True)
class Scrape:
    """One site's ``/metrics`` answer: ``metrics`` when it parsed; ``reachable`` False when the connection
    failed (refused, reset, timed out); ``error`` says what went wrong (a 404 means an agent without metrics)."""

    site: str
    at: float                      # monotonic
    reachable: bool
    metrics: SiteMetrics | None = None
    error: str | None = None


class Scraper(Service):
    def __init__(self, ssl_context: ssl.SSLContext | None, *, timeout_s: float = 1.5) -> None:
        self.ssl_context = ssl_context
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def _start(self) -> None:
        connector = aiohttp.TCPConnector(ssl=self.ssl_context if self.ssl_context is not None else False,
                                         limit_per_host=2)
        self._session = aiohttp.ClientSession(connector=connector, timeout=self.timeout)

    async def _stop(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("Scraper is not started")
        return self._session

    async def metrics(self, site: str, base_url: str) -> Scrape:
        now = time.monotonic()
        try:
            async with self.session.get(f"{base_url.rstrip('/')}/metrics") as resp:
                body = await resp.text()
                if resp.status != 200:
                    return Scrape(site, now, True, error=f"HTTP {resp.status}")
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return Scrape(site, now, False, error=f"{type(exc).__name__}: {exc}"[:200])
        try:
            return Scrape(site, now, True, metrics=digest(parse_text(body)))
        except ValueError as exc:
            return Scrape(site, now, True, error=f"unparseable metrics: {exc}"[:200])

    async def _json(self, url: str) -> tuple[int, Any]:
        try:
            async with self.session.get(url) as resp:
                if resp.status != 200:
                    return resp.status, None
                return 200, await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return 0, None

    async def trace(self, request_id: str, sites: dict[str, str]) -> tuple[str, dict[str, Any]] | None:
        """The trace of ``request_id`` from whichever agent answered it (each is asked at once):
        ``(site, trace)``, or None when no agent holds it."""
        if not request_id or len(request_id) > 128 or not set(request_id) <= _TRACE_ID_CHARS:
            raise ValueError(f"not a request id: {request_id[:40]!r}")
        names = sorted(sites)
        answers = await asyncio.gather(*(self._json(f"{sites[n].rstrip('/')}/v2/traces/{request_id}")
                                         for n in names))
        for name, (status, body) in zip(names, answers, strict=True):
            if status == 200 and isinstance(body, dict) and isinstance(body.get("hops"), list):
                return name, body
        return None

    async def recent_traces(self, sites: dict[str, str], limit: int = 20) -> list[dict[str, Any]]:
        """Trace summaries from every agent (``GET /v2/traces?limit=N``), each tagged with its ``site``."""
        names = sorted(sites)
        answers = await asyncio.gather(*(self._json(f"{sites[n].rstrip('/')}/v2/traces?limit={limit}")
                                         for n in names))
        out: list[dict[str, Any]] = []
        for name, (status, body) in zip(names, answers, strict=True):
            items = body.get("traces") if isinstance(body, dict) else body
            if status == 200 and isinstance(items, list):
                out.extend({**t, "site": t.get("site", name)} for t in items if isinstance(t, dict))
        out.sort(key=lambda t: -float(t.get("at_unix") or t.get("ts") or 0))
        return out[:limit]
