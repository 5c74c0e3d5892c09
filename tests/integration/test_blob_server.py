"""The variant store's HTTP service and the fetch client, over real HTTP on loopback, with real etcd."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from mesh.errors import BlobError
from mesh.etcd.keys import blobs_key
from variant_store.blobs import BlobStore
from variant_store.catalog import Catalog
from variant_store.fetch import fetch_blob
from variant_store.meta import VariantMeta
from variant_store.server import VariantStoreServer, header_identity

pytestmark = pytest.mark.integration

PAYLOAD = os.urandom(300_000)
DIGEST = hashlib.sha256(PAYLOAD).hexdigest()


class Recorder:
    """An authenticate hook that remembers what each request asked for."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []

    async def __call__(self, request: web.Request) -> str:
        ident = await header_identity(request)
        self.seen.append({"identity": ident, "method": request.method, "path": request.path,
                          "range": request.headers.get("Range", "")})
        return ident


def _flip_byte(path: Path, offset: int) -> None:
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture
async def served(tmp_path: Path, store: Any) -> AsyncIterator[tuple[VariantStoreServer, BlobStore, Recorder]]:
    blobs = BlobStore(tmp_path / "blobs")
    assert blobs.put_bytes(PAYLOAD) == DIGEST
    rec = Recorder()
    async with VariantStoreServer(blobs, Catalog(store), authenticate=rec, lease_ttl=5) as server:
        yield server, blobs, rec


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as sess:
        yield sess


async def test_get_etag_and_conditional_304(served: Any, http: aiohttp.ClientSession) -> None:
    server, _, rec = served
    url = f"{server.url}/blobs/{DIGEST}"
    async with http.get(url, headers={"X-Tiermesh-Tenant": "acme"}) as r:
        assert r.status == 200
        assert r.headers["ETag"] == f'"{DIGEST}"'
        assert await r.read() == PAYLOAD
    async with http.get(url, headers={"If-None-Match": f'"{DIGEST}"'}) as r:
        assert r.status == 304
        assert await r.read() == b""
    async with http.get(url, headers={"If-None-Match": '"' + "0" * 64 + '"'}) as r:
        assert r.status == 200
    async with http.head(url) as r:
        assert r.status == 200 and int(r.headers["Content-Length"]) == len(PAYLOAD)
    assert rec.seen[0]["identity"] == "acme" and rec.seen[1]["identity"] == "public"


async def test_range_requests_give_206(served: Any, http: aiohttp.ClientSession) -> None:
    server, _, _ = served
    url = f"{server.url}/blobs/{DIGEST}"
    async with http.get(url, headers={"Range": "bytes=1000-1999"}) as r:
        assert r.status == 206
        assert r.headers["Content-Range"] == f"bytes 1000-1999/{len(PAYLOAD)}"
        assert await r.read() == PAYLOAD[1000:2000]
    async with http.get(url, headers={"Range": "bytes=-10"}) as r:
        assert r.status == 206 and await r.read() == PAYLOAD[-10:]
    async with http.get(url, headers={"Range": f"bytes={len(PAYLOAD)}-"}) as r:
        assert r.status == 416
        assert r.headers["Content-Range"] == f"bytes */{len(PAYLOAD)}"
    # a stale If-Range means "the whole thing": a client never splices two different blobs
    async with http.get(url, headers={"Range": "bytes=0-9", "If-Range": '"stale"'}) as r:
        assert r.status == 200 and await r.read() == PAYLOAD


async def test_missing_and_malformed_digests(served: Any, http: aiohttp.ClientSession,
                                             tmp_path: Path) -> None:
    server, _, _ = served
    absent = hashlib.sha256(b"absent").hexdigest()
    async with http.get(f"{server.url}/blobs/{absent}") as r:
        assert r.status == 404
        assert (await r.json())["code"] == "blob"
    async with http.get(f"{server.url}/blobs/not-a-digest") as r:
        assert r.status == 400
    with pytest.raises(BlobError, match="not found"):
        await fetch_blob(server.url, absent, tmp_path / "out.bin", session=http)
    assert not (tmp_path / "out.bin").exists()


async def test_corrupted_blob_is_refused_over_http(served: Any, http: aiohttp.ClientSession,
                                                   tmp_path: Path) -> None:
    server, blobs, _ = served
    dest = tmp_path / "cache" / DIGEST
    # served and verified once, then a byte flips on disk: the cached verdict must not be trusted
    assert (await fetch_blob(server.url, DIGEST, dest, session=http)).read_bytes() == PAYLOAD
    dest.unlink()
    _flip_byte(blobs.path(DIGEST), 12345)
    async with http.get(f"{server.url}/blobs/{DIGEST}") as r:
        assert r.status == 502
        body = await r.json()
        assert body["code"] == "blob" and f"digest mismatch: expected {DIGEST} got " in body["error"]
    with pytest.raises(BlobError, match=f"digest mismatch: expected {DIGEST} got [0-9a-f]{{64}}"):
        await fetch_blob(server.url, DIGEST, dest, session=http)
    assert not dest.exists() and not dest.with_name(dest.name + ".part").exists()


