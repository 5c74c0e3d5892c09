"""Keeping a server's revocation list current from etcd ``pki/crl``, and ending the connections that a newly
revoked identity already holds.

etcd checks a client certificate against ``--client-crl-file`` at each TLS handshake and never again (measured
on etcd 3.5.1): the file rewritten in place refuses a revoked certificate's *next* connection at once, but a
connection it already holds lives on. ``tiermesh pki revoke`` takes the identity's etcd roles away
(:func:`mesh.etcd.rbac.cut_off`), so its unary requests on that connection are refused, but an open watch stream
keeps delivering events and its lease keep-alives keep its leases alive. Only ending the connection ends those:
the client dials again, and the handshake refuses it.

:class:`CrlFollower` follows ``pki/crl`` (a read, then a watch from that revision; read again whenever the watch
cannot resume), verifies each list against the CA certificate, adopts only a higher ``CRLNumber``, writes it
atomically to ``out`` (the file etcd's ``--client-crl-file`` names) and hands it to ``on_adopted`` (a TLS
server's trust: :meth:`CrlFollower.for_peers`). When an adopted list revokes a serial the list before it did
not, it runs ``on_revoked``, the bound on connections already open:

    bound                          what it does                                        needs
    drop_connections(port)         ``ss -K`` every established TCP connection whose    CAP_NET_ADMIN in the server's
                                   local port is ``port``: every client dials again,   network namespace, a kernel
                                   the revoked one fails the handshake                 with INET_DIAG_DESTROY
    signal_process(name, S)        SIGTERM the process ``name`` (found in /proc) after  a PID namespace shared with
                                   S x (the hostname's ordinal + 1) (etcd-2: 3 S), so a that process
                                   StatefulSet restarts its members one at a time and
                                   keeps its quorum

A list refused (it does not verify against the CA file now: a CA replaced on disk a moment after the list
arrived) is tried again every :data:`RETRY_REFUSED_S` until it is adopted or a newer value replaces it: the watch
delivers a value once, and a refusal that waited for the next change could wait for days.

A bound runs in a task of its own, one at a time (revocations that arrive meanwhile are handled after it), so a
staggered wait never holds up adopting the next list. With no list known before (no ``out`` file yet) nothing
is bounded: a server that had no list has not admitted anyone it should have refused since.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from mesh.backoff import Backoff
from mesh.errors import PkiError, StoreUnavailable
from mesh.etcd.endpoints import EtcdEndpoints
from mesh.etcd.keys import PKI_CRL
from mesh.etcd.store import Store
from mesh.etcd.watch import KeyRange
from mesh.lifecycle import Service, cancel_and_wait
from mesh.log import get_logger, kv
from mesh.pki.crl import RevocationList, crl_pem_from_record
from mesh.pki.files import read_cert, write_file
from mesh.pki.peers import TlsPeers

__all__ = ["RETRY_REFUSED_S", "CrlFollower", "OnRevoked", "connect_crl_reader", "drop_connections", "find_processes",
           "ordinal", "signal_process", "ss_argv"]

log = get_logger(__name__)

RETRY_REFUSED_S = 2.0  # a refused pki/crl value is considered again this often
# (the list now in force, the serials it revokes that the list before did not)
OnRevoked = Callable[[RevocationList, frozenset[int]], Awaitable[None]]
_ORDINAL = re.compile(r"(\d+)$")


class CrlFollower(Service):
    """Follows ``pki/crl`` through ``store``, believing only lists signed by the CA certificate at ``ca`` (read
    again for every list, so a replaced CA is picked up). ``out``: where the adopted list is written (None: not
    written); ``current``: the list in force now (default: the one in ``out``, if it verifies).
    ``on_adopted(crl)`` after each adoption; ``on_revoked(crl, serials)`` when it revokes something new."""

    def __init__(self, store: Store, ca: Path | str, out: Path | str | None = None, *,
                 current: RevocationList | None = None,
                 on_adopted: Callable[[RevocationList], object] | None = None,
                 on_revoked: OnRevoked | None = None) -> None:
        self.store = store
        self.ca_path = Path(ca)
        self.out = Path(out) if out is not None else None
        self.on_adopted = on_adopted
        self.on_revoked = on_revoked
        self.crl = current if current is not None else self._read_out()
        self.adopted = 0          # lists adopted since start
        self.bounds = 0           # bounds run to completion
        self.connected = False    # the last read of pki/crl succeeded and the watch is open
        self._pending: set[int] = set()
        self._refused: tuple[Any, int] | None = None  # the last value refused (and its revision), to try again
        self._revoked = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    def for_peers(cls, store: Store, peers: TlsPeers) -> CrlFollower:
        """A follower feeding a mutual-TLS server (``TlsPeers``): each list goes to its trust, which refuses a
        revoked caller's next request and closes its open keep-alive connections (``TlsPeers.load_crl``)."""
        return cls(store, peers.trust.ca_path, current=peers.trust.crl,
                   on_adopted=lambda crl: peers.load_crl(crl.to_pem()))

    def _read_out(self) -> RevocationList | None:
        if self.out is None or not self.out.exists():
            return None
        try:
            return RevocationList.load(self.out.read_bytes(), read_cert(self.ca_path), allow_expired=True)
        except (OSError, PkiError) as exc:
            log.warning("the revocation list in %s is not usable; following etcd from scratch", self.out,
                        extra=kv(event="crl_follow_stale", reason=str(exc)))
            return None

    async def _start(self) -> None:
        self._tasks = [asyncio.create_task(self._follow(), name="crl-follow"),
                       asyncio.create_task(self._bound_loop(), name="crl-bound"),
                       asyncio.create_task(self._retry_refused(), name="crl-retry")]

    async def _stop(self) -> None:
        await cancel_and_wait(*self._tasks)
        self._tasks = []

    # -- following ------------------------------------------------------------------------------
    async def _follow(self) -> None:
        """Read, then watch from the revision read; when the watch cannot resume (compaction) or anything else
        fails, read again after a jittered back-off. Never returns."""
        backoff = Backoff(0.25, 5.0)
        while True:
            try:
                revision = await self.store.revision()  # first: the watch replays what changes during the read
                held = await self.store.get(PKI_CRL)
                if held is not None:  # none yet: the first `tiermesh pki revoke` publishes one
                    await self._consider(held.value, revision)
                async with self.store.watch_ranges([KeyRange.key(PKI_CRL)], start_revision=revision + 1) as watch:
                    self.connected = True
                    async for ev in watch:
                        backoff.reset()
                        await self._consider(ev.value if ev.kind == "put" else None, ev.revision)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("following %s failed; reading it again", PKI_CRL,
                            extra=kv(event="crl_follow_retry", reason=str(exc)[:300]))
            self.connected = False
            await asyncio.sleep(backoff.next())

    async def _consider(self, value: Any, revision: int) -> None:
        """Adopt the list in a ``pki/crl`` value if it verifies and is newer. A bad value is logged and the list
        in force kept; a failure to read the CA or write ``out`` raises (the follow loop reads again later)."""
        refused_before, self._refused = self._refused, None  # any value considered supersedes one refused
        if value is None:
            if self.crl is not None:
                log.warning("no list at %s in etcd (none published yet, or deleted); keeping list %d", PKI_CRL,
                            self.crl.number,
                            extra=kv(event="crl_follow_missing"))
            return
        ca = await asyncio.to_thread(read_cert, self.ca_path)
        try:
            # expired or not: a higher number names every revocation a lower one does (mesh.pki.crl)
            crl = RevocationList.load(crl_pem_from_record(value), ca, allow_expired=True)
        except Exception as exc:  # untrusted bytes: whatever parsing them raises, the answer is to refuse them
            if refused_before is None or refused_before[1] != revision:  # once per value, not per retry
                log.warning("refusing the revocation list at %s (revision %d): %s; trying it again every %g s",
                            PKI_CRL, revision, exc, RETRY_REFUSED_S,
                            extra=kv(event="crl_follow_refused", reason=str(exc)[:300]))
            self._refused = (value, revision)
            return
        previous = self.crl
        if previous is not None and crl.number <= previous.number:
            return
        if self.out is not None:
            await asyncio.to_thread(write_file, self.out, crl.to_pem())
        self.crl = crl
        self.adopted += 1
        new = crl.serials - previous.serials if previous is not None else frozenset()
        log.info("adopted revocation list %d (%d revoked, %d new)", crl.number, len(crl.entries), len(new),
                 extra=kv(event="crl_adopted", reason=f"number={crl.number} revision={revision}"))
        if self.on_adopted is not None:
            try:
                self.on_adopted(crl)
            except Exception:
                log.exception("handing revocation list %d on failed", crl.number)
        if new and self.on_revoked is not None:
            self._pending |= new
            self._revoked.set()

    async def _retry_refused(self) -> None:
        while True:
            await asyncio.sleep(RETRY_REFUSED_S)
            refused = self._refused
            if refused is None:
                continue
            try:
                await self._consider(*refused)
            except Exception as exc:  # the CA unreadable, the file unwritable: the next round tries again
                if self._refused is None:
                    self._refused = refused
                log.warning("trying the refused revocation list again failed: %s", exc,
                            extra=kv(event="crl_follow_retry", reason=str(exc)[:300]))

    async def _bound_loop(self) -> None:
        while True:
            await self._revoked.wait()
            self._revoked.clear()
            serials, self._pending = frozenset(self._pending), set()
            if self.crl is None or self.on_revoked is None:
                continue
            try:
                await self.on_revoked(self.crl, serials)
                self.bounds += 1
            except Exception as exc:
                # not retried: a bound that cannot work here (no CAP_NET_ADMIN) would fail the same way again
                log.error("ending the open connections of revoked serials %s failed: %s",
                          ", ".join(f"{s:x}" for s in sorted(serials)), exc,
                          extra=kv(event="crl_bound_failed", reason=str(exc)[:300]))


