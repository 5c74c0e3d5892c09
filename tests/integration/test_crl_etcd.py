"""Revocation published through etcd: ``tiermesh pki revoke --etcd`` puts the new list at ``pki/crl`` and a
real agent (in this process, on the session etcd) whose own ``crl.pem`` is stale adopts it from its view: the
revoked tenant is refused within 5 s on its open keep-alive connection while another tenant keeps being served,
a revoked site's CURVE key stops being admitted, and an older list never overwrites a newer one in etcd."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
import time
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest

from edge_agent.agent import Agent
from edge_agent.agent_config import AgentConfig
from mesh.etcd.keys import PKI_CRL, site_cert_key
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from mesh.pki.crl import RevocationList, crl_pem_from_record
from mesh.pki.files import PkiPaths
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from mesh.pki.published import site_cert_record
from tests.helpers.mtls_edge import IO_TIMEOUT, tenant_context
from tests.helpers.waiting import eventually
from tiermesh.cli.main import EXIT_OK, main
from tiermesh.pki_etcd import publish_crl
from topology.loader import load_topology_file
from topology.store_io import apply as apply_topology
from variant_store.build import signature_from_onnx
from variant_store.catalog import Catalog

pytestmark = pytest.mark.integration

TOPOLOGY = Path(__file__).resolve().parents[1] / "data" / "topology_small.yaml"
TASK = "digit-classification"
DIGITS = Path(__file__).resolve().parents[2] / "variant_store" / "models" / "digits"
SITE, PEER = Identity("site", "edge-fra-1"), Identity("site", "core-eu")
ACME, GLOBEX = Identity("tenant", "acme"), Identity("tenant", "globex")


async def _idle_keepalive(url: str, ctx: ssl.SSLContext) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection that made one successful request and then stays open, idle (HTTP/1.1 keep-alive)."""
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    reader, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, parts.port, ssl=ctx), 15)
    writer.write(f"GET {parts.path} HTTP/1.1\r\nHost: {parts.hostname}\r\n\r\n".encode())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 15)
    assert head.startswith(b"HTTP/1.1 200"), head
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    await asyncio.wait_for(reader.readexactly(length), 15)
    return reader, writer


async def _closed_by_server(reader: asyncio.StreamReader) -> bool:
    try:
        return await reader.read(1) == b""
    except (ConnectionError, ssl.SSLError):
        return True


def _revoke(home: Path, store: Store, etcd: str, *who: str) -> int:
    return main(["pki", "revoke", "--home", str(home), *who, "--etcd", etcd, "--prefix", store.prefix])


