"""The mesh PKI: a CA, identities, certificates, CURVE keys bound to site certificates, revocation.

Ground floor beside ``mesh.v2``: depends only on ``cryptography``, the standard library and ``mesh``'s basics
(errors, log, lifecycle), so the etcd wrapper, the ZeroMQ transport and the SDK can all use it.

    identity   Identity(kind, name) <-> spiffe://tiermesh/<kind>/<name>; the one name rule
    policy     lifetimes, clock skew, EKUs per kind, private OIDs: the rules in one place
    ca         CertificateAuthority.create / .issue (pure, no files)
    curve      CURVE (X25519) key pairs in Z85; the certificate extension that binds one
    crl        RevocationList: a CA-signed X.509 CRL with the revoked identities
    verify     verify_certificate: strict checks, Identity or Unauthenticated / PermissionDenied
    files      the layout under $TIERMESH_HOME/pki/, atomic 0600 writes
    local      LocalPki: init / issue / revoke / listing on a home directory (what the CLI runs)
    reload     ReloadingCredentials (SSLContexts that follow their files), TrustStore (CA + CRL that do)
    peers      TlsPeers: a mutual-TLS server's credentials and its callers' identities, checked per connection
"""

from mesh.pki.ca import CertificateAuthority, IssuedCertificate
from mesh.pki.crl import Revocation, RevocationList
from mesh.pki.curve import CurveKeyPair
from mesh.pki.files import PkiPaths
from mesh.pki.identity import KINDS, Identity, Kind
from mesh.pki.local import IssuedRecord, LocalPki
from mesh.pki.peers import TlsPeers
from mesh.pki.policy import CA_LIFETIME, CLOCK_SKEW, LIFETIMES, Use
from mesh.pki.reload import ReloadingCredentials, TrustStore
from mesh.pki.verify import peer_certificate, verify_certificate

__all__ = [
    "CA_LIFETIME",
    "CLOCK_SKEW",
    "KINDS",
    "LIFETIMES",
    "CertificateAuthority",
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
