"""``tiermesh pki ...``: the mesh CA and the certificates of its identities, under ``$TIERMESH_HOME/pki/``.

    init      create the CA (ca.pem, ca-key.pem 0600) and an empty revocation list (crl.pem)
    issue     issue (or rotate) a tenant / site / admin / scheduler / store / etcd certificate and key; a site
              also gets a CURVE key pair (sites/S.curve, 0600) bound into its certificate; etcd's own certificate
              is --etcd-server NAME (etcd/NAME.pem: its client and peer ports and the CRL follower beside it)
    revoke    put every live certificate of an identity on crl.pem and publish it at etcd pki/crl (when an etcd
              is named with --etcd / $TIERMESH_ETCD or runs for this home), where every agent picks it up; with
              a root admin's certificate also cut the identity off etcd now (its roles, a site's heartbeat lease)
    refresh-crl
              re-sign the revocation list (same revocations, a fresh nextUpdate) and publish it at etcd pki/crl:
              verifiers refuse everyone once the list they hold is past its nextUpdate (two days), so run it
              every few hours (--every, or cron); `tiermesh up` does it on its own
    follow-crl
              keep etcd's --client-crl-file current from etcd pki/crl, and end the connections a newly revoked
              identity already holds (reset them, or restart etcd one member at a time)
    bundle    copy what one host holds (the CA, the revocation list, its own certificate, key and a site's CURVE
              keys: nothing of any other identity) into DIR/pki/, to carry to that host as its TIERMESH_HOME
    list      every certificate issued: identity, serial, not-after, state
    verify    check a certificate file strictly against the CA and the revocation list

Each identity's certificate carries exactly one URI SAN, spiffe://tiermesh/<kind>/<name>.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

from mesh.errors import ConfigError, Unauthenticated
from mesh.etcd.keys import PKI_CRL, site_cert_key
from mesh.pki.crl import REASONS
from mesh.pki.identity import KINDS, Identity, Kind
from mesh.pki.local import LocalPki
from mesh.pki.policy import CLOCK_SKEW, lifetimes_text
from mesh.pki.verify import load_certificate, verify_certificate
from tiermesh.cli.context import etcd_endpoints, open_store, store_args
from tiermesh.cli.main import EXIT_FAILED, EXIT_OK, add_common
from tiermesh.cli.pki_crl import add_crl_commands
from tiermesh.pki_etcd import Revoked, grant_site_access, publish_site_certificate, revoke

__all__ = ["register"]

_NOT_PUBLISHED = ("no etcd named (--etcd, $TIERMESH_ETCD) or running for this home: the list is written to "
                  "pki/crl.pem only, and agents see it only if their own crl.pem is updated")


def _home_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--home", metavar="DIR", default=None,
                   help="local state directory (default: $TIERMESH_HOME or ./.tiermesh); files go in DIR/pki/")


# the option naming an identity of each kind; etcd's is not --etcd, which names etcd's URLs in every command
_KIND_FLAG: dict[Kind, str] = {k: f"--{k}" for k in KINDS} | {"etcd": "--etcd-server"}


def _identity_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    for kind in KINDS:
        what = "etcd's own certificate (its ports and the CRL follower beside it)" if kind == "etcd" else kind
        g.add_argument(_KIND_FLAG[kind], dest=f"identity_{kind}", metavar="NAME", default=None,
                       help=f"the {what} NAME")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("pki", help="the mesh CA: issue, rotate, revoke and check certificates",
                       description=__doc__ + "\n" + lifetimes_text() + ".",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ps = p.add_subparsers(dest="pki_command", metavar="SUBCOMMAND", required=True)

    i = ps.add_parser("init", help="create the mesh CA", description=f"Create the mesh CA. {lifetimes_text()}.")
    _home_arg(i)
    i.add_argument("--force", action="store_true",
                   help="replace an existing CA (every certificate it issued stops being valid)")
    i.set_defaults(func=_init)

    s = ps.add_parser("issue", help="issue or rotate an identity's certificate",
                      description=f"Issue (or rotate: issue again) an identity's certificate and key. "
                                  f"{lifetimes_text()}; never past the CA's own notAfter. A site's certificate "
                                  f"is also published at etcd pki/sites/<site> when an etcd is named (--etcd, "
                                  f"$TIERMESH_ETCD) or runs for HOME: its peers learn its CURVE key there (the "
                                  f"site's agent publishes it too when it starts); with a root admin's certificate "
                                  f"the site's etcd user and role are made too (a machine added to a running mesh).")
    add_common(s)
    _identity_args(s)
    s.add_argument("--address", action="append", default=[], metavar="HOST",
                   help="(sites, stores and schedulers) a DNS name or IP it is reached at (a site's edge API and "
                        "ZeroMQ endpoint, the variant store's URL, a scheduler's console), added as a SAN; "
                        "repeatable. A site's IP addresses bind it: peers refuse to dial it at another IP")
    s.add_argument("--hours", type=float, default=None, metavar="N", help="lifetime in hours instead of the default")
    s.set_defaults(func=_issue)

    r = ps.add_parser("revoke", help="revoke every live certificate of an identity (crl.pem, then etcd pki/crl)",
                      description="Revoke every live certificate of an identity: sign a new revocation list into "
                                  "HOME/pki/crl.pem and publish it at etcd pki/crl, where every agent adopts it "
                                  "within seconds (a list older than the one in etcd is never published; a newer "
                                  "one found there is adopted into crl.pem first). Without an etcd (--etcd, "
                                  "$TIERMESH_ETCD, or one running for HOME) only crl.pem is written. With a root "
                                  "admin's certificate (--etcd-cert) it also cuts the identity off etcd at once: "
                                  "its etcd user loses every role, so each request on a connection it already "
                                  "holds is refused, and a site's live/<site> lease is revoked, so its heartbeat "
                                  "disappears. An identity issued again later gets its roles back from `tiermesh "
                                  "etcd-rbac`. Its open watch streams and lease keep-alives end only with its "
                                  "connections: `tiermesh pki follow-crl` beside etcd ends those.")
    add_common(r)
    _identity_args(r)
    r.add_argument("--reason", default=None, choices=REASONS, metavar="REASON",
                   help=f"RFC 5280 reason: {', '.join(REASONS)}")
    r.set_defaults(func=_revoke)

    add_crl_commands(ps)

    bu = ps.add_parser("bundle", help="copy one host's files (and nothing else) into DIR/pki/",
                       description="Copy exactly what the host of one identity holds into DIR/pki/, in the layout "
                                   "it reads: the CA certificate (ca.pem), the revocation list (crl.pem), its "
                                   "certificate and key, and for a site its CURVE key pair. No other identity's "
                                   "files: peers' certificates reach a site through etcd (pki/sites/), vouched "
                                   "for by the CA. Carry DIR to the host and run it with TIERMESH_HOME=DIR (or "
                                   "--home DIR). Refuses a missing, expired or revoked certificate.")
    _home_arg(bu)
    _identity_args(bu)
    bu.add_argument("--out", type=Path, required=True, metavar="DIR", help="the host's home directory to fill")
    bu.set_defaults(func=_bundle)

    ls = ps.add_parser("list", help="every certificate issued, with its state")
    _home_arg(ls)
    ls.add_argument("--json", action="store_true", help="a JSON array instead of a table")
    ls.set_defaults(func=_list)

    v = ps.add_parser("verify", help="check a certificate strictly (CA, SAN, EKU, validity, revocation)",
                      description="Check a certificate: issued by the mesh CA, exactly one URI SAN, not a CA, "
                                  f"within validity (±{CLOCK_SKEW.total_seconds():g} s), the EKU for the use, "
                                  "not revoked. Exit 0 if it passes, 1 if it does not, 2 for bad input.")
    _home_arg(v)
    v.add_argument("file", type=Path, metavar="FILE", help="a PEM (or DER) certificate")
    v.add_argument("--use", choices=["client", "server"], default="client", help="the use to check (default client)")
    v.add_argument("--kind", choices=KINDS, default=None, help="also require this kind of identity")
    v.add_argument("--curve", type=Path, default=None, metavar="FILE.curve",
                   help="also require that the certificate binds the CURVE key in this file")
    v.set_defaults(func=_verify)


def _pki(args: argparse.Namespace) -> LocalPki:
    from mesh.settings import MeshSettings

    return LocalPki.under(Path(args.home) if args.home else MeshSettings().home)


def _identity(args: argparse.Namespace) -> Identity:
    kind: Kind = next(k for k in KINDS if getattr(args, f"identity_{k}") is not None)
    return Identity(kind, getattr(args, f"identity_{kind}"))


def _init(args: argparse.Namespace) -> int:
    pki = _pki(args)
    ca = pki.init(force=args.force)
    print(f"CA written to {pki.paths.ca_cert} (key {pki.paths.ca_key}, 0600), valid until "
          f"{ca.cert.not_valid_after_utc:%Y-%m-%d %H:%M}Z; revocation list {pki.paths.crl}")
    return EXIT_OK


async def _issue(args: argparse.Namespace) -> int:
    identity = _identity(args)
    if args.hours is not None and not 0 < args.hours <= 24 * 366:
        raise ConfigError(f"--hours must be > 0 and at most a year, got {args.hours:g}")
    pki = _pki(args)
    issued = pki.issue(identity, lifetime=timedelta(hours=args.hours) if args.hours is not None else None,
                       addresses=args.address)
    print(f"{identity}: certificate {pki.paths.cert(identity)} serial {issued.serial:x}, key {pki.paths.key(identity)}"
          f" (0600), valid until {issued.cert.not_valid_after_utc:%Y-%m-%d %H:%M}Z")
    if identity.kind == "site":
        print(f"CURVE key pair {pki.paths.curve(identity)} (0600), public key {pki.curve(identity).public.decode()} "
              f"bound into the certificate")
        await _publish_site(args, pki, identity)
    return EXIT_OK


async def _publish_site(args: argparse.Namespace, pki: LocalPki, identity: Identity) -> None:
    from mesh.etcd.server import find_running
    from mesh.settings import MeshSettings

    named = etcd_endpoints(args.etcd, args.etcd_ca, args.etcd_cert, args.etcd_key, MeshSettings())
    if named is None and await asyncio.to_thread(find_running, pki.paths.root.parent) is None:
        print("no etcd named (--etcd, $TIERMESH_ETCD) or running for this home: the certificate is not published; "
              "the site's agent publishes it at etcd pki/sites/ when it starts", file=sys.stderr)
        return
    async with open_store(**store_args(args)) as store:
        changed = await publish_site_certificate(store, identity.name, pki.paths.cert(identity).read_bytes())
        role = await grant_site_access(store, identity.name)
    print(f"{'published' if changed else 'already'} at etcd {site_cert_key(identity.name)}", file=sys.stderr)
    if role is not None:
        print(f"etcd user {identity.common_name} has role {role} (read the mesh, write its own live/ and pki/sites/ "
              f"keys)", file=sys.stderr)
    else:
        print(f"warning: the certificate used may not manage etcd users: give {identity.common_name} its etcd role "
              f"with `tiermesh etcd-rbac` as a root admin before its agent starts", file=sys.stderr)


async def _revoke(args: argparse.Namespace) -> int:
    from mesh.etcd.server import find_running
    from mesh.settings import MeshSettings

    identity = _identity(args)
    pki = _pki(args)
    named = etcd_endpoints(args.etcd, args.etcd_ca, args.etcd_cert, args.etcd_key, MeshSettings())
    running = None if named is not None else await asyncio.to_thread(find_running, pki.paths.root.parent)
    if named is None and running is None:
        crl, new = pki.revoke(identity, reason=args.reason)
        _print_revoked(identity, new)
        print(f"{pki.paths.crl} is now list number {crl.number}; {_NOT_PUBLISHED}", file=sys.stderr)
        return EXIT_OK
    async with open_store(**store_args(args)) as store:
        done = await revoke(pki, store, identity, reason=args.reason)
    if done.adopted:
        print(f"adopted the newer list from etcd {PKI_CRL} into {pki.paths.crl}", file=sys.stderr)
    if done.foreign is not None:
        print(f"warning: etcd {PKI_CRL} held no list of this CA ({done.foreign}); it was replaced", file=sys.stderr)
    _print_revoked(identity, done.new)
    if not done.published:
        print(f"error: {pki.paths.crl} is list number {done.crl.number} but etcd {PKI_CRL} already holds number "
              f"{done.held_number}: not published; run the command again", file=sys.stderr)
        return EXIT_FAILED
    _print_cut_off(identity, done)
    print(f"list number {done.crl.number} written to {pki.paths.crl} and published at etcd {PKI_CRL}",
          file=sys.stderr)
    return EXIT_OK


def _print_cut_off(identity: Identity, done: Revoked) -> None:
    """What taking the identity's etcd roles (and a site's heartbeat lease) away did: etcd checks the revocation
    list only when a connection opens."""
    if done.cut_refused is not None:
        print(f"warning: not cut off in etcd: the certificate used may not manage etcd users (a root admin's may): "
              f"connections {identity} holds keep working until they end ({done.cut_refused})", file=sys.stderr)
        return
    if done.cut is None:
        return
    for line in done.cut.lines():
        print(f"etcd: {line}")
    if done.cut.roles:
        print(f"etcd: a watch stream or lease keep-alive it holds open ends only with its connection (`tiermesh pki "
              f"follow-crl` beside etcd ends those); if {identity} is issued again, `tiermesh etcd-rbac` gives its "
              f"roles back", file=sys.stderr)


def _print_revoked(identity: Identity, new: list[int]) -> None:
    for serial in new:
        print(f"revoked {identity} serial {serial:x}")
    if not new:
        print(f"{identity}: every live certificate was already revoked")


def _bundle(args: argparse.Namespace) -> int:
    from mesh.pki.files import PkiPaths

    identity = _identity(args)
    files = _pki(args).bundle(identity, PkiPaths.under(args.out))
    for role, path in files.items():
        print(f"{role:6} {path}")
    print(f"{identity}: {len(files)} files under {args.out}/pki; on that host run with TIERMESH_HOME={args.out} "
          f"(and etcd's addresses in TIERMESH_ETCD)", file=sys.stderr)
    return EXIT_OK


def _list(args: argparse.Namespace) -> int:
    now = datetime.now(UTC)
    rows = [{"identity": r.identity.uri, "serial": f"{r.serial:x}", "not_after": r.not_after.isoformat(),
             "state": "revoked" if r.revoked else "expired" if r.not_after < now else "valid"}
            for r in _pki(args).listing()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"certificates ({len(rows)})")
    for col in ("identity", "serial", "not after (UTC)", "state"):
        table.add_column(col, no_wrap=True)
    for row in rows:
        table.add_row(row["identity"], row["serial"], row["not_after"][:16].replace("T", " "), row["state"])
    Console(width=200).print(table)
    return EXIT_OK


def _verify(args: argparse.Namespace) -> int:
    try:
        data = args.file.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {args.file}: {exc}") from exc
    try:
        cert = load_certificate(data)
    except Unauthenticated as exc:
        raise ConfigError(f"{args.file} is not a certificate") from exc
    pki = _pki(args)
    curve = None
    if args.curve is not None:
        from mesh.pki.files import read_curve

        curve = read_curve(args.curve).public
    identity = verify_certificate(cert, ca=pki.ca().cert, crl=pki.crl(), use=args.use,
                                  kinds=(args.kind,) if args.kind else KINDS, curve_public=curve)
    print(f"ok: {identity} ({args.use} use), serial {cert.serial_number:x}, valid until "
          f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M}Z")
    return EXIT_OK
