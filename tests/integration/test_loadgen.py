"""The benchmarks' load generator runs in a process of its own and says what it really offered: a real
HTTP server in this process, the generator as ``python -m bench.loadgen``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from aiohttp import web

from bench.loadgen import LoadSpec, run_load

pytestmark = pytest.mark.integration


@pytest_asyncio.fixture
async def server() -> AsyncIterator[tuple[str, dict[str, int]]]:
    seen = {"n": 0, "slow": 0}

    async def echo(request: web.Request) -> web.Response:
        seen["n"] += 1
        body = await request.read()
        if request.headers.get("X-Slow"):
            seen["slow"] += 1
            await asyncio.sleep(0.2)
        if body == b"busy":
            return web.Response(status=503)
        return web.Response(body=body)

    app = web.Application()
    app.router.add_post("/e", echo)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/e", seen
    finally:
        await runner.cleanup()


@pytest.mark.asyncio
async def test_open_loop_offers_its_rate_and_counts_every_outcome(server: tuple[str, dict[str, int]]) -> None:
    url, seen = server
    res = await run_load(LoadSpec(url=url, bodies=[b"ok", b"busy"], headers={}, n=100, rate=100.0, slo_s=2.0,
                                  time_cap_s=20.0, extra={"cell": "a"}))
    assert res["cell"] == "a" and res["valid"] and res["sent"] == 100 == seen["n"]
    assert res["completed"] == 50 and res["rejected"] == 50        # round robin over the two bodies
    assert 90.0 <= res["achieved_rps"] <= 110.0 and res["offered_rps"] == 100.0


@pytest.mark.asyncio
async def test_a_rate_it_cannot_offer_is_marked_invalid(server: tuple[str, dict[str, int]]) -> None:
    """Replies take 200 ms and at most 4 may be outstanding: 1,000/s cannot be offered."""
    url, _ = server
    res = await run_load(LoadSpec(url=url, bodies=[b"x"], headers={"X-Slow": "1"}, n=400, rate=1000.0,
                                  max_inflight=4, slo_s=5.0, time_cap_s=20.0))
    assert not res["valid"] and res["not_sent"] > 0 and res["sent"] + res["not_sent"] == 400


@pytest.mark.asyncio
async def test_closed_loop_and_per_body_headers(server: tuple[str, dict[str, int]]) -> None:
    url, seen = server
    res = await run_load(LoadSpec(url=url, bodies=[b"a", b"b"], headers={}, body_headers=[{}, {"X-Slow": "1"}],
                                  n=20, mode="closed", concurrency=4, slo_s=5.0))
    assert res["valid"] and res["completed"] == 20 and seen["slow"] == 10 and res["offered_rps"] is None


def test_bad_specs_are_refused() -> None:
    for bad in (LoadSpec(url="u", bodies=[], headers={}, n=1), LoadSpec(url="u", bodies=[b"x"], headers={}, n=0),
                LoadSpec(url="u", bodies=[b"x"], headers={}, n=1, rate=0.0),
                LoadSpec(url="u", bodies=[b"x"], headers={}, n=1, body_headers=[{}, {}])):
        with pytest.raises(ValueError):
            LoadSpec.from_json(bad.to_json())
