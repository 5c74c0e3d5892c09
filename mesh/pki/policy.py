"""The rules of the mesh PKI in one place: how long certificates live, how much clock skew a verifier
forgives, which extended key usages each kind of identity gets, and the private OIDs tiermesh defines.

Lifetimes are short on purpose (hours, not years): rotation is routine (files are re-read without a restart)
and a stolen key is worth little for long. Everything here can be overridden per call.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from types import MappingProxyType
from typing import Literal

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from mesh.pki.identity import Kind

__all__ = ["CA_LIFETIME", "CLOCK_SKEW", "CRL_LIFETIME", "CRL_REFRESH", "EKUS", "KEEP_FRACTION", "LIFETIMES",
           "REVOKED_IDENTITY_OID", "USE_EKU", "Use", "lifetimes_text"]

CA_LIFETIME = timedelta(days=30)
LIFETIMES: Mapping[Kind, timedelta] = MappingProxyType({
    "tenant": timedelta(hours=12),
    "site": timedelta(hours=24),
    "admin": timedelta(hours=8),
    "scheduler": timedelta(hours=24),
    "store": timedelta(hours=24),
    "etcd": timedelta(hours=24),
})
# A start of a local mesh (`tiermesh up`) keeps a certificate that has more than this fraction of its lifetime left
# (LocalPki.renew: a site's 24 h certificate for 12 h, an operator's 8 h one for 4 h) and re-issues it otherwise, or
# when it is missing, revoked, of another CA or names other addresses. Re-issuing every certificate on every start
# filled `tiermesh pki list` (76 entries after 5 starts) and the revocation work of `pki revoke` for nothing.
KEEP_FRACTION = 0.5
# A revocation list's nextUpdate is this long after it is signed; a verifier holding a list past it (plus CLOCK_SKEW)
# admits no one (mesh.pki.verify: "crl_expired"), as it would refuse an expired certificate: a list nobody has
# re-signed for two days may be missing revocations. The CA's holder re-signs well before (CRL_REFRESH: `tiermesh up`
# does it on its own; an operator runs `tiermesh pki refresh-crl` from cron), so a list is fresh with 42 h to spare
# and a day of missed refreshes costs nothing. Two days, not hours: certificates live a day, so whoever issues
# them is around daily anyway.
CRL_LIFETIME = timedelta(days=2)
CRL_REFRESH = timedelta(hours=6)
# Verifiers accept a certificate this long before its notBefore and after its notAfter; the CA also backdates
# notBefore by as much, so a peer whose clock runs a little behind the issuer's accepts a fresh certificate.
CLOCK_SKEW = timedelta(minutes=2)

Use = Literal["client", "server"]
USE_EKU: Mapping[Use, x509.ObjectIdentifier] = MappingProxyType({
    "client": ExtendedKeyUsageOID.CLIENT_AUTH,
    "server": ExtendedKeyUsageOID.SERVER_AUTH,
})
# Sites serve and dial other sites; the scheduler also serves the admin console; the variant store serves blobs.
EKUS: Mapping[Kind, tuple[Use, ...]] = MappingProxyType({
    "tenant": ("client",),
    "site": ("server", "client"),
    "admin": ("client",),
    "scheduler": ("server", "client"),
    "store": ("server", "client"),  # serves blobs over HTTPS; a client of etcd
    "etcd": ("server", "client"),   # etcd's client and peer ports; members dial each other; the CRL follower reads etcd
})

# tiermesh's private OID arc: a UUID OID (ITU-T X.667, 2.25.<uuid>) needs no registration, and its owner
# allocates beneath it. Go's ASN.1 parser refuses its arcs (above 2**31-1), so it is used only where no Go program
# reads. Neither certificates nor revocation lists carry one now (etcd parses both: client certificates, and the list
# given by --client-crl-file); lists written before carried the revoked identity under .2, still read (the CURVE
# key binding is a subject attribute, see mesh.pki.curve).
_ARC = "2.25.104453098811647246352016318826609560993"
# Non-critical CRL entry extension of lists written before: the identity URI of the revoked certificate, DER
# UTF8String. Read (mesh.pki.crl), never written.
REVOKED_IDENTITY_OID = x509.ObjectIdentifier(_ARC + ".2")


def _hours(d: timedelta) -> str:
    h = d.total_seconds() / 3600
    return f"{h:g} h" if h < 48 else f"{h / 24:g} days"


def lifetimes_text() -> str:
    """For ``--help``: the default lifetimes, from the table above."""
    kinds = ", ".join(f"{k} {_hours(v)}" for k, v in LIFETIMES.items())
    return (f"Default lifetimes: {kinds}; CA {_hours(CA_LIFETIME)}; revocation list {_hours(CRL_LIFETIME)} "
            f"(re-signed every {_hours(CRL_REFRESH)}: `tiermesh pki refresh-crl`)")
