"""``tiermesh etcd``: run the embedded etcd in the foreground for a home directory (one member, or a local
cluster with ``--members 3``), so that other commands (and ``tiermesh up``) find it through
``<home>/etcd.json`` (on a home a secured ``tiermesh up`` ran in, as that starts it: TLS, client certificates, the
revocation list, recorded with the operator's files, :func:`tiermesh.secure.home_etcd`); and
``tiermesh etcd-rbac``: create etcd users and roles for a mesh's identities (:mod:`mesh.etcd.rbac`) and turn on
etcd's auth."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path

from mesh.errors import ConfigError
from mesh.etcd import rbac
from mesh.etcd.cluster import EtcdCluster
from mesh.etcd.server import EmbeddedEtcd, clear_record, find_running, write_record
from mesh.pki.identity import Identity
from mesh.settings import MeshSettings
from tiermesh.cli.main import EXIT_FAILED, EXIT_OK, add_common
from topology.loader import load_topology_file

__all__ = ["register", "run_etcd", "run_rbac"]


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("etcd", help="run an embedded etcd in the foreground (Ctrl-C stops it)")
    p.add_argument("--home", metavar="DIR", default=None,
                   help="local state directory (default: $TIERMESH_HOME or ./.tiermesh)")
    p.add_argument("--port", type=int, default=None, help="client port (default: a free port; one member only)")
    p.add_argument("--members", type=int, default=1,
                   help="members of a local etcd cluster (default 1; 3 for failover tests), data under "
                        "<home>/etcd/m<i>")
    p.set_defaults(func=run_etcd)
    r = sub.add_parser("etcd-rbac", help="create etcd users and roles for the mesh's identities and enable auth",
                       description="One etcd user per identity, named by its certificate's CN (etcd takes the CN "
                                   "as the user under --client-cert-auth): each site may write only its own "
                                   "live/<site> and pki/sites/<site> keys; schedulers write placement/, events/, "
                                   "election/; variant stores write catalog/, models/, services/; admins write "
                                   "topology/, tenants/, catalog/, models/, pki/, services/; tenants get no user. "
                                   "Everyone in the plan reads the prefix, except a --crl-follower, which reads "
                                   "pki/crl only. It also gives back the roles `tiermesh pki revoke` took from an "
                                   "identity: run it after issuing a revoked identity again. "
                                   "Run it with a --root-admin's certificate "
                                   "(--etcd-cert/--etcd-key) "
                                   "against an etcd with TLS and --client-cert-auth; it is idempotent.")
    add_common(r)
    r.add_argument("--topology", metavar="FILE", required=True, help="topology file: its sites get users")
    r.add_argument("--scheduler", metavar="NAME", action="append", default=[], help="a scheduler identity "
                   "(repeatable)")
    r.add_argument("--admin", metavar="NAME", action="append", default=[], help="an operator identity (repeatable)")
    r.add_argument("--store", metavar="NAME", action="append", default=[],
                   help="a variant store identity (store:NAME; repeatable)")
    r.add_argument("--crl-follower", metavar="KIND:NAME", action="append", default=[], type=_identity,
                   help="an identity that may read pki/crl and nothing else: `tiermesh pki follow-crl` beside etcd, "
                        "with etcd's own certificate (etcd:etcd: `tiermesh pki issue --etcd-server etcd`); "
                        "repeatable")
    r.add_argument("--root-admin", metavar="NAME", action="append", default=[], required=True,
                   help="an admin identity with etcd's root role (repeatable; include the one running this)")
    r.add_argument("--dry-run", action="store_true", help="print the users and roles, change nothing")
    r.set_defaults(func=run_rbac)


def _identity(text: str) -> Identity:
    """``KIND:NAME`` (a certificate's CN, as etcd names its user) as an identity."""
    kind, sep, name = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KIND:NAME (e.g. etcd:etcd), not {text!r}")
    try:
        return Identity(kind, name)  # type: ignore[arg-type]  # Identity checks the kind
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


async def run_etcd(args: argparse.Namespace) -> int:
    home = Path(args.home) if args.home else MeshSettings().home
    if args.members < 1:
        raise ConfigError(f"--members must be at least 1, not {args.members}")
    if args.members > 1 and args.port is not None:
        raise ConfigError("--port picks the port of a single member; a cluster's members pick free ports")
    running = find_running(home)
    if running:
        print(f"error: an etcd is already running for {home} at {running}", file=sys.stderr)
        return EXIT_FAILED
    from tiermesh.secure import home_etcd

    how = home_etcd(home)  # a secured home's etcd as `tiermesh up` starts it, recorded with the operator's files
    server: EmbeddedEtcd | EtcdCluster = (EmbeddedEtcd(home / "etcd", client_port=args.port, tls=how.tls)
                                          if args.members == 1 else EtcdCluster(home / "etcd", size=args.members,
                                                                                tls=how.tls))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
        members = [server] if isinstance(server, EmbeddedEtcd) else server.members
        # a cluster is recorded under this process (it lives as long as we do), one member under its own
        pid = server.pid if isinstance(server, EmbeddedEtcd) else os.getpid()
        assert pid is not None
        write_record(home, pid, server.url, **how.client)
        print(server.url, flush=True)
        logs = ", ".join(str(m.log_path) for m in members)
        print(f"etcd data in {home / 'etcd'}, log {logs}; Ctrl-C to stop", file=sys.stderr, flush=True)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await stop.wait()
            dead = [m for m in members if not m.running()]
            if dead:
                print(f"error: etcd exited; see {dead[0].log_path}", file=sys.stderr)
                return EXIT_FAILED
        return EXIT_OK
    finally:
        clear_record(home)
        await server.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def run_rbac(args: argparse.Namespace) -> int:
    from tiermesh.cli.context import open_store, store_args

    settings = MeshSettings()
    topo = load_topology_file(args.topology)
    prefix = args.prefix or settings.prefix
    plan = rbac.plan(prefix, sites=topo.sites, schedulers=args.scheduler, admins=args.admin,
                     root_admins=args.root_admin, stores=args.store, crl_followers=args.crl_follower)
    for user, roles in sorted(plan.users.items()):
        print(f"user {user}: {', '.join(roles)}")
    for role, grants in sorted(plan.roles.items()):
        for g in grants:
            print(f"role {role}: {g.access} {g.key}{'*' if g.prefix else ''}")
    if args.dry_run:
        return EXIT_OK
    if not (args.etcd or settings.etcd):
        raise ConfigError("etcd-rbac needs --etcd https://... with --etcd-ca, --etcd-cert and --etcd-key "
                          "(a root admin's certificate): RBAC on an etcd without TLS client auth names no one")
    async with open_store(**store_args(args)) as store:
        await rbac.apply(store, plan)
    print(f"etcd auth enabled for {prefix}", file=sys.stderr)
    return EXIT_OK
