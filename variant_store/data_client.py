"""A site's client of the variant store's data area (``variant_store.data_area``): tenants' job inputs and chunk
outputs, streamed between files and the store, with this site's client certificate when the store is HTTPS.

The store's URL is the one it announced (``BlobCache.store_url``); an error reply becomes the ``MeshError`` its
code names (a quota's 413 keeps its message, which states the quota). A downloaded object is hashed as it lands
and kept only when it hashes to its name: the store is trusted for nothing but delivery.

:meth:`DataClient.delete` is the scheduler's (retention: ``core_scheduler.job_sweeper``, which takes any object with
that method): the store refuses it to a site's or a tenant's certificate.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import ssl
import tempfile
from collections.abc import Callable
from pathlib import Path

import aiohttp

from mesh.errors import BlobError, ConflictError, PeerUnavailable, error_from_reply

__all__ = ["DataClient"]

_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=60.0)


class DataClient:
    """``store_url()``: the store's base URL or None (not announced yet); ``ssl()``: the client TLS context (None:
    plain HTTP, an ``--insecure`` mesh)."""

    def __init__(self, store_url: Callable[[], str | None], ssl_context: Callable[[], ssl.SSLContext | None]) -> None:
        self._store_url = store_url
        self._ssl = ssl_context

    def _url(self, tenant: str, digest: str) -> str:
        base = self._store_url()
        if base is None:
            raise PeerUnavailable("no variant store has announced itself: job data cannot be stored or read")
        return f"{base.rstrip('/')}/data/{tenant}/{digest}"

    def _ssl_arg(self) -> ssl.SSLContext | bool:
        ctx = self._ssl()
        return ctx if ctx is not None else False

    async def _check(self, resp: aiohttp.ClientResponse) -> None:
        if resp.status >= 400:
            raise error_from_reply(resp.status, await resp.read())

    async def put_file(self, tenant: str, digest: str, path: Path) -> None:
        """Upload ``path`` (streamed from disk) as ``tenant``'s object ``digest``."""
        try:
            async with aiohttp.ClientSession(timeout=_TIMEOUT) as session:
                with open(path, "rb") as f:  # noqa: ASYNC230  (aiohttp reads the file in its executor)
                    async with session.put(self._url(tenant, digest), data=f, ssl=self._ssl_arg(),
                                           headers={"Content-Length": str(os.fstat(f.fileno()).st_size)}) as resp:
                        await self._check(resp)
        except aiohttp.ClientError as exc:
            raise PeerUnavailable(f"variant store data area unreachable: {exc}") from exc

    async def put_bytes(self, tenant: str, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        try:
            async with aiohttp.ClientSession(timeout=_TIMEOUT) as session, \
                    session.put(self._url(tenant, digest), data=data, ssl=self._ssl_arg()) as resp:
                await self._check(resp)
        except aiohttp.ClientError as exc:
            raise PeerUnavailable(f"variant store data area unreachable: {exc}") from exc
        return digest

    async def get_file(self, tenant: str, digest: str, path: Path, *, max_bytes: int) -> Path:
        """``tenant``'s object ``digest`` at ``path`` (downloaded unless there already), checked against its
        name; at most ``max_bytes``."""
        if path.is_file():  # noqa: ASYNC240  (a stat)
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".dl-", dir=path.parent)
        h = hashlib.sha256()
        size = 0
        loop = asyncio.get_running_loop()
        try:
            with os.fdopen(fd, "wb") as f:
                async with aiohttp.ClientSession(timeout=_TIMEOUT) as session, \
                        session.get(self._url(tenant, digest), ssl=self._ssl_arg()) as resp:
                    await self._check(resp)
                    async for chunk in resp.content.iter_chunked(1 << 16):
                        size += len(chunk)
                        if size > max_bytes:
                            raise BlobError(f"data {digest[:12]} is over {max_bytes} bytes", digest=digest)
                        h.update(chunk)
                        await loop.run_in_executor(None, f.write, chunk)
            if h.hexdigest() != digest:
                raise BlobError(f"data {digest[:12]} from the store hashes to {h.hexdigest()[:12]}", digest=digest)
            os.replace(tmp, path)
        except aiohttp.ClientError as exc:
            raise PeerUnavailable(f"variant store data area unreachable: {exc}") from exc
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return path

    async def get_bytes(self, tenant: str, digest: str, *, max_bytes: int) -> bytes:
        """A small object (a chunk's outputs) in memory, checked against its name."""
        try:
            async with aiohttp.ClientSession(timeout=_TIMEOUT) as session, \
                    session.get(self._url(tenant, digest), ssl=self._ssl_arg()) as resp:
                await self._check(resp)
                if (resp.content_length or 0) > max_bytes:
                    raise BlobError(f"data {digest[:12]} is over {max_bytes} bytes", digest=digest)
                parts, size = [], 0
                async for chunk in resp.content.iter_chunked(1 << 16):
                    size += len(chunk)
                    if size > max_bytes:
                        raise BlobError(f"data {digest[:12]} is over {max_bytes} bytes", digest=digest)
                    parts.append(chunk)
                data = b"".join(parts)
        except aiohttp.ClientError as exc:
            raise PeerUnavailable(f"variant store data area unreachable: {exc}") from exc
        if len(data) > max_bytes or hashlib.sha256(data).hexdigest() != digest:
            raise BlobError(f"data {digest[:12]} from the store is not what its name says", digest=digest)
        return data

    async def delete(self, tenant: str, digest: str, *, min_age_s: float = 0.0) -> int | None:
        """Delete ``tenant``'s object ``digest``: the bytes freed, None when the store does not hold it;
        ``ConflictError`` when it was stored (again) less than ``min_age_s`` seconds ago, ``PermissionDenied`` for
        a caller that may not delete (anyone but an admin or the scheduler)."""
        try:
            async with aiohttp.ClientSession(timeout=_TIMEOUT) as session, \
                    session.delete(self._url(tenant, digest), params={"min_age_s": repr(float(min_age_s))},
                                   ssl=self._ssl_arg()) as resp:
                if resp.status == 404:
                    return None
                body = await resp.read()
        except aiohttp.ClientError as exc:
            raise PeerUnavailable(f"variant store data area unreachable: {exc}") from exc
        if resp.status >= 400:
            err = error_from_reply(resp.status, body)
            if resp.status == 409 and not isinstance(err, ConflictError):
                raise ConflictError(str(err)) from err
            raise err
        try:
            freed = json.loads(body).get("freed")
        except (UnicodeDecodeError, ValueError, AttributeError):
            freed = None
        return freed if isinstance(freed, int) and not isinstance(freed, bool) else 0
