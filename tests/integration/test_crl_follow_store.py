"""The variant store follows etcd ``pki/crl`` itself: ``tiermesh variants serve --pki-dir`` (a real process, on a
home that holds only its own bundle, whose ``crl.pem`` is never updated) refuses a revoked identity's blob
fetches within 5 s of ``tiermesh pki revoke`` publishing the list in etcd, and closes its idle keep-alive
connection, while another identity keeps fetching. Real etcd, real HTTPS on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import ssl
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest

from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from mesh.pki.files import PkiPaths
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from tests.helpers.waiting import eventually
from tiermesh.cli.main import EXIT_OK, main
from variant_store.blobs import BlobStore
from variant_store.catalog import Catalog
from variant_store.meta import VariantMeta

pytestmark = pytest.mark.integration
STORE = Identity("store", "variant-store")
ACME, EDGE, GLOBEX = Identity("tenant", "acme"), Identity("site", "edge-1"), Identity("tenant", "globex")
TIMEOUT = aiohttp.ClientTimeout(total=10)


def _context(pki: LocalPki, who: Identity) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.paths.ca_cert))
    ctx.load_cert_chain(pki.paths.cert(who), pki.paths.key(who))
    return ctx


async def _idle(url: str, ctx: ssl.SSLContext) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A keep-alive connection that fetched the blob once and then waits, idle."""
    parts = urlsplit(url)
    reader, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, parts.port, ssl=ctx), 10)
    writer.write(f"GET {parts.path} HTTP/1.1\r\nHost: {parts.hostname}\r\n\r\n".encode())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 200"), head
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
    await asyncio.wait_for(reader.readexactly(length), 10)
    return reader, writer


async def _closed(reader: asyncio.StreamReader) -> bool:
    try:
        return await reader.read(1) == b""
    except (ConnectionError, ssl.SSLError):
        return True


