"""Blobs between sites. An agent serves the verified blobs in its cache to its peers (``GET
/blobs/{digest}`` on its HTTP API: only a site identity over mutual TLS; anyone on an ``--insecure``
agent), and fetches a blob from the nearest live site whose heartbeat holds a variant built on it
before it falls back to the variant store, so a cold start at an edge pays a hop to its neighbour,
not a WAN round trip to the store. Whatever the source, the bytes are checked against their digest on
arrival (:func:`variant_store.fetch.fetch_blob`); a peer that fails or serves bad bytes costs one try.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from edge_agent.observe import Route
from mesh.errors import BadTensor, CatalogError, PermissionDenied
from variant_store.blobs import is_digest
from variant_store.meta import VariantMeta

if TYPE_CHECKING:  # mutual TLS (cryptography) is loaded only by an agent that serves it
    from edge_agent.mtls import EdgeTls

__all__ = ["PEER_FETCH_TIMEOUT_S", "blob_routes", "peer_sources"]

PEER_FETCH_TIMEOUT_S = 5.0  # a peer that does not deliver in this long is skipped for the next source
SUFFIXES = (".onnx", ".tflite")


def blob_routes(cache_dir: Path, tls: EdgeTls | None) -> list[Route]:
    async def get(request: web.Request) -> web.Response:
        if tls is not None:
            who = tls.peer(request)
            if who.kind != "site":
                raise PermissionDenied(f"{who} is a {who.kind}: blobs are served to sites only", reason="wrong_kind")
        digest = request.match_info["digest"]
        if not is_digest(digest):
            raise BadTensor(f"not a sha256 digest: {digest[:80]!r}")
        # only what fetch_blob put in place: verified, renamed from .part
        path = next((p for p in (cache_dir / f"{digest}{s}" for s in SUFFIXES) if p.is_file()), None)
        if path is None:
            raise CatalogError(f"no blob {digest} cached here")
        data = await asyncio.get_running_loop().run_in_executor(None, path.read_bytes)
        return web.Response(body=data, content_type="application/octet-stream", headers={"ETag": f'"{digest}"'})

    return [("GET", "/blobs/{digest}", get)]


def peer_sources(digest: str, here: str, live: Mapping[str, object], rtt_ms: Callable[[str], float],
                 variant: Callable[[str], VariantMeta | None]) -> list[str]:
    """HTTP URLs of the live sites (not ``here``) holding a variant whose blob or shared base is
    ``digest``, nearest first by ``rtt_ms``. ``live``: site -> heartbeat (``loaded``, ``http``)."""
    found: list[tuple[float, str]] = []
    for site, hb in live.items():
        url = getattr(hb, "http", None)
        if site == here or not url:
            continue
        for vid in getattr(hb, "loaded", {}) or {}:
            meta = variant(vid)
            if meta is not None and digest in (meta.blob_digest, meta.shared_base_digest):
                rtt = rtt_ms(site)
                if math.isfinite(rtt):
                    found.append((rtt, url))
                break
    return [url for _, url in sorted(found)]
