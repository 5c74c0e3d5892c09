"""``tiermesh variants ...``: what a model owner uses to register a model and see its variants.

    register     store an ONNX model plus a labelled validation set for a task
    build        generate, measure and catalog the variants of registered models
    build-digits register and build the committed digits family
    build-text   register and build the text family (MiniLM encoders + acme's and globex's heads)
    profile      measure one variant on this machine's hardware class
    list         the catalog as a table (or JSON), broken entries marked with the reason
    show         one variant's full metadata
    remove       take a task, a family, one variant or one cascade out of the catalog
    cascade      calibrate a cascade of a task's variants and catalog it (tiermesh.cli.cascades)
    cascades     list catalogued cascades
    pipeline     register (or --remove) a task made of other tasks (tiermesh.cli.pipelines)
    pipelines    list catalogued pipelines
    serve        the blob + catalog HTTP service
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from mesh.errors import CatalogError
from tiermesh.cli.main import EXIT_BAD_INPUT, EXIT_OK, add_addresses, add_common
from variant_store.blobs import BlobStore
from variant_store.catalog import Catalog
from variant_store.catalog_check import BrokenEntry
from variant_store.meta import VariantMeta

__all__ = ["blob_root", "broken_row", "register", "variant_row"]


def blob_root(args: argparse.Namespace) -> Path:
    """``<home>/blobs``: --home, else $TIERMESH_HOME, else ./.tiermesh."""
    from mesh.settings import MeshSettings

    home = Path(args.home) if getattr(args, "home", None) else MeshSettings().home
    return home / "blobs"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("variants", help="register models; build, profile and list their variants",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    vs = p.add_subparsers(dest="variants_command", metavar="SUBCOMMAND", required=True)

    r = vs.add_parser("register", help="register an ONNX model and its validation set for a task")
    r.add_argument("--task", required=True)
    r.add_argument("--family", required=True,
                   help="a family name no other task uses, e.g. my-mlp: variant ids are <family>.<format>."
                        "<precision> and unique across the mesh, so a name another task holds is refused")
    r.add_argument("--model", required=True, type=Path, metavar="FILE.onnx")
    r.add_argument("--validation", required=True, type=Path, metavar="FILE.npz",
                   help="arrays x, y (labels; optional for cosine) and calib_count (calibration rows)")
    r.add_argument("--owner", default="public", metavar="TENANT")
    r.add_argument("--metric", default="top1", choices=["top1", "cosine"])
    r.set_defaults(func=_register)

    b = vs.add_parser("build", help="generate and profile variants of registered models")
    b.add_argument("--task", default=None, help="only this task (default: every task with registered models)")
    b.add_argument("--family", action="append", default=None, help="only this family (repeatable)")
    b.add_argument("--kinds", nargs="+", default=None, metavar="KIND",
                   help="variant kinds to generate, e.g. onnx.fp32 onnx.int8-dynamic (default: all)")
    b.add_argument("--repeats", type=int, default=50, help="timed runs per batch size when profiling")
    b.add_argument("--json", action="store_true", help="print the build report as JSON")
    b.set_defaults(func=_build)

    d = vs.add_parser("build-digits", help="register and build the committed digits family")
    d.add_argument("--repeats", type=int, default=50)
    d.set_defaults(func=_build_digits)
    t = vs.add_parser("build-text", help="register and build the text family (built once into ~/.cache/tiermesh)")
    t.add_argument("--repeats", type=int, default=50)
    t.set_defaults(func=_build_text)

    pr = vs.add_parser("profile", help="measure one variant on this machine's hardware class")
    pr.add_argument("--task", required=True)
    pr.add_argument("--variant", required=True)
    pr.add_argument("--repeats", type=int, default=50)
    pr.set_defaults(func=_profile)

    ls = vs.add_parser("list", help="list catalogued variants")
    ls.add_argument("--task", default=None)
    ls.add_argument("--json", action="store_true",
                    help="one JSON object per variant, as a JSON array (broken entries: \"broken\": true, \"reason\")")
    ls.set_defaults(func=_list)

    rm = vs.add_parser("remove", help="take a task, a family or one variant out of the catalog",
                       description="Deletes the catalog keys in etcd (and, for a task or a family, its registered "
                                   "models); sites unload the variants when placement next runs. Blobs stay in the "
                                   "content-addressed blob store (other entries may name the same bytes): the "
                                   "summary lists those nothing names any more. A broken entry is removable too.")
    rm.add_argument("--task", required=True)
    which = rm.add_mutually_exclusive_group()
    which.add_argument("--family", default=None, help="only this family's registration and variants")
    which.add_argument("--variant", default=None, help="only this variant id (and the cascades chaining it)")
    which.add_argument("--cascade", default=None, help="only this cascade id (its variants stay)")
    rm.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    rm.add_argument("--json", action="store_true", help="print what was removed as JSON")
    rm.set_defaults(func=_remove)

    sh = vs.add_parser("show", help="one variant's metadata as JSON")
    sh.add_argument("--task", required=True)
    sh.add_argument("--variant", required=True)
    sh.set_defaults(func=_show)

    sv = vs.add_parser("serve", help="serve blobs and the catalog over HTTP and announce the URL in etcd")
    add_addresses(sv, "the blob and catalog server", aliases=("--host",))
    sv.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    sv.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    sv.add_argument("--site", default=None,
                    help="topology site this store runs at: routing charges a cold start elsewhere the "
                         "fetch over that site's path (default: none, fetches count as free)")
    sv.add_argument("--pki-dir", type=Path, default=None,
                    help="serve HTTPS with client certificates from this mesh PKI directory, as the store identity "
                         "--name (stores/NAME.pem, NAME-key.pem: `tiermesh pki issue --store NAME --address HOST`); "
                         "a tenant-private variant then goes only to its tenant, to admins and to the sites "
                         "placement asks to serve that tenant (etcd placement/<site>, read at each request; kept "
                         "for 5 minutes after placement moves away), a model's labelled validation set only to its "
                         "owner and admins, nothing to etcd's own certificate, and the revocation list is followed "
                         "from etcd pki/crl. Without it: plain HTTP that serves anyone (development only)")
    sv.add_argument("--name", default="variant-store", metavar="NAME",
                    help="the store's identity with --pki-dir: spiffe://tiermesh/store/NAME (default variant-store)")
    sv.set_defaults(func=_serve)

    for sp in (r, b, d, t, pr, ls, sh, sv, rm):
        add_common(sp)
    from tiermesh.cli.cascades import add_commands

    add_commands(vs, add_common, blob_root)
    from tiermesh.cli.pipelines import add_commands as add_pipeline_commands

    add_pipeline_commands(vs, add_common, blob_root)


async def _register(args: argparse.Namespace) -> int:
    from tiermesh.cli.context import open_store, store_args
    from variant_store.build import register_model

    async with open_store(**store_args(args)) as store:
        try:
            m = await register_model(Catalog(store), BlobStore(blob_root(args)), args.model, args.validation,
                                     args.task, args.family, owner=args.owner, metric=args.metric)
        except CatalogError as exc:  # the owner's input: a family another task holds, another task's inputs
            return _refused(exc)
    print(f"registered {m.task}/{m.family}: model {m.parent_digest[:12]}, "
          f"validation {m.validation_digest[:12]}")
    return EXIT_OK


async def _build(args: argparse.Namespace) -> int:
    from tiermesh.cli.context import open_store, store_args
    from variant_store.build import build_task

    reports = []
    refused: list[CatalogError] = []
    async with open_store(**store_args(args)) as store:
        catalog = Catalog(store)
        tasks = [args.task] if args.task else sorted({m.task for m in await catalog.list_models()})
        for task in tasks:
            try:
                reports.append(await build_task(catalog, BlobStore(blob_root(args)), task, families=args.family,
                                                kinds=args.kinds, progress=not args.json, repeats=args.repeats))
            except CatalogError as exc:  # no such task or family, or ids another task holds: the others still build
                refused.append(exc)
    for err in refused:
        _refused(err)
    if args.json:
        print(json.dumps([r.to_json() for r in reports], indent=2))
    else:
        for rep in reports:
            _print_variants(rep.built, rep.hardware_class)
            for s in rep.skipped:
                print(f"skipped {s.family}.{s.kind}: {s.reason}")
    return EXIT_BAD_INPUT if refused else EXIT_OK


async def _build_digits(args: argparse.Namespace) -> int:
    from tiermesh.cli.context import open_store, store_args
    from variant_store.build import ensure_digits_family

    async with open_store(**store_args(args)) as store:
        catalog = Catalog(store)
        reports = await ensure_digits_family(catalog, BlobStore(blob_root(args)), repeats=args.repeats,
                                             force=True)
        metas = await catalog.list_variants()
        cascades = await catalog.cascades()
    _print_variants(metas, reports[0].hardware_class if reports else None)
    _print_cascades(cascades)
    for rep in reports:
        for s in rep.skipped:
            print(f"skipped {s.family}.{s.kind}: {s.reason}")
    return EXIT_OK


async def _build_text(args: argparse.Namespace) -> int:
    from tiermesh.cli.context import open_store, store_args
    from variant_store.build_text import ensure_text_family

    async with open_store(**store_args(args)) as store:
        catalog = Catalog(store)
        reports = await ensure_text_family(catalog, BlobStore(blob_root(args)), repeats=args.repeats, force=True)
        metas = [m for task in ("text-topic", "text-group") for m in await catalog.list_variants(task)]
        cascades = [c for task in ("text-topic", "text-group") for c in await catalog.cascades(task)]
    _print_variants(metas, reports[0].hardware_class if reports else None)
    _print_cascades(cascades)
    return EXIT_OK


async def _profile(args: argparse.Namespace) -> int:
    from tiermesh.cli.context import open_store, store_args
    from variant_store.build import reprofile

    async with open_store(**store_args(args)) as store:
        meta = await reprofile(Catalog(store), BlobStore(blob_root(args)), args.task, args.variant,
                               repeats=args.repeats)
    _print_variants([meta], None)
    return EXIT_OK


async def _list(args: argparse.Namespace) -> int:
    from tiermesh.cli.context import open_store, store_args

    async with open_store(**store_args(args)) as store:
        catalog = Catalog(store)
        reading = await catalog.read(args.task)
        broken = reading.broken + await catalog.broken_models(args.task)
    if args.json:
        print(json.dumps([variant_row(m) for m in reading.variants] + [broken_row(b) for b in broken], indent=2))
    else:
        _print_variants(reading.variants, None)
        for b in broken:
            print(f"BROKEN {b.key}: {b.reason}")
    return EXIT_OK


async def _remove(args: argparse.Namespace) -> int:
    from tiermesh.cli.context import open_store, store_args
    from variant_store.catalog_remove import apply_removal, plan_removal

    async with open_store(**store_args(args)) as store:
        catalog = Catalog(store)
        try:
            plan = await plan_removal(catalog, args.task, family=args.family, variant=args.variant,
                                      cascade=args.cascade)
        except CatalogError as exc:
            return _refused(exc)
        if not args.yes:
            print(f"removing {plan.what}: {len(plan.keys)} keys")
            for key in plan.keys:
                print(f"  {key}")
            if not sys.stdin.isatty():
                print("error: not confirmed: pass --yes (stdin is no terminal)", file=sys.stderr)
                return EXIT_BAD_INPUT
            answer = await asyncio.to_thread(input, "remove? [y/N] ")
            if answer.strip().lower() not in ("y", "yes"):
                print("nothing removed")
                return EXIT_BAD_INPUT
        deleted = await apply_removal(catalog, plan)
    if args.json:
        print(json.dumps({**plan.to_json(), "deleted": deleted}, indent=2))
        return EXIT_OK
    print(f"removed {plan.what}: {len(plan.variant_keys)} variant entries, {len(plan.model_keys)} registered "
          f"models{', the task signature' if plan.other_keys else ''}, {len(plan.cascade_keys)} cascades "
          f"({deleted} keys)")
    if plan.digests:
        print(f"{len(plan.digests)} blobs no entry names any more stay in the content-addressed blob store "
              f"(<home>/blobs): {', '.join(d[:12] for d in plan.digests)}")
    return EXIT_OK


def _print_cascades(cascades: list[Any]) -> None:
    from tiermesh.cli.cascades import print_cascades

    if cascades:
        print_cascades(cascades, {})


def _refused(exc: CatalogError) -> int:
    print(f"error: {exc}", file=sys.stderr)
    return EXIT_BAD_INPUT


def broken_row(b: BrokenEntry) -> dict[str, Any]:
    """The ``list --json`` shape of an entry readers skip."""
    return {"broken": True, "key": b.key, "task": b.task, "id": b.name, "reason": b.reason}


async def _show(args: argparse.Namespace) -> int:
    from tiermesh.cli.context import open_store, store_args

    async with open_store(**store_args(args)) as store:
        meta = await Catalog(store).get_variant(args.task, args.variant)
    print(json.dumps(meta.to_json(), indent=2))
    return EXIT_OK


async def _serve(args: argparse.Namespace) -> int:
    import contextlib

    from mesh.settings import MeshSettings
    from tiermesh.cli.context import open_store, serve_for, store_args
    from variant_store.data_area import DataArea
    from variant_store.data_quotas import DataQuotaFollower
    from variant_store.server import VariantStoreServer

    settings = MeshSettings()
    bind = args.bind or settings.bind
    advertise = settings.advertised_host(args.bind, args.advertise)  # refuses a wildcard without one
    tls = None
    if args.pki_dir is not None:
        from mesh.pki.files import PkiPaths
        from mesh.pki.identity import Identity
        from variant_store.access import StoreTls

        tls = StoreTls(PkiPaths(args.pki_dir), Identity("store", args.name))
    else:
        print("WARNING: the variant store serves plain HTTP: anyone who reaches it reads every variant, "
              "tenant-private ones included (pass --pki-dir for HTTPS)", file=sys.stderr, flush=True)
    async with contextlib.AsyncExitStack() as stack:
        store = await stack.enter_async_context(open_store(**store_args(args)))
        if tls is not None:
            from tiermesh.crl_follow import CrlFollower

            # revocations come from etcd pki/crl, not from a crl.pem shared with the operator: a revoked
            # caller is refused on its next request and its open connections closed as soon as etcd has the list
            await stack.enter_async_context(CrlFollower.for_peers(store, tls))
        data = DataArea(blob_root(args).parent / "data")
        # the tenants' storage_mb from the topology: read before the server answers, then followed
        await stack.enter_async_context(DataQuotaFollower(store, data))
        server = await stack.enter_async_context(
            VariantStoreServer(BlobStore(blob_root(args)), Catalog(store), bind, args.port, advertise=advertise,
                               site=args.site, tls=tls, data=data))
        print(f"variant store serving at {server.url}", flush=True)
        await serve_for(args.duration)
    return EXIT_OK


def variant_row(m: VariantMeta) -> dict[str, Any]:
    """The ``list --json`` shape: the catalog entry flattened for people and scripts."""
    full = m.to_json()
    return {"id": m.variant_id, "task": m.task, "family": m.family, "format": m.format,
            "precision": m.precision, "runtime": m.runtime, "accuracy": m.accuracy, "metric": m.metric,
            "size_bytes": m.size_bytes, "digest": m.blob_digest, "owner": m.owner, "parent": m.parent,
            "shared_base_digest": m.shared_base_digest, "profiles": full["profiles"]}


def _print_variants(metas: list[VariantMeta], hardware_class: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    from variant_store.hardware import local_hardware_class

    hw = hardware_class or local_hardware_class()
    table = Table(title=f"variants ({len(metas)}), p50 on {hw}")
    for col, just in (("id", "left"), ("task", "left"), ("format", "left"), ("precision", "left"),
                      ("accuracy", "right"), ("size", "right"), ("p50@1 ms", "right"), ("owner", "left")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    for m in metas:
        prof = m.profiles.get(hw)
        p50 = f"{prof.compute_ms(1):.3f}" if prof else "-"
        table.add_row(m.variant_id, m.task, m.format, m.precision, f"{m.accuracy * 100:.2f}%",
                      _human(m.size_bytes), p50, m.owner)
    # piped output is for grep and logs: never wrap a variant id across lines there
    Console(file=sys.stdout, width=None if sys.stdout.isatty() else 200).print(table)


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"
