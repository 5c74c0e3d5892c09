"""etcd's own certificate (an ``etcd`` identity) is refused by an agent's edge, health endpoints included: it is
etcd's, not a caller of the mesh (as ``site:etcd`` it passed every check a site passes). The variant store's side:
``tests/integration/test_blob_server_tls.py``."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from edge_agent.http_api import EdgeHttpServer
from edge_agent.mtls import EdgeTls
from mesh.pki.identity import Identity
from tests.helpers.mtls_edge import ACME, SITE, call, make_pki, tenant_context
from tests.helpers_dataplane import OnnxDataPlane, digits_plane

pytestmark = pytest.mark.integration
ETCD = Identity("etcd", "etcd")


@pytest.fixture(scope="module")
def dp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OnnxDataPlane]:
    with digits_plane(tmp_path_factory.mktemp("model"), SITE.name, accuracy=0.96,
                      tenants=frozenset({"public", "acme"})) as plane:
        yield plane


async def _ready(url: str, ctx: ssl.SSLContext) -> int:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/v2/health/ready", ssl=ctx) as r:
        return r.status


async def test_the_edge_refuses_etcds_certificate(dp: OnnxDataPlane, tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    pki.issue(ETCD, addresses=["127.0.0.1"])
    async with EdgeHttpServer(dp, tls=EdgeTls(pki.paths, SITE.name)) as srv:
        etcd = tenant_context(pki, ETCD)
        assert await _ready(srv.url, tenant_context(pki, ACME)) == 200
        assert await _ready(srv.url, etcd) == 403
        status, body = await call(srv.url, etcd)
        assert status == 403 and body["code"] == "forbidden", body
