"""The edge's Open Inference Protocol routes beyond inference and metadata, as Triton serves them, so that
``tritonclient`` and ``perf_analyzer`` find what they ask for on the way:

    GET  /v2/models/{task}[/versions/{v}]/config    Triton's model config of the task (``mesh.v2.triton``)
    GET  /v2/models/{task}[/versions/{v}]/stats     statistics extension: the caller's own queries of the task
    GET  /v2/models/stats                           the same for every task the caller may use
    POST /v2/repository/index                       the tasks the caller may use, READY or UNAVAILABLE
    POST /v2/repository/models/{task}/load          200 when the task is servable now (nothing is loaded)
    POST /v2/repository/models/{task}/unload        403: the mesh, not its callers, places variants

Every route is the tenant's, with the same checks as model metadata (``identify``, ``visible``): a tenant sees only
the tasks it may use, and another tenant's private task answers the one 404 of a task that does not exist.
``/v2/models/stats`` is matched before ``/v2/models/{task}``, as in Triton: a task named ``stats`` would have no
metadata route (no task is).

**Statistics** count the queries the caller's tenant had answered at this door (``AgentMetrics.requests`` and
``door_time``), never another tenant's: a task's first entry has version ``""`` (all its variants, failures
included); then one entry per variant that answered it, with the variant id as ``version`` (a failed query has no
variant: it is counted in the task's entry only). ``/versions/{v}/stats`` keeps the entries of version ``v``. An
edge without metrics (no ``observe``) answers zero counts.

**Load and unload**: in a model-less mesh the caller names a task and the scheduler places its variants, so a load
places nothing. It answers 200 when the task can be served now (it has a variant and the site a routing snapshot),
503 ``no_route`` otherwise, and 403 when the request brings a model (``config`` or files: register it with
``tiermesh variants register``). An unload is always 403: callers cannot unload what other callers share.

**Classification** (``mesh.v2.classify``) applies in ``infer``; :func:`task_labels` gives its labels.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from edge_agent.dataplane import DataPlane, require_servable
from mesh.errors import PermissionDenied, RequestError, UnknownTask
from mesh.types import TaskSignature
from mesh.v2.triton import Counts, index_entry, signature_to_config, stats_entry

if TYPE_CHECKING:
    from edge_agent.metrics import AgentMetrics

__all__ = ["TASK_LABELS", "V2Extras", "model_stats", "task_labels", "tenant_counts", "usable_tasks"]

# Class names of the tasks whose classes have names. The catalog keeps no class names yet (a task signature has
# none), so they are written here for the tasks the mesh ships; another task's classes go by index alone, as
# Triton's do without a label file.
TASK_LABELS: dict[str, tuple[str, ...]] = {
    "digit-classification": tuple(str(d) for d in range(10)),
    "digit-parity": ("even", "odd"),
}
NO_VARIANT = "none"  # the variant label of a query that failed (edge_agent.metrics)


def task_labels(task: str) -> tuple[str, ...] | None:
    return TASK_LABELS.get(task)


def tenant_counts(metrics: AgentMetrics | None, tenant: str, tasks: set[str]) -> dict[tuple[str, str], Counts]:
    """(task, variant) -> the counts of ``tenant``'s queries of ``tasks`` answered at this door; variant ``""``: the
    task's whole. A tenant the metrics do not name (counted as ``other``) has none here: ``other`` is a crowd."""
    out: dict[tuple[str, str], Counts] = {}
    if metrics is None or tenant not in metrics.tenants:
        return out
    for (task, who, variant, outcome, _), n in metrics.requests.items():
        if who != tenant or task not in tasks:
            continue
        c = out.setdefault((task, variant if outcome == "ok" else ""), Counts())
        if outcome == "ok":
            c.success += n
        else:
            c.fail += n
    for (task, who, variant), t in metrics.door_time.items():
        if who != tenant or task not in tasks:
            continue
        c = out.setdefault((task, variant), Counts())
        c.rows, c.queue_ms, c.compute_ms, c.total_ms = t.rows, t.queue_ms, t.compute_ms, t.total_ms
    for (task, variant), c in list(out.items()):
        if variant:
            out.setdefault((task, ""), Counts()).add(c)
    return out


def usable_tasks(dp: DataPlane, visible: Callable[[str, str], bool] | None, tenant: str) -> list[str]:
    """The tasks ``tenant`` may use at this door (``visible`` None: every task)."""
    return [t for t in dp.tasks() if visible is None or visible(t, tenant)]


