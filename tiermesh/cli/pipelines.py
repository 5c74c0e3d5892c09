"""``tiermesh variants pipeline`` and ``tiermesh variants pipelines``: register, remove and list pipelines, tasks
declared as graphs of other tasks (issue 33, :mod:`variant_store.pipeline_catalog`).

    pipeline    check a graph (YAML or JSON: kind sequence or switch) against the catalog's task signatures and
                catalog it as ``pipelines/<task>``; a cycle, an unknown task, a mismatched signature or a bad
                switch table is refused (exit 2, nothing written). ``--remove`` takes it out
    pipelines   the catalogued pipelines as a table (or JSON), malformed entries marked with the reason

An accuracy is never given here, only measured: with ``--validation FILE.npz`` the pipeline is run end to end on
those labelled rows before it is catalogued (:mod:`variant_store.pipeline_measure`: each stage task by its most
accurate variant the owner may use, whose accuracy becomes the floor its stage queries ask), and registered with
the measured top-1; rows the pipeline's door would refuse are refused (exit 2, nothing written). Without it the
pipeline is catalogued unmeasured (an SLO asking a minimum accuracy is not met by it).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from mesh.errors import BlobError, CatalogError, MeshError, PipelineRefused
from tiermesh.cli.main import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK
from variant_store.pipeline_measure import LABELS, MAX_ROWS
from variant_store.pipeline_meta import PipelineMeta

__all__ = ["add_commands", "print_pipelines"]

_MAX_GRAPH_BYTES = 1 << 20


def add_commands(vs: argparse._SubParsersAction[argparse.ArgumentParser],
                 add_common: Callable[[argparse.ArgumentParser], Any],
                 blob_root: Callable[[argparse.Namespace], Path]) -> None:
    """The two subcommands, under ``tiermesh variants`` (``blob_root``: where its blobs are, from the args)."""
    p = vs.add_parser("pipeline", help="register (or --remove) a task made of other tasks",
                      description="Checks the graph's stages against the catalog's task signatures (each input fed "
                                  "by name from the pipeline's inputs or the stage before, same dtype and shape), "
                                  "refuses cycles and unknown tasks, and catalogs it as pipelines/<task>.")
    p.add_argument("--task", required=True, help="the pipeline's task name (not a task with variants)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--graph", type=Path, default=None, metavar="FILE", help="the graph, YAML or JSON")
    which.add_argument("--remove", action="store_true", help="take the pipeline out of the catalog")
    p.add_argument("--owner", default=None, help="a tenant whose private pipeline it is (default: public)")
    p.add_argument("--validation", type=Path, default=None, metavar="FILE.npz",
                   help="measure the pipeline's top-1 end to end on these labelled rows, then register it with the "
                        "figure: an .npz holding one array per pipeline input, by the input's name (rows first), "
                        f"and '{LABELS}', one integer class per row (at most the first {MAX_ROWS} rows are used). "
                        "Each stage task runs as its most accurate variant the owner may use; those variants' "
                        "accuracies become the floors the stage queries ask (with --graph only)")
    p.add_argument("--json", action="store_true", help="print the entry as JSON")
    p.set_defaults(func=partial(_pipeline, blob_root=blob_root))
    ls = vs.add_parser("pipelines", help="list catalogued pipelines")
    ls.add_argument("--json", action="store_true", help="a JSON array (malformed entries: \"broken\": true)")
    ls.set_defaults(func=_pipelines)
    for sp in (p, ls):
        add_common(sp)


def _load(path: Path) -> Any:
    import yaml

    if path.stat().st_size > _MAX_GRAPH_BYTES:
        raise PipelineRefused(f"{path}: a graph is at most {_MAX_GRAPH_BYTES} bytes", reason="graph")
    try:
        return yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise PipelineRefused(f"{path}: not YAML: {exc}", reason="graph") from exc


async def _pipeline(args: argparse.Namespace, *, blob_root: Callable[[argparse.Namespace], Path]) -> int:
    from tiermesh.cli.context import open_store, store_args
    from variant_store.meta import PUBLIC
    from variant_store.pipeline_catalog import graph_from_yaml, register_pipeline, remove_pipeline

    if args.validation is not None and args.remove:
        print("error: --validation measures a --graph, not a --remove", file=sys.stderr)
        return EXIT_BAD_INPUT
    async with open_store(**store_args(args)) as store:
        try:
            if args.remove:
                await remove_pipeline(store, args.task)
                print(f"removed pipelines/{args.task}")
                return EXIT_OK
            graph = graph_from_yaml(_load(args.graph), args.task)
            figures: dict[str, Any] = {}
            if args.validation is not None:
                m = await _measure(store, args, graph, blob_root(args))
                figures = {"accuracy": round(m.accuracy, 6), "heldout_rows": m.rows,
                           "stage_accuracy": m.stage_accuracy}
            meta = await register_pipeline(store, args.task, graph, owner=args.owner or PUBLIC, **figures)
        except (PipelineRefused, CatalogError, BlobError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        except MeshError as exc:  # a stage that would not run (a runtime that cannot load it, a feed left empty)
            print(f"error: measuring pipeline {args.task}: {exc}", file=sys.stderr)
            return EXIT_FAILED
    if args.json:
        print(json.dumps(meta.to_json(), indent=2))
        return EXIT_OK
    print_pipelines([meta])
    print(f"registered as pipelines/{meta.task}")
    return EXIT_OK


async def _measure(store: Any, args: argparse.Namespace, graph: Any, blobs: Path) -> Any:
    """The graph planned as it would be registered, run on the --validation rows (nothing written)."""
    import asyncio

    from variant_store.blobs import BlobStore
    from variant_store.catalog import Catalog
    from variant_store.meta import PUBLIC
    from variant_store.pipeline_measure import load_rows, measure_pipeline, plan_pipeline

    meta = await plan_pipeline(store, args.task, graph, owner=args.owner or PUBLIC)
    rows = await asyncio.to_thread(load_rows, args.validation, meta.signature)
    if not args.json:
        print(f"measuring pipeline {args.task} on {len(rows)} labelled rows", file=sys.stderr, flush=True)
    m = await measure_pipeline(Catalog(store), BlobStore(blobs), meta, rows)
    if not args.json:
        used = ", ".join(f"{t}: {m.variants[t]} ({a * 100:.2f}%)" for t, a in sorted(m.stage_accuracy.items()))
        print(f"top-1 {m.accuracy * 100:.2f}% on {m.rows} rows; stages by {used}", file=sys.stderr, flush=True)
    return m


async def _pipelines(args: argparse.Namespace) -> int:
    from tiermesh.cli.context import open_store, store_args
    from variant_store.pipeline_catalog import read_pipelines

    async with open_store(**store_args(args)) as store:
        reading = await read_pipelines(store)
    if args.json:
        rows: list[dict[str, Any]] = [p.to_json() for p in reading.pipelines]
        rows += [{"broken": True, "key": b.key, "task": b.task, "reason": b.reason} for b in reading.broken]
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    print_pipelines(reading.pipelines)
    for b in reading.broken:
        print(f"BROKEN {b.key}: {b.reason}")
    return EXIT_OK


def _shape(p: PipelineMeta) -> str:
    if p.kind == "sequence":
        return " -> ".join(s.task for s in p.stages)
    return f"{p.stages[0].task}[{p.select}] -> " + ", ".join(f"{c}:{t}" for c, t in p.table)


def print_pipelines(pipelines: list[PipelineMeta]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"pipelines ({len(pipelines)})")
    for col in ("task", "kind", "graph", "inputs", "outputs", "accuracy", "held-out rows", "owner"):
        table.add_column(col)
    for p in pipelines:
        table.add_row(p.task, p.kind, _shape(p), ", ".join(i.name for i in p.signature.inputs),
                      ", ".join(o.name for o in p.signature.outputs),
                      "-" if p.accuracy is None else f"{p.accuracy * 100:.2f}%", str(p.heldout_rows or "-"), p.owner)
    Console(file=sys.stdout, width=None if sys.stdout.isatty() else 200).print(table)
