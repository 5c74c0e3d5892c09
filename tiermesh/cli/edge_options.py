"""The options of a command that talks to one edge as a tenant (``tiermesh jobs``, ``tiermesh models``): its URL,
and the tenant's certificate for https or the tenant header for an ``--insecure`` edge. Imports nothing of the
server stack: these commands work on the SDK's own install."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["add_edge_options", "edge_client_args"]


def add_edge_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--edge", required=True, metavar="URL", help="the edge agent's HTTP(S) URL")
    p.add_argument("--tenant", default=None, help="tenant header, for an --insecure edge")
    p.add_argument("--cert", type=Path, default=None, help="the tenant's certificate (PEM), for https")
    p.add_argument("--key", type=Path, default=None, help="its private key (PEM)")
    p.add_argument("--ca", type=Path, default=None, help="the mesh CA certificate (PEM), for https")


def edge_client_args(args: argparse.Namespace) -> dict[str, Any]:
    """``mesh.edge_api.EdgeApi`` keyword arguments from :func:`add_edge_options`' options."""
    return {"tenant": args.tenant, "cert": args.cert, "key": args.key, "ca": args.ca}
