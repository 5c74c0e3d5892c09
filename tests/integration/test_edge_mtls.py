"""The edge API over mutual TLS, on loopback with real certificates and a real ONNX data plane: the negative
matrix of issue 11 (HTTP side), each case its own test, with a good tenant served before and after every bad
caller; rotation of the server's and a tenant's certificate under load; revocation within seconds; the
unmodified ``tritonclient.http`` and the SDK with certificates; and a real agent serving HTTPS."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as tritonhttp
from cryptography import x509

from edge_agent.http_api import EdgeHttpServer
from edge_agent.mtls import EdgeTls
from mesh import AsyncClient, Client, PeerUnavailable
from mesh.pki.ca import CertificateAuthority, IssuedCertificate
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from mesh.pki.reload import ReloadingCredentials
from tests.helpers.mtls_edge import (
    ACME,
    GLOBEX,
    HANDSHAKE,
    SITE,
    TASK,
    call,
    client_context,
    make_pki,
    tenant_context,
)
from tests.helpers.pki_certs import SERVER, odd_leaf
from tests.helpers_dataplane import OnnxDataPlane, digits_plane, serve_in_thread

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def dp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OnnxDataPlane]:
    with digits_plane(tmp_path_factory.mktemp("model"), SITE.name, accuracy=0.96,
                      tenants=frozenset({"public", "acme", "globex", "initech"})) as plane:
        yield plane


@dataclass
class Edge:
    url: str
    pki: LocalPki
    tls: EdgeTls
    home: Path


@pytest.fixture
async def edge(dp: OnnxDataPlane, tmp_path: Path) -> AsyncIterator[Edge]:
    pki = make_pki(tmp_path)
    tls = EdgeTls(pki.paths, SITE.name, interval_s=0.2)
    async with EdgeHttpServer(dp, tls=tls) as srv:
        yield Edge(srv.url, pki, tls, tmp_path)


async def served(edge: Edge, who: Identity = ACME) -> None:
    status, body = await call(edge.url, tenant_context(edge.pki, who))
    assert status == 200, body
    params = body["parameters"]
    assert isinstance(params, dict) and params["tenant"] == who.name


def test_the_server_url_is_https(edge: Edge) -> None:
    assert edge.url.startswith("https://127.0.0.1:")


# -- the negative matrix: each case builds a client certificate; the edge refuses it, at the handshake or with
# 401 naming the reason; a good tenant is served before and after ------------------------------------------

def _expired(ca: CertificateAuthority) -> IssuedCertificate:
    now = datetime.now(UTC)
    return odd_leaf(ca, valid=(now - timedelta(hours=3), now - timedelta(hours=2)))


def _not_yet_valid(ca: CertificateAuthority) -> IssuedCertificate:
    now = datetime.now(UTC)
    return odd_leaf(ca, valid=(now + timedelta(hours=1), now + timedelta(hours=2)))


def _wrong_ca(ca: CertificateAuthority) -> IssuedCertificate:
    return CertificateAuthority.create().issue(ACME)


AUTHN_CASES: dict[str, tuple[Callable[[CertificateAuthority], IssuedCertificate], set[str]]] = {
    # name: (certificate, the reasons a 401 may give if TLS lets it through)
    "wrong_ca": (_wrong_ca, {"wrong_ca"}),
    "expired": (_expired, {"expired"}),
    "not_yet_valid": (_not_yet_valid, {"not_yet_valid"}),
    "two_uri_sans": (lambda ca: odd_leaf(ca, uris=(ACME.uri, GLOBEX.uri)), {"san"}),
    "ca_true_leaf": (lambda ca: odd_leaf(ca, ca_flag=True), {"ca_certificate"}),
    "server_eku_only": (lambda ca: odd_leaf(ca, ekus=(SERVER,)), {"eku"}),
    "no_eku_extension": (lambda ca: odd_leaf(ca, ekus=None), {"eku"}),
}
# What this machine's OpenSSL does with each (checked, so a change in where the refusal happens is noticed)
AT_HANDSHAKE = {"wrong_ca", "expired", "not_yet_valid", "server_eku_only"}


async def _refused(edge: Edge, ctx_cert: tuple[x509.Certificate, object] | None, reasons: set[str]) -> str | int:
    await served(edge)
    if ctx_cert is None:
        ctx = client_context(edge.pki.paths.ca_cert)
    else:
        cert, key = ctx_cert
        ctx = client_context(edge.pki.paths.ca_cert, cert, key, edge.home / "odd")  # type: ignore[arg-type]
    for infer in (True, False):
        status, body = await call(edge.url, ctx, infer=infer)
        assert status in (HANDSHAKE, 401), (status, body)
        if status == 401:
            assert body["code"] == "unauthenticated"
            details = body.get("details")
            assert isinstance(details, dict) and details.get("reason") in reasons, body
    await served(edge)
    await served(edge, GLOBEX)
    return status


async def test_no_client_certificate_is_refused_at_the_handshake(edge: Edge) -> None:
    assert await _refused(edge, None, set()) == HANDSHAKE


@pytest.mark.parametrize("case", sorted(AUTHN_CASES))
async def test_bad_client_certificate_is_refused(edge: Edge, case: str) -> None:
    make, reasons = AUTHN_CASES[case]
    issued = make(edge.pki.ca())
    outcome = await _refused(edge, (issued.cert, issued.key), reasons)
    assert (outcome == HANDSHAKE) == (case in AT_HANDSHAKE), outcome


async def test_revoked_tenant_passes_tls_and_gets_401(edge: Edge) -> None:
    initech = Identity("tenant", "initech")
    edge.pki.issue(initech)
    await served(edge, initech)
    edge.pki.revoke(initech)
    edge.tls.trust.refresh()
    status, body = await call(edge.url, tenant_context(edge.pki, initech))
    assert status == 401 and body["code"] == "unauthenticated"
    assert body["details"] == {"reason": "revoked"}
    await served(edge)


async def test_header_claiming_another_tenant_is_forbidden(edge: Edge) -> None:
    ctx = tenant_context(edge.pki, ACME)
    status, body = await call(edge.url, ctx, headers={"X-Tiermesh-Tenant": "globex"})
    assert status == 403 and body["code"] == "forbidden" and "globex" in str(body["error"])
    status, body = await call(edge.url, ctx, infer=False, headers={"X-Tiermesh-Tenant": "globex"})
    assert status == 403
    # naming oneself is fine
    assert (await call(edge.url, ctx, headers={"X-Tiermesh-Tenant": "acme"}))[0] == 200
    await served(edge, GLOBEX)


async def test_tenant_parameter_claiming_another_tenant_is_forbidden(edge: Edge) -> None:
    status, body = await call(edge.url, tenant_context(edge.pki, ACME), params={"tenant": "globex"})
    assert status == 403 and body["code"] == "forbidden"
    await served(edge)


async def test_a_site_identity_may_not_call_the_tenant_api(edge: Edge) -> None:
    ctx = tenant_context(edge.pki, SITE)  # a real site certificate (it has clientAuth: sites dial sites)
    for infer in (True, False):
        status, body = await call(edge.url, ctx, infer=infer)
        assert status == 403 and body["code"] == "forbidden" and body["details"] == {"reason": "wrong_kind"}
    await served(edge)


# -- rotation and revocation under load ----------------------------------------------------------------------

async def test_rotating_server_and_tenant_certificates_loses_no_query(edge: Edge) -> None:
    x = np.full((1, 64), 0.25, np.float32)
    ca = str(edge.pki.paths.ca_cert)
    acme_files = (edge.pki.paths.cert(ACME), edge.pki.paths.key(ACME))
    fresh = ReloadingCredentials(*acme_files, edge.pki.paths.ca_cert)  # new connection per query
    fresh_ctx = fresh.client_context(check_hostname=True)
    errors: list[str] = []
    counts = {"sdk": 0, "fresh": 0}
    stop = time.monotonic() + 4.0

    async def sdk_loop(client: AsyncClient) -> None:
        while time.monotonic() < stop and counts["sdk"] < 2000:
            try:
                r = await client.infer(TASK, x, latency_ms=5000)
                assert r.tenant in ("acme", "globex")
                counts["sdk"] += 1
            except Exception as exc:
                errors.append(f"sdk {exc!r}")
            await asyncio.sleep(0.01)

    async def fresh_loop() -> None:
        while time.monotonic() < stop and counts["fresh"] < 500:
            fresh.refresh()
            status, body = await call(edge.url, fresh_ctx)
            if status != 200:
                errors.append(f"fresh {status} {body}")
            counts["fresh"] += 1
            await asyncio.sleep(0.02)

    async def rotate() -> None:
        await asyncio.sleep(1.0)
        edge.pki.issue(SITE, addresses=["127.0.0.1"])
        await asyncio.sleep(1.0)
        edge.pki.issue(ACME)

    site_before, acme_before = edge.tls.credentials.certificate.serial_number, fresh.certificate.serial_number
    async with AsyncClient(edge.url, cert=acme_files[0], key=acme_files[1], ca=ca) as acme, \
            AsyncClient(edge.url, cert=edge.pki.paths.cert(GLOBEX), key=edge.pki.paths.key(GLOBEX), ca=ca) as globex:
        await asyncio.gather(sdk_loop(acme), sdk_loop(globex), fresh_loop(), rotate())
        assert acme.credentials is not None and acme.credentials.certificate.serial_number != acme_before
    assert errors == []
    assert counts["sdk"] > 20 and counts["fresh"] > 10, counts
    assert edge.tls.credentials.certificate.serial_number != site_before  # the server reloaded in place
    assert fresh.certificate.serial_number != acme_before
    await served(edge)  # the rotated tenant certificate is good


async def test_a_revoked_tenant_is_refused_within_5_s_while_another_sees_no_error(edge: Edge) -> None:
    x = np.full((1, 64), 0.75, np.float32)
    ca = str(edge.pki.paths.ca_cert)
    statuses: dict[str, list[tuple[float, str]]] = {"acme": [], "globex": []}
    revoked_at: list[float] = []
    stop = time.monotonic() + 30.0

    async def loop(name: str, client: AsyncClient) -> None:
        while time.monotonic() < stop and len(statuses[name]) < 3000:
            try:
                await client.infer(TASK, x, latency_ms=5000)
                statuses[name].append((time.monotonic(), "ok"))
            except Exception as exc:
                statuses[name].append((time.monotonic(), getattr(exc, "code", repr(exc))))
            refused = [t for t, s in statuses["acme"] if s == "unauthenticated"]
            if revoked_at and refused and time.monotonic() > refused[0] + 1.0:
                return  # seen refused for a second: enough
            await asyncio.sleep(0.02)

    async def revoke() -> None:
        await asyncio.sleep(1.0)
        edge.pki.revoke(ACME)
        revoked_at.append(time.monotonic())

    async with AsyncClient(edge.url, cert=edge.pki.paths.cert(ACME), key=edge.pki.paths.key(ACME), ca=ca) as a, \
            AsyncClient(edge.url, cert=edge.pki.paths.cert(GLOBEX), key=edge.pki.paths.key(GLOBEX), ca=ca) as g:
        await asyncio.gather(loop("acme", a), loop("globex", g), revoke())
    assert revoked_at
    acme_after = [(t, s) for t, s in statuses["acme"] if t > revoked_at[0]]
    first_refusal = next(t for t, s in acme_after if s == "unauthenticated")
    assert first_refusal - revoked_at[0] < 5.0
    # once refused, never served again; before the revocation, always served
    assert all(s == "unauthenticated" for t, s in acme_after if t >= first_refusal), acme_after
    assert all(s == "ok" for t, s in statuses["acme"] if t <= revoked_at[0])
    assert statuses["globex"] and all(s == "ok" for _, s in statuses["globex"]), statuses["globex"]


# -- clients: the SDK and tritonclient with certificates ------------------------------------------------------

def test_sync_sdk_and_tritonclient_over_mutual_tls(dp: OnnxDataPlane, tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    paths = pki.paths
    x = np.full((2, 64), 0.5, np.float32)
    with serve_in_thread(dp, tls=EdgeTls(paths, SITE.name)) as srv:
        with Client(srv.url, cert=paths.cert(ACME), key=paths.key(ACME), ca=paths.ca_cert) as c:
            r = c.infer(TASK, x, latency_ms=5000)
            assert r.tenant == "acme" and r.output().shape == (2, 10)
        # no certificate: the handshake is refused, and the SDK says the peer is unavailable
        with Client(srv.url, ca=paths.ca_cert) as c, pytest.raises(PeerUnavailable):
            c.infer(TASK, x, latency_ms=5000)
        tc = tritonhttp.InferenceServerClient(
            srv.url.removeprefix("https://"), ssl=True, network_timeout=30.0,
            ssl_options={"ca_certs": str(paths.ca_cert), "certfile": str(paths.cert(GLOBEX)),
                         "keyfile": str(paths.key(GLOBEX))})
        try:
            assert tc.is_server_ready()
            inp = tritonhttp.InferInput("x", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            res = tc.infer(TASK, [inp], parameters={"latency_ms": 5000})
            np.testing.assert_array_equal(res.as_numpy("logits"), dp.run_direct({"x": x})["logits"])
            assert res.get_response()["parameters"]["tenant"] == "globex"
        finally:
            tc.close()


def test_sdk_refuses_a_certificate_over_plain_http(tmp_path: Path) -> None:
    from mesh.errors import ConfigError

    with pytest.raises(ConfigError, match="https"):
        AsyncClient("http://127.0.0.1:1", cert=tmp_path / "a.pem", key=tmp_path / "a-key.pem", ca=tmp_path / "ca")
    with pytest.raises(ConfigError, match="both"):
        AsyncClient("https://127.0.0.1:1", cert=tmp_path / "a.pem", ca=tmp_path / "ca")
    with pytest.raises(ConfigError, match="ca="):
        AsyncClient("https://127.0.0.1:1")
