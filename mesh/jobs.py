"""The SDK's offline jobs (the edge's job API, ``edge_agent.jobs_api``), asynchronous and synchronous:

    async with AsyncJobs("https://edge:8443", cert=..., key=..., ca=...) as jobs:
        job = await jobs.submit("digit-classification", x, min_accuracy=0.95, deadline_s=600)
        await job.wait()
        y = (await job.result())["logits"]

    jobs = Jobs(url, tenant="acme")          # the same, on a private loop thread
    job = jobs.submit(task, Path("rows.jsonl")); job.wait(); job.result()

Inputs: a NumPy array (sent as NPZ ``x``), a path to an ``.npz``, ``.jsonl`` or ``.oip`` file (the Open Inference
Protocol's binary tensor layout: its JSON header, then the tensor's bytes; streamed from disk), or bytes with
``format=``. ``job.result()`` holds the outputs in memory; ``job.result_to(path)`` writes a large one to a file as
it streams in. An error reply becomes the ``MeshError`` its code names (``mesh.errors``): an unknown task
``UnknownTask``, a deadline that cannot be met ``ImpossibleSLO`` (its message says the best feasible one), input
over quota ``PayloadTooLarge``, cancelling a finished job ``ConflictError``. A job that ends failed or cancelled
makes ``wait`` raise ``MeshError`` with its state and error.

``wait`` does not poll on a timer: each request is a long poll the edge answers as soon as the job changes (or after
``poll_s`` seconds, at most ``MAX_HOLD_S``), passing back the etcd revision of the status it last saw so that no
change between two requests is missed. Submitting an input already submitted (same task, bytes, format and
``min_accuracy``) while that job is queued, running or done returns that job (``job.deduplicated``) and runs nothing
again; ``fresh=True`` asks for a new run.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import aiohttp
import numpy as np

from mesh.errors import ConfigError, DeadlineExceeded, MeshError, PeerUnavailable, error_from_reply
from mesh.jobspec import FORMATS
from mesh.pki.reload import client_tls
from mesh.sdk_loop import LoopThread

__all__ = ["AsyncJob", "AsyncJobs", "Job", "Jobs"]

T = TypeVar("T")
TENANT_HEADER = "X-Tiermesh-Tenant"
Progress = Callable[[dict[str, Any]], None]
MAX_HOLD_S = 55.0  # under the edge's bound on one long poll (60 s)


@dataclass(frozen=True, slots=True)
class AsyncJob:
    """A submitted job: ``wait()``, ``status()``, ``result()``, ``cancel()``."""

    jobs: AsyncJobs
    task: str
    id: str
    admitted: dict[str, Any]

    @property
    def deduplicated(self) -> bool:
        """Whether the edge answered the submission with an identical job it had already (nothing ran again)."""
        return bool(self.admitted.get("deduplicated"))

    async def status(self) -> dict[str, Any]:
        return await self.jobs.show(self.task, self.id)

    async def wait(self, *, poll_s: float = 30.0, timeout: float | None = None,  # noqa: ASYNC109
                   progress: Progress | None = None) -> dict[str, Any]:
        return await self.jobs.wait(self.task, self.id, poll_s=poll_s, timeout=timeout, progress=progress)

    async def result(self) -> dict[str, np.ndarray]:
        return await self.jobs.result(self.task, self.id)

    async def result_to(self, path: str | Path, format: str = "npz") -> int:
        """Write the result to ``path`` as it arrives (never whole in memory); its size in bytes."""
        return await self.jobs.result_to(self.task, self.id, path, format)

    async def cancel(self) -> dict[str, Any]:
        return await self.jobs.cancel(self.task, self.id)


def _body(data: Any, fmt: str | None) -> tuple[Any, str]:
    if isinstance(data, np.ndarray):
        buf = io.BytesIO()
        np.savez(buf, x=data)
        return buf.getvalue(), "npz"
    if isinstance(data, Path | str) and not isinstance(data, bytes):
        path = Path(data)
        guess = {".npz": "npz", ".jsonl": "jsonl", ".ndjson": "jsonl", ".oip": "oip"}.get(path.suffix.lower())
        fmt = fmt or guess
        if fmt not in FORMATS:
            raise ConfigError(f"cannot tell the format of {path} (pass format= one of {', '.join(FORMATS)})")
        return path, fmt
    if isinstance(data, bytes):
        if fmt not in FORMATS:
            raise ConfigError(f"bytes need format= one of {', '.join(FORMATS)}")
        return data, fmt
    raise ConfigError(f"a job's input is an array, a path or bytes, not {type(data).__name__}")


class AsyncJobs:
    """The job API of the edge at ``base_url``; ``cert``/``key``/``ca`` for an https edge (the certificate names
    the tenant), ``tenant`` for an ``--insecure`` one."""

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

    async def _call(self, method: str, path: str, *, data: Any = None, params: dict[str, str] | None = None,
                    raw: bool = False) -> Any:
        ssl = self._ssl_factory() if self._ssl_factory is not None else False
        try:
            if isinstance(data, Path):
                with open(data, "rb") as f:  # noqa: ASYNC230  (aiohttp streams the file from its executor)
                    return await self._send(method, path, f, params, ssl, raw)
            return await self._send(method, path, data, params, ssl, raw)
        except aiohttp.ClientError as exc:
            raise PeerUnavailable(f"edge {self.base_url} unreachable: {exc}") from exc
        except TimeoutError as exc:
            raise DeadlineExceeded(f"edge {self.base_url} did not answer {method} {path} in time") from exc

    async def _send(self, method: str, path: str, data: Any, params: dict[str, str] | None, ssl: Any,
                    raw: bool) -> Any:
        async with self._open().request(method, self.base_url + path, data=data, params=params, ssl=ssl) as resp:
            body = await resp.read()
            if resp.status >= 400:
                raise error_from_reply(resp.status, body)
            return body if raw else await resp.json(content_type=None)

    async def submit(self, task: str, data: Any, *, min_accuracy: float = 0.0, deadline_s: float = 3600.0,
                     max_cost: float | None = None, format: str | None = None,
                     chunk_rows: int | None = None, fresh: bool = False, notify: str | None = None) -> AsyncJob:
        """Submit a job; ``fresh=True``: run it even when an identical one is queued, running or done; ``notify``:
        an https URL the mesh POSTs the job's outcome to once it ends (under a prefix the operator allowed the
        tenant in the topology, else ``RequestError``)."""
        body, fmt = _body(data, format)
        params = {"min_accuracy": str(min_accuracy), "deadline_s": str(deadline_s), "format": fmt,
                  "fresh": "1" if fresh else "0"}
        if max_cost is not None:
            params["max_cost"] = str(max_cost)
        if chunk_rows is not None:
            params["chunk_rows"] = str(chunk_rows)
        if notify is not None:
            params["notify"] = notify
        admitted = await self._call("POST", f"/v2/models/{task}/jobs", data=body, params=params)
        return AsyncJob(self, task, str(admitted["id"]), admitted)

    def job(self, task: str, job_id: str) -> AsyncJob:
        return AsyncJob(self, task, job_id, {})

    async def show(self, task: str, job_id: str, *, wait: float | None = None,
                   since: int | None = None) -> dict[str, Any]:
        """The job's status; with ``wait``, a long poll: answered when the job changed after revision ``since`` (a
        status's ``revision``; default: now), or after ``wait`` seconds."""
        params = {} if wait is None else {"wait": f"{min(wait, MAX_HOLD_S):.3f}"}
        if since is not None:
            params["since"] = str(int(since))
        out: dict[str, Any] = await self._call("GET", f"/v2/models/{task}/jobs/{job_id}", params=params or None)
        return out

    async def list(self, task: str | None = None) -> list[dict[str, Any]]:
        path = f"/v2/models/{task}/jobs" if task else "/v2/jobs"
        out: list[dict[str, Any]] = (await self._call("GET", path))["jobs"]
        return out

    async def cancel(self, task: str, job_id: str) -> dict[str, Any]:
        out: dict[str, Any] = await self._call("DELETE", f"/v2/models/{task}/jobs/{job_id}")
        return out

    async def result(self, task: str, job_id: str) -> dict[str, np.ndarray]:
        raw = await self._call("GET", f"/v2/models/{task}/jobs/{job_id}/result", params={"format": "npz"}, raw=True)
        with np.load(io.BytesIO(raw), allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}

    async def result_to(self, task: str, job_id: str, path: str | Path, format: str = "npz") -> int:
        """The result written to ``path`` as it streams in (a temp file beside it, renamed once complete: a cut
        stream leaves no partial file and raises ``PeerUnavailable``); its size in bytes."""
        dest = Path(path)
        tmp = dest.with_name(f".{dest.name}.part")
        ssl = self._ssl_factory() if self._ssl_factory is not None else False
        url = f"{self.base_url}/v2/models/{task}/jobs/{job_id}/result"
        size = 0
        try:
            # no bound on the whole transfer (a large result takes what it takes), only on silence
            idle = aiohttp.ClientTimeout(total=None, sock_connect=self._timeout.total, sock_read=self._timeout.total)
            async with self._open().get(url, params={"format": format}, ssl=ssl, timeout=idle) as resp:
                if resp.status >= 400:
                    raise error_from_reply(resp.status, await resp.read())
                with open(tmp, "wb") as f:  # noqa: ASYNC230  (local writes of the blocks as they arrive)
                    async for block in resp.content.iter_chunked(1 << 20):
                        f.write(block)
                        size += len(block)
                if resp.content_length is not None and size != resp.content_length:
                    raise PeerUnavailable(f"result of job {job_id} cut short: {size} of {resp.content_length} bytes")
            tmp.replace(dest)
        except aiohttp.ClientError as exc:
            raise PeerUnavailable(f"edge {self.base_url}: result of job {job_id} not received whole: {exc}") from exc
        except TimeoutError as exc:
            raise DeadlineExceeded(f"edge {self.base_url} did not send job {job_id}'s result in time") from exc
        finally:
            tmp.unlink(missing_ok=True)
        return size

    async def result_bytes(self, task: str, job_id: str, format: str = "npz") -> bytes:
        out: bytes = await self._call("GET", f"/v2/models/{task}/jobs/{job_id}/result", params={"format": format},
                                      raw=True)
        return out

    async def wait(self, task: str, job_id: str, *, poll_s: float = 30.0, timeout: float | None = None,  # noqa: ASYNC109
                   progress: Progress | None = None) -> dict[str, Any]:
        """Follow the job until it is done (its status), one long poll after another (each held at most ``poll_s``
        seconds; ``progress`` sees every status); ``MeshError`` when it ends failed or cancelled,
        ``DeadlineExceeded`` after ``timeout`` seconds."""
        end = None if timeout is None else time.monotonic() + timeout
        st = await self.show(task, job_id)
        while True:
            if progress is not None:
                progress(st)
            if st["state"] == "done":
                return st
            if st["state"] in ("failed", "cancelled"):
                raise MeshError(f"job {job_id} {st['state']}: {st.get('error') or 'no error given'}", state=st["state"])
            if end is not None and time.monotonic() >= end:
                raise DeadlineExceeded(f"job {job_id} not done after {timeout} s ({st['rows_done']}/{st['rows']} rows)")
            hold = max(0.05, poll_s if end is None else min(poll_s, end - time.monotonic()))
            revision = st.get("revision")
            st = await self.show(task, job_id, wait=hold, since=revision if isinstance(revision, int) else None)

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def __aenter__(self) -> AsyncJobs:
        return self

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()


