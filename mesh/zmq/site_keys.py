"""Which CURVE keys a site admits and dials: those bound by valid, unrevoked site certificates, learnt through etcd.

A site is a host of its own: it holds its own certificate, key and CURVE key pair, the CA and the revocation list,
nothing of its peers. Their certificates reach it through etcd (``pki/sites/<site>``, handed over by the agent's view
with :meth:`SiteKeys.publish`), and etcd is the delivery channel, never the authority. A published certificate is
believed only when it

    verifies           against the CA and the current revocation list (a site certificate, clientAuth EKU, in validity)
    names its key      is published under the name of the site it proves (``pki/sites/X`` holding Y's is refused)
    binds a CURVE key  (the subject attribute of :mod:`mesh.pki.curve`)
    is of the mesh     names a site of the topology, when the topology is known (``known``)

and then the key it binds is admitted (ZAP) and dialled, and the addresses it names bind that site (:meth:`names`):
what of a live record's ``endpoint`` and ``http`` is believed is :func:`mesh.pki.site_names.believe`'s rule.

This site's own certificate is read from its file (``site``), never from etcd: what it publishes is what it holds.
Refreshed when a certificate, the CA or the revocation list changed (and every 30 s regardless: certificates expire
without changing); started as a ``Service`` it polls its files every ``interval_s``. A site re-issued a certificate
(rotation) is not revoked: its previous key stays admitted for ``ROTATION_GRACE_S``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mesh.errors import ConfigError, MeshError
from mesh.log import get_logger, kv
from mesh.pki.curve import curve_key_from_certificate, raw_curve_key, z85_encode
from mesh.pki.files import PkiPaths
from mesh.pki.identity import Identity, Kind
from mesh.pki.reload import Poller
from mesh.pki.site_names import SiteNames

if TYPE_CHECKING:  # the trust store (cryptography) is built when CURVE is on
    from cryptography import x509

    from mesh.pki.trust import TrustStore

__all__ = ["ROTATION_GRACE_S", "SiteKeys"]

log = get_logger("mesh.zmq")
_SITE: tuple[Kind, ...] = ("site",)
_RECHECK_S = 30.0  # re-verify unchanged certificates this often anyway: they expire without changing
ROTATION_GRACE_S = 60.0  # a re-issued site's previous CURVE key stays admitted this long


class SiteKeys(Poller):
    """The CURVE keys bound by valid site certificates: this site's own (its file) and its peers' (published in
    etcd, :meth:`publish`). ``known()``: the sites of the topology (empty: not known yet, nobody refused for it)."""

    def __init__(self, paths: PkiPaths, trust: TrustStore | None = None, *, site: str | None = None,
                 known: Callable[[], Collection[str]] | None = None, interval_s: float = 1.0,
                 rotation_grace_s: float = ROTATION_GRACE_S) -> None:
        from mesh.pki.trust import TrustStore

        self.paths, self.interval_s, self.rotation_grace_s = paths, interval_s, rotation_grace_s
        self.site = site
        self.trust = trust or TrustStore.under(paths, interval_s=interval_s)
        self._known = known
        self._own = paths.cert(Identity("site", site)) if site is not None else None
        self._published: dict[str, bytes] = {}
        self._published_version = 0
        self._by_key: dict[bytes, str] = {}
        self._by_site: dict[str, bytes] = {}
        self._names: dict[str, SiteNames] = {}
        self._stamp: tuple[Any, ...] | None = None
        self._checked = 0.0
        self._refused: dict[str, str] = {}
        self._previous_by_key: dict[bytes, tuple[str, float]] = {}  # rotated-away key -> (site, grace end)
        # called with the sites no longer admitted (revoked, expired, removed) after each refresh that drops any
        self.on_revoked: list[Callable[[set[str]], object]] = []
        # called after every refresh that re-read the keys (a site re-issued, revoked, added)
        self.on_change: list[Callable[[], object]] = []
        self.refresh(force=True)

    # -- what etcd delivers ----------------------------------------------------------------------------------------
    def publish(self, certs: Mapping[str, bytes]) -> bool:
        """The site certificates etcd holds now (site -> PEM, as published at ``pki/sites/<site>``), replacing the
        previous set; re-verified at once if anything changed. True if the admitted keys were re-read."""
        certs = {site: pem for site, pem in certs.items() if site != self.site}  # our own comes from our file
        if certs == self._published:
            return False
        self._published = dict(certs)
        self._published_version += 1
        return self.refresh(force=True)

    def load_crl(self, pem: bytes) -> bool:
        """Adopt a newer revocation list received from elsewhere (etcd ``pki/crl``) and drop the keys of sites
        it revokes at once. ``PkiError`` if it does not verify; True if adopted."""
        if not self.trust.load_crl(pem):
            return False
        self.refresh(force=True)
        return True

    # -- queries -----------------------------------------------------------------------------------------------------
    def site_of(self, public: bytes) -> str | None:
        """The site whose certificate binds ``public`` (32 raw bytes, as ZAP gives it), or None. A site's key
        from before its certificate was re-issued still counts for ``ROTATION_GRACE_S``, so its connections
        and its peers' get through while it takes the new key (it is rotated, not revoked)."""
        site = self._by_key.get(public)
        if site is None:
            prev = self._previous_by_key.get(public)
            if prev is not None and prev[1] > time.monotonic() and prev[0] in self._by_site:
                return prev[0]
        return site

    def previous_key(self, site: str) -> bytes | None:
        """The Z85 key ``site``'s certificate bound before it was re-issued, within ``ROTATION_GRACE_S``."""
        for raw, (owner, until) in self._previous_by_key.items():
            if owner == site and until > time.monotonic():
                return z85_encode(raw)
        return None

    def key_of(self, site: str) -> bytes | None:
        """The Z85 CURVE public key ``site``'s valid certificate binds, or None."""
        return self._by_site.get(site)

    def sites(self) -> list[str]:
        return sorted(self._by_site)

    def admits(self, site: str) -> bool:
        return site in self._by_site

    def refuses(self, site: str) -> bool:
        """Whether ``site`` has a certificate here that is refused (revoked, expired, not binding a key, ...)."""
        return site in self._refused

    def refusal(self, site: str) -> str | None:
        """Why ``site``'s certificate is refused, or None."""
        return self._refused.get(site)

    def names(self, site: str) -> SiteNames | None:
        """The addresses ``site``'s valid certificate names; None for a site not admitted."""
        return self._names.get(site) if site in self._by_site else None

    def all_names(self) -> dict[str, SiteNames]:
        """:meth:`names` of every admitted site."""
        return {site: self._names[site] for site in self._by_site if site in self._names}

    def names_host(self, site: str, host: str) -> bool:
        """Whether ``site``'s certificate allows it to be dialled at ``host`` (an IP or a DNS name, as a live
        record advertises): :meth:`mesh.pki.site_names.SiteNames.allows`. False for a site not admitted."""
        names = self.names(site)
        return names is not None and names.allows(host)

    # -- refresh -----------------------------------------------------------------------------------------------------
    def _candidates(self) -> dict[str, bytes | Path]:
        out: dict[str, bytes | Path] = dict(self._published)
        if self._own is not None and self.site is not None:
            out[self.site] = self._own
        return out

    def _verify(self, site: str, source: bytes | Path, known: Collection[str]) -> tuple[bytes, x509.Certificate]:
        """The raw CURVE key ``source`` (PEM, or a file) proves for ``site``; ``MeshError`` / ``OSError`` why not."""
        from mesh.pki.files import read_cert
        from mesh.pki.verify import load_certificate

        cert = read_cert(source) if isinstance(source, Path) else load_certificate(source)
        proved = self.trust.verify(cert, use="client", kinds=_SITE).name
        if proved != site:
            raise ConfigError(f"published as {site} but it is the certificate of {proved}")
        if known and site not in known:
            raise ConfigError(f"{site} is not a site of the topology")
        key = curve_key_from_certificate(cert)
        if key is None:
            raise ConfigError("the certificate binds no CURVE key")
        return raw_curve_key(key), cert

    def _names_of(self, cert: x509.Certificate) -> SiteNames:
        try:
            return SiteNames.of(cert)
        except ValueError as exc:  # a malformed SAN: the verifier let it through, the addresses bind nothing
            raise ConfigError(f"unreadable subject alternative names: {exc}") from exc

    def refresh(self, *, force: bool = False) -> bool:
        trust_changed = self.trust.refresh()
        own = (self._own.name, *_stat(self._own)) if self._own is not None else None
        known = frozenset(self._known() if self._known is not None else ())
        stamp = (own, self._published_version, known)
        now = time.monotonic()
        if not (force or trust_changed or stamp != self._stamp or now - self._checked > _RECHECK_S):
            return False
        by_key: dict[bytes, str] = {}
        names: dict[str, SiteNames] = {}
        refused: dict[str, str] = {}
        for site, source in self._candidates().items():
            try:
                raw, cert = self._verify(site, source, known)
                names[site] = self._names_of(cert)
            except (MeshError, OSError) as exc:
                refused[site] = str(exc)
                continue
            by_key[raw] = site
        for site, why in refused.items():
            if self._refused.get(site) != why:
                log.warning("site certificate of %s not admitted to CURVE: %s", site, why,
                            extra=kv(peer=site, event="curve_refused"))
        gone = set(self._by_site) - set(by_key.values())
        if gone:
            log.warning("CURVE keys of %s no longer admitted", sorted(gone), extra=kv(event="curve_revoked"))
        for raw, site in self._by_key.items():  # re-issued (still valid under a new key): a grace period
            if site in by_key.values() and raw not in by_key:
                self._previous_by_key[raw] = (site, now + self.rotation_grace_s)
        self._previous_by_key = {k: v for k, v in self._previous_by_key.items()
                                 if v[1] > now and v[0] not in gone and k not in by_key}
        self._by_key, self._names = by_key, names
        self._by_site = {site: z85_encode(raw) for raw, site in by_key.items()}
        self._refused, self._stamp, self._checked = refused, stamp, now
        calls = [lambda f=f: f(gone) for f in self.on_revoked] if gone else []
        for call in [*calls, *self.on_change]:
            try:
                call()
            except Exception:
                log.exception("a site-keys listener failed")
        return True


def _stat(path: Path) -> tuple[int, int]:
    try:
        st = path.stat()
    except OSError:  # gone between the listing and now: the next refresh sees it gone
        return (0, -1)
    return (st.st_mtime_ns, st.st_size)
