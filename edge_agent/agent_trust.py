"""The agent's trust: its CURVE keys and the sites' (on unless ``--insecure``), a re-issued key of its own
taken without a restart, peers re-dialled when theirs change, and the revocation list from etcd handed to
both trust stores (edge TLS and CURVE). A mixin of :class:`edge_agent.agent.Agent`.

A site holds only its own identity (:meth:`mesh.pki.files.PkiPaths.host_files`). It publishes its certificate at
etcd ``pki/sites/<site>`` (public; RBAC lets it write that one key) and learns its peers' from there, through its
view: :class:`mesh.zmq.site_keys.SiteKeys` believes a published certificate only when the CA signed it for that
site and has not revoked it. A re-issued certificate is published first and its key taken a moment later
(``REKEY_PUBLISH_LEAD_S``), so peers already hold the new certificate when the new key knocks.

CURVE and mutual TLS load ``cryptography``: imported where a secured agent builds them, so an ``--insecure``
agent never loads it (the edge footprint)."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from mesh.errors import ConfigError, MeshError, PkiError, StoreError, Unauthenticated
from mesh.etcd.channels import StorePermissionDenied
from mesh.etcd.keys import site_cert_key
from mesh.log import get_logger, kv
from mesh.pki.files import PkiPaths, read_curve
from mesh.pki.identity import Identity
from mesh.pki.published import site_cert_record

if TYPE_CHECKING:
    from core_scheduler.state.view import MeshView
    from edge_agent.agent_config import AgentConfig
    from edge_agent.http_api import EdgeHttpServer
    from edge_agent.liveness import Liveness
    from edge_agent.peer_keys import PeerAddresses, PeerKeys
    from mesh.etcd.store import Store
    from mesh.pki.curve import CurveKeyPair
    from mesh.zmq.client import ZmqClient
    from mesh.zmq.curve import CurveSecurity
    from mesh.zmq.server import ZmqServer

__all__ = ["CRL_REFUSED_LOG_S", "REKEY_PUBLISH_LEAD_S", "AgentTrust"]

log = get_logger("edge_agent.agent")
# a re-issued certificate is in etcd this long before its key is taken: peers' views (a watch event, then a
# 0.2 s debounce) have it by then, so none refuses the new key's first handshake
REKEY_PUBLISH_LEAD_S = 1.0
# a revocation list a trust store refuses is handed over again on every view change: its refusal is said this often
CRL_REFUSED_LOG_S = 60.0


class AgentTrust:
    site: str
    store: Store | None
    view: MeshView | None
    curve: CurveSecurity | None
    peer_keys: PeerKeys | None
    peer_addresses: PeerAddresses | None
    zmq_server: ZmqServer | None
    zmq_client: ZmqClient | None
    http: EdgeHttpServer | None
    liveness: Liveness | None
    _crl_seen: bytes | None  # the pki/crl PEM every trust store holds (or holds a newer one than)
    _crl_refusal: tuple[bytes, float] | None = None  # the list last refused and when that was logged (monotonic)
    _certs_seen: dict[str, bytes] | None
    _published_pem: bytes | None
    _rekeying: asyncio.Task[None] | None
    cfg: AgentConfig

    # -- what is believed of the peers' live records ----------------------------------------------------------------
    def _peer_endpoint(self, site: str) -> str | None:
        """Where ``site`` is dialled: with CURVE, only an endpoint its certificate vouches for and no other live
        site holds (:class:`edge_agent.peer_keys.PeerAddresses`); on an ``--insecure`` mesh, what its live record
        says (nothing to check it by), or the operator's peer map."""
        if self.view is None or site not in self.view.live:
            return None
        if self.peer_addresses is not None:
            return self.peer_addresses.endpoint(site)
        return self.cfg.peer_map.get(site) or self.view.live[site].endpoint

    def _peer_http(self, site: str) -> str | None:
        """``site``'s edge URL for blob fetches, believed as :meth:`_peer_endpoint` is."""
        if self.peer_addresses is not None:
            return self.peer_addresses.http(site)
        hb = self.view.live.get(site) if self.view is not None else None
        return hb.http if hb is not None else None

    def _believe_peers(self) -> None:
        """Re-read what is believed of the live peers' addresses (the live records or the certificates changed)."""
        if self.peer_addresses is not None and self.view is not None:
            self.peer_addresses.update(self.view.live)

    def _pki_paths(self) -> PkiPaths:
        """The PKI directory of the edge certificate and the CURVE keys (``--pki-dir``, else HOME/pki)."""
        return PkiPaths(self.cfg.pki_dir) if self.cfg.pki_dir is not None else PkiPaths.under(self.cfg.home)

    async def _open_curve(self) -> CurveSecurity | None:
        """CURVE between sites, or None under ``insecure``, the only way to plain ZeroMQ: an agent without its
        certificate and CURVE key refuses to start (it once served plain ZeroMQ with a warning when its home lacked
        the ``.curve`` file, its edge TLS on: fail closed)."""
        cfg, me = self.cfg, Identity("site", self.site)
        if cfg.insecure:
            log.warning("--insecure: ZeroMQ links between sites are NOT authenticated or encrypted",
                        extra=kv(site=self.site, event="insecure"))
            return None
        paths = self._pki_paths()
        if not (paths.cert(me).exists() and paths.curve(me).exists()):
            others = sorted(p.name[:-4] for p in (paths.root / "sites").glob("*.pem")
                            if not p.name.endswith("-key.pem") and p.name[:-4] != self.site)
            if others:  # files copied to the wrong host, or the wrong --site: never run as someone else, nor open
                raise ConfigError(f"{paths.root} holds the files of site {', '.join(others)}, not of {self.site}: "
                                  f"copy this site's own (`tiermesh pki bundle --site {self.site} --out DIR`) or "
                                  f"start the agent with the --site its files are for")
            missing = [str(p) for p in (paths.cert(me), paths.curve(me)) if not p.exists()]
            raise ConfigError(f"site {self.site} has no {' and no '.join(missing)}: links between sites run CURVE "
                              f"with the site's certificate and CURVE key (`tiermesh pki issue --site {self.site}`); "
                              f"pass --insecure to run plain ZeroMQ (development only)")
        from mesh.zmq.curve import CurveSecurity
        from mesh.zmq.site_keys import SiteKeys

        keys = read_curve(paths.curve(me))
        view = self.view
        sites = SiteKeys(paths, site=self.site, known=lambda: view.topology.sites if view and view.topology else ())
        # etcd's list before our own certificate is checked (this host's crl.pem may predate its revocation) and
        # before any peer is believed
        if view is not None and view.crl is not None:
            try:
                sites.trust.load_crl(view.crl)
            except PkiError as exc:
                log.warning("revocation list from etcd not adopted by CURVE: %s", exc,
                            extra=kv(site=self.site, event="crl_refused"))
        # our own certificate must be this site's, unrevoked, and bind our own key, or no peer would ever admit us
        try:
            proved = sites.trust.verify(paths.cert(me).read_bytes(), use="server", kinds=(me.kind,),
                                        curve_public=keys.public)
        except Unauthenticated as exc:
            if exc.reason == "revoked":
                raise ConfigError(f"the certificate of site {self.site} ({paths.cert(me)}) is revoked: no peer "
                                  f"admits it; issue the site a new one (`tiermesh pki issue --site {self.site}`) "
                                  f"and copy it to this host") from exc
            raise ConfigError(f"the certificate of site {self.site} ({paths.cert(me)}) is refused: "
                              f"{exc.message}") from exc
        if proved != me:
            raise ConfigError(f"{paths.cert(me)} is the certificate of {proved}, not of site {self.site}")
        await self._publish_certificate(paths.cert(me).read_bytes())
        self._certs_seen = None
        self._adopt_site_certs(sites)
        await sites.start()
        log.info("CURVE on: %d site keys admitted (%d refused)", len(sites.sites()),
                 sum(sites.refuses(s) for s in (view.site_certs if view else {})),
                 extra=kv(site=self.site, event="curve"))
        sites.on_change.append(self._check_own_key)
        return CurveSecurity(keys, sites)

    async def _publish_certificate(self, pem: bytes) -> None:
        """Put our certificate at etcd ``pki/sites/<site>`` unless it is there already (an operator's
        ``tiermesh pki issue`` may have put it): peers learn our CURVE key from it. Refused by RBAC: a clear
        error, since no peer could admit us."""
        assert self.store is not None
        key = site_cert_key(self.site)
        record = site_cert_record(pem)
        try:
            held = await self.store.get(key)
            if held is not None and held.value == record:
                self._published_pem = pem
                return
            await self.store.put(key, record)
        except StorePermissionDenied as exc:
            raise ConfigError(f"etcd refused to let site {self.site} publish its certificate at {key}: grant it "
                              f"with `tiermesh etcd-rbac` (a site may write its own pki/sites key); peers cannot "
                              f"admit a site whose certificate they cannot read") from exc
        self._published_pem = pem
        log.info("certificate published at %s", key, extra=kv(site=self.site, event="cert_published"))

    def _adopt_site_certs(self, sites: object | None = None) -> None:
        """Hand the site certificates the view holds (etcd ``pki/sites/``) to the CURVE trust: it believes each
        only if the CA vouches for it. Called on every view change; cheap when nothing changed."""
        from mesh.zmq.site_keys import SiteKeys

        holder = sites if sites is not None else (self.curve.sites if self.curve is not None else None)
        if not isinstance(holder, SiteKeys) or self.view is None:
            return
        certs = self.view.site_certs
        if certs == self._certs_seen:
            return
        self._certs_seen = dict(certs)
        holder.publish(certs)

    def _check_own_key(self) -> None:
        """Our certificate was re-issued with a new CURVE key (rotation): publish it, then take the new pair
        without a restart. Only once the key file on disk holds the pair the valid certificate binds (files are
        replaced one by one)."""
        if self.curve is None or self._rekeying is not None:
            return
        bound = self.curve.sites.key_of(self.site)
        if bound is None or bound == self.curve.keys.public:
            return
        try:
            keys = read_curve(self._pki_paths().curve(Identity("site", self.site)))
        except (MeshError, OSError) as exc:
            log.warning("re-issued CURVE key not readable yet: %s", exc, extra=kv(site=self.site, event="rekey"))
            return
        if keys.public != bound:
            return  # the key file is not the certificate's yet: the next refresh looks again
        self._rekeying = asyncio.create_task(self._rekey(keys), name=f"rekey:{self.site}")

    async def _rekey(self, keys: CurveKeyPair) -> None:
        assert self.curve is not None and self.zmq_server is not None and self.zmq_client is not None
        try:
            pem = self._pki_paths().cert(Identity("site", self.site)).read_bytes()
            if pem != self._published_pem:    # peers learn the new key from etcd: put it there first, and
                await self._publish_certificate(pem)  # give their views a moment to take it
                await asyncio.sleep(REKEY_PUBLISH_LEAD_S)
            self.curve.keys = keys             # new sockets (server and client) use the new pair ...
            await self.zmq_server.rebind()     # ... and the listener now, so that peers dialling the key our
            self.zmq_client.drop_idle()        # certificate binds get through; idle client sockets reopen
            if self.liveness is not None:      # say so at once: peers dial the key our live record publishes
                await self.liveness.beat()
            log.info("CURVE key rotated without a restart", extra=kv(site=self.site, event="rekey"))
        except (StoreError, OSError) as exc:  # not taken: the next refresh that sees our key differ tries again
            log.warning("CURVE key rotation postponed: %s", exc, extra=kv(site=self.site, event="rekey"))
        except Exception:
            log.exception("CURVE key rotation failed", extra=kv(site=self.site, event="rekey"))
        finally:
            self._rekeying = None

    def _redial_rotated(self) -> None:
        """A peer whose CURVE key changed (re-issued certificate): its socket has the old key and would fail
        every handshake, so re-dial it with the new one; what was pending to it is re-sent over that."""
        assert self.zmq_client is not None and self.peer_keys is not None
        for endpoint, new in self.peer_keys.rotated():
            if new is None:  # nothing to dial it with (refused, or gone): what waits for it fails now
                self.zmq_client.fail_peer(endpoint, "its CURVE key changed")
            else:
                self.zmq_client.redial(endpoint, "its CURVE key changed")

    def _adopt_crl(self) -> None:
        """Hand a changed ``pki/crl`` to the edge TLS and CURVE trust stores; each adopts it only if it is
        signed by its CA and newer than what it holds. The list is done with once every store holds it or a newer
        one; a store that refuses it (not signed by the CA it holds yet, a transient failure) keeps the list it
        held, and the list is handed over again on the next view change (the site's own live record alone changes
        the view every ``max_interval_s``, 30 s), its refusal logged at most every ``CRL_REFUSED_LOG_S``."""
        pem = self.view.crl if self.view is not None else None
        if pem is None or pem == self._crl_seen:
            return
        holders = [("edge TLS", self.http.tls if self.http else None),
                   ("CURVE", self.curve.sites if self.curve else None)]
        refused: list[str] = []
        for what, holder in holders:
            if holder is None:
                continue
            try:
                adopted = holder.load_crl(pem)  # False: it holds this list or a newer one already
            except PkiError as exc:
                refused.append(f"{what}: {exc.message}")
                continue
            if adopted:
                log.info("revocation list from etcd adopted by %s", what, extra=kv(site=self.site, event="crl"))
        if not refused:
            self._crl_seen, self._crl_refusal = pem, None
            return
        now = time.monotonic()
        said = self._crl_refusal
        if said is None or said[0] != pem or now - said[1] >= CRL_REFUSED_LOG_S:
            self._crl_refusal = (pem, now)
            log.warning("revocation list from etcd not adopted (%s); the list held stays in force, this one is "
                        "tried again on the next view change", "; ".join(refused),
                        extra=kv(site=self.site, event="crl_refused"))