@dataclass(frozen=True, slots=True)
class Job:
    """A submitted job, synchronously (:class:`AsyncJob` on the :class:`Jobs` loop thread)."""

    jobs: Jobs
    inner: AsyncJob

    @property
    def id(self) -> str:
        return self.inner.id

    @property
    def deduplicated(self) -> bool:
        return self.inner.deduplicated

    def status(self) -> dict[str, Any]:
        return self.jobs._run(self.inner.status())

    def wait(self, *, poll_s: float = 30.0, timeout: float | None = None,
             progress: Progress | None = None) -> dict[str, Any]:
        return self.jobs._run(self.inner.wait(poll_s=poll_s, timeout=timeout, progress=progress))

    def result(self) -> dict[str, np.ndarray]:
        return self.jobs._run(self.inner.result())

    def result_to(self, path: str | Path, format: str = "npz") -> int:
        return self.jobs._run(self.inner.result_to(path, format))

    def cancel(self) -> dict[str, Any]:
        return self.jobs._run(self.inner.cancel())


class Jobs:
    """Synchronous :class:`AsyncJobs` (same arguments), on a private loop thread; ``close()`` ends it."""

    def __init__(self, base_url: str, **kwargs: Any) -> None:
        self._async = AsyncJobs(base_url, **kwargs)
        self._runner = LoopThread("tiermesh-jobs", "jobs client")

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._runner.call(coro)

    def submit(self, task: str, data: Any, **kwargs: Any) -> Job:
        return Job(self, self._run(self._async.submit(task, data, **kwargs)))

    def job(self, task: str, job_id: str) -> Job:
        return Job(self, self._async.job(task, job_id))

    def show(self, task: str, job_id: str) -> dict[str, Any]:
        return self._run(self._async.show(task, job_id))

    def list(self, task: str | None = None) -> list[dict[str, Any]]:
        return self._run(self._async.list(task))

    def cancel(self, task: str, job_id: str) -> dict[str, Any]:
        return self._run(self._async.cancel(task, job_id))

    def result_bytes(self, task: str, job_id: str, format: str = "npz") -> bytes:
        return self._run(self._async.result_bytes(task, job_id, format))

    def result_to(self, task: str, job_id: str, path: str | Path, format: str = "npz") -> int:
        return self._run(self._async.result_to(task, job_id, path, format))

    def close(self) -> None:
        self._runner.close(self._async.aclose)

    def __enter__(self) -> Jobs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