def model_stats(metrics: AgentMetrics | None, tenant: str, tasks: list[str],
                version: str | None = None) -> list[dict[str, Any]]:
    """The statistics extension's ``model_stats`` of ``tenant``'s queries of ``tasks`` (checked by the caller: the
    tenant may use them), as this module's docstring says; ``version``: only its entries (none: ``UnknownTask``).
    Shared by REST (``/stats``) and gRPC (``ModelStatistics``, :mod:`edge_agent.grpc_api`)."""
    counts = tenant_counts(metrics, tenant, set(tasks))
    entries = []
    for t in tasks:
        entries.append(stats_entry(t, "", counts.get((t, ""), Counts())))
        entries += [stats_entry(t, v, c) for (name, v), c in sorted(counts.items()) if name == t and v]
    if version is not None:
        entries = [e for e in entries if e["version"] == version]
        if not entries:
            raise UnknownTask(f"no statistics of task {', '.join(tasks)!r} version {version!r} here")
    return entries


_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class V2Extras:
    """The routes of this module over a data plane. ``who`` names a request's tenant; ``signature`` returns a task's
    signature if the tenant may know of it, else raises the one 404 (``http_api._Handlers.signature``);
    ``visible`` (None: every task) filters lists; ``metrics``: where statistics come from (None: zero counts)."""

    def __init__(self, dp: DataPlane, who: Callable[[web.Request], str],
                 signature: Callable[[str, str], TaskSignature], visible: Callable[[str, str], bool] | None,
                 metrics: AgentMetrics | None) -> None:
        self.dp, self.who, self.signature, self.visible, self.metrics = dp, who, signature, visible, metrics

    def routes(self) -> list[tuple[str, str, _Handler]]:
        """``/v2/models/stats`` first: it must match before ``/v2/models/{task}`` would take it for a task."""
        out: list[tuple[str, str, _Handler]] = [("GET", "/v2/models/stats", self.stats),
                                                ("POST", "/v2/repository/index", self.index),
                                                ("POST", "/v2/repository/models/{task}/load", self.load),
                                                ("POST", "/v2/repository/models/{task}/unload", self.unload)]
        for prefix in ("/v2/models/{task}", "/v2/models/{task}/versions/{version}"):
            out += [("GET", prefix + "/config", self.config), ("GET", prefix + "/stats", self.stats)]
        return out

    def _usable(self, tenant: str) -> list[str]:
        return usable_tasks(self.dp, self.visible, tenant)

    async def config(self, request: web.Request) -> web.Response:
        return web.json_response(signature_to_config(self.signature(request.match_info["task"], self.who(request))))

    async def stats(self, request: web.Request) -> web.Response:
        tenant = self.who(request)
        task = request.match_info.get("task")
        if task is not None:
            self.signature(task, tenant)  # the one 404 for a task the tenant may not know of
            tasks = [task]
        else:
            tasks = self._usable(tenant)
        entries = model_stats(self.metrics, tenant, tasks, request.match_info.get("version"))
        return web.json_response({"model_stats": entries})

    async def index(self, request: web.Request) -> web.Response:
        tenant = self.who(request)
        ready_only = (await _body(request)).get("ready") is True
        ready = self.dp.ready()
        entries = [index_entry(t, ready, "this site has no routing snapshot yet") for t in self._usable(tenant)]
        return web.json_response([e for e in entries if not ready_only or e["state"] == "READY"])

    async def load(self, request: web.Request) -> web.Response:
        task = request.match_info["task"]
        self.signature(task, self.who(request))
        params = (await _body(request)).get("parameters")
        if isinstance(params, dict) and any(k == "config" or k.startswith("file:") for k in params):
            raise PermissionDenied(f"the mesh places the variants of {task!r}; a load cannot bring a model: register "
                                   f"it with POST /v2/models/{task}/versions (multipart model + validation), or "
                                   "over gRPC with load_model(config=..., files=...)", reason="mesh_places_variants")
        require_servable(self.dp, task)
        return web.json_response({})

    async def unload(self, request: web.Request) -> web.Response:
        task = request.match_info["task"]
        self.signature(task, self.who(request))
        raise PermissionDenied(f"the mesh places the variants of {task!r} and shares them between callers: a caller "
                               "cannot unload them", reason="mesh_places_variants")


async def _body(request: web.Request) -> dict[str, object]:
    """A repository request's JSON object (an empty body is ``{}``); ``RequestError`` for anything else."""
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"the body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    return body
