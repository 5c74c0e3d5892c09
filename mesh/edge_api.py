"""The SDK's clients of an edge's tracked-work APIs (offline jobs: ``mesh.jobs``; model builds: ``mesh.models``): one
HTTP session per client, TLS from the tenant's certificate (or the tenant header on an ``--insecure`` edge), error
replies turned into the ``MeshError`` their code names with the edge's details kept, and the long-poll loop both
follow their work with.

:meth:`EdgeApi.follow` does not poll on a timer: each request is a long poll the edge answers as soon as the work
changes (or after ``poll_s`` seconds, at most :data:`MAX_HOLD_S`), passing back the etcd revision of the status it
last saw, so no change between two requests is missed. :class:`SyncEdgeApi` runs an async client on a private loop
thread for the synchronous classes.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

import aiohttp

from mesh.errors import DeadlineExceeded, MeshError, PeerUnavailable, error_from_reply
from mesh.pki.reload import client_tls
from mesh.sdk_loop import LoopThread
from mesh.v2.body import TENANT_HEADER

__all__ = ["MAX_HOLD_S", "EdgeApi", "Progress", "SyncEdgeApi", "error_with_details", "wait_params"]

T = TypeVar("T")
MAX_HOLD_S = 55.0  # under the edge's bound on one long poll (60 s)
Progress = Callable[[dict[str, Any]], None]
Show = Callable[[float | None, int | None], Awaitable[dict[str, Any]]]  # (wait s, since revision) -> status


def error_with_details(status: int, body: bytes) -> MeshError:
    """The reply's error with its ``details`` kept (a refused model's ``reason`` is one)."""
    err = error_from_reply(status, body)
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        details = json.loads(body).get("details")
        if isinstance(details, dict):
            err.details.update({str(k): v for k, v in details.items()})  # the edge's word over the defaults
    return err


def wait_params(wait: float | None, since: int | None) -> dict[str, str]:
    """A status request's long-poll parameters."""
    params = {} if wait is None else {"wait": f"{min(wait, MAX_HOLD_S):.3f}"}
    if since is not None:
        params["since"] = str(since)
    return params


class EdgeApi:
    """An edge at ``base_url``; ``cert``/``key``/``ca`` for an https edge (the certificate names the tenant),
    ``tenant`` for an ``--insecure`` one; ``timeout``: one request's bound in seconds."""

    def __init__(self, base_url: str, *, tenant: str | None = None, cert: str | Path | None = None,
                 key: str | Path | None = None, ca: str | Path | None = None, check_hostname: bool = True,
                 timeout: float = 300.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._ssl_factory, _ = client_tls(base_url, cert, key, ca, check_hostname)
        self._headers = {TENANT_HEADER: tenant} if tenant is not None and cert is None else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers)
        return self._session

    def _ssl(self) -> Any:
        return self._ssl_factory() if self._ssl_factory is not None else False

    async def _call(self, method: str, path: str, *, data: Any = None, params: dict[str, str] | None = None,
                    raw: bool = False) -> Any:
        """The reply's JSON (its bytes with ``raw``); ``data`` a ``Path`` is streamed from disk."""
        try:
            if isinstance(data, Path):
                with open(data, "rb") as f:  # noqa: ASYNC230  (aiohttp streams the file from its executor)
                    return await self._send(method, path, f, params, raw)
            return await self._send(method, path, data, params, raw)
        except aiohttp.ClientError as exc:
            raise PeerUnavailable(f"edge {self.base_url} unreachable: {exc}") from exc
        except TimeoutError as exc:
            raise DeadlineExceeded(f"edge {self.base_url} did not answer {method} {path} in time") from exc

    async def _send(self, method: str, path: str, data: Any, params: dict[str, str] | None, raw: bool) -> Any:
        async with self._open().request(method, self.base_url + path, data=data, params=params,
                                        ssl=self._ssl()) as resp:
            body = await resp.read()
            if resp.status >= 400:
                raise error_with_details(resp.status, body)
            return body if raw else await resp.json(content_type=None)

    @staticmethod
    async def follow(show: Show, *, what: str, done: Callable[[dict[str, Any]], bool],
                     failed: Callable[[dict[str, Any]], MeshError | None], describe: Callable[[dict[str, Any]], str],
                     poll_s: float = 30.0, timeout: float | None = None,  # noqa: ASYNC109
                     progress: Progress | None = None) -> dict[str, Any]:
        """Follow ``what`` until ``done(status)``, one long poll after another (each held at most ``poll_s`` s;
        ``progress`` sees every status): the error ``failed(status)`` names when it ended otherwise,
        ``DeadlineExceeded`` (with ``describe(status)``) after ``timeout`` seconds."""
        end = None if timeout is None else time.monotonic() + timeout
        st = await show(None, None)
        while True:
            if progress is not None:
                progress(st)
            if done(st):
                return st
            err = failed(st)
            if err is not None:
                raise err
            if end is not None and time.monotonic() >= end:
                raise DeadlineExceeded(f"{what} not done after {timeout} s ({describe(st)})")
            hold = max(0.05, poll_s if end is None else min(poll_s, end - time.monotonic()))
            revision = st.get("revision")
            st = await show(hold, revision if isinstance(revision, int) else None)

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()


class SyncEdgeApi:
    """A synchronous face of an :class:`EdgeApi` (``self._async``), on a private loop thread; ``close()`` ends it."""

    def __init__(self, inner: EdgeApi, thread: str) -> None:
        self._async = inner
        self._runner = LoopThread(f"tiermesh-{thread}", f"{thread} client")

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._runner.call(coro)

    def close(self) -> None:
        self._runner.close(self._async.aclose)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
