"""A revocation list past its nextUpdate fails closed, and re-signing it brings the mesh back: the variant store over
HTTPS (a ``TlsPeers`` server, as every edge is) holding an expired list refuses every caller (401 ``crl_expired``);
``tiermesh pki refresh-crl`` re-signs the list and publishes it at etcd ``pki/crl``, the store's follower adopts it,
and the caller is served again. Real etcd, real TLS on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import ssl
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from mesh.etcd.keys import PKI_CRL
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.store import Store
from mesh.pki.crl import RevocationList, crl_pem_from_record
from mesh.pki.files import write_file
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from mesh.pki.reload import ReloadingCredentials
from tiermesh.cli.main import EXIT_OK, main
from tiermesh.crl_follow import CrlFollower
from variant_store.access import StoreTls
from variant_store.blobs import BlobStore
from variant_store.catalog import Catalog
from variant_store.meta import VariantMeta
from variant_store.server import VariantStoreServer

pytestmark = pytest.mark.integration
STORE, ACME = Identity("store", "store"), Identity("tenant", "acme")
BYTES = os.urandom(1000)


async def _status(url: str, ctx: ssl.SSLContext) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as sess, sess.get(url, ssl=ctx) as r:
        body = await r.read()
        return r.status, json.loads(body) if r.status != 200 else body


async def test_an_expired_list_refuses_everyone_until_refresh_crl_publishes_a_fresh_one(
        tmp_path: Path, store: Store, etcd_server: EmbeddedEtcd, monkeypatch: pytest.MonkeyPatch) -> None:
    pki = LocalPki.under(tmp_path / "home")
    pki.init()
    pki.issue(STORE, addresses=["127.0.0.1"])
    pki.issue(ACME)
    # the home's list, signed three days ago and never since (a mesh whose operator stopped re-signing)
    write_file(pki.paths.crl, pki.crl().add(pki.ca(), [], now=datetime.now(UTC) - timedelta(days=3)).to_pem())
    blobs = BlobStore(tmp_path / "blobs")
    digest = blobs.put_bytes(BYTES)
    await Catalog(store).put_variant(VariantMeta(
        task="t", family="f", variant_id="v", format="onnx", precision="fp32", runtime="onnxruntime",
        blob_digest=digest, size_bytes=len(BYTES), accuracy=0.9, owner="public"))
    tls = StoreTls(pki.paths, STORE, interval_s=0.2)  # starts on an expired list: held, not used
    ctx = ReloadingCredentials.for_identity(pki.paths, ACME).client_context()
    server = VariantStoreServer(blobs, Catalog(store), host="127.0.0.1", tls=tls, announce=False)
    async with server, CrlFollower.for_peers(store, tls):
        url = f"{server.url}/blobs/{digest}"
        status, body = await _status(url, ctx)
        assert status == 401 and "revocation list held" in body["error"], body  # was 200: its age went unchecked
        monkeypatch.delenv("TIERMESH_ETCD", raising=False)
        code = await asyncio.to_thread(main, ["pki", "refresh-crl", "--home", str(tmp_path / "home"),
                                              "--etcd", etcd_server.url, "--prefix", store.prefix])
        assert code == EXIT_OK
        held = await store.get(PKI_CRL)
        assert held is not None
        published = RevocationList.load(crl_pem_from_record(held.value), pki.ca().cert)  # fresh: loads strictly
        assert published.number == pki.crl().number
        for _ in range(100):
            status, body = await _status(url, ctx)
            if status == 200:
                break
            await asyncio.sleep(0.05)
        assert (status, body) == (200, BYTES)