async def connect_crl_reader(target: EtcdEndpoints, prefix: str) -> Store:
    """A store for an identity that may read ``pki/crl`` only (it probes that key, not the prefix), waiting
    for etcd as long as it takes: beside etcd, the follower often starts first, or while etcd restarts. A refusal
    by RBAC ends it (``StorePermissionDenied``); a TLS handshake etcd refuses looks like an etcd that is down, so it
    is retried, each time logged with the store's hint about the TLS files."""
    backoff = Backoff(0.25, 10.0)
    while True:
        try:
            return await Store.connect(target, prefix, probe=PKI_CRL)
        except StoreUnavailable as exc:
            log.warning("etcd not reachable yet; trying again", extra=kv(event="crl_follow_wait",
                                                                         reason=str(exc)[:300]))
        await asyncio.sleep(backoff.next())


# -- bounds on connections already open ---------------------------------------------------------------
def ss_argv(port: int) -> list[str]:
    """``ss`` killing every established TCP connection whose local port is ``port`` (the server's side)."""
    if not 0 < port < 65536:
        raise ValueError(f"not a TCP port: {port}")
    return ["ss", "-K", "-H", "-t", "state", "established", f"( sport = :{port} )"]


def drop_connections(port: int, *, exec_prefix: Sequence[str] = ()) -> OnRevoked:
    """A bound that resets every connection to ``port`` (a server in this network namespace, or in the one
    ``exec_prefix`` enters: ``ip netns exec NS``): clients dial again and the revoked one fails the handshake.
    ``ss`` answers 0 even when the kernel refuses it ("SOCK_DESTROY answers: Operation not permitted" without
    CAP_NET_ADMIN): that is an error here."""
    argv = [*exec_prefix, *ss_argv(port)]

    async def drop(crl: RevocationList, serials: frozenset[int]) -> None:
        proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
        if proc.returncode != 0 or b"SOCK_DESTROY" in err:
            raise RuntimeError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): {err.decode().strip()}")
        closed = sum(1 for line in out.splitlines() if line.strip())
        log.info("reset %d connection(s) to port %d after list %d", closed, port, crl.number,
                 extra=kv(event="crl_connections_dropped", reason=f"port={port} closed={closed}"))

    return drop


