"""The variant store's data area: tenants' offline-job inputs and outputs, content-addressed and private to a
tenant, beside the model blobs: ``<root>/<tenant>/sha256/<ab>/<digest>``.

    PUT  /data/<tenant>/<digest>   store the body (streamed to disk, hashed as it arrives; it must hash to
                                   <digest>: 400 otherwise); 201, or 200 when already held (nothing charged twice)
    GET  /data/<tenant>/<digest>   the bytes (404 when absent)
    GET  /data/<tenant>            {"used_bytes", "quota_bytes", "objects"}
    DELETE /data/<tenant>/<digest>[?min_age_s=S]
                                   remove it (the scheduler's retention sweep): 200 {"digest", "freed"}, 404 when
                                   absent, 409 when it was stored or stored again less than S seconds ago

Who (with TLS: the client certificate's identity): tenant T reads and writes only ``/data/T``; sites (they
admit jobs at their door and run chunks), admins and variant stores any tenant's. Narrowing a site to the
tenants whose chunks it holds is not built yet. Only an admin or the scheduler deletes (``may_delete_data``): never
a tenant (its data may be a job's input another of its jobs shares) nor a site. Without TLS (development only)
anyone may do anything.

Deleting is safe against a new job that shares the object: storing an object that is held already refreshes its
time, and a delete with ``min_age_s`` spares an object stored within that window (the store's own clock on both
sides: no two machines' clocks are compared). A door stores a job's input before it admits the job; a sweep that
decided on an older snapshot of the jobs then finds the object too young and leaves it.

Quotas: bytes per tenant (``quotas`` by name, else ``quota_bytes``), charged as bytes arrive (uploads in flight
count), so two concurrent uploads cannot both slip under it; over it: 413 with the quota and the usage.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

from aiohttp import web

from mesh.errors import ConflictError, PayloadTooLarge, PermissionDenied, RequestError
from mesh.log import get_logger, kv
from mesh.pki.identity import Identity
from variant_store.blobs import is_digest

__all__ = ["DEFAULT_QUOTA", "DataArea", "data_routes", "may_delete_data", "may_use_data"]

log = get_logger(__name__)
DEFAULT_QUOTA = 2 << 30
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
Route = tuple[str, str, Callable[[web.Request], Any]]


def may_use_data(peer: Identity | None, tenant: str) -> bool:
    """Whether ``peer`` may read and write ``tenant``'s data (``None``: no TLS, development only)."""
    if peer is None:
        return True
    if peer.kind == "tenant":
        return peer.name == tenant
    return peer.kind in ("site", "admin", "store")


def may_delete_data(peer: Identity | None) -> bool:
    """Whether ``peer`` may delete data (``None``: no TLS, development only): an operator or the scheduler."""
    return peer is None or peer.kind in ("admin", "scheduler")


