"""Blobs between sites. An agent serves the verified blobs in its cache to its peers (``GET
/blobs/{digest}`` on its HTTP API: only a site identity over mutual TLS; anyone on an ``--insecure``
agent), and fetches a blob from the nearest live site whose heartbeat holds a variant built on it
before it falls back to the variant store, so a cold start at an edge pays a hop to its neighbour,
not a WAN round trip to the store. Whatever the source, the bytes are checked against their digest on
arrival; a peer that fails or serves bad bytes costs one try.

A peer is a source only as far as it is believed (:class:`PeerSource`): its URL is the one its certificate vouches
for (``http_of``: :class:`edge_agent.peer_keys.PeerAddresses`; what its live record says only on an ``--insecure``
mesh), the server must prove to be that site, and it may send at most the size the catalog states for the blob
(:mod:`edge_agent.blob_cache`). A blob whose size the catalog does not state (a shared backbone: variants name its
digest, not its size) comes from the variant store only.

Only public blobs pass between peers. A tenant's private blob comes from the variant store, which gives it only to
the sites placement asks to serve that tenant (:mod:`variant_store.placed`): an agent cannot tell which of its peers
that is (it follows its own placement only), so it serves none of them, and asks none for one. The cost is a cold
start of a private variant paying the trip to the store rather than to a neighbour.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from edge_agent.observe import Route
from mesh.errors import BadTensor, CatalogError, PermissionDenied
from variant_store.blobs import is_digest
from variant_store.meta import PUBLIC, VariantMeta

if TYPE_CHECKING:  # mutual TLS (cryptography) is loaded only by an agent that serves it
    from edge_agent.mtls import EdgeTls

__all__ = ["PEER_FETCH_TIMEOUT_S", "PeerSource", "blob_routes", "peer_sources", "public_blob"]

PEER_FETCH_TIMEOUT_S = 5.0  # a peer that does not deliver in this long is skipped for the next source
SUFFIXES = (".onnx", ".tflite")


def public_blob(digest: str, metas: Iterable[VariantMeta]) -> bool:
    """Whether a public variant among ``metas`` is built on blob ``digest`` (what a peer may serve another)."""
    return any(m.owner == PUBLIC and m.names(digest) for m in metas)


def blob_routes(cache_dir: Path, tls: EdgeTls | None, shareable: Callable[[str], bool]) -> list[Route]:
    """``GET /blobs/{digest}``: the cached blob, to sites only, and only if ``shareable`` (a public variant's)."""
    async def get(request: web.Request) -> web.StreamResponse:
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
        if not shareable(digest):
            raise PermissionDenied(f"blob {digest} is not a public variant's: a private blob comes from the variant "
                                   f"store only, to the sites placement asks to serve its tenant",
                                   reason="private_blob")
        # streamed from the file in chunks (sendfile where the socket allows): never a whole blob in memory per request
        return web.FileResponse(path, headers={"Content-Type": "application/octet-stream", "ETag": f'"{digest}"'})

    return [("GET", "/blobs/{digest}", get)]


@dataclass(frozen=True, slots=True)
class PeerSource:
    """A live site to fetch a blob from: its base URL, and the most bytes it may send (the catalog's size)."""

    site: str
    url: str
    max_bytes: int


def peer_sources(digest: str, here: str, live: Mapping[str, object], rtt_ms: Callable[[str], float],
                 variant: Callable[[str], VariantMeta | None],
                 http_of: Callable[[str], str | None]) -> list[PeerSource]:
    """The live sites (not ``here``) holding a public variant whose blob is ``digest``, nearest first by ``rtt_ms``,
    each at the URL ``http_of`` believes for it (None: not a source). ``live``: site -> heartbeat (``loaded``)."""
    found: list[tuple[float, str, PeerSource]] = []
    for site, hb in live.items():
        if site == here:
            continue
        for vid in getattr(hb, "loaded", {}) or {}:
            meta = variant(vid)
            if meta is None or meta.blob_digest != digest or meta.owner != PUBLIC:
                continue
            url, rtt = http_of(site), rtt_ms(site)
            if url and math.isfinite(rtt) and meta.size_bytes > 0:
                found.append((rtt, site, PeerSource(site, url, meta.size_bytes)))
            break
    return [src for _, _, src in sorted(found, key=lambda f: f[:2])]
