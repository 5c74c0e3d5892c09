"""The scheduler leader's forecast state in etcd, so that a new leader continues the forecast.

Layout (under the scheduler's writable ``events/`` prefix, :data:`mesh.etcd.keys.FORECAST_STATE`)::

    events/forecast/head           {"schema": 1, "gen": "<g>", "chunks": n, "keys": k, "bytes": b, "ts": ...}
    events/forecast/<g>/<i>        {"schema": 1, ...state fields..., "keys": [rows i*R .. ]}

The state (:meth:`DemandForecaster.to_state`) is cut into chunks of at most ``CHUNK_BYTES`` of JSON so
no value nears etcd's 1.5 MiB limit whatever the size of the mesh. A save writes the new generation's
chunks first, then the head that points at them (and deletes the previous generation's chunks) in one
txn; every txn is fenced by the caller's compares (the leader's election key), so a stale leader never
overwrites a newer leader's state, and a reader never sees a head whose chunks are missing.
"""

from __future__ import annotations

import json
import time
from typing import Any

from mesh.etcd.keys import FORECAST_STATE
from mesh.etcd.ops import Compare, Delete, Op, Put, chunk_ops
from mesh.etcd.store import Store

__all__ = ["CHUNK_BYTES", "load_forecast", "save_forecast"]

CHUNK_BYTES = 256 * 1024
HEAD = FORECAST_STATE + "/head"


def _chunks(state: dict[str, Any]) -> list[dict[str, Any]]:
    rows = state.get("keys", [])
    base = {k: v for k, v in state.items() if k != "keys"}
    out: list[dict[str, Any]] = []
    cur: list[Any] = []
    size = 0
    for row in rows:
        n = len(json.dumps(row, separators=(",", ":")))
        if cur and size + n > CHUNK_BYTES:
            out.append({"schema": 1, **base, "keys": cur})
            cur, size = [], 0
        cur.append(row)
        size += n
    out.append({"schema": 1, **base, "keys": cur})
    return out


async def save_forecast(store: Store, state: dict[str, Any], gen: str, fence: list[Compare]) -> int | None:
    """Write ``state`` as generation ``gen`` (unique per save, no '/'); returns the bytes written, or
    ``None`` when a fenced txn was refused (the caller is no longer leader)."""
    chunks = _chunks(state)
    ops: list[Op] = [Put(f"{FORECAST_STATE}/{gen}/{i}", c) for i, c in enumerate(chunks)]
    for part in chunk_ops(ops, max_bytes=CHUNK_BYTES * 3):
        if not (await store.txn(fence, part)).succeeded:
            return None
    head = await store.get(HEAD)
    stale: list[Op] = []
    if head is not None and isinstance(head.value, dict) and head.value.get("gen") != gen:
        old = str(head.value.get("gen"))
        stale = [Delete(f"{FORECAST_STATE}/{old}/{i}") for i in range(int(head.value.get("chunks", 0)))]
    size = sum(len(json.dumps(c, separators=(",", ":"))) for c in chunks)
    new_head = {"schema": 1, "gen": gen, "chunks": len(chunks), "keys": len(state.get("keys", [])),
                "bytes": size, "ts": time.time()}
    first, rest = (stale[:126], stale[126:])
    if not (await store.txn(fence, [Put(HEAD, new_head), *first])).succeeded:
        return None
    for part in chunk_ops(rest):
        await store.txn(fence, part)
    return size


async def load_forecast(store: Store) -> dict[str, Any] | None:
    """The last saved state, or ``None`` when there is none (or its chunks are incomplete)."""
    head = await store.get(HEAD)
    if head is None or not isinstance(head.value, dict) or "gen" not in head.value:
        return None
    gen, n = str(head.value["gen"]), int(head.value.get("chunks", 0))
    items = await store.get_prefix(f"{FORECAST_STATE}/{gen}/")
    parts = {kv_.key.rsplit("/", 1)[-1]: kv_.value for kv_ in items}
    if n < 1 or any(str(i) not in parts or not isinstance(parts[str(i)], dict) for i in range(n)):
        return None
    state = {k: v for k, v in parts["0"].items() if k not in ("schema", "keys")}
    state["keys"] = [row for i in range(n) for row in parts[str(i)].get("keys", [])]
    return state
