"""The console's aiohttp application: one page (``static/index.html`` and its script) and a small JSON API
behind the admin gate (:mod:`console.auth`):

    GET /                       the page (live map, placements and events, tenants, traces, topology)
    GET /static/...             its script, styles and the vendored libraries (``static/vendor``, with licences)
    GET /api/state              the current snapshot (:class:`console.state.ConsoleState`)
    GET /api/stream             server-sent events: one ``state`` event per new snapshot, comments as keep-alive
    GET /api/topology           the applied topology as YAML, and the record of the last apply (its diff)
    GET /api/traces?limit=N     recent trace summaries from every live agent
    GET /api/traces/{id}        one request's decision trace, from the agent that answered it (404 if none has it)
    GET /api/jobs[?tenant=T]    offline jobs per tenant: counts by state, progress, the sites at work (console.jobs)
    GET /api/builds[?tenant=T]  tenants' model builds: state, stage, progress, each variant's results (console.builds)
    GET /api/cascades           calibrated cascades per task, broken entries, escalation per site (console.cascades)
    GET /api/pipelines          pipelines as declared, queries by outcome, per-stage latency (console.pipelines)
    GET /api/versions[?tenant=T]  tenant tasks' versions: state, family, accuracy, share, queries (console.versions)
    GET /api/whoami             the admin's name

``extra_routes`` mounts more handlers behind the same gate (the scheduler's ``/metrics``).
"""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from ruamel.yaml import YAML

from console import builds as builds_view
from console import cascades as cascades_view
from console import pipelines as pipelines_view
from console import versions as versions_view
from console.auth import ADMIN, AdminGate
from console.jobs import summary
from console.scrape import Scraper
from console.state import ConsoleState
from core_scheduler.state.builds import BuildBook
from core_scheduler.state.jobs import JobBook
from mesh.errors import StoreError
from variant_store.cascade_catalog import read_cascades

__all__ = ["STATIC_DIR", "Route", "make_app"]

STATIC_DIR = Path(__file__).resolve().parent / "static"
Route = tuple[str, str, Callable[[web.Request], Awaitable[web.StreamResponse]]]
STATE: web.AppKey[ConsoleState] = web.AppKey("state", ConsoleState)
SCRAPER: web.AppKey[Scraper] = web.AppKey("scraper", Scraper)
CLOSING: web.AppKey[asyncio.Event] = web.AppKey("closing", asyncio.Event)
KEEPALIVE_S = 15.0


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS), status=status,
                        content_type="application/json")


async def _index(request: web.Request) -> web.StreamResponse:
    request.app[STATE].touch()
    return web.FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-store"})


async def _state(request: web.Request) -> web.Response:
    request.app[STATE].touch()
    return _json(request.app[STATE].snapshot)


async def _whoami(request: web.Request) -> web.Response:
    return _json({"admin": request[ADMIN]})


async def _stream(request: web.Request) -> web.StreamResponse:
    state, closing = request.app[STATE], request.app[CLOSING]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store",
                                       "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    version = -1
    state.touch()
    state.viewers += 1
    closed = asyncio.ensure_future(closing.wait())
    # ends when the client goes (a failed write) or the server closes (at once: the wait races `closed`)
    try:
        while not closing.is_set():
            newer = asyncio.ensure_future(state.wait_newer(version, KEEPALIVE_S))
            await asyncio.wait({newer, closed}, return_when=asyncio.FIRST_COMPLETED)
            if not newer.done():
                newer.cancel()
                await asyncio.gather(newer, return_exceptions=True)
                break
            snap = newer.result()
            try:
                if snap["version"] > version:
                    version = snap["version"]
                    await resp.write(b"event: state\ndata: " + orjson.dumps(snap, option=orjson.OPT_NON_STR_KEYS)
                                     + b"\n\n")
                else:
                    await resp.write(b": keep-alive\n\n")
            except (ConnectionResetError, RuntimeError):
                break
    finally:
        state.viewers -= 1
        state.touch()  # a page reconnecting its stream finds the loop still quick
        closed.cancel()
        await asyncio.gather(closed, return_exceptions=True)
    return resp


def _yaml(data: Any) -> str:
    yaml = YAML()
    yaml.default_flow_style = None
    buf = io.StringIO()
    yaml.dump(data, buf)
    return buf.getvalue()