async def test_the_store_refuses_a_revoked_identity_within_5_s_from_etcd(store: Store, etcd_server: EmbeddedEtcd,
                                                                          tmp_path: Path) -> None:
    operator = tmp_path / "operator"
    pki = LocalPki.under(operator)
    pki.init()
    pki.issue(STORE, addresses=["127.0.0.1"])
    for who in (ACME, EDGE, GLOBEX):
        pki.issue(who)
    home = tmp_path / "store"
    pki.bundle(STORE, PkiPaths.under(home))  # the store's host: its own files only, crl.pem never updated after
    stale = (home / "pki" / "crl.pem").read_bytes()
    data = os.urandom(50_000)
    digest = BlobStore(home / "blobs").put_bytes(data)
    await Catalog(store).put_variant(VariantMeta(
        task="digit-classification", family="mlp", variant_id="mlp.public", format="onnx", precision="fp32",
        runtime="onnxruntime", blob_digest=digest, size_bytes=len(data), accuracy=0.9, owner="public"))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tiermesh", "variants", "serve", "--home", str(home), "--etcd", etcd_server.url,
        "--prefix", store.prefix, "--pki-dir", str(home / "pki"), "--name", STORE.name, "--bind", "127.0.0.1",
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, preexec_fn=_default_signals)
    assert proc.stderr is not None
    log = bytearray()  # its stderr, read as it comes (kept whole, whatever happens at its stop)
    reader = asyncio.create_task(_drain(proc.stderr, log))
    sigs = "signal state unknown"
    statuses: dict[str, list[tuple[float, int | str]]] = {"acme": [], "edge-1": [], "globex": []}
    revoked: dict[str, float] = {}
    began: dict[str, float] = {}
    idle_writer = None
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 90)).decode()
        assert "variant store serving at https://" in line, line
        url = f"{line.rsplit(' ', 1)[1].strip()}/blobs/{digest}"
        idle_reader, idle_writer = await _idle(url, _context(pki, ACME))
        sigs = _signal_state(proc.pid)  # for the message, should it not stop
        stop = time.monotonic() + 40

        async def fetch(who: Identity) -> None:
            conn = aiohttp.TCPConnector(ssl=_context(pki, who), limit=1)  # one keep-alive connection at a time
            async with aiohttp.ClientSession(connector=conn, timeout=TIMEOUT) as session:
                while time.monotonic() < stop and not ("edge-1" in revoked and _refused_for(statuses, "edge-1", 1)):
                    try:
                        async with session.get(url) as resp:
                            body = await resp.read()
                            assert resp.status != 200 or body == data
                            statuses[who.name].append((time.monotonic(), resp.status))
                    except aiohttp.ClientError as exc:
                        statuses[who.name].append((time.monotonic(), repr(exc)))
                    await asyncio.sleep(0.05)

        async def revoke() -> None:
            for who in (ACME, EDGE):  # a tenant, then a site
                await asyncio.sleep(1.5)
                began[who.name] = time.monotonic()  # the list is published (and may bite) before the command returns
                code = await asyncio.to_thread(main, ["pki", "revoke", "--home", str(operator), f"--{who.kind}",
                                                      who.name, "--etcd", etcd_server.url, "--prefix", store.prefix])
                assert code == EXIT_OK
                revoked[who.name] = time.monotonic()

                async def refused(name: str = who.name) -> bool:
                    return _refused_for(statuses, name, 0)

                await eventually(refused, 10, f"{who} refused")

        await asyncio.gather(fetch(ACME), fetch(EDGE), fetch(GLOBEX), revoke())
        closed = await asyncio.wait_for(_closed(idle_reader), 10)  # closed without waiting for a request
        assert closed and time.monotonic() - revoked["acme"] < 10
        for name in ("acme", "edge-1"):
            after = [(t, s) for t, s in statuses[name] if t > revoked[name]]
            first = next(t for t, s in after if s == 401)
            print(f"\n{name}: blob fetch refused {first - revoked[name]:.3f} s after the revoke returned")
            assert first - revoked[name] < 5.0
            assert all(s == 401 for t, s in after if t >= first), after
            before = [(t, s) for t, s in statuses[name] if t < began[name]]
            assert before and all(s == 200 for t, s in before), before
        assert len(statuses["globex"]) > 20 and all(s == 200 for _, s in statuses["globex"]), statuses["globex"]
        assert (home / "pki" / "crl.pem").read_bytes() == stale  # it came through etcd only
    finally:
        if idle_writer is not None:
            idle_writer.close()
            with contextlib.suppress(ConnectionError, ssl.SSLError, TimeoutError):
                await asyncio.wait_for(idle_writer.wait_closed(), 5)
        if proc.returncode is None:
            proc.send_signal(2)  # SIGINT: it stops in order (its announcement leaves with its lease)
        assert proc.stdout is not None
        rest = asyncio.create_task(_drain(proc.stdout, bytearray()))  # whatever else it prints
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except TimeoutError:  # say why, rather than leave a store running
            proc.kill()
            await proc.wait()
            await asyncio.wait_for(asyncio.gather(reader, rest, return_exceptions=True), 10)
            pytest.fail(f"the store did not stop within 30 s of SIGINT ({sigs}); its log ends:\n"
                        + log.decode()[-3000:])
        await asyncio.wait_for(asyncio.gather(reader, rest), 10)
    assert b"adopted revocation list 3" in log, log.decode()[-3000:]


def _default_signals() -> None:
    """In the child before exec: Ctrl-C as a terminal gives it. A signal ignored or blocked in this (long-running
    test) process would be inherited through exec, and a store started with SIGINT ignored never hears its stop
    (two full runs here: its log ended at its last request)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def _signal_state(pid: int) -> str:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "signal state unknown"
    return " ".join(x for x in status.splitlines() if x.startswith("Sig"))


async def _drain(stream: asyncio.StreamReader, into: bytearray) -> None:
    while chunk := await stream.read(65536):
        into += chunk


def _refused_for(statuses: dict[str, list[tuple[float, int | str]]], who: str, seconds: float) -> bool:
    refused = [t for t, s in statuses[who] if s == 401]
    return bool(refused) and time.monotonic() > refused[0] + seconds