async def test_revocation_through_etcd_reaches_an_agent_with_a_stale_crl(store: Store, etcd_server: EmbeddedEtcd,
                                                                          tmp_path: Path) -> None:
    await apply_topology(store, load_topology_file(TOPOLOGY))
    await Catalog(store).put_task(signature_from_onnx(TASK, DIGITS / "mlp-tiny.onnx"))
    operator = tmp_path / "operator"
    pki = LocalPki.under(operator)
    pki.init()
    for who in (SITE, PEER):
        pki.issue(who, addresses=["127.0.0.1"])
    pki.issue(ACME)
    pki.issue(GLOBEX)
    agent_home = tmp_path / "agent"
    pki.bundle(SITE, PkiPaths.under(agent_home))  # the agent's own files only: its crl.pem never updated
    stale = (agent_home / "pki" / "crl.pem").read_bytes()
    # the peer's certificate reaches the agent through etcd, as the peer's own agent publishes it
    await store.put(site_cert_key(PEER.name), site_cert_record(pki.paths.cert(PEER).read_bytes()))
    cfg = AgentConfig(site=SITE.name, etcd=etcd_server.url, prefix=store.prefix, home=agent_home, lease_ttl_s=2.0,
                      tls=True)
    statuses: dict[str, list[tuple[float, int | str]]] = {"acme": [], "globex": []}
    revoked_at: list[float] = []
    async with Agent(cfg) as agent:
        assert agent.curve is not None and agent.curve.sites.admits(PEER.name)
        url = f"{agent.http_url}/v2/models/{TASK}"
        stop = time.monotonic() + 30.0
        idle_reader, idle_writer = await _idle_keepalive(url, tenant_context(pki, ACME))

        async def loop(who: Identity) -> None:
            # one keep-alive connection at a time: requests after the revocation ride the open one
            conn = aiohttp.TCPConnector(ssl=tenant_context(pki, who), limit=1)
            async with aiohttp.ClientSession(connector=conn, timeout=IO_TIMEOUT) as session:
                while time.monotonic() < stop and len(statuses[who.name]) < 2000:
                    try:
                        async with session.get(url) as resp:
                            await resp.read()
                            statuses[who.name].append((time.monotonic(), resp.status))
                    except aiohttp.ClientError as exc:
                        statuses[who.name].append((time.monotonic(), repr(exc)))
                    refused = [t for t, s in statuses["acme"] if s == 401]
                    if revoked_at and refused and time.monotonic() > refused[0] + 1.0:
                        return  # refused for a second: enough
                    await asyncio.sleep(0.02)

        async def revoke() -> None:
            await asyncio.sleep(1.0)
            assert await asyncio.to_thread(_revoke, operator, store, etcd_server.url, "--tenant", "acme") == EXIT_OK
            revoked_at.append(time.monotonic())

        try:
            await asyncio.gather(loop(ACME), loop(GLOBEX), revoke())
            assert revoked_at
            # the idle keep-alive connection was closed by the agent without waiting for its next request
            closed = await asyncio.wait_for(_closed_by_server(idle_reader), 10)
            assert closed and time.monotonic() - revoked_at[0] < 10
        finally:
            idle_writer.close()
            with contextlib.suppress(ConnectionError, ssl.SSLError, TimeoutError):
                await asyncio.wait_for(idle_writer.wait_closed(), 5)
        acme_after = [(t, s) for t, s in statuses["acme"] if t > revoked_at[0]]
        first_refusal = next(t for t, s in acme_after if s == 401)
        assert first_refusal - revoked_at[0] < 5.0
        assert all(s == 401 for t, s in acme_after if t >= first_refusal), acme_after
        assert all(s == 200 for t, s in statuses["acme"] if t <= revoked_at[0])
        assert statuses["globex"] and all(s == 200 for _, s in statuses["globex"]), statuses["globex"]
        assert (agent_home / "pki" / "crl.pem").read_bytes() == stale  # it came through etcd only

        # a site revoked the same way: its CURVE key is no longer admitted by the agent's ZAP handler
        assert await asyncio.to_thread(_revoke, operator, store, etcd_server.url, "--site", PEER.name) == EXIT_OK

        async def peer_cut_off() -> bool:
            return not agent.curve.sites.admits(PEER.name)  # type: ignore[union-attr]

        await eventually(peer_cut_off, 5, "the revoked site's CURVE key is dropped")
        assert agent.curve.sites.admits(SITE.name)
        assert (agent_home / "pki" / "crl.pem").read_bytes() == stale

    held = await store.get(PKI_CRL)
    assert held is not None
    newest = RevocationList.load(crl_pem_from_record(held.value), pki.ca().cert)
    assert newest.number == pki.crl().number == 3 and len(newest.entries) == 2
    # an older list (the agent's stale copy, number 1) is refused: etcd keeps the newer one
    old = RevocationList.load(stale, pki.ca().cert)
    assert await publish_crl(store, old, pki.ca().cert) == (False, 3)
    assert (await store.get(PKI_CRL)).value == held.value  # type: ignore[union-attr]


async def test_revoke_adopts_a_newer_list_from_etcd_and_refuses_to_go_back(store: Store, etcd_server: EmbeddedEtcd,
                                                                          tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    pki = LocalPki.under(one)
    pki.init()
    pki.issue(ACME)
    pki.issue(GLOBEX)
    shutil.copytree(one / "pki", two / "pki")  # a second operator's copy of the same CA
    assert await asyncio.to_thread(_revoke, one, store, etcd_server.url, "--tenant", "acme") == EXIT_OK
    out = capsys.readouterr()
    assert "published at etcd pki/crl" in out.err
    assert "etcd: etcd has no user tenant:acme" in out.out  # tenants never have one: nothing to cut off
    # the second home's crl.pem is older: revoke there takes the newer list from etcd first, so acme stays revoked
    assert await asyncio.to_thread(_revoke, two, store, etcd_server.url, "--tenant", "globex") == EXIT_OK
    assert "adopted the newer list" in capsys.readouterr().err
    held = await store.get(PKI_CRL)
    assert held is not None
    crl = RevocationList.load(crl_pem_from_record(held.value), pki.ca().cert)
    assert crl.number == 3 and len(crl.entries) == 2
    # who was revoked travels beside the signed list (the list itself holds serials only: etcd parses it)
    assert set(held.value["identities"].values()) == {ACME.uri, GLOBEX.uri}
    # the first home now lags: publishing its list as it is would be refused
    stale = pki.crl()
    assert await publish_crl(store, stale, pki.ca().cert) == (False, 3)
    assert held.value["number"] == 3


def test_revoke_without_etcd_says_it_wrote_crl_pem_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("TIERMESH_ETCD", raising=False)
    pki = LocalPki.under(tmp_path)
    pki.init()
    pki.issue(ACME)
    assert main(["pki", "revoke", "--home", str(tmp_path), "--tenant", "acme"]) == EXIT_OK
    err = capsys.readouterr().err
    assert "crl.pem only" in err and "no etcd" in err
    assert pki.crl().number == 2
