"""``tiermesh up``: a whole mesh on this machine, optionally driven by a labelled workload.

Starts the embedded etcd, applies the topology, builds or loads the digits family into the variant
store, starts a scheduler and one agent process per site with every site-to-site path delayed by
userspace TCP proxies, prints the edge API addresses, and with ``--duration`` runs a mixed SLO
workload through the SDK, then prints (and with ``--report`` writes) a table per SLO class.

With ``--netns`` (root) every site, etcd and the control services run in network namespaces of their
own, each with its own address on a bridge this run creates and removes, and each a host as deployed: a home of
its own (HOME/hosts/<role>) holding only its own identity's files, started with the command line the Kubernetes
manifests use; the report lists them. ``--kill``, ``--cut`` and ``--blackhole`` are failure drills at a time into the
workload; ``--join`` adds a machine mid-run as an operator does and ``--revoke`` takes one out
(``tiermesh pki revoke``).

Secured by default: the edge APIs speak HTTPS with client certificates; the run creates the mesh CA
under HOME/pki (or keeps the one there), a certificate per site and one per tenant of the topology, and
prints where they are. ``--insecure`` (development only, with a warning) serves plain HTTP and takes the
tenant from the X-Tiermesh-Tenant header.

The admin console runs beside the scheduler and its address is printed (last, after a workload's report):
with TLS it admits the admin certificate the run issues (``HOME/pki/admins/admin.pem``, and ``admin.p12`` with
its password file for a browser); with ``--insecure`` the printed address carries a token.
``--then-serve`` keeps the mesh and the console up after a ``--duration`` workload, until Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from mesh.errors import ConfigError
from mesh.etcd.server import clear_record, find_running, write_record
from mesh.lifecycle import cancel_and_wait
from mesh.log import LogToFile
from mesh.settings import MeshSettings
from tiermesh.cli.agent import INSECURE_WARNING
from tiermesh.drills import LinkDrill, crosses_link, drill_report, parse_kill, parse_link_drill
from tiermesh.harness import LocalMesh
from tiermesh.membership import REVOKE_GRACE_S, MembershipDrill, check_drills, membership_report, parse_membership
from tiermesh.mesh_options import MeshOptions, logs_dir
from tiermesh.netns import require_netns
from tiermesh.secure import OPERATOR, MeshCredentials
from tiermesh.workload import (
    DEFAULT_CLASSES,
    TEXT_CLASS,
    SdkClients,
    SloClass,
    WarmUp,
    by_edge,
    render_edges,
    render_table,
    run_workload,
    summarise,
    warm_up,
)
from topology.loader import load_topology_file

__all__ = ["print_console", "register", "run_up"]

DEFAULT_TOPOLOGY = Path("examples/topology.yaml")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("up", help="start a whole local mesh (etcd, variant store, scheduler, agents)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topology", type=Path, default=DEFAULT_TOPOLOGY, help="topology YAML (default %(default)s)")
    p.add_argument("--home", type=Path, default=None, help="state directory (default $TIERMESH_HOME or .tiermesh)")
    p.add_argument("--duration", type=float, default=None,
                   help="run a workload for S seconds, print the report and stop (default: serve until Ctrl-C)")
    p.add_argument("--qps", type=float, default=40.0, help="offered load of the workload (queries/s)")
    p.add_argument("--report", type=Path, default=None, help="write the workload report as JSON here")
    p.add_argument("--records", type=Path, default=None, metavar="FILE",
                   help="write every workload query as one JSON line here (class, edge, serving site and variant, "
                        "door-timed total_ms against budget_ms, error code): where a class's misses happened")
    p.add_argument("--kill", metavar="SITE@SECONDS", default=None,
                   help="SIGKILL a site's agent this many seconds into the workload (failure drill)")
    p.add_argument("--cut", metavar="A-B@SECONDS", action="append", default=[],
                   help="fail the link A-B (both ways, every path over it) this many seconds into the workload: "
                        "connections are reset (repeatable)")
    p.add_argument("--blackhole", metavar="A-B@SECONDS", action="append", default=[],
                   help="like --cut, but packets vanish without a reset: a gray failure (repeatable)")
    p.add_argument("--join", metavar="SITE@SECONDS", action="append", default=[],
                   help="a site of the topology that is not there at start: this many seconds into the workload it "
                        "joins as an operator adds a machine (topology applied with it, its certificate issued for "
                        "its address, its files copied to its host, its agent started); the report says when it "
                        "served its first query (repeatable)")
    p.add_argument("--revoke", metavar="SITE@SECONDS", action="append", default=[],
                   help="`tiermesh pki revoke --site SITE` this many seconds into the workload (its agent keeps "
                        "running, as a compromised machine would); the report shows what it served after and that "
                        "its peers sent it nothing from 5 s after (repeatable; needs the secured mesh)")
    p.add_argument("--netns", action="store_true",
                   help="every site, etcd and the control services in a network namespace of its own, with "
                        "its own address on a private bridge (root; removed on exit)")
    p.add_argument("--no-wan", action="store_true", help="no delay proxies between sites")
    p.add_argument("--etcd-members", type=int, default=1, metavar="N",
                   help="run the embedded etcd as an N-member cluster (1 or 3; not with --netns yet); every "
                        "process gets all members' URLs and fails over between them")
    p.add_argument("--no-caps", action="store_true",
                   help="run every agent uncapped. Default: each site's agent gets the CPU (a cgroup quota) and model "
                        "memory its topology entry declares, scaled to this machine (uncapped, and said so, where "
                        "cgroups are not writable)")
    p.add_argument("--insecure", action="store_true",
                   help="edge APIs over plain HTTP, tenant from the X-Tiermesh-Tenant header (development only: "
                        "anyone can claim any tenant). Default: HTTPS with client certificates from HOME/pki")
    p.add_argument("--no-text", action="store_true",
                   help="serve the digits family only: skip the text family (MiniLM encoders shared by acme's and "
                        "globex's heads; built once into ~/.cache/tiermesh, about a minute)")
    p.add_argument("--console-port", type=int, default=0, metavar="PORT",
                   help="port of the admin console (default: any free one; the address is printed)")
    p.add_argument("--no-console", action="store_true", help="do not serve the admin console")
    p.add_argument("--then-serve", action="store_true",
                   help="after the --duration workload and its report, keep serving (mesh and console) until Ctrl-C")
    p.add_argument("--verbose", action="store_true",
                   help="this process's log (etcd, the variant build, the scheduler) and library warnings on the "
                        "screen too. Default: only in HOME/logs/up.log; each site's agent logs to "
                        "HOME/logs/<site>.log")
    p.set_defaults(func=run_up)


async def run_up(args: argparse.Namespace) -> int:
    settings = MeshSettings()
    home = (args.home or settings.home).resolve()
    # the variant build runs ONNX Runtime and TF Lite here, whose C loggers write to stderr's descriptor: to the
    # log too (the agents' own go to their files)
    with LogToFile(logs_dir(home) / "up.log", echo=args.verbose, native=True):
        return await _run_up(args, home)


async def _run_up(args: argparse.Namespace, home: Path) -> int:
    console = Console(stderr=False)
    if not args.topology.exists():
        raise ConfigError(f"topology file {args.topology} not found (run from the repository root or pass --topology)")
    if find_running(home):
        raise ConfigError(f"an etcd already runs for {home}; stop it or pass --home DIR")
    if args.insecure and MeshCredentials.under(home).secured():
        # its etcd data has RBAC on: a plain etcd there answers no one, and turning auth off for this run would
        # quietly unsecure the home
        raise ConfigError(f"{home} holds a secured mesh (its etcd has TLS and RBAC on, from an earlier `tiermesh up`): "
                          f"--insecure cannot run there. Drop --insecure, or give the insecure mesh a home of its own "
                          f"(--home DIR, e.g. --home .tiermesh-insecure)")
    kill = parse_kill(args.kill)
    if args.etcd_members not in (1, 3, 5):
        raise ConfigError(f"--etcd-members {args.etcd_members}: an etcd cluster has 1, 3 or 5 members")
    if args.etcd_members > 1 and args.netns:
        raise ConfigError("--etcd-members > 1 with --netns is not built yet (etcd runs in one namespace)")
    if not 0 <= args.console_port <= 65535:
        raise ConfigError(f"--console-port {args.console_port}: a port is 0..65535")
    topology_sites = set(load_topology_file(args.topology).sites)
    members = [parse_membership("join", d, topology_sites) for d in args.join]
    members += [parse_membership("revoke", d, topology_sites) for d in args.revoke]
    check_drills(members, topology_sites - {d.site for d in members if d.kind == "join"})
    if args.revoke and args.insecure:
        raise ConfigError("--revoke revokes a certificate: the --insecure mesh has none")
    opts = MeshOptions(topology=args.topology, home=home, wan=not args.no_wan, netns=args.netns,
                       joins=[d.site for d in members if d.kind == "join"],
                       etcd_members=args.etcd_members, tls=not args.insecure, caps=not args.no_caps,
                       text_backbones=None if args.no_text else [],
                       console=not (args.no_console or args.netns), console_port=args.console_port)
    if args.insecure:
        console.print(f"[bold yellow]{INSECURE_WARNING}[/]")
    mesh = LocalMesh(opts)
    sites = set(mesh.topology.sites)
    drills = [parse_link_drill("cut", d, sites) for d in args.cut]
    drills += [parse_link_drill("blackhole", d, sites) for d in args.blackhole]
    if drills and args.no_wan and not args.netns:
        raise ConfigError("--cut/--blackhole need the delay proxies or --netns (this run has neither)")
    if args.netns:
        await require_netns(firewall=bool(drills))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    t_start = time.perf_counter()
    with console.status("starting mesh: etcd, topology, variant store, scheduler, agents..."):
        await mesh.start()
    try:
        # other commands on this home (`tiermesh topology apply`, ...) find it, as the local operator
        files = mesh.creds.files(OPERATOR) if mesh.creds is not None else {}
        write_record(home, os.getpid(), mesh.etcd_url, **files)
        capped = mesh.cgroups is not None and mesh.cgroups.available
        with console.status("placement warming the sites" + (" (capped sites time their variants under their caps "
                                                              "first: their class is new)..." if capped else "...")):
            # "mesh up" means queries succeed (issue 30): every task servable, the capped sites' timings in (a
            # site timing its variants at a tenth of a core has no room for a 10 ms query), placement loaded
            pending = await mesh.wait_servable(timeout=60)
            if pending:
                pending = await mesh.wait_profiled(timeout=45)
            await mesh.wait_placed(timeout=60)
            await mesh.wait_quiet(timeout=20)  # no load or heap thaw left to stall a capped site's first queries
        console.print(f"[bold green]mesh up[/] in {time.perf_counter() - t_start:.1f} s — etcd {mesh.etcd_url}")
        if pending:
            console.print(f"  {len(pending)} capped site(s) still timing variants under their caps after 45 s, in the "
                          "background; placement adds each as its timings arrive")
        for name, sp in sorted(mesh.sites.items()):
            tier = mesh.topology.sites[name].tier
            console.print(f"  {tier:6s} {name:14s} http {sp.http}  grpc {sp.grpc or 'off'}  zmq {sp.zmq}")
            caps = mesh.site_caps.get(name)
            console.print(f"  {'':6s} {'':14s} caps: {caps.describe() if caps else 'none (--no-caps)'}")
        if mesh.cgroups is not None and not mesh.cgroups.available:
            console.print(f"[bold yellow]sites run WITHOUT CPU caps:[/] {mesh.cgroups.why}")
        etcd_log = getattr(mesh.etcd, "log_path", None)
        console.print(f"logs: {logs_dir(home)}/ (<site>.log per agent, up.log for this process"
                      + (f"; etcd's {etcd_log}" if etcd_log is not None else "") + "; --verbose shows up.log here)",
                      markup=False, soft_wrap=True)
        if mesh.pki is not None:
            paths = mesh.pki.paths
            console.print(f"mutual TLS: CA {paths.ca_cert}; tenant certificates ({', '.join(mesh.tenants())}) in "
                          f"{paths.root / 'tenants'}; e.g. Client(URL, cert=..., key=..., ca={str(paths.ca_cert)!r})")
            console.print(f"etcd: TLS, client certificates and RBAC per role; variant store {mesh.store_url} (HTTPS, "
                          f"tenant-private variants to their tenant only); operator identity {paths.root / 'admins'}")
        if args.duration is None:
            print_console(mesh, console)
            console.print("serving; Ctrl-C to stop")
            await stop.wait()
            return 0
        rc = await _drive(mesh, args, console, kill, drills, stop, members)
        print_console(mesh, console, serving=args.then_serve)
        if args.then_serve and rc == 0 and not stop.is_set():
            console.print("serving; Ctrl-C to stop")
            await stop.wait()
        return rc
    finally:
        clear_record(home)
        with console.status("stopping mesh..."):
            await mesh.stop()


def print_console(mesh: LocalMesh, console: Console, *, serving: bool = True) -> None:
    """Where the admin console is and how to get in (certificate files, or the token in the address)."""
    if mesh.console is None:
        if mesh.opts.netns:
            console.print("console: not served with --netns yet")
        return
    if mesh.pki is not None:
        files = mesh.admin_files()
        console.print(f"admin certificate {files['cert']} (key {files['key']}, CA {files['ca']}); for a browser "
                      f"import {files['p12']} (password in {files['p12_password']})", markup=False, soft_wrap=True)
    note = "" if serving else "  (stops with this run: --then-serve, or `make demo SERVE=1`, keeps it up)"
    console.print(f"[bold]console[/] {mesh.console.login_url}{note}", soft_wrap=True)


async def _until_stopped(task: asyncio.Task[Any], stop: asyncio.Event) -> bool:
    """Wait for ``task`` or ``stop`` (Ctrl-C), whichever comes first; on ``stop`` cancel the task and wait until it
    has ended. Whether the task finished by itself."""
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    await cancel_and_wait(stopper)
    if task.done():
        return True
    await cancel_and_wait(task)
    return False


async def _drive(mesh: LocalMesh, args: argparse.Namespace, console: Console, kill: tuple[str, float] | None,
                 drills: list[LinkDrill], stop: asyncio.Event, members: list[MembershipDrill]) -> int:
    from variant_store.families.datasets import load_validation_npz

    val = load_validation_npz()
    x, y = val.x[val.calib_count:], val.y[val.calib_count:]
    classes: tuple[SloClass, ...] = DEFAULT_CLASSES
    data: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    if mesh.opts.text_backbones is not None:  # a text class too: held-out package descriptions
        from variant_store.families.text_corpus import load_corpus

        classes, data = (*DEFAULT_CLASSES, TEXT_CLASS), {TEXT_CLASS.task: load_corpus().holdout()}
    edges = mesh.edge_urls()
    for url in edges.values():
        await mesh.check_dial(url)  # with --netns: through the run's bridge, never the default route
    credentials = mesh.tenant_files if mesh.pki is not None else None
    # one SDK client per (edge, tenant) for the warm-up and the run: the run starts on warm connections
    async with SdkClients(edges, (c.tenant for c in classes), credentials) as clients:

        async def _warm() -> dict[str, WarmUp]:
            found = await warm_up(edges, x, y, classes=classes, data=data, clients=clients)
            await mesh.wait_placed(timeout=30)  # what the warm-up's demand placed, loaded everywhere it was put
            await mesh.wait_quiet(timeout=20)  # and the heap thaws its unloads owe, done before the run
            return found

        with console.status("warming each class at every edge (a tenant's private task is placed on its first "
                            "demand)..."):
            warming = asyncio.create_task(_warm())
            if not await _until_stopped(warming, stop):
                return 130
        warm = warming.result()
        console.print("warm-up (not measured): " + ", ".join(
            f"{name} {w.seconds:.1f} s/{w.queries} q" + ("" if w.ready else " [bold yellow]NOT READY[/]")
            for name, w in warm.items()))
        failed: dict[int, list[tuple[str, str]]] = {}

        async def _kill_later(site: str, at: float) -> None:
            await asyncio.sleep(at)
            console.print(f"[bold red]killing {site}[/] (SIGKILL) at t={at:.0f}s")
            await mesh.kill_site(site)

        async def _drill_later(i: int, d: LinkDrill) -> None:
            await asyncio.sleep(d.at_s)
            console.print(f"[bold red]{d.kind} {d.link}[/] at t={d.at_s:.0f}s")
            failed[i] = await mesh.drill(d.kind, d.a, d.b)

        joined: dict[str, float] = {}
        forwarded: dict[str, int | None] = {}

        async def _member_later(d: MembershipDrill) -> None:
            await asyncio.sleep(d.at_s)
            if d.kind == "join":
                console.print(f"[bold green]joining {d.site}[/] at t={d.at_s:.0f}s")
                joined[d.site] = await mesh.join_site(d.site)
                return
            console.print(f"[bold red]revoking {d.site}[/] at t={d.at_s:.0f}s")
            await mesh.revoke_site(d.site)
            await asyncio.sleep(REVOKE_GRACE_S)  # from here on its peers must send it nothing
            forwarded[d.site] = await mesh.forwarded_served(d.site)

        timers = [asyncio.create_task(_drill_later(i, d)) for i, d in enumerate(drills)]
        timers += [asyncio.create_task(_member_later(d)) for d in members]
        if kill is not None:
            timers.append(asyncio.create_task(_kill_later(*kill)))
        offered = [0]
        console.print(f"workload: {args.qps:.0f} q/s for {args.duration:.0f} s across edges {sorted(edges)}")
        work = asyncio.create_task(run_workload(edges, x, y, duration_s=args.duration, qps=args.qps,
                                                classes=classes, data=data,
                                                on_tick=lambda n, _t: offered.__setitem__(0, n),
                                                clients=clients))
        finished = await _until_stopped(work, stop)  # else Ctrl-C: its queries ended before the clients close
        for t in timers:
            t.cancel()
        for t in timers:  # a drill that failed says so here, not silently
            if t.done() and not t.cancelled() and (exc := t.exception()) is not None:
                raise exc
        if not finished:
            return 130
        result = work.result()
        tiers = {n: s.tier for n, s in mesh.topology.sites.items()}
        summary = summarise(result.records, tiers)
        console.print(render_table(summary))
        per_edge = by_edge(result.records)
        console.print(render_edges(per_edge))
        lost = offered[0] - len(result.records)
        report: dict[str, Any] = {"schema": 1, "duration_s": result.duration_s, "qps": args.qps,
                                  "queries": len(result.records), "offered": offered[0], "lost": lost,
                                  "kill": args.kill, "netns": args.netns, "tls": mesh.pki is not None,
                                  "addresses": mesh.addresses(),
                                  "warmup": {name: dataclasses.asdict(w) for name, w in warm.items()},
                                  "classes": summary, "edges": per_edge}
        if drills:
            report["drills"] = [drill_report(d, result.records, crosses_link(mesh.topology, d.a, d.b), lost=lost,
                                             failed_pairs=failed.get(i, [])) for i, d in enumerate(drills)]
            for section in report["drills"]:
                noticed = section["detection_s"]
                console.print(f"{section['kind']} {section['link']} at {section['at_s']:.0f}s: "
                              f"{section['routed_around']} routed around (first "
                              f"{'never' if noticed is None else f'{noticed:.2f}s after'}), "
                              f"{section['crossing_after']} still crossed, errors {section['errors'] or '-'}, "
                              f"{section['past_deadline_1s']} past deadline+1s, {section['affected_misses']} affected "
                              f"missed (last {section['last_miss_s']:.2f}s after)")
        if members:
            report["membership"] = []
            for d in members:
                after = None
                if d.kind == "revoke" and forwarded.get(d.site) is not None:
                    end = await mesh.forwarded_served(d.site)
                    after = None if end is None else end - forwarded[d.site]  # type: ignore[operator]
                section = membership_report(d, result.records, ready_s=joined.get(d.site), forwarded_after_grace=after)
                report["membership"].append(section)
                console.print(_membership_line(section))
        if args.report is not None:
            args.report.parent.mkdir(parents=True, exist_ok=True)
            args.report.write_text(json.dumps(report, indent=2))
            console.print(f"report written to {args.report}")
        if args.records is not None:
            args.records.parent.mkdir(parents=True, exist_ok=True)
            args.records.write_text("".join(json.dumps(dataclasses.asdict(r)) + "\n" for r in result.records))
            console.print(f"{len(result.records)} query records written to {args.records}")
        return 0


def _membership_line(section: dict[str, Any]) -> str:
    if section["kind"] == "join":
        first = section["first_served_s"]
        return (f"join {section['site']} at {section['at_s']:.0f}s: agent up {section['ready_s']}s after, first query "
                f"served {'never' if first is None else f'{first:.2f}s after'}, {section['served']} served")
    last = section["last_served_s"]
    return (f"revoke {section['site']} at {section['at_s']:.0f}s: {section['served_before']} served in the "
            f"{REVOKE_GRACE_S:.0f}s before, {section['served_after']} after"
            f"{'' if last is None else f' (the last {last:.2f}s after)'}, {section['served_from_grace']} from "
            f"{REVOKE_GRACE_S:.0f}s after; "
            f"run for its peers from then: {section['forwarded_to_it_from_grace']}; errors after "
            f"{section['errors_after'] or '-'}")
