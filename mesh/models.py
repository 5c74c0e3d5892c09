"""The SDK's model registration (the edge's model API, ``edge_agent.models_api``), asynchronous and synchronous:

    async with AsyncModels("https://edge:8443", cert=..., key=..., ca=...) as models:
        build = await models.register("my-digits", "logreg", model=Path("m.onnx"), validation=(x, y))
        done = await build.wait()          # each variant's accuracy, size and latency per hardware class
        done["variants"]

    models = Models(url, tenant="acme")    # the same, on a private loop thread
    models.register(task, family, model=b"...", validation=Path("val.npz")).wait()

``min_accuracy`` (optional, in [0, 1]) declares the task's accuracy bar: the new version takes traffic only when one
of its variants meets it, else it is held; the finished build's ``version``, ``version_state`` (``active`` or
``held``) and ``version_note`` (e.g. ``best 0.91 < declared 0.95``) say which. ``model``: a path to an ONNX file
(streamed from disk) or its bytes. ``validation``: a path to an NPZ with ``x`` and
``y`` (streamed), its bytes, or an ``(x, y)`` pair of arrays (sent as such an NPZ). An error reply becomes the
``MeshError`` its code names: a model the checks refuse ``ModelRejected`` (its ``reason`` detail says which check), a
task that is not the tenant's ``PermissionDenied``, a family in use ``ConflictError``, inputs over the tenant's quota
``PayloadTooLarge``. A build that ends failed makes ``wait`` raise ``MeshError`` with its ``reason`` and error.

``wait`` does not poll on a timer: each request is a long poll the edge answers as soon as the build changes (or
after ``poll_s`` seconds), passing back the etcd revision of the status it last saw, so no change is missed.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from mesh.edge_api import EdgeApi, Progress, SyncEdgeApi, wait_params
from mesh.errors import ConfigError, MeshError

__all__ = ["AsyncBuild", "AsyncModels", "Build", "Models"]



@dataclass(frozen=True, slots=True)
class AsyncBuild:
    """A registered model's build: ``status()``, ``wait()``."""

    models: AsyncModels
    task: str
    id: str
    admitted: dict[str, Any]

    async def status(self) -> dict[str, Any]:
        return await self.models.show(self.task, self.id)

    async def wait(self, *, poll_s: float = 30.0, timeout: float | None = None,  # noqa: ASYNC109
                   progress: Progress | None = None) -> dict[str, Any]:
        return await self.models.wait(self.task, self.id, poll_s=poll_s, timeout=timeout, progress=progress)


