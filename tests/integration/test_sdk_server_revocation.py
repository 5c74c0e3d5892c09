"""The SDK checks the *server's* revocation: with ``crl=`` (the CA's list, standard library ``ssl`` only) it refuses,
at the handshake and before sending anything, an edge serving a revoked site certificate (a revoked site key posing
as an edge), and a client made before the revocation refuses it once its list file changes, its pooled keep-alive
connection included. Without ``crl=`` the request still goes through (TLS checks chain and validity only), which is
why the option exists. A real edge HTTP server (the agent's, ``EdgeHttpServer`` with ``EdgeTls``) on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest

from edge_agent.http_api import EdgeHttpServer
from edge_agent.mtls import EdgeTls
from mesh import AsyncClient, Client, PeerUnavailable
from mesh.errors import ConfigError, PkiError
from mesh.pki.files import write_file
from mesh.pki.local import LocalPki
from mesh.pki.reload import CrlFile
from tests.helpers.mtls_edge import ACME, SITE, TASK, make_pki
from tests.helpers_dataplane import OnnxDataPlane, digits_plane, serve_in_thread

pytestmark = pytest.mark.integration
X = np.full((1, 64), 0.5, np.float32)


@pytest.fixture(scope="module")
def dp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OnnxDataPlane]:
    with digits_plane(tmp_path_factory.mktemp("model"), SITE.name, accuracy=0.96,
                      tenants=frozenset({"public", "acme"})) as plane:
        yield plane


@dataclass
class Edge:
    url: str
    pki: LocalPki


@pytest.fixture
async def edge(dp: OnnxDataPlane, tmp_path: Path) -> AsyncIterator[Edge]:
    pki = make_pki(tmp_path)
    async with EdgeHttpServer(dp, tls=EdgeTls(pki.paths, SITE.name, interval_s=0.2)) as srv:
        yield Edge(srv.url, pki)


def _files(pki: LocalPki) -> dict[str, Path]:
    return {"cert": pki.paths.cert(ACME), "key": pki.paths.key(ACME), "ca": pki.paths.ca_cert}


async def test_a_revoked_edge_is_refused_at_the_handshake_and_sent_nothing(edge: Edge, dp: OnnxDataPlane) -> None:
    pki = edge.pki
    # a client made before the revocation, with crl=: served, and keeps a pooled keep-alive connection
    early = AsyncClient(edge.url, crl=pki.paths.crl, check_hostname=False, **_files(pki))
    async with early:
        assert (await early.infer(TASK, X, latency_ms=5000)).tenant == "acme"
        pki.revoke(SITE)  # the site's key is compromised: its certificate is revoked, the server keeps serving it
        await asyncio.sleep(1.2)  # the client checks its files at most every second
        calls = dp.calls
        with pytest.raises(PeerUnavailable, match=r"(?i)revoked"):
            await early.infer(TASK, X, latency_ms=5000)
        assert dp.calls == calls  # the request never reached the server
    async with AsyncClient(edge.url, crl=pki.paths.crl, check_hostname=False, **_files(pki)) as fresh:
        with pytest.raises(PeerUnavailable, match=r"(?i)revoked"):
            await fresh.infer(TASK, X, latency_ms=5000)
    assert dp.calls == calls
    # without crl= TLS checks the chain and validity only: the request goes to the revoked server
    async with AsyncClient(edge.url, check_hostname=False, **_files(pki)) as blind:
        assert (await blind.infer(TASK, X, latency_ms=5000)).tenant == "acme"
    assert dp.calls == calls + 1


def test_the_sync_client_and_a_server_only_context_take_crl_too(dp: OnnxDataPlane, tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    pki.revoke(SITE)
    with serve_in_thread(dp, tls=EdgeTls(pki.paths, SITE.name)) as srv:
        with Client(srv.url, crl=pki.paths.crl, check_hostname=False, **_files(pki)) as c, \
                pytest.raises(PeerUnavailable, match=r"(?i)revoked"):
            c.infer(TASK, X, latency_ms=5000)
        # no client certificate (a mutual-TLS edge refuses it later anyway): the server is still checked first
        with Client(srv.url, ca=pki.paths.ca_cert, crl=pki.paths.crl, check_hostname=False) as c, \
                pytest.raises(PeerUnavailable, match=r"(?i)revoked"):
            c.infer(TASK, X, latency_ms=5000)


async def test_an_expired_list_refuses_every_server(edge: Edge) -> None:
    """Fail closed, as every verifier of the mesh: a list past its nextUpdate checks nothing any more."""
    pki = edge.pki
    write_file(pki.paths.crl, pki.crl().add(pki.ca(), [], now=datetime.now(UTC) - timedelta(days=3)).to_pem())
    async with AsyncClient(edge.url, crl=pki.paths.crl, check_hostname=False, **_files(pki)) as c:
        with pytest.raises(PeerUnavailable, match=r"(?i)expired"):
            await c.infer(TASK, X, latency_ms=5000)


def test_only_a_revocation_list_is_taken_as_one(tmp_path: Path) -> None:
    """A certificate in the crl= file would be loaded as one more trusted CA: refused."""
    pki = make_pki(tmp_path)
    with pytest.raises(PkiError, match="not a PEM revocation list"):
        CrlFile(pki.paths.ca_cert)
    with pytest.raises(PkiError):
        CrlFile(tmp_path / "missing.pem")
    with pytest.raises(ConfigError, match="https"):
        AsyncClient("http://127.0.0.1:1", crl=pki.paths.crl)


def test_tritonclient_refuses_a_revoked_edge_with_the_readmes_context_factory(dp: OnnxDataPlane,
                                                                             tmp_path: Path) -> None:
    """The README's recipe for unmodified ``tritonclient.http``: an ``ssl_context_factory`` that loads the list."""
    import gevent.ssl
    import tritonclient.http as tritonhttp

    pki = make_pki(tmp_path)
    crl = str(pki.paths.crl)

    def mesh_context(cafile: str | None = None) -> gevent.ssl.SSLContext:
        ctx = gevent.ssl.create_default_context(cafile=cafile)
        ctx.verify_flags |= gevent.ssl.VERIFY_CRL_CHECK_LEAF  # the server's certificate against the CA's list
        ctx.load_verify_locations(cafile=crl)
        return ctx

    options = {"ca_certs": str(pki.paths.ca_cert), "certfile": str(pki.paths.cert(ACME)),
               "keyfile": str(pki.paths.key(ACME))}
    with serve_in_thread(dp, tls=EdgeTls(pki.paths, SITE.name, interval_s=0.2)) as srv:
        address = srv.url.removeprefix("https://")

        def ready() -> bool:
            tc = tritonhttp.InferenceServerClient(address, ssl=True, ssl_options=options, network_timeout=10.0,
                                                  ssl_context_factory=mesh_context)
            try:
                return bool(tc.is_server_ready())
            finally:
                tc.close()

        assert ready()
        pki.revoke(SITE)
        with pytest.raises(Exception, match=r"(?i)revoked"):
            ready()

