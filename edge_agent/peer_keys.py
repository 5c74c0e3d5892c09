"""Which CURVE key this site dials each peer with, and which sockets must be re-dialled when a peer re-keys.

A peer serves with the key its valid certificate binds. While it rotates (its certificate re-issued with a new
key) it may for a moment still serve with the previous one, and it says which in its live record. So two keys
can be right: the one the live record publishes, tried first, and the one the certificate binds. A connection
that drops or fails its handshake names the key it had (``lost``): the next socket tries the other one. That is
how a peer re-binding with its new key is reached at the first reconnect, without waiting for its live record
(etcd, then this site's view, a few hundred milliseconds later), and how one that had not re-keyed yet is
dialled back with the old key at the next failure. A live record publishing a key the certificate does not bind
(nor bound before its re-issue) is refused, and so is a peer whose certificate is not known here (not published in
etcd, or not vouched for by the CA): etcd delivers keys, the CA decides, so a key etcd alone vouches for is never
dialled.

Where each peer is dialled, and which edge URL of it is used, is :class:`PeerAddresses`: a live record's
``endpoint`` and ``http`` are believed only as far as the peer's certificate vouches for them
(:func:`mesh.pki.site_names.believe`), so a site cannot take another's endpoint (the transport keeps one socket
per endpoint, opened with the key of the one site believed there) nor point peers at a URL of its choosing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from mesh.log import get_logger, kv
from mesh.pki.site_names import Believed, Believer, Claim

if TYPE_CHECKING:  # CURVE loads cryptography: only a secured agent builds this
    from mesh.zmq.site_keys import SiteKeys

__all__ = ["PeerAddresses", "PeerKeys", "serving_keys"]

log = get_logger(__name__)


def serving_keys(bound: bytes | None, previous: bytes | None, published: bytes | None) -> tuple[bytes, ...] | None:
    """The keys a peer may be serving with, the one to try first first, from the key its certificate binds
    (``bound``), the one it bound before a re-issue still in its grace period (``previous``) and the one its
    live record publishes. ``()``: none known (no valid certificate: a published key alone is never enough); None:
    the live record publishes a key the certificate does not bind (read the certificates again before refusing
    it)."""
    if bound is None:
        return ()
    if published is None:
        return (bound,)
    if published == bound:
        return (bound,)
    if published == previous:  # re-issued: it has not said yet that it took the new key
        return (published, bound)
    return None


class PeerAddresses:
    """Where each live peer is dialled and which of its edge URLs is used, believed from its certificate
    (``sites``) and re-computed by :meth:`update` when the live records or the certificates change. ``peer_map``:
    the operator's WAN-emulation routes (site -> endpoint dialled instead of the one it advertises)."""

    def __init__(self, here: str, sites: SiteKeys, peer_map: Mapping[str, str] | None = None) -> None:
        self.here, self.sites, self.peer_map = here, sites, dict(peer_map or {})
        self.believed: dict[str, Believed] = {}
        self._believer = Believer(here)

    def update(self, live: Mapping[str, Any]) -> None:
        claims = {site: Claim(getattr(rec, "endpoint", None), getattr(rec, "http", None), self.peer_map.get(site))
                  for site, rec in live.items() if site != self.here}
        self.believed = self._believer.update(claims, self.sites.all_names())

    def endpoint(self, site: str) -> str | None:
        b = self.believed.get(site)
        return b.endpoint if b is not None else None

    def http(self, site: str) -> str | None:
        b = self.believed.get(site)
        return b.http if b is not None else None


class PeerKeys:
    """The key each peer endpoint's socket was opened with, from ``sites`` (certificates) and ``live`` (site ->
    live record with a ``curve_key``); ``endpoint_of(site)`` maps a live site to the endpoint dialled."""

    def __init__(self, here: str, sites: SiteKeys, live: Callable[[], Mapping[str, Any]],
                 endpoint_of: Callable[[str], str | None]) -> None:
        self.here, self.sites, self._live, self._endpoint_of = here, sites, live, endpoint_of
        self._dialled: dict[str, bytes | None] = {}  # endpoint -> the key its socket was opened with

    def server_key(self, endpoint: str, lost: bytes | None = None) -> bytes | None:
        """``ZmqClient``'s ``server_key_for``: the key to dial ``endpoint`` with now, remembered."""
        key = self._dialled[endpoint] = self._choose(endpoint, lost)
        return key

    def rotated(self) -> list[tuple[str, bytes | None]]:
        """The endpoints whose socket has a key its peer no longer serves with, each with the key to dial it
        with now (None: nothing may dial it); forgotten here until dialled again."""
        out = []
        for endpoint, dialled in list(self._dialled.items()):
            found = self._keys(endpoint)
            if found is not None and found[1] is None and self.sites.refresh():
                found = self._keys(endpoint)  # re-issued since we last read the certificates
            if found is not None and found[1] and dialled in found[1]:
                continue
            self._dialled.pop(endpoint, None)
            out.append((endpoint, self._choose(endpoint, None)))
        return out

    def _choose(self, endpoint: str, lost: bytes | None) -> bytes | None:
        for _ in range(2):  # a second look only after the certificates were read again
            found = self._keys(endpoint)
            if found is None:
                return None
            site, keys = found
            if keys is None or (lost is not None and keys == (lost,)):
                # a key nobody binds, or the only one we know just failed: re-issued since we last looked?
                if self.sites.refresh():
                    continue
                if keys is None:
                    log.warning("%s publishes a CURVE key its certificate does not bind: not dialled", site,
                                extra=kv(site=self.here, peer=site, event="curve_mismatch"))
                    return None
            if not keys:
                return None
            if lost in keys and len(keys) > 1:
                return next(k for k in keys if k != lost)
            return keys[0]
        return None

    def _keys(self, endpoint: str) -> tuple[str, tuple[bytes, ...] | None] | None:
        """The live site behind ``endpoint`` and the keys it may serve with (see :func:`serving_keys`); None if
        no live site is dialled there, or its certificate here is refused (revoked, expired)."""
        # ``endpoint_of`` maps at most one live site to an endpoint (PeerAddresses): the one whose key it is dialled
        # with, whatever other live records claim the same endpoint
        for site, rec in self._live().items():
            if site == self.here or self._endpoint_of(site) != endpoint:
                continue
            bound = self.sites.key_of(site)
            if bound is None and self.sites.refuses(site):
                return None
            published = rec.curve_key.encode() if rec.curve_key else None
            return site, serving_keys(bound, self.sites.previous_key(site), published)
        return None
