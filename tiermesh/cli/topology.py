"""``tiermesh topology validate FILE | diff FILE | apply FILE | show [--json]``.

A file is validated before anything connects to etcd, so an invalid file never reaches it
(exit 2, ``file:line: field: what`` on stderr). etcd unreachable -> exit 3 (mapped by
``tiermesh.cli.main``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from mesh.types import TIER_RANK
from tiermesh.cli.main import EXIT_FAILED, EXIT_OK, add_common
from topology.loader import load_topology_file
from topology.schema import Topology
from topology.store_io import Diff, apply, desired_state, diff, load_topology, read_state

__all__ = ["format_diff", "register", "render_topology"]


def register(sub: Any) -> None:
    p = sub.add_parser("topology", help="validate, diff, apply and show the topology (sites, links, tenants)")
    tsub = p.add_subparsers(dest="topology_command", metavar="ACTION", required=True)

    v = tsub.add_parser("validate", help="check a topology file; no etcd needed")
    v.add_argument("file")
    v.set_defaults(func=_validate)

    d = tsub.add_parser("diff", help="show what applying FILE would change in etcd")
    d.add_argument("file")
    add_common(d)
    d.set_defaults(func=_diff)

    a = tsub.add_parser("apply", help="make etcd hold FILE's topology (one transaction, idempotent)")
    a.add_argument("file")
    add_common(a)
    a.set_defaults(func=_apply)

    s = tsub.add_parser("show", help="print the topology applied in etcd")
    s.add_argument("--json", action="store_true", help="machine-readable JSON instead of tables")
    add_common(s)
    s.set_defaults(func=_show)


def _console() -> Console:
    # Resolved at call time so redirected / captured stdout is honoured; wide enough for key names.
    return Console(file=sys.stdout, highlight=False, width=max(100, Console().width))


def render_topology(topo: Topology, console: Console) -> None:
    sites = Table(title="sites")
    for col in ("name", "tier", "region", "lat,lon", "cpus", "memory MiB", "hardware", "USD/h"):
        sites.add_column(col)
    for s in sorted(topo.sites.values(), key=lambda s: (-TIER_RANK[s.tier], s.name)):  # core first
        hw = s.hardware
        sites.add_row(s.name, s.tier, s.region, f"{s.lat:g},{s.lon:g}", str(hw.cpu_cores), str(hw.memory_mb),
                      hw.hardware_class, f"{hw.price_per_hour:.2f}")
    links = Table(title="links")
    for col in ("a", "b", "latency ms", "bandwidth Mbit/s", "jitter ms"):
        links.add_column(col)
    for lk in topo.links:
        links.add_row(lk.a, lk.b, f"{lk.latency_ms:g}", f"{lk.bandwidth_mbps:g}", f"{lk.jitter_ms:g}")
    tenants = Table(title="tenants")
    for col in ("name", "isolation", "quotas"):
        tenants.add_column(col)
    for t in sorted(topo.tenants.values(), key=lambda t: t.name):
        tenants.add_row(t.name, t.isolation, ", ".join(f"{k}={v:g}" for k, v in sorted(t.quotas.items())))
    console.print(sites, links, tenants)


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def format_diff(d: Diff) -> list[str]:
    """One ``+ key`` / ``- key`` / ``~ key  field: old -> new`` line per key, sorted by key."""
    lines: list[str] = []
    for key in d.keys():
        if key in d.added:
            lines.append(f"+ {key}")
        elif key in d.removed:
            lines.append(f"- {key}")
        else:
            old, new = (_flat(x) for x in d.changed[key])
            fields = sorted(set(old) | set(new))
            what = ", ".join(f"{f}: {old.get(f)!r} -> {new.get(f)!r}"
                             for f in fields if old.get(f) != new.get(f))
            lines.append(f"~ {key}  {what}")
    return lines


def _print_diff(d: Diff, console: Console) -> None:
    styles = {"+": "green", "-": "red", "~": "yellow"}
    for line in format_diff(d):
        console.print(line, style=styles[line[0]], markup=False)


def _validate(args: argparse.Namespace) -> int:
    topo = load_topology_file(args.file)
    console = _console()
    render_topology(topo, console)
    console.print(f"{args.file}: ok ({len(topo.sites)} sites, {len(topo.links)} links, "
                  f"{len(topo.tenants)} tenants)", markup=False)
    return EXIT_OK


def _store_cm(args: argparse.Namespace) -> Any:
    # Imported here so that `validate` never touches etcd machinery.
    from tiermesh.cli.context import open_store, store_args

    return open_store(**store_args(args))


async def _diff(args: argparse.Namespace) -> int:
    topo = load_topology_file(args.file)  # before any connection: a bad file never reaches etcd
    async with _store_cm(args) as store:
        state, _ = await read_state(store)
    d = diff({k: v.value for k, v in state.items()}, desired_state(topo))
    console = _console()
    if d.empty:
        console.print("no changes")
    else:
        _print_diff(d, console)
        console.print(d.summary(), markup=False)
    return EXIT_OK


def _source(path: str) -> str:
    return Path(path).read_text(encoding="utf-8", errors="replace")


async def _apply(args: argparse.Namespace) -> int:
    topo = load_topology_file(args.file)
    source = _source(args.file)  # kept with the record of this apply (the console shows it)
    async with _store_cm(args) as store:
        d = await apply(store, topo, source=source)
    console = _console()
    if d.empty:
        console.print("no changes")
    else:
        _print_diff(d, console)
        console.print(f"applied: {d.summary()}", markup=False)
    return EXIT_OK


async def _show(args: argparse.Namespace) -> int:
    async with _store_cm(args) as store:
        topo = await load_topology(store)
    if topo is None:
        print("no topology applied (run: tiermesh topology apply FILE)", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(json.dumps(topo.to_dict(), indent=2, sort_keys=True))
    else:
        render_topology(topo, _console())
    return EXIT_OK
