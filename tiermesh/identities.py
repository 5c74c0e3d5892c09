"""Who is who in a local mesh: the certificates of every site, tenant, operator, scheduler and the
console's people (with ``tls``), or the sites' CURVE keys alone (with ``curve``), and the files an SDK
client or a browser needs. A mixin of :class:`tiermesh.harness.LocalMesh`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from console import new_token
from mesh.errors import ConfigError
from mesh.pki.files import write_file
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from mesh.types import DEFAULT_TENANT

if TYPE_CHECKING:
    from pathlib import Path

    from tiermesh.mesh_options import MeshOptions, SiteProcess
    from tiermesh.secure import MeshCredentials
    from topology.schema import Topology

__all__ = ["CONSOLE_ADMIN", "CONSOLE_SCRAPER", "CONSOLE_SERVER", "MeshIdentities"]

# the console's identities in a local mesh: it serves as CONSOLE_SERVER, scrapes the agents as CONSOLE_SCRAPER,
# and CONSOLE_ADMIN (PEM and PKCS#12) is for the person at the browser
CONSOLE_SERVER = Identity("scheduler", "console")
CONSOLE_SCRAPER = Identity("admin", "console")
CONSOLE_ADMIN = Identity("admin", "admin")


class MeshIdentities:
    opts: MeshOptions
    topology: Topology
    sites: dict[str, SiteProcess]
    pki: LocalPki | None
    creds: MeshCredentials | None

    if TYPE_CHECKING:
        def _address(self, role: str) -> str: ...
        def fill_hosts(self, sites: list[str]) -> None: ...

    def tenants(self) -> list[str]:
        """Every tenant a caller may be: the topology's, and the default ``public``."""
        return sorted({DEFAULT_TENANT, *self.topology.tenants})

    def _issue_certificates(self, names: list[str], *, rotate: bool = False) -> None:
        """With ``tls``: the CA (kept if the home has one) and a certificate for every identity of
        :mod:`tiermesh.secure`, the home's own while it may be kept (:meth:`LocalPki.renew`); ``rotate`` issues
        every one afresh, and running processes reload the files."""
        if self.creds is None:
            return
        sites = {n: self._address(n) for n in names}
        self.creds.issue(sites, self.tenants(), etcd_address=self._address("etcd"), store_address=self._address("ctl"),
                         rotate=rotate)
        if self.opts.console:  # the console's server and scrape identities, and one for a person's browser
            pki = self.creds.pki
            pki.renew(CONSOLE_SERVER, addresses=["127.0.0.1", "localhost"], force=rotate)
            pki.renew(CONSOLE_SCRAPER, force=rotate)
            files = self.admin_files()
            if pki.renew(CONSOLE_ADMIN, force=rotate) or not (files["p12"].exists() and files["p12_password"].exists()):
                password = new_token()  # the browser's copy of the admin's current certificate
                pki.export_pkcs12(CONSOLE_ADMIN, password)
                write_file(files["p12_password"], password.encode() + b"\n", private=True)
        self.fill_hosts(names)  # with hosts of their own: each gets its own files, as an operator copies them

    def rotate_certificates(self) -> None:
        """Re-issue every certificate (and every site's CURVE key) in place, as an operator rotating would;
        running processes pick them up from the files, none restarts."""
        if self.creds is None:
            raise ConfigError("this mesh runs without TLS (MeshOptions.tls is off): there are no certificates")
        self._issue_certificates(sorted(n for n, sp in self.sites.items() if sp.proc is not None), rotate=True)

    def tenant_files(self, tenant: str) -> dict[str, Path]:
        """``cert``, ``key`` and ``ca`` for an SDK client of ``tenant`` (``AsyncClient(url, **files)``)."""
        if self.pki is None:
            raise ConfigError("this mesh runs without TLS (MeshOptions.tls is off): there are no certificates")
        who = Identity("tenant", tenant)
        return {"cert": self.pki.paths.cert(who), "key": self.pki.paths.key(who), "ca": self.pki.paths.ca_cert}

    def admin_files(self, name: str = CONSOLE_ADMIN.name) -> dict[str, Path]:
        """``cert``, ``key``, ``ca``, ``p12`` and ``p12_password`` (a file) of an admin, for the console."""
        if self.pki is None:
            raise ConfigError("this mesh runs without TLS (MeshOptions.tls is off): the console takes a token")
        who = Identity("admin", name)
        cert = self.pki.paths.cert(who)
        return {"cert": cert, "key": self.pki.paths.key(who), "ca": self.pki.paths.ca_cert,
                "p12": cert.with_suffix(".p12"), "p12_password": cert.with_suffix(".p12.password")}

    def _issue_site_credentials(self, names: list[str]) -> None:
        """What `tiermesh pki init` (unless a CA is there) and `tiermesh pki issue --site S` do."""
        pki = LocalPki.under(self.opts.home)
        if not pki.exists():
            pki.init()
        for name in names:
            pki.renew(Identity("site", name))
        self.fill_hosts(names)
