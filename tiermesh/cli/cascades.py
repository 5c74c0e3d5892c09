"""``tiermesh variants cascade`` and ``tiermesh variants cascades``: calibrate, register and list a task's
cascades (issue 33, :mod:`variant_store.cascade`). ``tiermesh variants remove --task T --cascade ID`` removes one
(:mod:`tiermesh.cli.variants`).

    cascade    run every stage on the task's validation split, choose the thresholds on one half, measure the
               cascade on the other, catalog it (``cascades/<task>/<id>``); a target no threshold reaches is
               refused (exit 2, nothing written)
    cascades   the catalogued cascades as a table (or JSON), malformed entries marked with the reason
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from mesh.errors import CascadeRefused, CatalogError
from tiermesh.cli.main import EXIT_BAD_INPUT, EXIT_OK
from variant_store.cascade_meta import RULES, CascadeMeta

__all__ = ["add_commands", "cascade_row"]


def add_commands(vs: argparse._SubParsersAction[argparse.ArgumentParser],
                 add_common: Callable[[argparse.ArgumentParser], Any],
                 blob_root: Callable[[argparse.Namespace], Path]) -> None:
    """The two subcommands, under ``tiermesh variants`` (``blob_root``: where its blobs are, from the args)."""
    c = vs.add_parser("cascade", help="calibrate a cascade of a task's variants and catalog it",
                      description="Runs each stage (cheapest first) on the task's validation rows, chooses each "
                                  "threshold on a seeded, label-stratified half so the fewest rows escalate while "
                                  "top-1 there stays >= the target, then measures accuracy and escalation on the "
                                  "other half: those figures are what routing believes.")
    c.add_argument("--task", required=True)
    c.add_argument("--stages", required=True, metavar="V1,V2[,V3]",
                   help="variant ids of the task, cheapest first (`tiermesh variants list --task T`)")
    c.add_argument("--rule", default="max_softmax", choices=list(RULES),
                   help="a stage's confidence in its answer: the top softmax probability, or the gap to the second")
    c.add_argument("--target-accuracy", type=float, default=None, metavar="X",
                   help="top-1 to meet on the calibration half (default: the last stage's there, minus 0.003)")
    c.add_argument("--id", default=None, dest="cascade_id", help="the cascade's id (default: <V1>-to-<V2>...)")
    c.add_argument("--json", action="store_true", help="print the result as JSON")
    c.set_defaults(func=partial(_cascade, blob_root=blob_root))

    ls = vs.add_parser("cascades", help="list catalogued cascades")
    ls.add_argument("--task", default=None)
    ls.add_argument("--json", action="store_true", help="a JSON array (malformed entries: \"broken\": true)")
    ls.set_defaults(func=_cascades)
    for sp in (c, ls):
        add_common(sp)


async def _cascade(args: argparse.Namespace, *, blob_root: Callable[[argparse.Namespace], Path]) -> int:
    from tiermesh.cli.context import open_store, store_args
    from variant_store.blobs import BlobStore
    from variant_store.build import load_validation
    from variant_store.cascade import register_cascade
    from variant_store.catalog import Catalog

    stages = tuple(s.strip() for s in args.stages.split(",") if s.strip())

    def say(msg: str) -> None:
        if not args.json:
            print(msg, file=sys.stderr, flush=True)

    async with open_store(**store_args(args)) as store:
        try:
            cal = await register_cascade(Catalog(store), BlobStore(blob_root(args)), args.task, stages,
                                         rule=args.rule, target_accuracy=args.target_accuracy,
                                         cascade_id=args.cascade_id, progress=say, load_rows=load_validation)
        except (CascadeRefused, CatalogError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
    if args.json:
        print(json.dumps(cal.to_json(), indent=2))
        return EXIT_OK
    print_cascades([cal.meta], {cal.meta.cascade_id: cal.stage_accuracy})
    print(f"calibrated in {cal.seconds:.2f}s; registered as cascades/{cal.meta.task}/{cal.meta.cascade_id}")
    return EXIT_OK


async def _cascades(args: argparse.Namespace) -> int:
    from tiermesh.cli.context import open_store, store_args
    from variant_store.catalog import Catalog

    async with open_store(**store_args(args)) as store:
        reading = await Catalog(store).read_cascades(args.task)
    if args.json:
        rows = [cascade_row(c) for c in reading.cascades]
        rows += [{"broken": True, "key": b.key, "task": b.task, "id": b.name, "reason": b.reason}
                 for b in reading.broken]
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    print_cascades(reading.cascades, {})
    for b in reading.broken:
        print(f"BROKEN {b.key}: {b.reason}")
    return EXIT_OK


def cascade_row(c: CascadeMeta) -> dict[str, Any]:
    """The ``cascades --json`` shape: the catalog entry as it is written."""
    return {"id": c.cascade_id, **c.to_json()}


def print_cascades(cascades: list[CascadeMeta], alone: dict[str, tuple[float, ...]]) -> None:
    """A table of cascades; ``alone``: cascade id -> each stage's own held-out top-1, when just measured."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"cascades ({len(cascades)}), figures on the held-out half")
    for col, just in (("task", "left"), ("id", "left"), ("stages", "left"), ("rule", "left"),
                      ("thresholds", "right"), ("accuracy", "right"), ("stages alone", "right"),
                      ("escalation", "right"), ("rows cal/held", "right"), ("owner", "left")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    for c in cascades:
        solo = alone.get(c.cascade_id)
        table.add_row(c.task, c.cascade_id, " -> ".join(c.stages), c.rule,
                      ", ".join(f"{t:.4f}" for t in c.thresholds), f"{c.accuracy * 100:.2f}%",
                      ", ".join(f"{a * 100:.2f}%" for a in solo) if solo else "-",
                      ", ".join(f"{e * 100:.1f}%" for e in c.escalation),
                      f"{c.calibration_rows}/{c.heldout_rows}", c.owner)
    Console(file=sys.stdout, width=None if sys.stdout.isatty() else 200).print(table)
