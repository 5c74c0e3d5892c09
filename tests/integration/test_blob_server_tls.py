"""The variant store over HTTPS with mesh client certificates: tenant-private variants (catalog entry and blob)
only to their tenant, the sites placement asks to serve it (etcd ``placement/<site>``) and admins; a model's
labelled validation set only to its owner and admins; public ones to any valid identity, never to etcd's own
certificate; no or bad certificates refused. Real TLS on loopback, real etcd."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest

from mesh.errors import PermissionDenied
from mesh.etcd.keys import placement_key
from mesh.pki.crl import Revocation
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from mesh.pki.reload import ReloadingCredentials
from variant_store.access import StoreTls
from variant_store.blobs import BlobStore
from variant_store.catalog import Catalog, RegisteredModel
from variant_store.fetch import fetch_blob
from variant_store.meta import VariantMeta
from variant_store.placed import PlacedVariants
from variant_store.server import VariantStoreServer

pytestmark = pytest.mark.integration

TASK = "digit-classification"
PUBLIC_BYTES, A_BYTES, B_BYTES = os.urandom(2000), os.urandom(3000), os.urandom(4000)
LABELS_BYTES = os.urandom(1500)  # tenant-a's labelled validation set
IDS = [Identity("tenant", "tenant-a"), Identity("tenant", "tenant-b"), Identity("site", "edge-1"),
       Identity("site", "edge-2"), Identity("scheduler", "s1"), Identity("admin", "op")]
ETCD = Identity("etcd", "etcd")
GRACE_S = 1.0


def _placement(*variants: str) -> dict[str, Any]:
    return {"schema": 1, "variants": [{"task": TASK, "variant_id": v} for v in variants]}


def _meta(variant: str, digest: str, size: int, owner: str) -> VariantMeta:
    return VariantMeta(task=TASK, family="mlp", variant_id=variant, format="onnx", precision="fp32",
                       runtime="onnxruntime", blob_digest=digest, size_bytes=size, accuracy=0.9, owner=owner)


@pytest.fixture
async def secured(tmp_path: Path, store: Any) -> AsyncIterator[tuple[VariantStoreServer, LocalPki, dict[str, str]]]:
    pki = LocalPki.under(tmp_path / "home")
    pki.init()
    pki.issue(Identity("store", "store"), addresses=["127.0.0.1"])
    for ident in (*IDS, ETCD):
        pki.issue(ident)
    blobs = BlobStore(tmp_path / "blobs")
    digests = {"public": blobs.put_bytes(PUBLIC_BYTES), "a": blobs.put_bytes(A_BYTES), "b": blobs.put_bytes(B_BYTES),
               "labels": blobs.put_bytes(LABELS_BYTES)}
    cat = Catalog(store)
    await cat.put_variant(_meta("mlp.public", digests["public"], len(PUBLIC_BYTES), "public"))
    await cat.put_variant(_meta("mlp.head-a", digests["a"], len(A_BYTES), "tenant-a"))
    await cat.put_variant(_meta("mlp.head-b", digests["b"], len(B_BYTES), "tenant-b"))
    await cat.put_model(RegisteredModel(task=TASK, family="mlp-a", parent_digest=digests["a"],
                                        validation_digest=digests["labels"], owner="tenant-a"))
    # placement (the scheduler's record, etcd RBAC: no site writes it) asks edge-1 for both heads, edge-2 for a's
    await store.put(placement_key("edge-1"), _placement("mlp.public", "mlp.head-a", "mlp.head-b"))
    await store.put(placement_key("edge-2"), _placement("mlp.head-a"))
    tls = StoreTls(pki.paths, Identity("store", "store"), interval_s=0.2)
    async with PlacedVariants(store, grace_s=GRACE_S) as placed:
        server = VariantStoreServer(blobs, cat, host="127.0.0.1", tls=tls, announce=False, placement=placed)
        async with server:
            yield server, pki, digests


def _client(pki: LocalPki, ident: Identity) -> ssl.SSLContext:
    return ReloadingCredentials.for_identity(pki.paths, ident).client_context()


async def _get(url: str, ctx: ssl.SSLContext | bool) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as sess, sess.get(url, ssl=ctx) as r:
        body = await r.read()
        return r.status, body


async def _catalog(server: VariantStoreServer, pki: LocalPki, ident: Identity) -> set[str]:
    status, body = await _get(f"{server.url}/catalog", _client(pki, ident))
    assert status == 200, body
    return {v["variant_id"] for v in json.loads(body)["variants"]}


async def test_private_variants_only_to_their_tenant_and_its_sites(secured: Any) -> None:
    server, pki, digests = secured
    assert server.url.startswith("https://")
    a, b, edge1, edge2, sched, admin = IDS
    assert await _catalog(server, pki, a) == {"mlp.public", "mlp.head-a"}
    assert await _catalog(server, pki, b) == {"mlp.public", "mlp.head-b"}
    assert await _catalog(server, pki, edge1) == {"mlp.public", "mlp.head-a", "mlp.head-b"}
    assert await _catalog(server, pki, edge2) == {"mlp.public", "mlp.head-a"}
    assert await _catalog(server, pki, sched) == {"mlp.public"}
    assert await _catalog(server, pki, admin) == {"mlp.public", "mlp.head-a", "mlp.head-b"}

    def blob(which: str) -> str:
        return f"{server.url}/blobs/{digests[which]}"

    # tenant A asking for tenant B's private head: refused (403), and it learns nothing of the bytes
    status, body = await _get(blob("b"), _client(pki, a))
    assert status == 403 and b"forbidden" in body and B_BYTES not in body
    assert await _get(blob("a"), _client(pki, a)) == (200, A_BYTES)
    assert await _get(blob("public"), _client(pki, a)) == (200, PUBLIC_BYTES)
    assert await _get(blob("b"), _client(pki, edge1)) == (200, B_BYTES)
    assert (await _get(blob("b"), _client(pki, edge2)))[0] == 403
    assert (await _get(blob("a"), _client(pki, sched)))[0] == 403
    # an unknown digest: a tenant or site is refused before learning whether it exists; an admin gets 404
    unknown = f"{server.url}/blobs/{'0' * 64}"
    assert (await _get(unknown, _client(pki, b)))[0] == 403
    assert (await _get(unknown, _client(pki, edge1)))[0] == 403
    assert (await _get(unknown, _client(pki, admin)))[0] == 404

    # the fetch client: a site with its certificate gets the blob; tenant A is told it may not
    dest = pki.paths.ca_cert.parent / "dl"
    got = await fetch_blob(server.url, digests["b"], dest / "b", ssl=_client(pki, edge1), timeout=10)
    assert got.read_bytes() == B_BYTES
    with pytest.raises(PermissionDenied):
        await fetch_blob(server.url, digests["b"], dest / "b2", ssl=_client(pki, a), timeout=10)
    assert not (dest / "b2").exists()


async def test_no_or_foreign_or_revoked_certificate_is_refused(secured: Any, tmp_path: Path) -> None:
    server, pki, digests = secured
    url = f"{server.url}/blobs/{digests['public']}"
    anonymous = ssl.create_default_context(cafile=str(pki.paths.ca_cert))
    anonymous.check_hostname = False
    with pytest.raises(aiohttp.ClientError):  # no client certificate: the handshake (or first read) fails
        await _get(url, anonymous)
    other = LocalPki.under(tmp_path / "other")
    other.init()
    other.issue(Identity("tenant", "tenant-a"))
    foreign = ReloadingCredentials(other.paths.cert(Identity("tenant", "tenant-a")),
                                   other.paths.key(Identity("tenant", "tenant-a")), pki.paths.ca_cert).client_context()
    with pytest.raises(aiohttp.ClientError):  # a certificate from another CA
        await _get(url, foreign)
    ctx = _client(pki, IDS[0])
    assert (await _get(url, ctx))[0] == 200
    pki.revoke(IDS[0])  # writes crl.pem; the store's trust store re-reads it
    for _ in range(50):
        status, body = await _get(url, ctx)
        if status == 401:
            break
        await asyncio.sleep(0.2)
    assert status == 401, body


async def test_a_list_from_etcd_closes_a_revoked_callers_open_connection_at_once(secured: Any) -> None:
    """The path the serve command's CRL follower takes (``load_crl``, crl.pem untouched): the revoked caller's idle
    keep-alive connection is closed when the list is adopted, without waiting for its next request."""
    server, pki, digests = secured
    a, b = IDS[0], IDS[1]
    url = urlsplit(f"{server.url}/blobs/{digests['public']}")
    reader, writer = await asyncio.wait_for(asyncio.open_connection(url.hostname, url.port, ssl=_client(pki, a)), 10)
    try:
        writer.write(f"GET {url.path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200")
        await asyncio.wait_for(reader.readexactly(len(PUBLIC_BYTES)), 10)
        newer = pki.crl().add(pki.ca(), [Revocation(pki.certificate(a).serial_number, a, datetime.now(UTC))])
        assert server.tls.load_crl(newer.to_pem())
        assert await asyncio.wait_for(reader.read(1), 2) == b""  # closed by the store
        assert (await _get(f"{server.url}/blobs/{digests['public']}", _client(pki, a)))[0] == 401
        assert (await _get(f"{server.url}/blobs/{digests['public']}", _client(pki, b))) == (200, PUBLIC_BYTES)
        assert not server.tls.load_crl(newer.to_pem())  # the same list again: nothing to adopt
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            await writer.wait_closed()


async def test_a_site_reads_a_private_variant_only_while_placement_asks_it_to_serve_its_tenant(
        secured: Any, store: Any) -> None:
    """``serves`` wired from etcd placement: a site never asked to serve tenant-b gets 403 for b's head (every site
    got it before); placement naming b's head at edge-2 lets edge-2's very next fetch through (the store reads
    placement/<site> at the request: a site that learns its placement never gets there first); moved away, the head
    stays readable for the grace (a fetch in flight, a cold start on the way), then not."""
    server, pki, digests = secured
    edge2 = IDS[3]
    url = f"{server.url}/blobs/{digests['b']}"
    assert (await _get(url, _client(pki, edge2)))[0] == 403
    await store.put(placement_key("edge-2"), _placement("mlp.head-a", "mlp.head-b"))
    assert await _get(url, _client(pki, edge2)) == (200, B_BYTES)  # no wait: read from etcd at the request
    assert "mlp.head-b" in await _catalog(server, pki, edge2)
    await store.put(placement_key("edge-2"), _placement("mlp.head-a"))
    assert await _get(url, _client(pki, edge2)) == (200, B_BYTES)  # within the grace
    await asyncio.sleep(GRACE_S + 0.3)
    assert (await _get(url, _client(pki, edge2)))[0] == 403
    assert "mlp.head-b" not in await _catalog(server, pki, edge2)
    await store.delete(placement_key("edge-2"))  # a site placement forgot entirely: nothing private
    await asyncio.sleep(GRACE_S + 0.3)
    assert (await _get(f"{server.url}/blobs/{digests['a']}", _client(pki, edge2)))[0] == 403


async def test_labelled_validation_data_goes_to_its_owner_and_admins_only(secured: Any) -> None:
    """A private model's labelled validation set: its owner reads it (it was refused), no site (every site read it)
    and no scheduler (it could download it)."""
    server, pki, digests = secured
    a = IDS[0]
    url = f"{server.url}/blobs/{digests['labels']}"
    got = {who.common_name: (await _get(url, _client(pki, who)))[0] for who in IDS}
    assert got == {"tenant:tenant-a": 200, "tenant:tenant-b": 403, "site:edge-1": 403, "site:edge-2": 403,
                   "scheduler:s1": 403, "admin:op": 200}
    assert await _get(url, _client(pki, a)) == (200, LABELS_BYTES)


async def test_etcds_own_certificate_reads_nothing(secured: Any) -> None:
    """etcd's certificate (an etcd identity, issued and revocable like the others) is refused even a public blob and
    the catalog: it is etcd's, not a reader of models (as ``site:etcd`` it read every private blob)."""
    server, pki, digests = secured
    for path in (f"/blobs/{digests['public']}", f"/blobs/{digests['a']}", "/catalog"):
        status, body = await _get(f"{server.url}{path}", _client(pki, ETCD))
        assert status == 403, (path, body)
    assert any(r.identity == ETCD for r in pki.listing())  # in issued.jsonl: `pki revoke` can revoke it
    crl, new = pki.revoke(ETCD)
    assert new and all(crl.is_revoked(s) for s in new)
