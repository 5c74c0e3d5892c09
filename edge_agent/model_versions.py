"""The edge's routes for a tenant task's versions (issue 34 item 3), beside registration (``edge_agent.models_api``):

    GET    /v2/models/{task}/versions   the task's versions: each one's family, state, accuracy and traffic share,
                                        the active one and the split (``variant_store.versions.VersionRecord``)
    PUT    /v2/models/{task}/traffic    {"2": 0.1, "1": 0.9}: split the task's traffic by weight (one version at
                                        weight > 0 makes it the active one and ends the split)
    DELETE /v2/models/{task}            take the task out of the catalog everywhere and collect its blobs

A door may not write the catalog, so the traffic and delete routes write a request to the variant store
(``modelops/<tenant>/<id>``, ``variant_store.version_keeper``), which checks the tenant owns the task and answers
in the same key; the door waits for the answer (polled, at most ``answer_s``) and takes the key out. Another
tenant's task is a 404, as reads answer (``UnknownTask``); a split naming a version the task cannot serve is a 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web

from mesh.buildspec import is_name
from mesh.errors import ConflictError, DeadlineExceeded, RequestError, UnknownTask
from mesh.etcd.keys import model_op_key, version_key
from mesh.etcd.store import Store
from variant_store.versions import ModelOp, VersionRecord

__all__ = ["ModelVersions"]

MAX_BODY = 64 << 10


class ModelVersions:
    """The version routes; ``tenant(request)``: the caller's tenant, admitted (``ModelsApi._tenant``)."""

    def __init__(self, store: Store, tenant: Callable[[web.Request], str], *, answer_s: float = 30.0,
                 poll_s: float = 0.1) -> None:
        self.store, self.tenant = store, tenant
        self.answer_s, self.poll_s = answer_s, poll_s

    def routes(self) -> list[tuple[str, str, Callable[[web.Request], Any]]]:
        return [("GET", "/v2/models/{task}/versions", self.show), ("PUT", "/v2/models/{task}/traffic", self.traffic),
                ("DELETE", "/v2/models/{task}", self.delete)]

    def _task(self, request: web.Request) -> str:
        task = request.match_info["task"]
        if not is_name(task):
            raise RequestError(f"task name {task[:60]!r} must be 1-128 of letters, digits, '_' and '-'")
        return task

    async def show(self, request: web.Request) -> web.Response:
        tenant, task = self.tenant(request), self._task(request)
        item = await self.store.get(version_key(task))
        try:
            rec = VersionRecord.from_json(item.value) if item is not None else None
        except ValueError:
            rec = None
        if rec is None or rec.owner != tenant:
            raise UnknownTask(f"no task {task!r} with versions of tenant {tenant!r}", task=task)
        return web.json_response(rec.to_summary())

    async def traffic(self, request: web.Request) -> web.Response:
        tenant, task = self.tenant(request), self._task(request)
        body = await request.content.read(MAX_BODY + 1)
        if len(body) > MAX_BODY:
            raise RequestError(f"a traffic split is at most {MAX_BODY} bytes")
        try:
            asked = json.loads(body or b"null")
        except ValueError as exc:
            raise RequestError(f"a traffic split is JSON: {exc}") from exc
        if isinstance(asked, dict) and isinstance(asked.get("weights"), dict):
            asked = asked["weights"]
        if not isinstance(asked, dict) or not asked or len(asked) > 100:
            raise RequestError('send {"<version>": <weight>, ...}, e.g. {"2": 0.1, "1": 0.9}')
        try:
            op = ModelOp.from_json({"id": uuid.uuid4().hex, "tenant": tenant, "task": task, "op": "traffic",
                                    "weights": asked, "created": time.time()})
        except ValueError as exc:
            raise RequestError(f"bad traffic split: {exc}") from exc
        return web.json_response(await self._ask(op))

    async def delete(self, request: web.Request) -> web.Response:
        tenant, task = self.tenant(request), self._task(request)
        op = ModelOp(op_id=uuid.uuid4().hex, tenant=tenant, task=task, op="delete", created=time.time())
        return web.json_response(await self._ask(op))

    async def _ask(self, op: ModelOp) -> dict[str, Any]:
        """Write ``op`` for the store, wait (bounded) for its answer, take the key out; the answer's result, or
        its refusal as the error the HTTP boundary maps."""
        key = model_op_key(op.tenant, op.op_id)
        await self.store.put(key, op.to_json())
        try:
            deadline = time.monotonic() + self.answer_s
            while time.monotonic() < deadline:
                item = await self.store.get(key)
                if item is not None:
                    with contextlib.suppress(ValueError):
                        got = ModelOp.from_json(item.value)
                        if got.state == "done":
                            return dict(got.result)
                        if got.state == "failed":
                            raise _error(got)
                await asyncio.sleep(self.poll_s)
            raise DeadlineExceeded(f"the variant store did not answer the {op.op} of task {op.task!r} within "
                                   f"{self.answer_s:g} s (it may still apply it: read the task's versions)")
        finally:
            with contextlib.suppress(Exception):
                await self.store.delete(key)


def _error(op: ModelOp) -> Exception:
    if op.reason == "not_found":
        return UnknownTask(op.error or f"no task {op.task!r}", task=op.task)
    if op.reason == "conflict":
        return ConflictError(op.error, task=op.task)
    return RequestError(op.error or "refused")
