"""Machines joining and leaving a local mesh, and revocation reaching etcd: a mixin of
:class:`tiermesh.harness.LocalMesh`.

``join_site`` adds a site's machine mid-run as an operator does it; ``revoke_site`` takes one out with
``tiermesh pki revoke`` (its process keeps running, as a compromised machine would); ``forwarded_served`` reads from
a site's own ``/metrics`` what it ran for its peers (the membership drill's evidence, :mod:`tiermesh.membership`).

With the mesh secured, the harness is also etcd's CRL follower (``tiermesh pki follow-crl`` beside etcd in a
deployment, :mod:`tiermesh.crl_follow`): it keeps etcd's ``--client-crl-file`` current from ``pki/crl``, and when a
list revokes something new it ends the connections etcd holds, so a revoked identity's open watch and lease
keep-alives end with them (as root: ``ss -K`` on etcd's client port, inside etcd's namespace with netns; otherwise a
restart of each etcd member). The in-process variant store (without netns) follows ``pki/crl`` the same way.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from mesh.errors import ConfigError, MeshError
from mesh.log import get_logger, kv
from mesh.pki.identity import Identity

if TYPE_CHECKING:
    from pathlib import Path

    from mesh.etcd.cluster import EtcdCluster
    from mesh.etcd.server import EmbeddedEtcd
    from mesh.etcd.store import Store
    from mesh.lifecycle import Service
    from mesh.pki.crl import RevocationList
    from mesh.pki.local import LocalPki
    from tiermesh.mesh_options import MeshOptions, SiteProcess
    from tiermesh.secure import MeshCredentials
    from topology.schema import Topology
    from variant_store.server import VariantStoreServer

__all__ = ["Membership"]

log = get_logger("tiermesh.harness")


class Membership:
    opts: MeshOptions
    pki: LocalPki | None
    creds: MeshCredentials | None
    topology: Topology
    store: Store | None
    sites: dict[str, SiteProcess]
    etcd: EmbeddedEtcd | EtcdCluster | None
    variant_server: VariantStoreServer | None
    _crl_follow: list[Service]  # CRL followers, and the refresher

    if TYPE_CHECKING:
        @property
        def etcd_url(self) -> str: ...
        @property
        def own_homes(self) -> bool: ...
        def _address(self, role: str) -> str: ...
        def _exec_prefix(self, role: str) -> list[str]: ...
        def fill_host(self, role: str, identities: list[Identity]) -> Path: ...
        def etcd_crl_file(self) -> Path | None: ...
        async def start_site(self, name: str) -> None: ...
        def _issue_certificates(self, names: list[str], *, rotate: bool = False) -> None: ...

    # -- revocation reaching etcd and the in-process store ------------------------------------------------------
    async def start_crl_follow(self) -> None:
        """Follow ``pki/crl`` for etcd (its CRL file, and the bound on open connections) and for the in-process
        variant store, and, holding the CA, re-sign the list before it expires (:mod:`tiermesh.crl_refresh`) and
        renew the certificates past half their lifetime (:mod:`tiermesh.cert_renew`); nothing without TLS."""
        out = self.etcd_crl_file()
        if self.creds is None or self.store is None or out is None:
            return
        from tiermesh.cert_renew import CertRenewer
        from tiermesh.crl_follow import CrlFollower
        from tiermesh.crl_refresh import CrlRefresher

        followers: list[Service] = [
            CrlFollower(self.store, self.creds.pki.paths.ca_cert, out, on_revoked=self._end_etcd_connections),
            CrlRefresher(self.creds.pki, self.store),
            CertRenewer(lambda: self._issue_certificates(sorted(n for n, sp in self.sites.items()
                                                                if sp.proc is not None)))]
        tls = self.variant_server.tls if self.variant_server is not None else None
        if tls is not None:
            followers.append(CrlFollower.for_peers(self.store, tls))
        for follower in followers:
            await follower.start()
            self._crl_follow.append(follower)

    async def stop_crl_follow(self) -> None:
        followers, self._crl_follow = self._crl_follow, []
        for follower in followers:
            await follower.stop()

    async def _end_etcd_connections(self, crl: RevocationList, serials: frozenset[int]) -> None:
        """The bound on a revoked identity's open etcd connections: reset them all (root), or restart etcd."""
        from mesh.etcd.cluster import EtcdCluster
        from tiermesh.crl_follow import drop_connections

        members = self.etcd.members if isinstance(self.etcd, EtcdCluster) else [self.etcd] if self.etcd else []
        if os.geteuid() == 0:
            for member in members:
                port = int(member.url.rsplit(":", 1)[1])
                await drop_connections(port, exec_prefix=self._exec_prefix("etcd"))(crl, serials)
            return
        for member in members:  # one at a time: a cluster keeps its quorum
            await member.restart()
        log.info("etcd restarted after list %d: open connections of revoked serials ended", crl.number,
                 extra=kv(event="crl_etcd_restarted"))

    # -- machines joining and leaving ----------------------------------------------------------------------------
    def initial_topology(self) -> Topology:
        """The topology applied at start: every site but those that join later (``MeshOptions.joins``), and their
        links; tenants unchanged."""
        joins = set(self.opts.joins)
        topo = self.topology
        if not joins:
            return topo
        from topology.schema import Topology

        return Topology(sites={n: s for n, s in topo.sites.items() if n not in joins},
                        links=tuple(lk for lk in topo.links if not joins & set(lk.ends)), tenants=topo.tenants)

    async def join_site(self, name: str) -> float:
        """Add the machine of ``name`` as an operator does: apply the topology with it, issue its certificate
        naming its address (``tiermesh pki issue --site S --address HOST``), copy its files, and only those, to its
        host (``tiermesh pki bundle``), start its agent there. Returns seconds until its agent was up."""
        from topology.store_io import apply as apply_topology

        if name not in self.opts.joins:
            raise ConfigError(f"{name} is not a site that joins (MeshOptions.joins: {self.opts.joins})")
        assert self.store is not None
        t0 = time.monotonic()
        await apply_topology(self.store, self.topology,
                             source=self.opts.topology.read_text(encoding="utf-8", errors="replace"))
        me = Identity("site", name)
        if self.pki is not None:
            self.pki.issue(me, addresses=[self._address(name)])
        elif self.opts.curve:
            from mesh.pki.local import LocalPki

            LocalPki.under(self.opts.home).issue(me)
        if self.own_homes:
            self.fill_host(name, [me])
        await self.start_site(name)
        log.info("site %s joined in %.2f s", name, time.monotonic() - t0, extra=kv(event="site_joined", site=name))
        return time.monotonic() - t0

    async def revoke_site(self, name: str) -> None:
        """Take ``name`` out as an operator does with ``tiermesh pki revoke --site S`` against this mesh's etcd as the
        root operator: every live certificate of the site revoked, the list published at ``pki/crl``, the site cut
        off etcd (roles, heartbeat lease). Its process keeps running, as a compromised machine would."""
        from tiermesh.pki_etcd import revoke

        if self.pki is None or self.store is None:
            raise ConfigError("--revoke needs the secured mesh (certificates to revoke): drop --insecure")
        done = await revoke(self.pki, self.store, Identity("site", name))
        if not done.published:
            raise MeshError(f"revoking {name}: etcd holds list {done.held_number}, newer than ours "
                            f"({done.crl.number}); not published")
        log.warning("site %s revoked: list %d published; in etcd: %s", name, done.crl.number,
                    "; ".join(done.cut.lines()) if done.cut else done.cut_refused,
                    extra=kv(event="site_revoked", site=name))

    async def forwarded_served(self, name: str) -> int | None:
        """How many queries ``name``'s agent ran for its peers (its own ``/metrics``,
        ``tiermesh_served_total{role="forwarded"}``), read with the operator's admin certificate; None if it
        cannot be read (not running, no TLS)."""
        import ssl

        import aiohttp
        from prometheus_client.parser import text_string_to_metric_families

        from tiermesh.secure import OPERATOR

        sp = self.sites.get(name)
        if sp is None or not sp.http or self.creds is None:
            return None
        files = self.creds.files(OPERATOR)
        ctx = ssl.create_default_context(cafile=str(files["ca"]))
        ctx.check_hostname = False  # the agent's certificate names its own address; the CA chain is checked
        ctx.load_cert_chain(str(files["cert"]), str(files["key"]))
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session, \
                    session.get(f"{sp.http}/metrics", ssl=ctx) as resp:
                text = await resp.text()
        except (aiohttp.ClientError, OSError, TimeoutError):
            return None
        total = 0
        for family in text_string_to_metric_families(text):
            if family.name == "tiermesh_served":
                total += sum(int(s.value) for s in family.samples
                             if s.name.endswith("_total") and s.labels.get("role") == "forwarded")
        return total
