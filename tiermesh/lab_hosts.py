"""Every host its own home, as the mesh is deployed: what ``tiermesh up --netns`` gives each network namespace. A
mixin of :class:`tiermesh.harness.LocalMesh`.

With namespaces (``lab``), each participant runs as it would on a machine of its own: a home directory of its own
under ``HOME/hosts/<role>/`` holding exactly what that host's Kubernetes pod mounts (its identity's
:meth:`mesh.pki.files.PkiPaths.host_files`, copied there by :meth:`mesh.pki.local.LocalPki.bundle`, nothing of any
other identity), and the command line and settings the manifests use (:mod:`tiermesh.hosts`, one source for both),
on the ports the manifests use (each namespace has an address of its own). The harness stays the operator: it holds
the CA in ``HOME/pki``, issues, bundles, and is the only one that sees every host's files. What the lab appends to a
command (a ready file, the WAN emulation's peer map, a CPU cap, timing knobs) is lab plumbing, after the
deployed command line, never instead of it.

Without namespaces (the quick demo) every process shares ``HOME`` as before.

    role        home                  holds (pki/)                                       runs
    <site>      hosts/<site>/         ca, crl, sites/<site>.pem, -key.pem, .curve        tiermesh agent
    ctl         hosts/ctl/            ca, crl, stores/variant-store*, schedulers/...*    variants serve; scheduler
    etcd        hosts/etcd/           ca.pem, crl.pem (etcd's --client-crl-file), etcd's server certificate and key
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from mesh.log import get_logger
from mesh.pki.files import PkiPaths, write_file
from mesh.pki.identity import Identity
from tiermesh.hosts import (
    AGENT_HTTP_PORT,
    AGENT_ZMQ_PORT,
    STORE_PORT,
    HostCommand,
    agent_command,
    scheduler_command,
    shared_env,
    store_command,
)
from tiermesh.secure import ETCD_SERVER, SCHEDULER, STORE

if TYPE_CHECKING:
    from mesh.etcd.server import ServerTLS
    from mesh.etcd.store import Store
    from mesh.pki.local import LocalPki
    from tiermesh.mesh_options import MeshOptions, SiteProcess
    from tiermesh.netns import NetnsLab
    from tiermesh.secure import MeshCredentials
    from topology.schema import Topology

__all__ = ["HostHomes"]

log = get_logger("tiermesh.harness")

# TIERMESH_* settings of the harness's own environment that a host must not inherit: it is configured by the
# deployed command line and shared_env alone, as a pod is
_HOST_OWNED = ("TIERMESH_HOME", "TIERMESH_ETCD", "TIERMESH_ETCD_CA", "TIERMESH_ETCD_CERT", "TIERMESH_ETCD_KEY",
               "TIERMESH_PREFIX", "TIERMESH_BIND", "TIERMESH_ADVERTISE")


class HostHomes:
    opts: MeshOptions
    lab: NetnsLab | None
    pki: LocalPki | None
    creds: MeshCredentials | None
    topology: Topology
    store: Store | None
    sites: dict[str, SiteProcess]

    if TYPE_CHECKING:
        @property
        def etcd_url(self) -> str: ...
        def _address(self, role: str) -> str: ...
        def _store_site(self) -> str | None: ...
        async def start_site(self, name: str) -> None: ...

    @property
    def own_homes(self) -> bool:
        """Whether every host has a home of its own (with namespaces: hosts as deployed)."""
        return self.lab is not None

    def host_home(self, role: str) -> Path:
        """The home directory of ``role``'s host (a site, ``ctl`` or ``etcd``); ``HOME`` itself without own homes."""
        return self.opts.home / "hosts" / role if self.own_homes else self.opts.home

    def fill_host(self, role: str, identities: list[Identity]) -> Path:
        """Give ``role``'s host exactly the files of ``identities`` (as an operator copies them to a machine):
        each written whole and renamed into place (a running host re-reads them: rotation), then anything else
        under its ``pki/`` removed, so nothing of another identity stays. Without TLS or CURVE it holds none.
        Returns the host's home."""
        home = self.host_home(role)
        paths = PkiPaths.under(home)
        home.mkdir(parents=True, exist_ok=True)
        kept: set[Path] = set()
        if self.pki is not None or self.opts.curve:
            from mesh.pki.local import LocalPki

            operator = self.pki or LocalPki.under(self.opts.home)
            for who in identities:
                kept.update(operator.bundle(who, paths).values())
        if paths.root.exists():
            for path in sorted(paths.root.rglob("*"), reverse=True):  # files first, then emptied directories
                if path.is_file() and path not in kept:
                    path.unlink()
                elif path.is_dir() and not any(path.iterdir()):
                    path.rmdir()
        return home

    def fill_hosts(self, sites: list[str]) -> None:
        """Every host's files, after the operator issued (or re-issued) them."""
        if not self.own_homes:
            return
        for name in sites:
            self.fill_host(name, [Identity("site", name)])
        if self.pki is not None:
            self.fill_host("ctl", [STORE, SCHEDULER])
            self._fill_etcd_host()

    def _fill_etcd_host(self) -> None:
        assert self.creds is not None
        tls = self.creds.etcd_server()
        home = self.host_home("etcd")
        pki = home / "pki"
        for src, name, private in ((tls.cert_file, "etcd.pem", False), (tls.key_file, "etcd-key.pem", True),
                                   (tls.ca_file, "ca.pem", False)):
            write_file(pki / name, Path(src).read_bytes(), private=private)
        if not (pki / "crl.pem").exists():  # a follower keeps it current from etcd pki/crl once etcd runs
            assert self.pki is not None
            write_file(pki / "crl.pem", self.pki.paths.crl.read_bytes())

    def etcd_tls(self) -> ServerTLS | None:
        """etcd's TLS: its own files, the revocation list it checks every client handshake against, and the one
        peer it admits on its raft port (its own identity, as :meth:`MeshCredentials.etcd_server` names it)."""
        if self.creds is None:
            return None
        from mesh.etcd.server import ServerTLS

        if not self.own_homes:
            return self.creds.etcd_server()
        pki = self.host_home("etcd") / "pki"
        return ServerTLS(pki / "etcd.pem", pki / "etcd-key.pem", pki / "ca.pem", crl_file=pki / "crl.pem",
                         peer_cn=ETCD_SERVER.common_name)

    def etcd_crl_file(self) -> Path | None:
        tls = self.etcd_tls()
        return tls.crl_file if tls is not None else None

    # -- command lines -----------------------------------------------------------------------------------------------
    def _host_env(self, command: HostCommand, home: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k.upper() not in _HOST_OWNED}
        env |= shared_env(etcd=self.etcd_url, prefix=self.opts.prefix, home=str(home), log_format="text")
        if self.creds is not None:  # etcd with client certificates: the host's own identity
            env |= dict(command.env)
        return env

    def deployed_agent(self, name: str) -> tuple[list[str], dict[str, str]]:
        """``tiermesh agent`` as the manifests run it, for ``name``'s host: (argv after ``python``, env)."""
        home = self.host_home(name)
        command = agent_command(name, home=str(home), advertise=self._address(name), bind="0.0.0.0",
                                http_port=AGENT_HTTP_PORT, zmq_port=AGENT_ZMQ_PORT)
        argv = [sys.executable, "-m", "tiermesh", *command.args]
        if self.creds is None:
            argv.append("--no-edge-tls" if self.opts.curve else "--insecure")
        return argv, self._host_env(command, home)

    def deployed_control(self, scheduler_id: str) -> tuple[HostCommand, HostCommand, dict[str, str], dict[str, str]]:
        """The variant store and a scheduler replica as the manifests run them, on the ``ctl`` host: the two
        commands and their environments."""
        home = self.host_home("ctl")
        store = store_command(home=str(home), advertise=self._address("ctl"), site=self._store_site(),
                              bind=self._address("ctl"), port=STORE_PORT, tls=self.creds is not None)
        sched = scheduler_command(scheduler_id, home=str(home))
        return store, sched, self._host_env(store, home), self._host_env(sched, home)
