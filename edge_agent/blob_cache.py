"""A site's blob cache: a variant's file from this site's cache, else the nearest live peer holding it, else the
variant store, verified on arrival either way (:func:`variant_store.fetch.fetch_blob`).

Downloads are deduplicated per digest: variants that share a blob once fetched it into one ``.part`` file at the
same time, and one download then lost its file to the other's rename (a ``runtime_load`` failure). Blobs are
content-addressed and land by rename, so a fetch needs no lock beyond that.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from pathlib import Path

from edge_agent.blobs import PEER_FETCH_TIMEOUT_S
from mesh.errors import MeshError, RuntimeLoadError
from mesh.lifecycle import single_flight
from mesh.log import get_logger, kv
from variant_store.blobs import sha256_file
from variant_store.fetch import fetch_blob

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
        # peers' base URLs that hold a blob (digest -> nearest first), tried before the store (edge_agent.blobs)
        self.peer_sources: Callable[[str], list[str]] | None = None
        self._fetching: dict[str, asyncio.Future[Path]] = {}

    async def fetch(self, digest: str, fmt: str) -> Path:
        """The verified file of blob ``digest`` (a ``fmt`` model) in this site's cache, fetched if need be."""
        path = self.cache_dir / f"{digest}{'.tflite' if fmt == 'tflite' else '.onnx'}"
        return await single_flight(self._fetching, digest, lambda: self._fetch_once(digest, path),
                                   lambda: RuntimeLoadError("fetch cancelled"))

    async def _fetch_once(self, digest: str, path: Path) -> Path:
        if await asyncio.get_running_loop().run_in_executor(None, _cached, path, digest):
            return path
        for url in self.peer_sources(digest) if self.peer_sources is not None else ():
            try:
                return await fetch_blob(url, digest, path, ssl=self.ssl, timeout=PEER_FETCH_TIMEOUT_S)
            except MeshError as exc:  # gone, refused, or bytes that did not verify: the next source
                log.info("blob %s from peer %s failed: %s", digest[:12], url, exc,
                         extra=kv(site=self.site, event="blob_peer_failed"))
        if self.store_url is None:
            raise RuntimeLoadError(f"{self.site}: variant store not announced and no peer holds blob {digest}")
        return await fetch_blob(self.store_url, digest, path, ssl=self.ssl)