async def _topology(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.touch()
    topo = state.view.topology
    return _json({"yaml": _yaml(topo.to_dict()) if topo is not None else None, "last_apply": state.last_apply})


async def _traces(request: web.Request) -> web.Response:
    try:
        limit = max(1, min(200, int(request.query.get("limit", "20"))))
    except ValueError:
        return _json({"error": "limit must be an integer", "code": "bad_request"}, 400)
    state = request.app[STATE]
    return _json({"traces": await request.app[SCRAPER].recent_traces(state.live_urls(), limit)})


async def _trace(request: web.Request) -> web.Response:
    state = request.app[STATE]
    request_id = request.match_info["request_id"]
    try:
        found = await request.app[SCRAPER].trace(request_id, state.live_urls())
    except ValueError as exc:
        return _json({"error": str(exc), "code": "bad_request"}, 400)
    if found is None:
        return _json({"error": f"no live agent holds a trace of {request_id!r} (not traced, too old, or the "
                               f"agent that answered it is gone)", "code": "not_found"}, 404)
    site, trace = found
    return _json({"answered_by": site, **trace})


def _per_tenant(noun: str, read: Callable[[Any, str | None], Awaitable[list[Any]]],
                summarize: Callable[[list[Any], Iterable[str]], dict[str, Any]]
                ) -> Callable[[web.Request], Awaitable[web.Response]]:
    """A per-tenant view of tracked work in etcd (``?tenant=T``): jobs, builds. 503 when etcd does not answer; 404
    for a tenant neither the topology nor any record names."""

    async def handler(request: web.Request) -> web.Response:
        state = request.app[STATE]
        state.touch()
        tenant = request.query.get("tenant")
        try:
            views = await read(state.store, tenant)
        except StoreError as exc:
            return _json({"error": f"etcd did not answer: {exc}", "code": exc.code}, 503)
        known = set(state.view.tenants)
        if tenant is not None and tenant not in known and not views:
            return _json({"error": f"no tenant {tenant[:64]!r} in the topology, and no {noun} of one",
                          "code": "not_found"}, 404)
        return _json(summarize(views, [tenant] if tenant is not None else known))

    return handler


_jobs = _per_tenant("job", lambda store, tenant: JobBook(store).views(tenant), summary)
_builds = _per_tenant("build", lambda store, tenant: BuildBook(store).views(tenant), builds_view.summary)


async def _cascades(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.touch()
    try:
        reading = await read_cascades(state.store)
    except StoreError as exc:
        return _json({"error": f"etcd did not answer: {exc}", "code": exc.code}, 503)
    sites, errors = await cascades_view.scrape(request.app[SCRAPER], state.live_urls())
    return _json(cascades_view.summary(reading.cascades, reading.broken, sites, errors, time.time()))


async def _pipelines(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.touch()
    sites, errors = await pipelines_view.scrape(request.app[SCRAPER], state.live_urls())
    return _json(pipelines_view.summary(state.view.pipelines, sites, errors, time.time()))


async def _versions(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.touch()
    tenant = request.query.get("tenant")
    try:
        reading = await versions_view.read_records(state.store)
    except StoreError as exc:
        return _json({"error": f"etcd did not answer: {exc}", "code": exc.code}, 503)
    sites, errors = await versions_view.scrape(request.app[SCRAPER], state.live_urls())
    out = versions_view.summary(reading.records, reading.broken, sites, errors, time.time(), tenant)
    if tenant is not None and tenant not in state.view.tenants and not out["tasks"]:
        return _json({"error": f"no tenant {tenant[:64]!r} in the topology, and no versioned task of one",
                      "code": "not_found"}, 404)
    return _json(out)


def make_app(state: ConsoleState, scraper: Scraper, gate: AdminGate, closing: asyncio.Event,
             extra_routes: Sequence[Route] = ()) -> web.Application:
    app = web.Application(middlewares=[gate.middleware])
    app[STATE], app[SCRAPER], app[CLOSING] = state, scraper, closing
    app.router.add_get("/", _index)
    app.router.add_static("/static", STATIC_DIR, follow_symlinks=False)
    app.router.add_get("/api/state", _state)
    app.router.add_get("/api/stream", _stream)
    app.router.add_get("/api/topology", _topology)
    app.router.add_get("/api/traces", _traces)
    app.router.add_get("/api/traces/{request_id}", _trace)
    app.router.add_get("/api/whoami", _whoami)
    app.router.add_get("/api/jobs", _jobs)
    app.router.add_get("/api/builds", _builds)
    app.router.add_get("/api/cascades", _cascades)
    app.router.add_get("/api/pipelines", _pipelines)
    app.router.add_get("/api/versions", _versions)
    for method, path, handler in extra_routes:
        app.router.add_route(method, path, handler)
    return app
