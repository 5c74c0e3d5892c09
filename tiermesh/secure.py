"""The credentials of a secured local mesh (``tiermesh up``, secured by default), and who uses which.

One mesh CA under ``<home>/pki`` (kept if the home has one). Issued on every start (re-issuing is rotation:
running processes re-read the files):

    identity                 used by                                     for
    site:<S>                 the agent of S                              edge HTTPS, CURVE, etcd client, blob fetches
    tenant:<T>               SDK / tritonclient callers of tenant T      edge HTTPS client certificate
    admin:operator           this harness                                etcd root (applies RBAC, topology, catalog)
    scheduler:scheduler      the scheduler                               etcd: placements, events, election
    store:variant-store      the variant store                           blob HTTPS; etcd: catalog, its announcement
    etcd:etcd                etcd (its client and peer ports)            an identity kind of its own (server + client
                             and the CRL follower beside it              EKU: etcd's health probe and its members
                                                                         present it; no CURVE key), issued like the
                                                                         others, so it is in issued.jsonl and
                                                                         `tiermesh pki revoke --etcd-server etcd`
                                                                         revokes it; no tiermesh server admits it
                                                                         (no blob, no edge) and RBAC lets it read
                                                                         pki/crl only

The revocation list is re-signed on start when older than ``CRL_REFRESH``, and every ``CRL_REFRESH`` while the mesh
runs (:class:`tiermesh.crl_refresh.CrlRefresher`): verifiers refuse everyone once the list they hold expires.

etcd then runs with TLS and client-certificate auth, and :func:`rbac_plan` gives each identity only what its
role needs (:mod:`mesh.etcd.rbac`): an agent writes only its own ``live/<site>`` and ``pki/sites/<site>``; tenants
have no etcd user. The variant store serves HTTPS as its own ``store`` identity (never a site's) and hands a
tenant-private variant only to that tenant, to sites and to admins (:mod:`variant_store.access`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from mesh.etcd.rbac import RbacPlan, plan
from mesh.etcd.server import ServerTLS
from mesh.pki.files import write_file
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from mesh.pki.policy import CRL_REFRESH
from tiermesh.hosts import ETCD_IDENTITY, SCHEDULER_IDENTITY, STORE_IDENTITY

__all__ = ["ETCD_SERVER", "OPERATOR", "SCHEDULER", "STORE", "MeshCredentials", "rbac_plan"]

ETCD_SERVER = ETCD_IDENTITY
OPERATOR = Identity("admin", "operator")
SCHEDULER = SCHEDULER_IDENTITY
STORE = STORE_IDENTITY


@dataclass(frozen=True, slots=True)
class MeshCredentials:
    pki: LocalPki

    @classmethod
    def under(cls, home: Path) -> MeshCredentials:
        return cls(LocalPki.under(home))

    @property
    def root(self) -> Path:
        return self.pki.paths.root

    def _etcd_files(self) -> tuple[Path, Path]:
        return self.pki.paths.cert(ETCD_SERVER), self.pki.paths.key(ETCD_SERVER)

    def issue(self, sites: Mapping[str, str], tenants: Iterable[str], *, etcd_address: str,
              store_address: str) -> None:
        """The CA (made if missing), then a fresh certificate for every identity above; ``sites`` maps each
        site to the address callers and peers dial (named in its certificate, which binds it there)."""
        if not self.pki.exists():
            self.pki.init()
        self.pki.standardise_crl()  # a home from before: etcd must be able to read its list
        if self.pki.crl().crl.last_update_utc + CRL_REFRESH < datetime.now(UTC):
            # a kept home's list may have expired: fresh before any host copies it (verifiers refuse everyone while
            # the list they hold is expired); tiermesh.crl_refresh keeps it fresh from then on
            self.pki.refresh_crl()
        for name, address in sites.items():
            self.pki.issue(Identity("site", name), addresses=[address])
        self.pki.issue(STORE, addresses=list(dict.fromkeys([store_address, "localhost"])))
        for tenant in tenants:
            self.pki.issue(Identity("tenant", tenant))
        for who in (OPERATOR, SCHEDULER):
            self.pki.issue(who)
        # 127.0.0.1 too: a single member's peer port listens on loopback (mesh.etcd.server)
        self.pki.issue(ETCD_SERVER, addresses=list(dict.fromkeys([etcd_address, "localhost", "127.0.0.1"])))

    def etcd_server(self) -> ServerTLS:
        """etcd's TLS: its certificate and key, the CA, and its own copy of the revocation list (``--client-crl-file``,
        made from ``crl.pem`` if missing; a follower keeps it current from etcd ``pki/crl``)."""
        cert, key = self._etcd_files()
        crl = cert.parent / "crl.pem"
        if not crl.exists():
            write_file(crl, self.pki.paths.crl.read_bytes())
        return ServerTLS(cert, key, self.pki.paths.ca_cert, crl_file=crl, peer_cn=ETCD_SERVER.common_name)

    def files(self, who: Identity) -> dict[str, Path]:
        """``ca``, ``cert`` and ``key`` of ``who`` (``Store.connect(url, prefix, **files)``)."""
        return {"ca": self.pki.paths.ca_cert, "cert": self.pki.paths.cert(who), "key": self.pki.paths.key(who)}

    def etcd_args(self, who: Identity) -> list[str]:
        """The ``--etcd-ca/--etcd-cert/--etcd-key`` arguments of a ``tiermesh`` command running as ``who``."""
        f = self.files(who)
        return ["--etcd-ca", str(f["ca"]), "--etcd-cert", str(f["cert"]), "--etcd-key", str(f["key"])]


def rbac_plan(prefix: str, sites: Iterable[str]) -> RbacPlan:
    """Who may touch which etcd keys in a local mesh: each site its own live key, the scheduler its keys, the
    operator (root: this harness and the variant store) everything."""
    return plan(prefix, sites=sites, schedulers=[SCHEDULER.name], admins=[OPERATOR.name],
                root_admins=[OPERATOR.name], stores=[STORE.name])
