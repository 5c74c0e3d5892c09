"""The credentials of a secured local mesh (``tiermesh up``, secured by default), and who uses which.

One mesh CA under ``<home>/pki`` (kept if the home has one). A start keeps each certificate still good for more
than half its lifetime (:meth:`mesh.pki.local.LocalPki.renew`) and issues the others; ``rotate`` issues them all
(running processes re-read the files):

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
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from mesh.etcd.rbac import RbacPlan, plan
from mesh.etcd.server import ServerTLS
from mesh.pki.files import write_file
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from mesh.pki.policy import CRL_REFRESH
from tiermesh.hosts import ETCD_IDENTITY, SCHEDULER_IDENTITY, STORE_IDENTITY

__all__ = ["ETCD_SERVER", "OPERATOR", "SCHEDULER", "STORE", "HomeEtcd", "MeshCredentials", "etcd_addresses",
           "home_etcd", "rbac_plan"]

ETCD_SERVER = ETCD_IDENTITY
OPERATOR = Identity("admin", "operator")
SCHEDULER = SCHEDULER_IDENTITY
STORE = STORE_IDENTITY


def etcd_addresses(etcd_address: str) -> list[str]:
    """What etcd's certificate names: where it is dialled, and loopback (a single member's peer port listens there,
    :mod:`mesh.etcd.server`; commands on the home start it there when no mesh runs, :func:`home_etcd`)."""
    return list(dict.fromkeys([etcd_address, "localhost", "127.0.0.1"]))


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
              store_address: str, rotate: bool = False) -> None:
        """The CA (made if missing), then a certificate for every identity above: the one on disk while it may be
        kept (:meth:`LocalPki.renew`), else a fresh one; with ``rotate`` a fresh one for each. ``sites`` maps each
        site to the address callers and peers dial (named in its certificate, which binds it there)."""
        if not self.pki.exists():
            self.pki.init()
        self.pki.standardise_crl()  # a home from before: etcd must be able to read its list
        if self.pki.crl().crl.last_update_utc + CRL_REFRESH < datetime.now(UTC):
            # a kept home's list may have expired: fresh before any host copies it (verifiers refuse everyone while
            # the list they hold is expired); tiermesh.crl_refresh keeps it fresh from then on
            self.pki.refresh_crl()
        wanted: list[tuple[Identity, list[str]]] = [(Identity("site", n), [a]) for n, a in sites.items()]
        wanted.append((STORE, list(dict.fromkeys([store_address, "localhost"]))))
        wanted += [(Identity("tenant", t), []) for t in tenants]
        wanted += [(OPERATOR, []), (SCHEDULER, [])]
        wanted.append((ETCD_SERVER, etcd_addresses(etcd_address)))
        for who, addresses in wanted:
            self.pki.renew(who, addresses=addresses, force=rotate)

    def secured(self) -> bool:
        """Whether this home's etcd runs secured: a secured ``tiermesh up`` issued etcd's certificate here, and turned
        on etcd's auth (RBAC) in the home's etcd data, which from then on answers no client without a user."""
        return self.pki.paths.cert(ETCD_SERVER).exists()

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


@dataclass(frozen=True, slots=True)
class HomeEtcd:
    """How a command starts a home's own etcd while no mesh runs there, and whom it connects as: ``tls`` None and no
    ``client`` files for a home never secured; else etcd's TLS as ``tiermesh up`` starts it and the operator's files
    (``ca``, ``cert``, ``key``: ``Store.connect(url, prefix, **client)``)."""

    tls: ServerTLS | None = None
    client: Mapping[str, Path] = field(default_factory=dict)


def home_etcd(home: Path) -> HomeEtcd:
    """:class:`HomeEtcd` of ``home``. A secured home's etcd certificate and the operator's are renewed first as a start
    renews them (:meth:`LocalPki.renew`: a home left stopped for a day has expired ones), for loopback, where commands
    start it (``PkiError`` if one must be issued and the home holds no CA key)."""
    creds = MeshCredentials.under(home)
    if not creds.secured():
        return HomeEtcd()
    creds.pki.renew(ETCD_SERVER, addresses=etcd_addresses("127.0.0.1"))
    creds.pki.renew(OPERATOR)
    return HomeEtcd(creds.etcd_server(), creds.files(OPERATOR))


def rbac_plan(prefix: str, sites: Iterable[str]) -> RbacPlan:
    """Who may touch which etcd keys in a local mesh: each site its own live key, the scheduler its keys, the
    operator (root: this harness and the variant store) everything."""
    return plan(prefix, sites=sites, schedulers=[SCHEDULER.name], admins=[OPERATOR.name],
                root_admins=[OPERATOR.name], stores=[STORE.name])
