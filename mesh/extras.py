"""Which optional dependencies (pip extras) each part of tiermesh needs, checked before it imports them.

The base install (``pip install tiermesh``) is the SDK: ``mesh.Client`` / ``mesh.AsyncClient``, with aiohttp
and orjson only (outputs are ``mesh.Tensor``; no numpy, no cryptography). Server roles sit behind extras named for
them (``pyproject.toml`` is the one list of what each brings):

    numpy       the SDK with numpy arrays in and out (every role below brings numpy too)
    grpc        the SDK speaking gRPC (``grpcs://`` edges, :mod:`mesh.grpc_transport`): grpclib
    agent       a site agent: etcd client, ZeroMQ, ONNX Runtime, TFLite, the mesh PKI (cryptography)
    scheduler   a scheduler replica and its admin console: etcd client, placement
    store       the variant store: catalog, variant generation (onnx, quantization), the digits family
    etcd        the embedded etcd binaries (``tiermesh up``, ``tiermesh etcd``)
    all         every role above

A room that needs a heavy library calls :func:`require` at its top, so a device that installed only the SDK
and imports a server component gets one clear :class:`MissingExtra` naming the extra to install, not a bare
``ModuleNotFoundError`` from three imports down. :func:`require` only looks the modules up
(``importlib.util.find_spec``): it imports nothing, so it costs microseconds.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

from mesh.errors import ConfigError

__all__ = ["EXTRAS", "MissingExtra", "require"]

EXTRAS = ("numpy", "grpc", "agent", "scheduler", "store", "etcd", "all")


class MissingExtra(ConfigError):
    """A server component was imported on an install without its extra (e.g. the SDK-only base install)."""

    def __init__(self, extras: Sequence[str], missing: Sequence[str]) -> None:
        self.extras = tuple(extras)
        self.missing = tuple(missing)
        hint = " or ".join(f"pip install 'tiermesh[{e}]'" for e in self.extras)
        names = "/".join(self.extras)
        super().__init__(f"this needs tiermesh's {names} extra, which is not installed (missing: "
                         f"{', '.join(self.missing)}); install it with {hint}")


def require(extras: str | Sequence[str], *modules: str) -> None:
    """Raise :class:`MissingExtra` unless every one of ``modules`` (top-level import names) is installed.
    ``extras``: the extra that brings them, or several when any of them does (the etcd client comes with
    the agent, the scheduler and the store)."""
    names = (extras,) if isinstance(extras, str) else tuple(extras)
    unknown = [e for e in names if e not in EXTRAS]
    if unknown:
        raise ValueError(f"unknown extra(s) {unknown}; known: {EXTRAS}")
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtra(names, missing)
