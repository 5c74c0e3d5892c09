"""Client side of the blob service: download one blob by digest, resume a partial download,
verify the bytes before anyone can use them.

``dest`` doubles as a local cache entry: a ``dest`` that already hashes to ``digest`` is kept as is.
Bytes land in ``<dest>.part`` and are renamed onto ``dest`` only after they verified, so a reader
of ``dest`` never sees unverified bytes.
"""

from __future__ import annotations

import asyncio
import os
import ssl as _ssl
from collections.abc import Callable
from pathlib import Path

import aiohttp

from mesh.errors import BlobError, MeshError, PeerUnavailable, PermissionDenied, Unauthenticated, error_from_code
from mesh.log import get_logger, kv
from variant_store.blobs import is_digest, sha256_file

__all__ = ["fetch_blob", "spool"]

log = get_logger(__name__)
_CHUNK = 1 << 16
_FLUSH = 1 << 20  # write to disk (off the loop) a megabyte at a time


async def fetch_blob(base_url: str, digest: str, dest: Path, *, session: aiohttp.ClientSession | None = None,
                     timeout: float = 30, tenant: str | None = None,  # noqa: ASYNC109
                     ssl: _ssl.SSLContext | None = None) -> Path:
    """Download blob ``digest`` from the variant store at ``base_url`` into ``dest`` and return ``dest``.

    Raises ``BlobError`` when the blob is missing, the store refuses it (corrupt at the source),
    or the bytes received do not hash to ``digest`` (the bad file is deleted); ``PeerUnavailable``
    when the store cannot be reached; ``PermissionDenied`` when an HTTPS store refuses this identity a
    tenant-private blob. ``ssl``: the client context (the caller's mesh certificate) for an ``https://`` store.
    """
    if not is_digest(digest):
        raise BlobError(f"not a sha256 digest: {digest!r}", digest=digest)
    dest = Path(dest)
    loop = asyncio.get_running_loop()
    if dest.is_file():
        if await loop.run_in_executor(None, sha256_file, dest) == digest:
            return dest
        _discard(dest)  # a stale or damaged cache entry: fetch it again
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    headers = {"X-Tiermesh-Tenant": tenant} if tenant else {}
    own = session is None
    sess = session or aiohttp.ClientSession()
    try:
        resumed = await _download(sess, base_url, digest, part, headers, timeout, ssl)
        got = await loop.run_in_executor(None, sha256_file, part)
        if got != digest and resumed:
            # the partial file itself may have been bad: one clean retry before blaming the store
            log.warning("resumed blob did not verify; downloading again", extra=kv(event="blob_retry"))
            _discard(part)
            await _download(sess, base_url, digest, part, headers, timeout, ssl)
            got = await loop.run_in_executor(None, sha256_file, part)
        if got != digest:
            _discard(part)
            raise BlobError(f"digest mismatch: expected {digest} got {got}", digest=digest, actual=got)
        os.replace(part, dest)
        return dest
    finally:
        if own:
            await sess.close()


async def _download(sess: aiohttp.ClientSession, base_url: str, digest: str, part: Path,
                    headers: dict[str, str], timeout: float,  # noqa: ASYNC109
                    ssl: _ssl.SSLContext | None = None) -> bool:
    """Fill ``part``; returns True when it appended to bytes already there (a resumed download)."""
    have = _size(part)
    hdrs = dict(headers)
    if have:
        # If-Range: should the store ever hold different bytes under this name, send them whole
        hdrs.update({"Range": f"bytes={have}-", "If-Range": f'"{digest}"'})
    url = f"{base_url.rstrip('/')}/blobs/{digest}"
    try:
        async with sess.get(url, headers=hdrs, timeout=aiohttp.ClientTimeout(total=timeout),
                            ssl=ssl if ssl is not None else True) as resp:
            if resp.status == 416 and have:
                # the partial file is as long as (or longer than) the blob: start over
                _discard(part)
                return await _download(sess, base_url, digest, part, headers, timeout, ssl)
            if resp.status not in (200, 206):
                raise await _error_from(resp, digest)
            resumed = resp.status == 206 and have > 0
            await spool(resp, part, append=resumed)
            return resumed
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise PeerUnavailable(f"variant store at {base_url} unreachable: {exc!r}", url=base_url) from exc


async def spool(resp: aiohttp.ClientResponse, path: Path, *, append: bool = False, max_bytes: int | None = None,
                too_much: Callable[[], MeshError] | None = None) -> None:
    """Write ``resp``'s body to ``path`` (appended to it with ``append``), a megabyte at a time off the loop.
    Past ``max_bytes`` of body it stops and raises ``too_much()`` (what is written so far stays: the caller's
    ``.part`` to discard)."""
    loop = asyncio.get_running_loop()
    f = await loop.run_in_executor(None, open, path, "ab" if append else "wb")
    try:
        buf, total = bytearray(), 0
        async for chunk in resp.content.iter_chunked(_CHUNK):
            total += len(chunk)
            if max_bytes is not None and total > max_bytes:
                raise too_much() if too_much is not None else BlobError(f"more than {max_bytes} bytes")
            buf += chunk
            if len(buf) >= _FLUSH:
                await loop.run_in_executor(None, f.write, bytes(buf))
                buf.clear()
        await loop.run_in_executor(None, f.write, bytes(buf))
    finally:
        await loop.run_in_executor(None, f.close)


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


def _discard(path: Path) -> None:
    path.unlink(missing_ok=True)


async def _error_from(resp: aiohttp.ClientResponse, digest: str) -> MeshError:
    try:
        body = await resp.json(content_type=None)
        err = error_from_code(str(body.get("code", "blob")), str(body.get("error", "")))
    except (ValueError, aiohttp.ContentTypeError, AttributeError):
        err = BlobError(f"variant store answered HTTP {resp.status} for blob {digest}")
    if isinstance(err, BlobError | PermissionDenied | Unauthenticated):
        return err
    return BlobError(f"variant store refused blob {digest}: HTTP {resp.status}: {err}", digest=digest)
