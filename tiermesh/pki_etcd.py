"""What the operator's PKI puts into etcd, as functions the CLI (``tiermesh pki revoke`` / ``issue``) and the lab's
drills (:mod:`tiermesh.membership_ops`) both run: the revocation list at ``pki/crl`` (and cutting the revoked
identity off etcd at once), and a site's certificate at ``pki/sites/<site>`` with its etcd user and role.

``refresh_crl`` re-signs the list (same revocations, number + 1, a fresh nextUpdate) and publishes it the same way:
verifiers refuse everyone once the list they hold is past its nextUpdate (:mod:`mesh.pki.crl`).

``revoke`` adopts a newer list from etcd first (two operators' copies of the CA never undo each other's
revocations), revokes every live certificate of the identity, publishes the list by compare-and-swap (an older list
never replaces a newer one), then takes the identity's etcd roles and a site's heartbeat lease away
(:func:`mesh.etcd.rbac.cut_off`): etcd checks its revocation list only when a connection opens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cryptography import x509

from mesh.errors import ConflictError, PkiError
from mesh.etcd.channels import StorePermissionDenied
from mesh.etcd.keys import PKI_CRL, site_cert_key
from mesh.etcd.rbac import CutOff, cut_off, grant_site
from mesh.etcd.store import Store
from mesh.pki.crl import RevocationList, crl_pem_from_record, crl_record
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from mesh.pki.published import site_cert_record

__all__ = ["Refreshed", "Revoked", "grant_site_access", "publish_crl", "publish_site_certificate", "refresh_crl",
           "revoke"]

_PUBLISH_TRIES = 5


@dataclass(slots=True)
class Revoked:
    """What :func:`revoke` did: the list now in force and the serials it newly revokes; whether a newer list was
    adopted from etcd first (or why etcd's could not be read); whether it was published (else the number etcd
    holds); the cut-off in etcd (None: not published, or ``cut_refused`` says why not)."""

    crl: RevocationList
    new: list[int]
    adopted: bool = False
    foreign: str | None = None
    published: bool = False
    held_number: int = 0
    cut: CutOff | None = None
    cut_refused: str | None = None
    notes: list[str] = field(default_factory=list)


async def publish_crl(store: Store, crl: RevocationList, ca_cert: x509.Certificate) -> tuple[bool, int]:
    """Put ``crl`` at ``pki/crl`` unless etcd already holds a list of this CA numbered as high or higher: an
    older list never undoes a revocation. The put is a compare-and-swap on the key's revision, so a list
    published by someone else between our read and our write is seen, not overwritten. Returns (published,
    the number etcd holds now)."""
    for _ in range(_PUBLISH_TRIES):
        held = await store.get(PKI_CRL)
        number = _held_number(held.value, ca_cert) if held is not None else None
        if number is not None and number >= crl.number:
            return False, number
        try:
            await store.put_if_mod_revision(PKI_CRL, crl_record(crl), held.mod_revision if held else 0)
        except ConflictError:
            continue  # someone published meanwhile: look again
        return True, crl.number
    raise ConflictError(f"{PKI_CRL} kept changing while publishing list {crl.number}: run the command again")


def _held_number(value: object, ca_cert: x509.Certificate) -> int | None:
    """The number of the list in a ``pki/crl`` value if it verifies against ``ca_cert``; None if it does not
    (unreadable, or from a replaced CA: ours supersedes it)."""
    try:
        # expired or not: its number still says whether ours is newer
        return RevocationList.load(crl_pem_from_record(value), ca_cert, allow_expired=True).number
    except (ValueError, PkiError):
        return None


@dataclass(slots=True)
class Refreshed:
    """What :func:`refresh_crl` did: the list now in force (re-signed), whether a newer one was adopted from etcd
    first (or why etcd's could not be read), whether it was published (else the number etcd holds)."""

    crl: RevocationList
    adopted: bool = False
    foreign: str | None = None
    published: bool = False
    held_number: int = 0


async def _adopt_from_etcd(pki: LocalPki, store: Store) -> tuple[bool, str | None]:
    """Take etcd's list into ``crl.pem`` first if it is newer: (adopted, why etcd's could not be read)."""
    held = await store.get(PKI_CRL)
    if held is None:
        return False, None
    try:
        return pki.adopt_crl(crl_pem_from_record(held.value)), None
    except (ValueError, PkiError) as exc:
        return False, str(exc)


async def refresh_crl(pki: LocalPki, store: Store) -> Refreshed:
    """Re-sign the revocation list (after adopting a newer one from etcd) and publish it at ``pki/crl``."""
    adopted, foreign = await _adopt_from_etcd(pki, store)
    crl = pki.refresh_crl()
    published, number = await publish_crl(store, crl, pki.ca().cert)
    return Refreshed(crl, adopted=adopted, foreign=foreign, published=published, held_number=number)


async def revoke(pki: LocalPki, store: Store, identity: Identity, *, reason: str | None = None) -> Revoked:
    """Revoke every live certificate of ``identity`` and make etcd know it (see the module)."""
    adopted, foreign = await _adopt_from_etcd(pki, store)
    crl, new = pki.revoke(identity, reason=reason)
    published, number = await publish_crl(store, crl, pki.ca().cert)
    done = Revoked(crl, new, adopted=adopted, foreign=foreign, published=published, held_number=number)
    if published:
        try:
            done.cut = await cut_off(store, identity)
        except StorePermissionDenied as exc:
            done.cut_refused = str(exc)
    return done


async def grant_site_access(store: Store, site: str) -> str | None:
    """The site's etcd user and role (:func:`mesh.etcd.rbac.grant_site`), so a machine added to a running mesh can
    connect; None (and nothing changed) when ``store`` may not manage users: then `tiermesh etcd-rbac` does it."""
    try:
        return await grant_site(store, site)
    except StorePermissionDenied:
        return None


async def publish_site_certificate(store: Store, site: str, pem: bytes) -> bool:
    """Put a site's certificate (public) at ``pki/sites/<site>``, where its peers learn its CURVE key (they believe
    it only if the CA signed it). False if etcd holds exactly that already."""
    key, record = site_cert_key(site), site_cert_record(pem)
    held = await store.get(key)
    if held is not None and held.value == record:
        return False
    await store.put(key, record)
    return True
