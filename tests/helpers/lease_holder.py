"""Holds etcd state for a test from another process, so the test can SIGKILL the owner.

    python tests/helpers/lease_holder.py URL PREFIX key KEY TTL          # put KEY under a lease
    python tests/helpers/lease_holder.py URL PREFIX elect NAME ID TTL    # campaign, then hold

Prints one JSON line (``{"lease": id}`` / ``{"leader": id, "revision": rev}``) once the state
is in etcd, then sleeps until killed (at most 120 s, so a lost test cannot leave it forever).
"""

from __future__ import annotations

import asyncio
import json
import sys

from mesh.etcd.election import Election
from mesh.etcd.store import Store


async def main(argv: list[str]) -> None:
    url, prefix, mode = argv[:3]
    async with await Store.connect(url, prefix) as store:
        if mode == "key":
            key, ttl = argv[3], float(argv[4])
            lease = await store.lease(ttl)
            await store.put(key, {"owner": "helper"}, lease=lease)
            print(json.dumps({"lease": lease.id}), flush=True)
        else:
            name, cid, ttl = argv[3], argv[4], float(argv[5])
            election = Election(store, name, cid, ttl=ttl)
            await election.campaign()
            print(json.dumps({"leader": cid, "revision": election.leader_revision}), flush=True)
        await asyncio.sleep(120)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