def _part(value: Any, what: str) -> Any:
    """What aiohttp sends for one part: an open file (streamed), or bytes."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, Path | str):
        return Path(value)
    if what == "validation" and isinstance(value, tuple) and len(value) == 2:
        buf = io.BytesIO()
        np.savez(buf, x=np.asarray(value[0]), y=np.asarray(value[1]))
        return buf.getvalue()
    raise ConfigError(f"the {what} is a path or bytes{' or an (x, y) pair' if what == 'validation' else ''}, "
                      f"not {type(value).__name__}")


class AsyncModels(EdgeApi):
    """The model API of the edge at ``base_url`` (``mesh.edge_api.EdgeApi``'s arguments; ``timeout`` 600 s by
    default: an upload of a large model takes a while)."""

    def __init__(self, base_url: str, *, timeout: float = 600.0, **kwargs: Any) -> None:
        super().__init__(base_url, timeout=timeout, **kwargs)

    async def register(self, task: str, family: str, *, model: Any, validation: Any,
                       min_accuracy: float | None = None) -> AsyncBuild:
        """Upload the parent ``model`` and its labelled ``validation`` set as ``family`` of the caller's private
        ``task`` (new or its own); the build that the variant store then runs. ``min_accuracy``: the task's
        accuracy bar, declared (the edge checks it: ``RequestError`` outside [0, 1]); None keeps the one declared
        before, if any."""
        params = {"family": family}
        if min_accuracy is not None:
            params["min_accuracy"] = str(min_accuracy)  # as given: the edge's check is the one
        parts = {"model": _part(model, "model"), "validation": _part(validation, "validation")}
        files = []
        try:
            form = aiohttp.FormData()
            for name, value in parts.items():
                if isinstance(value, Path):
                    f = open(value, "rb")  # noqa: ASYNC230  (aiohttp streams it; closed below)
                    files.append(f)
                    value = f
                form.add_field(name, value, filename=f"{name}.bin", content_type="application/octet-stream")
            admitted: dict[str, Any] = await self._call("POST", f"/v2/models/{task}/versions", data=form,
                                                        params=params)
        finally:
            for f in files:
                f.close()
        return AsyncBuild(self, task, admitted["id"], admitted)

    def build(self, task: str, build_id: str) -> AsyncBuild:
        return AsyncBuild(self, task, build_id, {})

    async def show(self, task: str, build_id: str, *, wait: float | None = None,
                   since: int | None = None) -> dict[str, Any]:
        """The build's status; with ``wait``, a long poll (answered once it changed after revision ``since``)."""
        out: dict[str, Any] = await self._call("GET", f"/v2/models/{task}/builds/{build_id}",
                                               params=wait_params(wait, since) or None)
        return out

    async def list(self, task: str | None = None) -> list[dict[str, Any]]:
        """The caller's builds (of ``task``), newest first."""
        out: list[dict[str, Any]] = (await self._call("GET", f"/v2/models/{task}/builds" if task else "/v2/builds")
                                     )["builds"]
        return out

    # versions (issue 34 item 3: edge_agent.model_versions) ---------------------------------------------------
    async def versions(self, task: str) -> dict[str, Any]:
        """The task's versions: each one's family, state, accuracy and traffic share; the active one."""
        out: dict[str, Any] = await self._call("GET", f"/v2/models/{task}/versions")
        return out

    async def traffic(self, task: str, weights: dict[int | str, float]) -> dict[str, Any]:
        """Split the task's traffic by weight between its versions (``{2: 0.1, 1: 0.9}``); one version alone makes it
        the active one. The versions as they are after it."""
        body = json.dumps({str(v): float(w) for v, w in weights.items()}).encode()
        out: dict[str, Any] = await self._call("PUT", f"/v2/models/{task}/traffic", data=body)
        return out

    async def delete(self, task: str) -> dict[str, Any]:
        """Delete the caller's task everywhere and collect its blobs: what was removed."""
        out: dict[str, Any] = await self._call("DELETE", f"/v2/models/{task}")
        return out

    async def wait(self, task: str, build_id: str, *, poll_s: float = 30.0, timeout: float | None = None,  # noqa: ASYNC109
                   progress: Progress | None = None) -> dict[str, Any]:
        """Follow the build until it is done (its status); ``MeshError`` when it failed, ``DeadlineExceeded`` after
        ``timeout`` seconds."""
        def failed(st: dict[str, Any]) -> MeshError | None:
            if st["state"] == "failed":
                return MeshError(f"build {build_id} failed ({st.get('reason') or 'no reason'}): "
                                 f"{st.get('error') or 'no error given'}", state="failed", reason=st.get("reason"))
            return None

        return await self.follow(lambda wait, since: self.show(task, build_id, wait=wait, since=since),
                                 what=f"build {build_id}", done=lambda st: st["state"] == "done", failed=failed,
                                 describe=lambda st: f"{st['state']}, {st.get('stage')}, {st.get('progress', 0):.0%}",
                                 poll_s=poll_s, timeout=timeout, progress=progress)


@dataclass(frozen=True, slots=True)
class Build:
    """A build, synchronously (:class:`AsyncBuild` on the :class:`Models` loop thread)."""

    models: Models
    inner: AsyncBuild

    @property
    def id(self) -> str:
        return self.inner.id

    def status(self) -> dict[str, Any]:
        return self.models._run(self.inner.status())

    def wait(self, *, poll_s: float = 30.0, timeout: float | None = None,
             progress: Progress | None = None) -> dict[str, Any]:
        return self.models._run(self.inner.wait(poll_s=poll_s, timeout=timeout, progress=progress))


class Models(SyncEdgeApi):
    """Synchronous :class:`AsyncModels` (same arguments), on a private loop thread; ``close()`` ends it."""

    _async: AsyncModels

    def __init__(self, base_url: str, **kwargs: Any) -> None:
        super().__init__(AsyncModels(base_url, **kwargs), "models")

    def register(self, task: str, family: str, *, model: Any, validation: Any,
                 min_accuracy: float | None = None) -> Build:
        return Build(self, self._run(self._async.register(task, family, model=model, validation=validation,
                                                          min_accuracy=min_accuracy)))

    def build(self, task: str, build_id: str) -> Build:
        return Build(self, self._async.build(task, build_id))

    def show(self, task: str, build_id: str) -> dict[str, Any]:
        return self._run(self._async.show(task, build_id))

    def list(self, task: str | None = None) -> list[dict[str, Any]]:
        return self._run(self._async.list(task))

    def versions(self, task: str) -> dict[str, Any]:
        return self._run(self._async.versions(task))

    def traffic(self, task: str, weights: dict[int | str, float]) -> dict[str, Any]:
        return self._run(self._async.traffic(task, weights))

    def delete(self, task: str) -> dict[str, Any]:
        return self._run(self._async.delete(task))