class DataArea:
    """Tenants' data under ``root``; file I/O runs in the default executor."""

    def __init__(self, root: Path | str, *, quota_bytes: int = DEFAULT_QUOTA,
                 quotas: Mapping[str, int] | None = None) -> None:
        self.root = Path(root)
        self.quota_bytes = quota_bytes
        self.quotas = dict(quotas or {})
        self._used: dict[str, int] = {}

    def quota(self, tenant: str) -> int:
        return self.quotas.get(tenant, self.quota_bytes)

    def _tenant_dir(self, tenant: str) -> Path:
        if not _TENANT.match(tenant):
            raise RequestError(f"not a tenant name: {tenant[:40]!r}")
        return self.root / tenant / "sha256"

    def path(self, tenant: str, digest: str) -> Path:
        if not is_digest(digest):
            raise RequestError(f"not a sha256 digest: {digest[:80]!r}")
        return self._tenant_dir(tenant) / digest[:2] / digest

    def used(self, tenant: str) -> int:
        if tenant not in self._used:
            d = self._tenant_dir(tenant)
            self._used[tenant] = sum(p.stat().st_size for p in d.glob("*/*") if is_digest(p.name)) \
                if d.is_dir() else 0
        return self._used[tenant]

    def objects(self, tenant: str) -> int:
        d = self._tenant_dir(tenant)
        return sum(1 for p in d.glob("*/*") if is_digest(p.name)) if d.is_dir() else 0

    def _over(self, tenant: str, adding: int) -> PayloadTooLarge:
        q, used = self.quota(tenant), self.used(tenant)
        return PayloadTooLarge(f"tenant {tenant!r} data over quota: {used} bytes held + {adding} > {q} bytes",
                               quota_bytes=q, used_bytes=used)

    async def receive(self, tenant: str, digest: str, chunks: AsyncIterator[bytes],
                      declared: int | None = None) -> tuple[int, bool]:
        """Store ``chunks`` as ``tenant``'s object ``digest``; returns (size, created). ``RequestError`` when the
        bytes hash otherwise, ``PayloadTooLarge`` past the tenant's quota (``declared``: checked before reading)."""
        final = self.path(tenant, digest)
        if final.is_file():
            async for _ in chunks:  # drain: the client sends its body whatever we answer
                pass
            with contextlib.suppress(FileNotFoundError):  # in use again: a delete decided before now spares it
                os.utime(final)
            return final.stat().st_size, False
        if declared is not None and self.used(tenant) + declared > self.quota(tenant):
            raise self._over(tenant, declared)
        loop = asyncio.get_running_loop()
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".up-", dir=final.parent)
        h = hashlib.sha256()
        size = 0
        self._used[tenant] = self.used(tenant)
        try:
            with os.fdopen(fd, "wb") as f:
                async for chunk in chunks:
                    if self._used[tenant] + len(chunk) > self.quota(tenant):
                        raise self._over(tenant, size + len(chunk))
                    self._used[tenant] += len(chunk)  # charged as it lands: concurrent uploads see it
                    size += len(chunk)
                    h.update(chunk)
                    await loop.run_in_executor(None, f.write, chunk)
                await loop.run_in_executor(None, os.fsync, f.fileno())
            if h.hexdigest() != digest:
                raise RequestError(f"the body hashes to {h.hexdigest()}, not {digest}", actual=h.hexdigest())
            os.chmod(tmp, 0o444)
            os.replace(tmp, final)
        except BaseException:
            self._used[tenant] -= size
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        log.info("data stored", extra=kv(tenant=tenant, event="data_stored", digest=digest[:12], size=size))
        return size, True


    async def remove(self, tenant: str, digest: str, *, min_age_s: float = 0.0) -> int | None:
        """Delete ``tenant``'s object ``digest``; the bytes freed (taken off the tenant's usage), or None when it is
        absent. ``ConflictError`` when it was stored (or stored again) less than ``min_age_s`` seconds ago."""
        path = self.path(tenant, digest)
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        age = time.time() - st.st_mtime
        if age < min_age_s:
            raise ConflictError(f"data {digest[:12]} of tenant {tenant!r} was stored {age:.0f} s ago, under "
                                f"{min_age_s:.0f} s: kept", age_s=round(age, 3))
        try:
            path.unlink()
        except FileNotFoundError:  # a concurrent delete won
            return None
        if tenant in self._used:
            self._used[tenant] = max(0, self._used[tenant] - st.st_size)
        log.info("data removed", extra=kv(tenant=tenant, event="data_removed", digest=digest[:12], size=st.st_size))
        return st.st_size


def data_routes(area: DataArea, peer: Callable[[web.Request], Identity | None]) -> list[Route]:
    """The data area's routes; ``peer(request)``: the caller's verified identity (None without TLS)."""

    def allowed(request: web.Request) -> str:
        tenant = request.match_info["tenant"]
        who = peer(request)
        if not may_use_data(who, tenant):
            raise PermissionDenied(f"{who} may not use tenant {tenant!r}'s data", reason="other_tenant")
        return tenant

    async def put(request: web.Request) -> web.Response:
        tenant = allowed(request)
        digest = request.match_info["digest"]
        area.path(tenant, digest)  # a bad name is refused before the body is read
        size, created = await area.receive(tenant, digest, request.content.iter_chunked(1 << 16),
                                           request.content_length)
        return web.json_response({"digest": digest, "size": size}, status=201 if created else 200)

    async def get(request: web.Request) -> web.StreamResponse:
        tenant = allowed(request)
        path = area.path(tenant, request.match_info["digest"])
        if not path.is_file():
            raise _Absent(f"no data {request.match_info['digest']} for tenant {tenant!r}")
        return web.FileResponse(path, headers={"Content-Type": "application/octet-stream"})

    async def usage(request: web.Request) -> web.Response:
        tenant = allowed(request)
        return web.json_response({"used_bytes": area.used(tenant), "quota_bytes": area.quota(tenant),
                                  "objects": area.objects(tenant)})

    async def delete(request: web.Request) -> web.Response:
        tenant = request.match_info["tenant"]
        who = peer(request)
        if not may_delete_data(who):
            raise PermissionDenied(f"{who} may not delete data: only an admin or the scheduler may",
                                   reason="not_operator")
        digest = request.match_info["digest"]
        try:
            min_age_s = float(request.query.get("min_age_s", "0"))
        except ValueError as exc:
            raise RequestError(f"min_age_s is not a number: {request.query['min_age_s'][:40]!r}") from exc
        if not 0.0 <= min_age_s <= 1e9:  # NaN fails this too
            raise RequestError(f"min_age_s must be in [0, 1e9] seconds, got {min_age_s}")
        freed = await area.remove(tenant, digest, min_age_s=min_age_s)
        if freed is None:
            raise _Absent(f"no data {digest} for tenant {tenant!r}")
        return web.json_response({"digest": digest, "freed": freed})

    return [("PUT", "/data/{tenant}/{digest}", put), ("GET", "/data/{tenant}/{digest}", get),
            ("GET", "/data/{tenant}", usage), ("DELETE", "/data/{tenant}/{digest}", delete)]


class _Absent(RequestError):
    """Absent data: 404 (the code stays ``bad_request``)."""

    http_status = 404
