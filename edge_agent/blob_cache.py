"""A site's blob cache: a variant's file from this site's cache, else the nearest live peer holding it, else the
variant store, verified on arrival either way.

Downloads are deduplicated per digest: variants that share a blob once fetched it into one ``.part`` file at the
same time, and one download then lost its file to the other's rename (a ``runtime_load`` failure). Blobs are
content-addressed and land by rename, so a fetch needs no lock beyond that.

A peer is another site, and a compromised one must not be able to fill this site's disk or stand in for a third
site, so a fetch from a peer (:meth:`BlobCache._from_peer`) differs from the store's resumable download
(:func:`variant_store.fetch.fetch_blob`): the TLS server must prove to be the site the source names
(``verify_server``: its certificate's URI SAN, checked before a byte of the body is read), the body may be at most
the catalog's size for the blob (a larger ``Content-Length`` is refused at once, a longer body cut off at the cap),
and it lands in a file of its own that is deleted on any failure (never resumed by the store's download).
"""

from __future__ import annotations

import asyncio
import os
import ssl
from collections.abc import Callable
from pathlib import Path

import aiohttp

from edge_agent.blobs import PEER_FETCH_TIMEOUT_S, PeerSource
from mesh.errors import BlobError, MeshError, PeerUnavailable, RuntimeLoadError
from mesh.lifecycle import single_flight
from mesh.log import get_logger, kv
from mesh.pki.site_names import response_ssl_object
from variant_store.blobs import sha256_file
from variant_store.fetch import fetch_blob, spool

__all__ = ["BlobCache"]

log = get_logger(__name__)


def _cached(path: Path, digest: str) -> bool:
    return path.is_file() and sha256_file(path) == digest


class BlobCache:
    def __init__(self, site: str, cache_dir: Path) -> None:
        self.site = site
        self.cache_dir = cache_dir
        self.store_url: str | None = None            # the variant store, once announced
        self.ssl: ssl.SSLContext | None = None       # this site's client certificate, for https:// sources
        # the live peers that hold a blob (digest -> nearest first), tried before the store (edge_agent.blobs)
        self.peer_sources: Callable[[str], list[PeerSource]] | None = None
        # the site an https peer's TLS server proves to be (its ssl object -> site name, raising MeshError): set
        # with ``ssl``; without it (an --insecure mesh, plain http) nobody is proved and only the cap holds
        self.verify_server: Callable[[object], str] | None = None
        self._fetching: dict[str, asyncio.Future[Path]] = {}

    async def fetch(self, digest: str, fmt: str) -> Path:
        """The verified file of blob ``digest`` (a ``fmt`` model) in this site's cache, fetched if need be."""
        path = self.cache_dir / f"{digest}{'.tflite' if fmt == 'tflite' else '.onnx'}"
        return await single_flight(self._fetching, digest, lambda: self._fetch_once(digest, path),
                                   lambda: RuntimeLoadError("fetch cancelled"))

    async def _fetch_once(self, digest: str, path: Path) -> Path:
        if await asyncio.get_running_loop().run_in_executor(None, _cached, path, digest):
            return path
        for src in self.peer_sources(digest) if self.peer_sources is not None else ():
            try:
                return await self._from_peer(src, digest, path)
            except MeshError as exc:  # gone, refused, too big, or bytes that did not verify: the next source
                log.info("blob %s from peer %s failed: %s", digest[:12], src.site, exc,
                         extra=kv(site=self.site, peer=src.site, event="blob_peer_failed"))
        if self.store_url is None:
            raise RuntimeLoadError(f"{self.site}: variant store not announced and no peer holds blob {digest}")
        return await fetch_blob(self.store_url, digest, path, ssl=self.ssl)

    async def _from_peer(self, src: PeerSource, digest: str, path: Path) -> Path:
        part = path.with_name(f"{path.name}.peer-{src.site}.part")
        part.parent.mkdir(parents=True, exist_ok=True)
        loop = asyncio.get_running_loop()
        try:
            await self._download(src, digest, part)
            got = await loop.run_in_executor(None, sha256_file, part)
            if got != digest:
                raise BlobError(f"{src.site} sent bytes that hash to {got}, not {digest}", digest=digest)
            os.replace(part, path)
            return path
        finally:
            part.unlink(missing_ok=True)

    async def _download(self, src: PeerSource, digest: str, part: Path) -> None:
        https = src.url.lower().startswith("https://")
        ssl_context: ssl.SSLContext | bool = False  # plain http: only on an --insecure mesh (PeerAddresses)
        if https:
            if self.ssl is None or self.verify_server is None:
                raise PeerUnavailable(f"{src.site}: no client certificate to fetch {src.url} with")
            ssl_context = self.ssl
        url = f"{src.url.rstrip('/')}/blobs/{digest}"
        timeout = aiohttp.ClientTimeout(total=PEER_FETCH_TIMEOUT_S)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session, \
                    session.get(url, ssl=ssl_context, allow_redirects=False) as resp:
                if https:
                    assert self.verify_server is not None
                    proved = self.verify_server(response_ssl_object(resp))
                    if proved != src.site:
                        raise BlobError(f"{src.url} is served by site {proved}, not {src.site}", digest=digest)
                if resp.status != 200:
                    raise BlobError(f"{src.site} answered HTTP {resp.status} for blob {digest}", digest=digest)
                if resp.content_length is not None and resp.content_length > src.max_bytes:
                    raise BlobError(f"{src.site} offers {resp.content_length} bytes for blob {digest}, which the "
                                    f"catalog says is {src.max_bytes}", digest=digest)
                await spool(resp, part, max_bytes=src.max_bytes, too_much=lambda: BlobError(
                    f"{src.site} sent more than the {src.max_bytes} bytes the catalog states for blob {digest}",
                    digest=digest))
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise PeerUnavailable(f"{src.site} at {src.url} unreachable: {exc!r}", url=src.url) from exc

