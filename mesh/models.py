"""The SDK's model registration (the edge's model API, ``edge_agent.models_api``), asynchronous and synchronous:

    async with AsyncModels("https://edge:8443", cert=..., key=..., ca=...) as models:
        build = await models.register("my-digits", "logreg", model=Path("m.onnx"), validation=(x, y))
        done = await build.wait()          # each variant's accuracy, size and latency per hardware class
        done["variants"]

    models = Models(url, tenant="acme")    # the same, on a private loop thread
    models.register(task, family, model=b"...", validation=Path("val.npz")).wait()

``model``: a path to an ONNX file (streamed from disk) or its bytes. ``validation``: a path to an NPZ with ``x`` and
``y`` (streamed), its bytes, or an ``(x, y)`` pair of arrays (sent as such an NPZ). An error reply becomes the
``MeshError`` its code names: a model the checks refuse ``ModelRejected`` (its ``reason`` detail says which check), a
task that is not the tenant's ``PermissionDenied``, a family in use ``ConflictError``, inputs over the tenant's quota
``PayloadTooLarge``. A build that ends failed makes ``wait`` raise ``MeshError`` with its ``reason`` and error.

``wait`` does not poll on a timer: each request is a long poll the edge answers as soon as the build changes (or
after ``poll_s`` seconds), passing back the etcd revision of the status it last saw, so no change is missed.
"""

from __future__ import annotations

import contextlib
import io
import json
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import aiohttp
import numpy as np

from mesh.errors import ConfigError, DeadlineExceeded, MeshError, PeerUnavailable, error_from_reply
from mesh.pki.reload import client_tls
from mesh.sdk_loop import LoopThread

__all__ = ["AsyncBuild", "AsyncModels", "Build", "Models"]

T = TypeVar("T")
TENANT_HEADER = "X-Tiermesh-Tenant"
MAX_HOLD_S = 55.0  # under the edge's bound on one long poll (60 s)
Progress = Callable[[dict[str, Any]], None]


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


def _error(status: int, body: bytes) -> MeshError:
    """The reply's error with its ``details`` kept (a refused model's ``reason`` is one)."""
    err = error_from_reply(status, body)
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        details = json.loads(body).get("details")
        if isinstance(details, dict):
            err.details.update({str(k): v for k, v in details.items()})  # the edge's word over the defaults
    return err


class AsyncModels:
    """The model API of the edge at ``base_url``; ``cert``/``key``/``ca`` for an https edge (the certificate names
    the tenant), ``tenant`` for an ``--insecure`` one."""

    def __init__(self, base_url: str, *, tenant: str | None = None, cert: str | Path | None = None,
                 key: str | Path | None = None, ca: str | Path | None = None, check_hostname: bool = True,
                 timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._ssl_factory, _ = client_tls(base_url, cert, key, ca, check_hostname)
        self._headers = {TENANT_HEADER: tenant} if tenant is not None and cert is None else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers)
        return self._session

    async def _call(self, method: str, path: str, *, data: Any = None,
                    params: dict[str, str] | None = None) -> Any:
        ssl = self._ssl_factory() if self._ssl_factory is not None else False
        try:
            async with self._open().request(method, self.base_url + path, data=data, params=params,
                                            ssl=ssl) as resp:
                body = await resp.read()
                if resp.status >= 400:
                    raise _error(resp.status, body)
                return await resp.json(content_type=None)
        except aiohttp.ClientError as exc:
            raise PeerUnavailable(f"edge {self.base_url} unreachable: {exc}") from exc
        except TimeoutError as exc:
            raise DeadlineExceeded(f"edge {self.base_url} did not answer {method} {path} in time") from exc

    async def register(self, task: str, family: str, *, model: Any, validation: Any) -> AsyncBuild:
        """Upload the parent ``model`` and its labelled ``validation`` set as ``family`` of the caller's private
        ``task`` (new or its own); the build that the variant store then runs."""
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
                                                        params={"family": family})
        finally:
            for f in files:
                f.close()
        return AsyncBuild(self, task, admitted["id"], admitted)

    def build(self, task: str, build_id: str) -> AsyncBuild:
        return AsyncBuild(self, task, build_id, {})

    async def show(self, task: str, build_id: str, *, wait: float | None = None,
                   since: int | None = None) -> dict[str, Any]:
        """The build's status; with ``wait``, a long poll (answered once it changed after revision ``since``)."""
        params = {} if wait is None else {"wait": f"{min(wait, MAX_HOLD_S):.3f}"}
        if since is not None:
            params["since"] = str(int(since))
        out: dict[str, Any] = await self._call("GET", f"/v2/models/{task}/builds/{build_id}", params=params or None)
        return out

    async def list(self, task: str | None = None) -> list[dict[str, Any]]:
        """The caller's builds (of ``task``), newest first."""
        out: list[dict[str, Any]] = (await self._call("GET", f"/v2/models/{task}/builds" if task else "/v2/builds")
                                     )["builds"]
        return out

    async def wait(self, task: str, build_id: str, *, poll_s: float = 30.0, timeout: float | None = None,  # noqa: ASYNC109
                   progress: Progress | None = None) -> dict[str, Any]:
        """Follow the build until it is done (its status); ``MeshError`` when it failed, ``DeadlineExceeded`` after
        ``timeout`` seconds."""
        end = None if timeout is None else time.monotonic() + timeout
        st = await self.show(task, build_id)
        while True:
            if progress is not None:
                progress(st)
            if st["state"] == "done":
                return st
            if st["state"] == "failed":
                raise MeshError(f"build {build_id} failed ({st.get('reason') or 'no reason'}): "
                                f"{st.get('error') or 'no error given'}", state="failed", reason=st.get("reason"))
            if end is not None and time.monotonic() >= end:
                raise DeadlineExceeded(f"build {build_id} not done after {timeout} s ({st['state']}, "
                                       f"{st.get('stage')}, {st.get('progress', 0):.0%})")
            hold = max(0.05, poll_s if end is None else min(poll_s, end - time.monotonic()))
            revision = st.get("revision")
            st = await self.show(task, build_id, wait=hold, since=revision if isinstance(revision, int) else None)

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def __aenter__(self) -> AsyncModels:
        return self

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()


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


class Models:
    """Synchronous :class:`AsyncModels` (same arguments), on a private loop thread; ``close()`` ends it."""

    def __init__(self, base_url: str, **kwargs: Any) -> None:
        self._async = AsyncModels(base_url, **kwargs)
        self._runner = LoopThread("tiermesh-models", "models client")

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._runner.call(coro)

    def register(self, task: str, family: str, *, model: Any, validation: Any) -> Build:
        return Build(self, self._run(self._async.register(task, family, model=model, validation=validation)))

    def build(self, task: str, build_id: str) -> Build:
        return Build(self, self._async.build(task, build_id))

    def show(self, task: str, build_id: str) -> dict[str, Any]:
        return self._run(self._async.show(task, build_id))

    def list(self, task: str | None = None) -> list[dict[str, Any]]:
        return self._run(self._async.list(task))

    def close(self) -> None:
        self._runner.close(self._async.aclose)

    def __enter__(self) -> Models:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
