"""A done job's result, streamed from the data area: one chunk's outputs in memory at a time, whatever the job's size.

- JSON lines: each chunk's outputs fetched, checked and written as lines to the response, then dropped (chunked
  transfer encoding; a row is its single output's values, or an object of outputs by name when there are several);
- NPZ: a zip needs each array whole and in one member, so the chunks' outputs are appended, per output, to
  anonymous temp files in the door's spool directory; the NPZ (uncompressed ``.npy`` members, as ``np.savez``
  writes) is assembled from them into another anonymous temp file and sent with its length. Bounded by the spool's
  disk, not by memory; the files vanish when closed, however the request ends.

The first chunk is fetched before the reply starts, so a store that is down or an output that is unreadable is still
an error reply (``mesh.errors``' status); past that point a failure can only cut the stream short: JSON lines then
lack their terminating chunk and an NPZ its announced length, which any HTTP client reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import zipfile
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import IO

import numpy as np
from aiohttp import web

from core_scheduler.state.jobs import JobView
from mesh.errors import ConflictError
from variant_store.data_client import DataClient
from variant_store.jobdata import decode_outputs

__all__ = ["MAX_CHUNK_OUTPUT_BYTES", "RESULT_FORMATS", "stream_result"]

MAX_CHUNK_OUTPUT_BYTES = 256 << 20  # one chunk's outputs (the chunk worker refuses to write more)
RESULT_FORMATS = ("npz", "jsonl")
_COPY = 1 << 20


async def _outputs(v: JobView, data: DataClient) -> AsyncGenerator[dict[str, np.ndarray], None]:
    """Each chunk's outputs in row order, checked: one chunk's rows each, the same names as the first chunk's."""
    names: list[str] | None = None
    for seen in sorted(v.chunks, key=lambda s: s.chunk.start):
        c = seen.chunk
        if c.output_digest is None:
            raise ConflictError(f"chunk {c.index} of job {v.job.job_id} has no output")
        raw = await data.get_bytes(v.job.tenant, c.output_digest, max_bytes=MAX_CHUNK_OUTPUT_BYTES)
        out = decode_outputs(raw)
        del raw
        if names is None:
            names = sorted(out)
        if sorted(out) != names:
            raise ConflictError(f"chunk {c.index}'s outputs are {sorted(out)}, the first chunk's {names}")
        for name, arr in out.items():
            if arr.shape[:1] != (c.rows,):
                raise ConflictError(f"chunk {c.index}'s output {name!r} has {arr.shape[:1]} rows, not {c.rows}")
        yield out


def _lines(out: dict[str, np.ndarray]) -> bytes:
    names = sorted(out)
    lists = {n: out[n].tolist() for n in names}
    rows = len(lists[names[0]])
    if len(names) == 1:
        return "".join(json.dumps(r) + "\n" for r in lists[names[0]]).encode()
    return "".join(json.dumps({n: lists[n][i] for n in names}) + "\n" for i in range(rows)).encode()


async def _jsonl(request: web.Request, v: JobView, data: DataClient) -> web.StreamResponse:
    loop = asyncio.get_running_loop()
    async with contextlib.aclosing(_outputs(v, data)) as outputs:
        first = await anext(outputs, None)  # before the reply starts: a failure here is still an error reply
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson",
                                           "X-Tiermesh-Rows": str(v.job.rows)})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        if first is not None:
            await resp.write(await loop.run_in_executor(None, _lines, first))
            del first
            async for out in outputs:
                await resp.write(await loop.run_in_executor(None, _lines, out))
    await resp.write_eof()
    return resp


class _Parts:
    """Per output name: its rows' raw bytes so far, in an anonymous temp file; its dtype and row shape."""

    def __init__(self, spool: Path) -> None:
        self.spool = spool
        self.files: dict[str, IO[bytes]] = {}
        self.kinds: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}
        self.rows = 0

    def add(self, out: dict[str, np.ndarray]) -> None:  # in the executor: file I/O
        for name, arr in out.items():
            kind = (arr.dtype, arr.shape[1:])
            if name not in self.files:
                self.files[name] = tempfile.TemporaryFile(dir=self.spool, prefix="result-")
                self.kinds[name] = kind
            elif self.kinds[name] != kind:
                raise ConflictError(f"output {name!r} is {arr.dtype}{list(arr.shape[1:])} in rows from {self.rows}, "
                                    f"{self.kinds[name][0]}{list(self.kinds[name][1])} before")
            self.files[name].write(np.ascontiguousarray(arr).tobytes())
        self.rows += len(next(iter(out.values())))

    def assemble(self) -> IO[bytes]:  # in the executor
        """The NPZ, in an anonymous temp file positioned at its start."""
        npz = tempfile.TemporaryFile(dir=self.spool, prefix="result-npz-")
        try:
            with zipfile.ZipFile(npz, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
                for name in sorted(self.files):
                    dtype, shape = self.kinds[name]
                    src = self.files[name]
                    src.seek(0)
                    with zf.open(f"{name}.npy", "w", force_zip64=True) as member:
                        header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
                                  "shape": (self.rows, *shape)}
                        np.lib.format.write_array_header_2_0(member, header)
                        while block := src.read(_COPY):
                            member.write(block)
            npz.seek(0)
        except BaseException:
            npz.close()
            raise
        return npz

    def close(self) -> None:
        for f in self.files.values():
            f.close()


async def _npz(request: web.Request, v: JobView, data: DataClient, spool: Path) -> web.StreamResponse:
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, lambda: spool.mkdir(parents=True, exist_ok=True))
    parts = _Parts(spool)
    npz: IO[bytes] | None = None
    try:
        async with contextlib.aclosing(_outputs(v, data)) as outputs:
            async for out in outputs:
                await loop.run_in_executor(None, parts.add, out)
        npz = await loop.run_in_executor(None, parts.assemble)
        parts.close()
        size = await loop.run_in_executor(None, _size, npz)
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream",
                                           "X-Tiermesh-Rows": str(v.job.rows)})
        resp.content_length = size
        await resp.prepare(request)
        while block := await loop.run_in_executor(None, npz.read, _COPY):
            await resp.write(block)
        await resp.write_eof()
        return resp
    finally:
        parts.close()
        if npz is not None:
            with contextlib.suppress(OSError):
                npz.close()


def _size(f: IO[bytes]) -> int:
    f.seek(0, 2)
    size = f.tell()
    f.seek(0)
    return size


async def stream_result(request: web.Request, v: JobView, fmt: str, data: DataClient,
                        spool: Path) -> web.StreamResponse:
    """Send done job ``v``'s outputs, rows in input order, as ``fmt`` (one of ``RESULT_FORMATS``)."""
    if fmt == "jsonl":
        return await _jsonl(request, v, data)
    return await _npz(request, v, data, spool)
