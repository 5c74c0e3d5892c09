"""``tiermesh pki refresh-crl`` and ``tiermesh pki follow-crl``: keeping revocation lists fresh and where servers
read them (registered by :mod:`tiermesh.cli.pki`).

    refresh-crl   where the CA is held: re-sign the list before its nextUpdate and publish it at etcd pki/crl
    follow-crl    beside etcd: keep its --client-crl-file current from etcd pki/crl, end revoked connections
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import timedelta
from pathlib import Path

from mesh.errors import ConfigError
from mesh.etcd.keys import PKI_CRL
from mesh.pki.crl import RevocationList
from mesh.pki.local import LocalPki
from mesh.pki.policy import CRL_LIFETIME, CRL_REFRESH
from tiermesh.cli.context import etcd_endpoints, open_store, serve_for, store_args
from tiermesh.cli.main import EXIT_FAILED, EXIT_OK, add_common

__all__ = ["add_crl_commands"]


def add_crl_commands(ps: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    life, every = CRL_LIFETIME.total_seconds() / 3600, CRL_REFRESH.total_seconds() / 3600
    rf = ps.add_parser("refresh-crl", help="re-sign the revocation list before it expires and publish it",
                       description=f"Re-sign HOME/pki/crl.pem (the same revocations, number + 1, fresh for "
                                   f"{life:g} h) and publish it at etcd pki/crl (with --etcd, $TIERMESH_ETCD, or "
                                   f"the etcd running for HOME; a newer list found there is adopted first, as "
                                   f"`pki revoke` does). Every verifier (agents, the variant store, the SDK with "
                                   f"crl=) refuses every certificate once the list it holds is past its "
                                   f"nextUpdate, so run this every {every:g} h or so where the CA key is (cron, "
                                   f"or --every); `tiermesh up` does it on its own.")
    add_common(rf)
    rf.add_argument("--every", type=float, default=None, metavar="HOURS",
                    help=f"keep running and re-sign whenever the list is HOURS old (e.g. {every:g})")
    rf.add_argument("--duration", type=float, default=None, help="with --every: stop after this many seconds")
    rf.set_defaults(func=_refresh_crl)

    f = ps.add_parser("follow-crl", help="keep etcd's --client-crl-file current from etcd pki/crl",
                      description="Follow etcd pki/crl, verify each list against the CA certificate, and write "
                                  "every newer one atomically to --out, the file etcd's --client-crl-file names "
                                  "(etcd reads it at each TLS handshake: a revoked certificate's next connection "
                                  "is refused). etcd never checks a connection again once open, so when a list "
                                  "revokes a serial the previous one did not, end the open connections: "
                                  "--drop-connections PORT resets every established connection to etcd's client "
                                  "port (ss -K; needs CAP_NET_ADMIN in etcd's network namespace; every client "
                                  "dials again, the revoked one is refused), or --signal-process etcd "
                                  "--stagger-s S sends SIGTERM to etcd after S x (the hostname's ordinal + 1) s "
                                  "(etcd-2: 3 S; needs a PID namespace shared with etcd), so a StatefulSet "
                                  "restarts its members one at a time and keeps quorum. etcd refuses every client "
                                  "while that file is missing, so a missing --out is first written from "
                                  "HOME/pki/crl.pem (the host's own copy). Run it with etcd's own "
                                  "certificate (--etcd-cert: `tiermesh pki issue --etcd-server etcd`), given read "
                                  "access to pki/crl only by `tiermesh etcd-rbac --crl-follower etcd:etcd`. Runs "
                                  "until stopped.")
    add_common(f)
    f.add_argument("--ca", type=Path, default=None, metavar="FILE",
                   help="the mesh CA certificate lists must be signed by (default HOME/pki/ca.pem)")
    f.add_argument("--out", type=Path, required=True, metavar="FILE", help="where to write the list (PEM)")
    bound = f.add_mutually_exclusive_group()
    bound.add_argument("--drop-connections", type=int, default=None, metavar="PORT",
                       help="reset every established TCP connection whose local port is PORT after a revocation")
    bound.add_argument("--signal-process", default=None, metavar="NAME",
                       help="send SIGTERM to the process NAME after a revocation (staggered by --stagger-s)")
    f.add_argument("--stagger-s", type=float, default=30.0, metavar="S",
                   help="with --signal-process: wait S x (the hostname's trailing integer + 1) first (default 30)")
    f.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    f.set_defaults(func=_follow_crl)


def _home(args: argparse.Namespace) -> Path:
    from mesh.settings import MeshSettings

    return Path(args.home) if args.home else MeshSettings().home


async def _refresh_crl(args: argparse.Namespace) -> int:
    from mesh.etcd.server import find_running
    from mesh.settings import MeshSettings
    from tiermesh.crl_refresh import CrlRefresher
    from tiermesh.pki_etcd import refresh_crl

    pki = LocalPki.under(_home(args))
    named = etcd_endpoints(args.etcd, args.etcd_ca, args.etcd_cert, args.etcd_key, MeshSettings())
    running = None if named is not None else await asyncio.to_thread(find_running, pki.paths.root.parent)
    if args.every is not None:
        if not 0 < args.every * 3600 < CRL_LIFETIME.total_seconds():
            raise ConfigError(f"--every must be more than 0 and less than the list's life ({CRL_LIFETIME}), "
                              f"not {args.every:g} h")
        if named is None and running is None:
            raise ConfigError("--every needs the etcd to publish in: --etcd (or $TIERMESH_ETCD)")
        async with open_store(**store_args(args)) as store, \
                CrlRefresher(pki, store, every=timedelta(hours=args.every)):
            print(f"re-signing {pki.paths.crl} every {args.every:g} h and publishing it at etcd {PKI_CRL}",
                  flush=True)
            await serve_for(args.duration)
        return EXIT_OK
    if named is None and running is None:
        crl = pki.refresh_crl()
        print(f"{pki.paths.crl} is now list number {crl.number}, fresh until {crl.next_update:%Y-%m-%d %H:%M}Z; no "
              f"etcd named (--etcd, $TIERMESH_ETCD) or running for this home: not published", file=sys.stderr)
        return EXIT_OK
    async with open_store(**store_args(args)) as store:
        done = await refresh_crl(pki, store)
    if done.adopted:
        print(f"adopted the newer list from etcd {PKI_CRL} into {pki.paths.crl} first", file=sys.stderr)
    if not done.published:
        print(f"error: etcd {PKI_CRL} already holds list number {done.held_number}, not older than "
              f"{done.crl.number}: not published; run the command again", file=sys.stderr)
        return EXIT_FAILED
    print(f"list number {done.crl.number} ({len(done.crl.entries)} revoked), fresh until "
          f"{done.crl.next_update:%Y-%m-%d %H:%M}Z, written to {pki.paths.crl} and published at etcd {PKI_CRL}")
    return EXIT_OK


async def _follow_crl(args: argparse.Namespace) -> int:
    from mesh.pki.files import PkiPaths, read_cert, write_file
    from mesh.settings import MeshSettings
    from tiermesh.crl_follow import CrlFollower, OnRevoked, connect_crl_reader, drop_connections, signal_process

    settings = MeshSettings()
    target = etcd_endpoints(args.etcd, args.etcd_ca, args.etcd_cert, args.etcd_key, settings)
    if target is None:
        raise ConfigError("follow-crl needs the etcd it serves: --etcd https://... (or $TIERMESH_ETCD) with "
                          "--etcd-ca, --etcd-cert and --etcd-key")
    paths = PkiPaths.under(Path(args.home) if args.home else settings.home)
    ca = args.ca or paths.ca_cert
    if not args.out.exists() and paths.crl.exists():
        # etcd refuses every client, this one included, while its --client-crl-file is missing (3.5.1: "open ...:
        # no such file"): start from the host's own copy (expired or not: etcd only looks up serials in it), and
        # etcd's newer list replaces it once connected
        pem = RevocationList.load(paths.crl.read_bytes(), read_cert(ca), allow_expired=True).to_pem()
        write_file(args.out, pem)
        print(f"{args.out} was missing: started it from {paths.crl}", file=sys.stderr)
    bound: OnRevoked | None = None
    if args.drop_connections is not None:
        bound = drop_connections(args.drop_connections)
    elif args.signal_process is not None:
        bound = signal_process(args.signal_process, args.stagger_s)
    async with await connect_crl_reader(target, args.prefix or settings.prefix) as store, \
            CrlFollower(store, ca, args.out, on_revoked=bound) as follower:
        held = follower.crl.number if follower.crl is not None else "none"
        print(f"following etcd {PKI_CRL} into {args.out} (list held: {held})", flush=True)
        await serve_for(args.duration)
    return EXIT_OK
