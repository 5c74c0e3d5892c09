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

``wait`` does not poll on a timer: each request is a long poll the edge answers as soon as the job changes
(``mesh.edge_api.EdgeApi.follow``), so no change between two requests is missed. Submitting an input already
submitted (same task, bytes, format and ``min_accuracy``) while that job is queued, running or done returns that job
(``job.deduplicated``) and runs nothing again; ``fresh=True`` asks for a new run.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from mesh.edge_api import EdgeApi, Progress, SyncEdgeApi, error_with_details, wait_params
from mesh.errors import ConfigError, DeadlineExceeded, MeshError, PeerUnavailable
from mesh.jobspec import FORMATS

__all__ = ["AsyncJob", "AsyncJobs", "Job", "Jobs"]



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


class AsyncJobs(EdgeApi):
    """The job API of the edge at ``base_url`` (``mesh.edge_api.EdgeApi``'s arguments)."""

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
        out: dict[str, Any] = await self._call("GET", f"/v2/models/{task}/jobs/{job_id}",
                                               params=wait_params(wait, since) or None)
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
        url = f"{self.base_url}/v2/models/{task}/jobs/{job_id}/result"
        size = 0
        try:
            # no bound on the whole transfer (a large result takes what it takes), only on silence
            idle = aiohttp.ClientTimeout(total=None, sock_connect=self._timeout.total, sock_read=self._timeout.total)
            async with self._open().get(url, params={"format": format}, ssl=self._ssl(), timeout=idle) as resp:
                if resp.status >= 400:
                    raise error_with_details(resp.status, await resp.read())
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
        def failed(st: dict[str, Any]) -> MeshError | None:
            if st["state"] in ("failed", "cancelled"):
                return MeshError(f"job {job_id} {st['state']}: {st.get('error') or 'no error given'}",
                                 state=st["state"])
            return None

        return await self.follow(lambda wait, since: self.show(task, job_id, wait=wait, since=since),
                                 what=f"job {job_id}", done=lambda st: st["state"] == "done", failed=failed,
                                 describe=lambda st: f"{st['rows_done']}/{st['rows']} rows", poll_s=poll_s,
                                 timeout=timeout, progress=progress)


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


class Jobs(SyncEdgeApi):
    """Synchronous :class:`AsyncJobs` (same arguments), on a private loop thread; ``close()`` ends it."""

    _async: AsyncJobs

    def __init__(self, base_url: str, **kwargs: Any) -> None:
        super().__init__(AsyncJobs(base_url, **kwargs), "jobs")

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
