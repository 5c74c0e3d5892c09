"""The mesh PKI: a CA, identities, certificates, CURVE keys bound to site certificates, revocation.

Ground floor beside ``mesh.v2``: depends only on ``cryptography``, the standard library and ``mesh``'s basics
(errors, log, lifecycle), so the etcd wrapper, the ZeroMQ transport and the SDK can all use it. The SDK uses only
``reload`` (standard library alone: the base install has no ``cryptography``), so the names below are imported on
first use.

    identity   Identity(kind, name) <-> spiffe://tiermesh/<kind>/<name>; the one name rule; the kinds servers admit
    policy     lifetimes, clock skew, EKUs per kind, private OIDs: the rules in one place
    ca         CertificateAuthority.create / .issue (pure, no files)
    curve      CURVE (X25519) key pairs in Z85; the certificate extension that binds one
    crl        RevocationList: a CA-signed X.509 CRL with the revoked identities, fresh for two days
    verify     verify_certificate: strict checks, Identity or Unauthenticated / PermissionDenied
    files      the layout under $TIERMESH_HOME/pki/, atomic 0600 writes
    local      LocalPki: init / issue / revoke / listing on a home directory (what the CLI runs)
    reload     ReloadingCredentials, CrlFile: SSLContexts that follow their files, a client's check of the
               server's revocation (standard library only)
    trust      TrustStore: the CA and revocation list a verifier trusts, following their files
    peers      TlsPeers: a mutual-TLS server's credentials and its callers' identities, checked per connection
    published  a site's certificate as etcd carries it (pki/sites/<site>): delivered by etcd, believed by the CA
"""

from typing import TYPE_CHECKING

from mesh.lazy import lazy_exports

if TYPE_CHECKING:
    from mesh.pki.ca import CertificateAuthority, IssuedCertificate
    from mesh.pki.crl import Revocation, RevocationList
    from mesh.pki.curve import CurveKeyPair
    from mesh.pki.files import PkiPaths
    from mesh.pki.identity import CALLER_KINDS, KINDS, Identity, Kind
    from mesh.pki.local import IssuedRecord, LocalPki
    from mesh.pki.peers import TlsPeers
    from mesh.pki.policy import CA_LIFETIME, CLOCK_SKEW, LIFETIMES, Use
    from mesh.pki.reload import CrlFile, ReloadingCredentials
    from mesh.pki.trust import TrustStore
    from mesh.pki.verify import peer_certificate, verify_certificate

_LAZY = {
    "CertificateAuthority": "mesh.pki.ca", "IssuedCertificate": "mesh.pki.ca",
    "Revocation": "mesh.pki.crl", "RevocationList": "mesh.pki.crl",
    "CurveKeyPair": "mesh.pki.curve",
    "PkiPaths": "mesh.pki.files",
    "CALLER_KINDS": "mesh.pki.identity", "KINDS": "mesh.pki.identity", "Identity": "mesh.pki.identity",
    "Kind": "mesh.pki.identity",
    "IssuedRecord": "mesh.pki.local", "LocalPki": "mesh.pki.local",
    "TlsPeers": "mesh.pki.peers",
    "CA_LIFETIME": "mesh.pki.policy", "CLOCK_SKEW": "mesh.pki.policy", "LIFETIMES": "mesh.pki.policy",
    "Use": "mesh.pki.policy",
    "CrlFile": "mesh.pki.reload", "ReloadingCredentials": "mesh.pki.reload",
    "TrustStore": "mesh.pki.trust",
    "peer_certificate": "mesh.pki.verify", "verify_certificate": "mesh.pki.verify",
}

__all__ = [
    "CALLER_KINDS",
    "CA_LIFETIME",
    "CLOCK_SKEW",
    "KINDS",
    "LIFETIMES",
    "CertificateAuthority",
    "CrlFile",
    "CurveKeyPair",
    "Identity",
    "IssuedCertificate",
    "IssuedRecord",
    "Kind",
    "LocalPki",
    "PkiPaths",
    "ReloadingCredentials",
    "Revocation",
    "RevocationList",
    "TlsPeers",
    "TrustStore",
    "Use",
    "peer_certificate",
    "verify_certificate",
]

__getattr__, __dir__ = lazy_exports("mesh.pki", _LAZY, globals())
