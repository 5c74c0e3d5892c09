"""How a command gets its Store: an etcd URL if given, else the etcd already running for the
local home directory, else an embedded etcd on ``<home>/etcd`` for the duration of the block."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from mesh.etcd.server import EmbeddedEtcd, find_running
from mesh.etcd.store import Store
from mesh.log import get_logger, kv
from mesh.settings import MeshSettings

__all__ = ["open_store", "store_args"]

log = get_logger(__name__)


@asynccontextmanager
async def open_store(etcd: str | None = None, home: Path | str | None = None,
                     prefix: str | None = None) -> AsyncIterator[Store]:
    settings = MeshSettings()
    url = etcd or settings.etcd
    home_dir = Path(home) if home is not None else settings.home
    key_prefix = prefix or settings.prefix
    if url is None:
        url = await asyncio.to_thread(find_running, home_dir)  # a short HTTP health probe
    if url is not None:
        async with await Store.connect(url, key_prefix) as store:
            yield store
        return
    # Nothing running: etcd lives only as long as this command; its data stays on disk.
    server = EmbeddedEtcd(home_dir / "etcd")
    await server.start()
    log.info("started a temporary embedded etcd", extra=kv(event="etcd_temp", reason=server.url))
    try:
        async with await Store.connect(server.url, key_prefix) as store:
            yield store
    finally:
        await server.stop()


def store_args(args: argparse.Namespace) -> dict[str, Any]:
    """``open_store`` keyword arguments from the options of ``tiermesh.cli.main.add_common``."""
    return {"etcd": getattr(args, "etcd", None), "home": getattr(args, "home", None),
            "prefix": getattr(args, "prefix", None)}
