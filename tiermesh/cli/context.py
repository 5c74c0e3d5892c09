"""How a command gets its Store: the etcd URLs if given (``--etcd`` or ``TIERMESH_ETCD``, with TLS files
when ``https://``), else the etcd already running for the local home directory, else an embedded etcd
on ``<home>/etcd`` for the duration of the block, started as ``tiermesh up`` starts it there: on a secured home
(:func:`tiermesh.secure.home_etcd`) with TLS, client-certificate auth and the revocation list, the command connecting
as the home's operator (that etcd's data has RBAC on: it answers no one without a user).

Each way that fails says so in plain words, with the URL and what to do (``StoreUnavailable``: exit 3)."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from mesh.errors import ConfigError, EtcdServerError, StoreUnavailable
from mesh.etcd.endpoints import EtcdEndpoints, parse_endpoints, split_urls
from mesh.etcd.server import RECORD_FILE, EmbeddedEtcd, running_record
from mesh.etcd.store import Store
from mesh.log import get_logger, kv
from mesh.settings import MeshSettings

__all__ = ["etcd_endpoints", "open_store", "serve_for", "store_args"]

log = get_logger(__name__)

PathArg = Path | str | None


def etcd_endpoints(etcd: str | Sequence[str] | None, ca: PathArg, cert: PathArg, key: PathArg,
                   settings: MeshSettings) -> EtcdEndpoints | None:
    """The etcd cluster named on the command line, else in settings, checked (``ConfigError``); None
    when neither names one (the caller finds or starts a local etcd)."""
    urls = split_urls(etcd) or settings.etcd
    ca, cert, key = (ca or settings.etcd_ca), (cert or settings.etcd_cert), (key or settings.etcd_key)
    if not urls:
        if ca or cert or key:
            raise ConfigError("etcd TLS files given without etcd URLs: pass --etcd https://host:port[,...] too")
        return None
    return parse_endpoints(urls, ca=ca, cert=cert, key=key)


@asynccontextmanager
async def open_store(etcd: str | Sequence[str] | None = None, home: Path | str | None = None,
                     prefix: str | None = None, *, etcd_ca: PathArg = None, etcd_cert: PathArg = None,
                     etcd_key: PathArg = None) -> AsyncIterator[Store]:
    settings = MeshSettings()
    home_dir = Path(home) if home is not None else settings.home
    key_prefix = prefix or settings.prefix
    target: EtcdEndpoints | str | None = etcd_endpoints(etcd, etcd_ca, etcd_cert, etcd_key, settings)
    if target is not None:
        async with await _connect(target, key_prefix, "check the URL(s), that etcd runs there, and for https:// "
                                  "--etcd-ca/--etcd-cert/--etcd-key (or TIERMESH_ETCD, TIERMESH_ETCD_CA/CERT/KEY)") \
                as store:
            yield store
        return
    running = await asyncio.to_thread(running_record, home_dir)  # a short HTTP health probe
    if running is not None:  # with the recorded operator certificate when it demands one (`tiermesh up`)
        async with await _connect(running.url, key_prefix, f"the mesh recorded in {home_dir / RECORD_FILE} may be "
                                  "stopping: try again once it has stopped, or stop it",
                                  ca=running.ca, cert=running.cert, key=running.key) as store:
            yield store
        return
    # Nothing running: etcd lives only as long as this command; its data stays on disk.
    from tiermesh.secure import home_etcd

    how = await asyncio.to_thread(home_etcd, home_dir)
    server = EmbeddedEtcd(home_dir / "etcd", tls=how.tls)
    # a command's own etcd is plumbing: its start and stop are not news on the terminal (``--log-level DEBUG``)
    quiet = _Quiet(logging.getLogger(EmbeddedEtcd.__module__))
    try:
        await server.start()
    except EtcdServerError as exc:
        quiet.restore()
        raise StoreUnavailable(f"no mesh runs for {home_dir} and its etcd (data {server.data_dir}) did not start: "
                               f"{exc}; is another etcd using that data directory? (see {server.log_path})") from exc
    log.debug("started a temporary embedded etcd", extra=kv(event="etcd_temp", reason=server.url))
    try:
        hint = (f"the etcd of {home_dir}, started for this command "
                + ("as its operator" if how.tls else "without TLS: if a secured mesh ran on this home, its PKI "
                   f"({home_dir / 'pki'}) is gone; use another --home"))
        async with await _connect(server.url, key_prefix, hint, **how.client) as store:
            yield store
    finally:
        try:
            await server.stop()
        finally:
            quiet.restore()


class _Quiet:
    """A logger's INFO lines held back (made DEBUG-only) until :meth:`restore`, unless it already logs DEBUG."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger, self.level = logger, logger.level
        if not logger.isEnabledFor(logging.DEBUG):
            logger.setLevel(logging.WARNING)

    def restore(self) -> None:
        self.logger.setLevel(self.level)


async def _connect(target: EtcdEndpoints | str, prefix: str, advice: str, *, ca: Path | None = None,
                   cert: Path | None = None, key: Path | None = None) -> Store:
    """``Store.connect``, its refusal said with ``advice`` (what to do about it)."""
    try:
        return await Store.connect(target, prefix, ca=ca, cert=cert, key=key)
    except StoreUnavailable as exc:
        raise StoreUnavailable(f"{exc}\n  ({advice})") from exc


def store_args(args: argparse.Namespace) -> dict[str, Any]:
    """``open_store`` keyword arguments from the options of ``tiermesh.cli.main.add_common``."""
    return {"etcd": getattr(args, "etcd", None), "home": getattr(args, "home", None),
            "prefix": getattr(args, "prefix", None), "etcd_ca": getattr(args, "etcd_ca", None),
            "etcd_cert": getattr(args, "etcd_cert", None), "etcd_key": getattr(args, "etcd_key", None)}


async def serve_for(duration: float | None) -> None:
    """What a serving command does once it is up: wait until interrupted, or ``duration`` seconds (``--duration``)."""
    await (asyncio.Event().wait() if duration is None else asyncio.sleep(duration))