def ordinal(hostname: str) -> int:
    """The trailing integer of a host name (a StatefulSet member ``etcd-2`` -> 2; none -> 0)."""
    m = _ORDINAL.search(hostname)
    return int(m.group(1)) if m else 0


def find_processes(name: str, proc: Path = Path("/proc")) -> list[int]:
    """The pids (not this one) whose command name or first argument's base name is ``name``."""
    found = []
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            comm = (entry / "comm").read_text().strip()
            argv0 = (entry / "cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
            if name in (comm, os.path.basename(argv0)):
                found.append(int(entry.name))
    return sorted(found)


def signal_process(name: str, stagger_s: float, *, hostname: str | None = None,
                   proc: Path = Path("/proc")) -> OnRevoked:
    """A bound that SIGTERMs the process ``name`` after ``stagger_s`` x (this host's :func:`ordinal` + 1): a
    StatefulSet member restarts (its container), one member at a time when ``stagger_s`` exceeds a restart. Member 0
    waits too: restarting at once cut off the very `tiermesh pki revoke` that published the list, before it had
    taken the revoked identity's etcd roles away (seen in deploy-check)."""
    delay = stagger_s * (ordinal(hostname if hostname is not None else socket.gethostname()) + 1)

    async def restart(crl: RevocationList, serials: frozenset[int]) -> None:
        if delay:
            log.info("SIGTERM to %s in %.0f s (list %d)", name, delay, crl.number,
                     extra=kv(event="crl_restart_scheduled"))
            await asyncio.sleep(delay)
        pids = find_processes(name, proc)
        if not pids:
            raise RuntimeError(f"no process named {name!r} (is the PID namespace shared with it?)")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        log.info("sent SIGTERM to %s (pid %s) after list %d", name, ", ".join(map(str, pids)), crl.number,
                 extra=kv(event="crl_process_signalled"))

    return restart
