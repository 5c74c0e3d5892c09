"""CURVE between sites, bound to the mesh CA: who may open a ZeroMQ connection to a site, and as whom.

    SiteKeys        (:mod:`mesh.zmq.site_keys`) the CURVE public keys of the sites whose certificates, published
                    in etcd, verify against the CA and the revocation list: key -> site, site -> key
    CurveSecurity   the :class:`mesh.zmq.base.SocketSecurity` of a site: its own key pair on every socket; on a
                    server, a ZAP handler that admits a client key only if ``SiteKeys`` knows it, with the
                    site's name as the connection's ZMTP ``User-Id``
                    (``load_crl``: a newer list from etcd ``pki/crl``, adopted at once)
    RateLimitedLog  one warning per peer per ``every_s`` for garbage, the rest counted

The ZAP handler is a ROUTER on ``inproc://zeromq.zap.01`` of the server's own context (libzmq asks it once
per handshake), driven by the same :class:`mesh.zmq.pump.Pump` as the data sockets: a refused peer finishes no
handshake and gets nothing, not even an error (its own client sees ``handshake failed (authentication)``,
callers see ``PeerUnavailable`` or their deadline). A site revoked while connected stops being named by
:meth:`CurveSecurity.peer` within one refresh (1 s by default), so its requests are refused, and its open
connections are shut down then (:meth:`CurveSecurity.close_connections`: libzmq cannot drop one ROUTER peer, so
the TCP connection a site's frames came from — ``ZMQ_SRCFD`` — is shut down under it; its reconnect meets ZAP).
A site re-issued a certificate (rotation) is not revoked: its connections stay, and its first handshake with
the new key reads the certificates again rather than waiting for the next poll.
"""

from __future__ import annotations

import os
import socket
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import zmq

from mesh.errors import PeerUnavailable
from mesh.log import get_logger, kv
from mesh.pki.curve import CurveKeyPair
from mesh.zmq.pump import Pump, io_socket

if TYPE_CHECKING:  # the site keys (cryptography) are built when CURVE is on, not by every importer of
    from mesh.zmq.site_keys import SiteKeys  # RateLimitedLog (an --insecure agent)

__all__ = ["ZAP_ENDPOINT", "CurveSecurity", "RateLimitedLog"]

log = get_logger("mesh.zmq")
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by ZeroMQ RFC 27


class RateLimitedLog:
    """At most one warning per key every ``every_s``; what is held back is counted and said with the next one.
    Remembers at most ``max_keys`` keys (the least recently warned are forgotten), so a flood from many
    peers costs bounded memory."""

    def __init__(self, every_s: float = 10.0, max_keys: int = 1024) -> None:
        self.every_s, self.max_keys = every_s, max_keys
        self.total = 0      # every event seen
        self.logged = 0     # warnings written
        self._last: OrderedDict[str, tuple[float, int]] = OrderedDict()

    def warn(self, key: str, message: str, *args: Any, **fields: Any) -> bool:
        self.total += 1
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last[0] < self.every_s:
            self._last[key] = (last[0], last[1] + 1)
            return False
        held = last[1] if last is not None else 0
        self._last[key] = (now, 0)
        self._last.move_to_end(key)
        while len(self._last) > self.max_keys:
            self._last.popitem(last=False)
        self.logged += 1
        log.warning(message + (f" ({held} more from {key} not logged)" if held else ""), *args,
                    extra=kv(peer=key, **fields))
        return True


_MAX_CONNECTIONS = 4096
_REREAD_GAP_S = 0.1  # an unknown client key re-reads the site certificates at most this often


def _sockname(fd: int) -> Any:
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            return s.getsockname()
    except OSError:
        return None


def _shutdown(fd: int, local: Any) -> bool:
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            if s.getsockname() != local:
                return False
            s.shutdown(socket.SHUT_RDWR)  # the duplicate and libzmq's descriptor share one connection
            return True
    except OSError:
        return False