async def test_fetch_resumes_a_partial_download_with_range(served: Any, http: aiohttp.ClientSession,
                                                           tmp_path: Path) -> None:
    server, _, rec = served
    dest = tmp_path / "model.onnx"
    dest.with_name(dest.name + ".part").write_bytes(PAYLOAD[:100_000])
    assert (await fetch_blob(server.url, DIGEST, dest, session=http)).read_bytes() == PAYLOAD
    assert rec.seen[-1]["range"] == "bytes=100000-"
    assert not dest.with_name(dest.name + ".part").exists()
    # a verified cache entry is used as is: no second request
    n = len(rec.seen)
    await fetch_blob(server.url, DIGEST, dest, session=http)
    assert len(rec.seen) == n


async def test_fetch_recovers_from_a_damaged_partial_file(served: Any, http: aiohttp.ClientSession,
                                                         tmp_path: Path) -> None:
    server, _, rec = served
    dest = tmp_path / "model.onnx"
    dest.with_name(dest.name + ".part").write_bytes(b"\x00" * 5000)  # wrong prefix bytes
    assert (await fetch_blob(server.url, DIGEST, dest, session=http)).read_bytes() == PAYLOAD
    assert [s["range"] for s in rec.seen[-2:]] == ["bytes=5000-", ""]  # resume, then a clean retry


async def test_fetch_rejects_bytes_that_do_not_match(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    """A store (or a proxy in between) that serves the wrong bytes: the client must catch it itself."""

    async def lying(request: web.Request) -> web.Response:
        return web.Response(body=PAYLOAD[:-1] + b"!")

    app = web.Application()
    app.router.add_get("/blobs/{digest}", lying)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        dest = tmp_path / "out.bin"
        with pytest.raises(BlobError, match=f"digest mismatch: expected {DIGEST} got [0-9a-f]{{64}}"):
            await fetch_blob(f"http://{host}:{port}", DIGEST, dest, session=http)
        assert not dest.exists() and not dest.with_name(dest.name + ".part").exists()
    finally:
        await runner.cleanup()


async def test_catalog_health_and_announcement(tmp_path: Path, store: Any,
                                               http: aiohttp.ClientSession) -> None:
    cat = Catalog(store)
    await cat.put_variant(VariantMeta(task="digit-classification", family="mlp", variant_id="mlp.onnx.fp32",
                                      format="onnx", precision="fp32", runtime="onnxruntime",
                                      blob_digest=DIGEST, size_bytes=len(PAYLOAD), accuracy=0.97))
    server = VariantStoreServer(BlobStore(tmp_path), cat, lease_ttl=5)
    async with server:
        kv = await store.get(blobs_key())
        assert kv is not None and kv.value["url"] == server.url
        async with http.get(f"{server.url}/healthz") as r:
            assert r.status == 200 and (await r.json())["ok"] is True
        async with http.get(f"{server.url}/catalog", params={"task": "digit-classification"}) as r:
            variants = (await r.json())["variants"]
        assert [v["variant_id"] for v in variants] == ["mlp.onnx.fp32"]
        async with http.get(f"{server.url}/catalog", params={"task": "text-embedding"}) as r:
            assert (await r.json())["variants"] == []
    assert await store.get(blobs_key()) is None  # the announcement goes with the server


async def test_a_client_leaving_mid_blob_is_no_error_and_the_store_serves_on(
        tmp_path: Path, store: Any, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture) -> None:
    """A site stopped (or a fetch given up) halfway through a large blob: the store logs that the client left,
    not a server error with a traceback, and answers the next request whole."""
    caplog.set_level(logging.INFO)
    big = os.urandom(24 * 1024 * 1024)  # more than loopback's socket buffers hold: the send is still going
    blobs = BlobStore(tmp_path / "blobs")
    digest = blobs.put_bytes(big)
    small = blobs.put_bytes(PAYLOAD)
    async with VariantStoreServer(blobs, Catalog(store), authenticate=header_identity, lease_ttl=5) as server:
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"GET /blobs/{digest} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        await writer.drain()
        got = 0
        while got < 256 * 1024:  # part of it, then gone
            chunk = await asyncio.wait_for(reader.read(65536), 10)
            assert chunk, "the store closed first"
            got += len(chunk)
        writer.transport.abort()  # a reset, as a killed process's socket gives
        for _ in range(100):  # until the store has noticed (bounded: 10 s)
            if any(getattr(r, "tm", {}).get("event") == "blob_client_gone" for r in caplog.records):
                break
            await asyncio.sleep(0.1)
        async with http.get(f"{server.url}/blobs/{small}") as r:
            assert r.status == 200 and await r.read() == PAYLOAD
    assert any(getattr(r, "tm", {}).get("event") == "blob_client_gone" for r in caplog.records), caplog.text[-2000:]
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
