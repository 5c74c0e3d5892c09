"""The console's admin gate with client certificates (mesh.pki.peers.TlsPeers, as at the edge): an admin is
served, a tenant or site certificate gets 403, no certificate gets no TLS session, and an admin revoked through
crl.pem is refused (401) within seconds, without a restart."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from console import ConsoleConfig, ConsoleServer
from mesh.etcd.store import Store
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki

pytestmark = pytest.mark.integration


@pytest.fixture
async def secured(store: Store, tmp_path: Path) -> AsyncIterator[tuple[ConsoleServer, LocalPki]]:
    pki = LocalPki.under(tmp_path)
    pki.init()
    pki.issue(Identity("scheduler", "console"), addresses=["127.0.0.1"])
    for who in (Identity("admin", "console"), Identity("admin", "ops"), Identity("tenant", "acme"),
                Identity("site", "edge-1")):
        pki.issue(who)
    server = ConsoleServer(store, ConsoleConfig(pki_dir=pki.paths.root, tick_s=0.5))
    await server.start()
    try:
        yield server, pki
    finally:
        await server.stop()


def _ctx(pki: LocalPki, who: Identity | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.paths.ca_cert))
    if who is not None:
        ctx.load_cert_chain(str(pki.paths.cert(who)), str(pki.paths.key(who)))
    return ctx


async def _get(url: str, ctx: ssl.SSLContext) -> tuple[int, dict[str, object]]:
    async with aiohttp.ClientSession() as s, s.get(url, ssl=ctx) as resp:
        return resp.status, await resp.json()


async def test_admins_only(secured: tuple[ConsoleServer, LocalPki]) -> None:
    server, pki = secured
    assert server.url.startswith("https://127.0.0.1:")
    status, body = await _get(f"{server.url}/api/whoami", _ctx(pki, Identity("admin", "ops")))
    assert (status, body) == (200, {"admin": "ops"})
    for who in (Identity("tenant", "acme"), Identity("site", "edge-1")):
        status, body = await _get(f"{server.url}/api/state", _ctx(pki, who))
        assert status == 403 and body["code"] == "forbidden", (who, body)
    with pytest.raises(aiohttp.ClientError):  # TLS 1.3: the handshake's refusal surfaces at the first read
        await _get(f"{server.url}/api/state", _ctx(pki, None))


async def test_a_revoked_admin_is_refused_without_a_restart(secured: tuple[ConsoleServer, LocalPki]) -> None:
    server, pki = secured
    ops = Identity("admin", "ops")
    assert (await _get(f"{server.url}/api/whoami", _ctx(pki, ops)))[0] == 200
    pki.revoke(ops)  # rewrites crl.pem, which the console's trust store re-reads every second
    async with asyncio.timeout(10):
        while True:
            if (await _get(f"{server.url}/api/whoami", _ctx(pki, ops)))[0] == 401:
                break
            await asyncio.sleep(0.2)
    assert (await _get(f"{server.url}/api/whoami", _ctx(pki, Identity("admin", "console"))))[0] == 200
