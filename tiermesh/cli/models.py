"""``tiermesh models register | builds | show``: a tenant registers its own models at an edge, over its own
certificate (the SDK's ``mesh.models``; the edge's ``edge_agent.models_api``).

    tiermesh models register --edge URL --tenant acme my-digits logreg model.onnx val.npz [--min-accuracy 0.95] --wait
    tiermesh models builds   --edge URL --tenant acme [TASK]
    tiermesh models show     --edge URL --tenant acme BUILD_ID [--task TASK] [--follow]
    tiermesh models versions --edge URL --tenant acme TASK
    tiermesh models traffic  --edge URL --tenant acme TASK 2=0.1 1=0.9
    tiermesh models delete   --edge URL --tenant acme TASK

An https:// edge takes ``--cert/--key/--ca`` (the tenant's certificate names the tenant); ``--tenant`` is for an
``--insecure`` one. ``val.npz`` holds ``x`` (one row per example) and ``y`` (integer labels). ``--wait`` and
``--follow`` follow the build by long polls until it ends, one line per change on stderr; the final status (each
variant's accuracy, size and latency per hardware class) is printed as JSON, with the version the build made and
whether traffic moved to it (``version_state`` active, or held) and why (``version_note``). ``--min-accuracy``
declares the task's accuracy bar: a version takes traffic only when one of its variants meets it (later
registrations keep it until one declares another). A refusal or a failed build exits 1 with its reason.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mesh.errors import ConfigError, MeshError
from mesh.models import AsyncModels
from tiermesh.cli.edge_options import add_edge_options, edge_client_args

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("models", help="tenants' own models: register, builds, show", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    msub = p.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    r = msub.add_parser("register", help="upload a parent ONNX model and its labelled validation set")
    add_edge_options(r)
    r.add_argument("task", help="your private task (new, or one of yours)")
    r.add_argument("family", help="a family name no task uses yet (letters, digits, '_', '-')")
    r.add_argument("model", type=Path, help="the parent model (.onnx)")
    r.add_argument("validation", type=Path, help="the validation set (.npz with x and y)")
    r.add_argument("--min-accuracy", type=float, default=None, metavar="A",
                   help="the task's accuracy bar in [0, 1]: a version takes traffic only when a variant meets it "
                        "(default: the bar declared before, else the active version's accuracy)")
    r.add_argument("--wait", action="store_true", help="follow the build until it ends")
    r.set_defaults(func=_register)
    b = msub.add_parser("builds", help="your builds")
    add_edge_options(b)
    b.add_argument("task", nargs="?", default=None)
    b.set_defaults(func=_builds)
    s = msub.add_parser("show", help="a build's state, progress and variants")
    add_edge_options(s)
    s.add_argument("build_id")
    s.add_argument("--task", default=None, help="the build's task (default: looked up in your builds)")
    s.add_argument("--follow", action="store_true", help="follow it until it ends")
    s.set_defaults(func=_show)
    v = msub.add_parser("versions", help="a task's versions, the active one and the traffic split")
    add_edge_options(v)
    v.add_argument("task")
    v.set_defaults(func=_versions)
    t = msub.add_parser("traffic", help="split a task's traffic between versions by weight (one: make it active)")
    add_edge_options(t)
    t.add_argument("task")
    t.add_argument("weights", nargs="+", metavar="VERSION=WEIGHT")
    t.set_defaults(func=_traffic)
    d = msub.add_parser("delete", help="delete a task everywhere and collect its blobs")
    add_edge_options(d)
    d.add_argument("task")
    d.set_defaults(func=_delete)


def _models(args: argparse.Namespace) -> AsyncModels:
    return AsyncModels(args.edge, **edge_client_args(args))


def _print(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True))


def _line(st: dict[str, Any]) -> None:
    print(f"{st['state']}: {st.get('stage') or '-'} {float(st.get('progress') or 0):.0%}", file=sys.stderr)


def _outcome(st: dict[str, Any]) -> None:
    if st.get("version"):
        why = f" ({st['version_note']})" if st.get("version_note") else ""
        print(f"version {st['version']}: {st.get('version_state') or 'unknown'}{why}", file=sys.stderr)


async def _follow(models: AsyncModels, task: str, build_id: str) -> int:
    try:
        st = await models.wait(task, build_id, progress=_line)
        _print(st)
        _outcome(st)
    except MeshError as exc:
        _print(await models.show(task, build_id))
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


async def _register(args: argparse.Namespace) -> int:
    for what, path in (("model", args.model), ("validation set", args.validation)):
        if not path.is_file():
            raise ConfigError(f"the {what} {path} is not a file")
    async with _models(args) as models:
        build = await models.register(args.task, args.family, model=args.model, validation=args.validation,
                                      min_accuracy=args.min_accuracy)
        _print(build.admitted)
        if args.wait:
            return await _follow(models, args.task, build.id)
    return 0


async def _builds(args: argparse.Namespace) -> int:
    async with _models(args) as models:
        _print(await models.list(args.task))
    return 0


async def _show(args: argparse.Namespace) -> int:
    async with _models(args) as models:
        task = args.task
        if task is None:
            task = next((b["task"] for b in await models.list() if b["id"] == args.build_id), None)
            if task is None:
                raise ConfigError(f"no build {args.build_id!r} among yours")
        if args.follow:
            return await _follow(models, task, args.build_id)
        _print(await models.show(task, args.build_id))
    return 0


async def _versions(args: argparse.Namespace) -> int:
    async with _models(args) as models:
        _print(await models.versions(args.task))
    return 0


def _weights(items: list[str]) -> dict[int | str, float]:
    out: dict[int | str, float] = {}
    for item in items:
        version, _, weight = item.partition("=")
        try:
            out[int(version)] = float(weight)
        except ValueError as exc:
            raise ConfigError(f"a weight is VERSION=WEIGHT (e.g. 2=0.1), not {item!r}") from exc
    return out


async def _traffic(args: argparse.Namespace) -> int:
    weights = _weights(args.weights)
    async with _models(args) as models:
        _print(await models.traffic(args.task, weights))
    return 0


async def _delete(args: argparse.Namespace) -> int:
    async with _models(args) as models:
        _print(await models.delete(args.task))
    return 0