class _ZapHandler:
    """ZAP (RFC 27) on one context: admits the CURVE client keys ``sites`` knows, as their site."""

    def __init__(self, ctx: zmq.Context[Any], sites: SiteKeys, refusals: RateLimitedLog) -> None:
        self.sites, self.refusals = sites, refusals
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        try:
            self.sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError:
            self.sock.close(linger=0)
            raise
        self.pump = Pump(io_socket(self.sock), self._on_request, "zap handler")
        self.users = 0
        self._reread_at = 0.0

    def _may_reread(self) -> bool:
        """An unknown key may be a peer that took its re-issued certificate's key before our poll read that
        certificate: look at the files again, at most every ``_REREAD_GAP_S`` (a flood of garbage costs
        no more than that)."""
        now = time.monotonic()
        if now - self._reread_at < _REREAD_GAP_S:
            return False
        self._reread_at = now
        return True

    def _on_request(self, msg: list[zmq.Frame]) -> None:
        parts = [f.bytes for f in msg]
        # [routing id, b"", version, request id, domain, address, identity, mechanism, *credentials]
        if len(parts) < 8 or parts[1] != b"" or parts[2] != b"1.0":
            self.refusals.warn("zap", "malformed ZAP request (%d frames)", len(parts))
            return
        rid, address, mechanism = parts[3], parts[5].decode(errors="replace"), parts[7]
        site = None
        if mechanism == b"CURVE" and len(parts) == 9 and len(parts[8]) == 32:
            site = self.sites.site_of(parts[8])
            if site is None and self._may_reread() and self.sites.refresh():
                site = self.sites.site_of(parts[8])  # a site re-issued (rotated) since the last poll
        if site is None:
            self.refusals.warn(address or "?", "refused a %s handshake from %s: its key is not bound to a valid "
                               "site certificate", mechanism.decode(errors="replace"), address,
                               event="curve_refused")
            reply = [b"1.0", rid, b"400", b"key not bound to a valid site certificate", b"", b""]
        else:
            reply = [b"1.0", rid, b"200", b"OK", site.encode(), b""]
        try:
            self.pump.send([parts[0], b"", *reply])
        except zmq.ZMQError as exc:
            log.debug("ZAP reply failed: %s", exc)

    def close(self) -> None:
        self.pump.close()
        self.sock.close(linger=0)


class CurveSecurity:
    """A site's CURVE: its own ``keys`` on every socket; servers admit the sites ``sites`` knows."""

    def __init__(self, keys: CurveKeyPair, sites: SiteKeys, *, domain: str = "tiermesh") -> None:
        self.keys, self.sites, self.domain = keys, sites, domain
        self.refusals = RateLimitedLog()
        self._zap: dict[int, _ZapHandler] = {}
        # the TCP connections admitted sites' frames came from: fd -> (site, our local address), at most
        # _MAX_CONNECTIONS (the oldest forgotten), for close_connections
        self._conns: OrderedDict[int, tuple[str, Any]] = OrderedDict()
        sites.on_revoked.append(self.close_connections)

    @property
    def public_key(self) -> str:
        return self.keys.public.decode()

    def apply_server(self, sock: zmq.Socket[Any]) -> None:
        ctx = sock.context
        zap = self._zap.get(id(ctx))
        if zap is None:
            zap = self._zap[id(ctx)] = _ZapHandler(ctx, self.sites, self.refusals)
        zap.users += 1
        sock.setsockopt(zmq.ZAP_DOMAIN, self.domain.encode())
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.keys.secret)
        sock.setsockopt(zmq.CURVE_SERVER, 1)

    def release_server(self, sock: zmq.Socket[Any]) -> None:
        zap = self._zap.get(id(sock.context))
        if zap is not None:
            zap.users -= 1
            if zap.users <= 0:
                del self._zap[id(sock.context)]
                zap.close()

    def apply_client(self, sock: zmq.Socket[Any], server_key: bytes | None) -> None:
        if server_key is None:
            raise PeerUnavailable("no CURVE key known for this peer (no live record with one, or it disagrees "
                                  "with the site's certificate)")
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.keys.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.keys.secret)

    def peer(self, frame: zmq.Frame) -> str | None:
        """The site that sent ``frame``, if it is still admitted (a revoked one is not, once noticed)."""
        try:
            user = frame.get("User-Id")
        except zmq.ZMQError:
            return None
        if not isinstance(user, str) or not self.sites.admits(user):
            return None
        self._note_connection(frame, user)
        return user

    def _note_connection(self, frame: zmq.Frame, site: str) -> None:
        try:
            fd = frame.get(zmq.SRCFD)
        except (zmq.ZMQError, AttributeError):
            return
        known = self._conns.get(fd)
        if known is not None and known[0] == site:
            return  # the hot path: one dict lookup
        local = _sockname(fd)
        if local is None:
            return
        self._conns[fd] = (site, local)
        self._conns.move_to_end(fd)
        while len(self._conns) > _MAX_CONNECTIONS:
            self._conns.popitem(last=False)

    def close_connections(self, sites: set[str]) -> int:
        """Shut down the open connections whose frames came from ``sites`` (revoked): the peer's next handshake
        goes through ZAP again, which refuses it. A descriptor is shut down only if it is still a socket on the
        same local address (not reused by something else of this process). Returns how many were closed."""
        closed = 0
        for fd, (site, local) in list(self._conns.items()):
            if site not in sites:
                continue
            del self._conns[fd]
            if _shutdown(fd, local):
                closed += 1
        if closed:
            log.warning("closed %d ZeroMQ connection(s) of %s (no longer admitted)", closed, sorted(sites),
                        extra=kv(event="curve_closed"))
        return closed
