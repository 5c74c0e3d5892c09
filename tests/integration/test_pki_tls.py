"""The mesh PKI over real transports on loopback: a mutual-TLS handshake (stdlib ssl + asyncio) with
contexts built from the files ``LocalPki`` writes, rotation of those files under live contexts, and the
sites' CURVE keys in a real pyzmq CURVE handshake."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import zmq
import zmq.auth

from mesh.errors import Unauthenticated
from mesh.pki.ca import CertificateAuthority
from mesh.pki.curve import CurveKeyPair
from mesh.pki.files import cert_pem, key_pem, write_file
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from mesh.pki.reload import ReloadingCredentials
from mesh.pki.trust import TrustStore
from mesh.pki.verify import peer_certificate
from tests.helpers.waiting import eventually

pytestmark = pytest.mark.integration

TENANT, SITE, OTHER_SITE = Identity("tenant", "acme"), Identity("site", "edge-1"), Identity("site", "core-1")
IO_TIMEOUT = 10.0


@pytest.fixture
def pki(tmp_path: Path) -> LocalPki:
    p = LocalPki.under(tmp_path)
    p.init()
    p.issue(SITE, addresses=["127.0.0.1"])
    p.issue(TENANT)
    return p


Server = tuple[int, list[str]]


@contextlib.asynccontextmanager
async def echo_identity_server(ctx: ssl.SSLContext, trust: TrustStore) -> AsyncIterator[Server]:
    """A TLS server on loopback that answers each line with the client's verified identity and certificate
    serial (or the reason it refused it). Yields (port, log of what it saw)."""
    seen: list[str] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.readline():
                try:
                    cert = peer_certificate(writer.get_extra_info("ssl_object"))
                    ident = trust.verify(cert, use="client", kinds=("tenant",))
                    answer = f"{ident.uri} {cert.serial_number:x}"
                except Unauthenticated as exc:
                    answer = f"refused {exc.reason}"
                seen.append(answer)
                writer.write(answer.encode() + b"\n")
                await writer.drain()
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ctx)
    try:
        yield server.sockets[0].getsockname()[1], seen
    finally:
        server.close()
        await server.wait_closed()


Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@contextlib.asynccontextmanager
async def connect(port: int, ctx: ssl.SSLContext) -> AsyncIterator[Conn]:
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port, ssl=ctx), IO_TIMEOUT)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, ssl.SSLError, TimeoutError):
            await asyncio.wait_for(writer.wait_closed(), IO_TIMEOUT)


async def ask(conn: Conn) -> str:
    reader, writer = conn
    writer.write(b"who am i\n")
    await writer.drain()
    return (await asyncio.wait_for(reader.readline(), IO_TIMEOUT)).decode().strip()


def bare_client_context(ca_pem: Path) -> ssl.SSLContext:
    """Trusts our CA, presents no certificate."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(cafile=str(ca_pem))
    return ctx


async def refused(attempt: Callable[[], Awaitable[str]]) -> None:
    """The server must not answer: TLS 1.3 lets the client finish its side of the handshake, so the refusal
    shows up at the first read, as an alert, a reset or end of stream."""
    try:
        answer = await attempt()
    except (ssl.SSLError, ConnectionError, asyncio.IncompleteReadError):
        return
    assert answer == "", f"server answered a client it should have refused: {answer!r}"


async def test_tenant_certificate_is_accepted_and_both_ends_verify(pki: LocalPki) -> None:
    trust = TrustStore.under(pki.paths)
    server_creds = ReloadingCredentials.for_identity(pki.paths, SITE)
    client_creds = ReloadingCredentials.for_identity(pki.paths, TENANT)
    async with echo_identity_server(server_creds.server_context(), trust) as (port, _), \
            connect(port, client_creds.client_context()) as conn:
        assert await ask(conn) == f"{TENANT.uri} {client_creds.certificate.serial_number:x}"
        server_cert = peer_certificate(conn[1].get_extra_info("ssl_object"))
        assert trust.verify(server_cert, use="server", kinds=("site",)) == SITE


async def test_client_without_certificate_is_refused(pki: LocalPki) -> None:
    trust = TrustStore.under(pki.paths)
    server_ctx = ReloadingCredentials.for_identity(pki.paths, SITE).server_context()
    async with echo_identity_server(server_ctx, trust) as (port, seen):

        async def attempt() -> str:
            async with connect(port, bare_client_context(pki.paths.ca_cert)) as conn:
                return await ask(conn)

        await refused(attempt)
        assert seen == []


async def test_client_from_another_ca_is_refused(pki: LocalPki, tmp_path: Path) -> None:
    other = CertificateAuthority.create()
    issued = other.issue(TENANT)
    write_file(tmp_path / "o.pem", cert_pem(issued.cert))
    write_file(tmp_path / "o-key.pem", key_pem(issued.key), private=True)
    ctx = bare_client_context(pki.paths.ca_cert)
    ctx.load_cert_chain(tmp_path / "o.pem", tmp_path / "o-key.pem")
    trust = TrustStore.under(pki.paths)
    server_ctx = ReloadingCredentials.for_identity(pki.paths, SITE).server_context()
    async with echo_identity_server(server_ctx, trust) as (port, seen):

        async def attempt() -> str:
            async with connect(port, ctx) as conn:
                return await ask(conn)

        await refused(attempt)
        assert seen == []


async def test_revoked_tenant_passes_tls_but_not_verification(pki: LocalPki) -> None:
    """TLS checks the chain; revocation is the TrustStore's job after it, re-read from crl.pem on change."""
    trust = TrustStore.under(pki.paths)
    server_ctx = ReloadingCredentials.for_identity(pki.paths, SITE).server_context()
    client_ctx = ReloadingCredentials.for_identity(pki.paths, TENANT).client_context()
    async with echo_identity_server(server_ctx, trust) as (port, _):
        async with connect(port, client_ctx) as conn:
            assert (await ask(conn)).startswith(TENANT.uri)
            pki.revoke(TENANT)
            assert trust.refresh()
            assert await ask(conn) == "refused revoked"


async def test_server_from_another_ca_is_refused_by_the_client(pki: LocalPki, tmp_path: Path) -> None:
    other = LocalPki.under(tmp_path / "other")
    other.init()
    other.issue(SITE)
    trust = TrustStore.under(other.paths)
    server_ctx = ReloadingCredentials.for_identity(other.paths, SITE).server_context()
    client_ctx = ReloadingCredentials.for_identity(pki.paths, TENANT).client_context()
    async with echo_identity_server(server_ctx, trust) as (port, _):
        with pytest.raises(ssl.SSLCertVerificationError):
            async with connect(port, client_ctx):
                pass


async def test_rotation_reloads_into_the_same_contexts(pki: LocalPki) -> None:
    trust = TrustStore.under(pki.paths)
    server_creds = ReloadingCredentials.for_identity(pki.paths, SITE)
    client_creds = ReloadingCredentials.for_identity(pki.paths, TENANT)
    server_ctx, client_ctx = server_creds.server_context(), client_creds.client_context()
    old_site, old_tenant = server_creds.certificate.serial_number, client_creds.certificate.serial_number
    async with echo_identity_server(server_ctx, trust) as (port, _):
        async with connect(port, client_ctx) as before:
            assert await ask(before) == f"{TENANT.uri} {old_tenant:x}"
            new_site, new_tenant = pki.issue(SITE).serial, pki.issue(TENANT).serial
            assert server_creds.refresh() and client_creds.refresh()
            assert not server_creds.refresh()  # nothing changed since
            async with connect(port, client_ctx) as after:
                assert await ask(after) == f"{TENANT.uri} {new_tenant:x}"
                assert peer_certificate(after[1].get_extra_info("ssl_object")).serial_number == new_site
            # the connection made before the rotation keeps working on its old certificates
            assert await ask(before) == f"{TENANT.uri} {old_tenant:x}"
    assert new_site != old_site and server_creds.certificate.serial_number == new_site


async def test_half_written_rotation_keeps_the_old_pair(pki: LocalPki) -> None:
    creds = ReloadingCredentials.for_identity(pki.paths, TENANT)
    ctx = creds.client_context()
    old = creds.certificate.serial_number
    fresh = pki.ca().issue(TENANT)
    write_file(pki.paths.cert(TENANT), cert_pem(fresh.cert))  # the certificate lands before its key
    assert not creds.refresh()
    assert creds.certificate.serial_number == old
    trust = TrustStore.under(pki.paths)
    server_ctx = ReloadingCredentials.for_identity(pki.paths, SITE).server_context()
    async with echo_identity_server(server_ctx, trust) as (port, _), connect(port, ctx) as conn:
        assert await ask(conn) == f"{TENANT.uri} {old:x}"
        write_file(pki.paths.key(TENANT), key_pem(fresh.key), private=True)
        assert creds.refresh()
        async with connect(port, ctx) as conn2:
            assert await ask(conn2) == f"{TENANT.uri} {fresh.serial:x}"


async def test_running_credentials_follow_their_files(pki: LocalPki) -> None:
    creds = ReloadingCredentials.for_identity(pki.paths, SITE, interval_s=0.05)
    async with creds:
        new = pki.issue(SITE).serial

        async def reloaded() -> bool:
            return creds.certificate.serial_number == new

        await eventually(reloaded, 10, "the poller loads the rotated certificate")


def test_site_curve_keys_make_a_real_curve_handshake(pki: LocalPki) -> None:
    pki.issue(OTHER_SITE)
    server_keys, client_keys = pki.curve(SITE), pki.curve(OTHER_SITE)
    # the .curve file is ZeroMQ's own certificate format, and libzmq derives the same public key
    assert zmq.auth.load_certificate(str(pki.paths.curve(SITE))) == (server_keys.public, server_keys.secret)
    assert zmq.curve_public(server_keys.secret) == server_keys.public
    # each site's public key is the one its certificate binds
    trust = TrustStore.under(pki.paths)
    assert trust.verify(pki.certificate(SITE), use="server", curve_public=server_keys.public) == SITE
    assert trust.verify(pki.certificate(OTHER_SITE), use="client", curve_public=client_keys.public) == OTHER_SITE

    ctx = zmq.Context()
    try:
        server = ctx.socket(zmq.ROUTER)
        server.curve_server = True
        server.curve_secretkey, server.curve_publickey = server_keys.secret, server_keys.public
        port = server.bind_to_random_port("tcp://127.0.0.1")

        def dealer(keys: CurveKeyPair, server_public: bytes) -> zmq.Socket[bytes]:
            s = ctx.socket(zmq.DEALER)
            s.curve_secretkey, s.curve_publickey, s.curve_serverkey = keys.secret, keys.public, server_public
            s.connect(f"tcp://127.0.0.1:{port}")
            return s

        good = dealer(client_keys, server_keys.public)
        good.send(b"ping")
        assert server.poll(int(IO_TIMEOUT * 1000)), "no CURVE message arrived"
        ident, body = server.recv_multipart()
        assert body == b"ping"
        server.send_multipart([ident, b"pong"])
        assert good.poll(int(IO_TIMEOUT * 1000)) and good.recv() == b"pong"

        # a client that expects another server key never completes the handshake: nothing arrives
        wrong = dealer(CurveKeyPair.generate(), CurveKeyPair.generate().public)
        wrong.send(b"sneak")
        assert not server.poll(1000)
    finally:
        ctx.destroy(linger=0)
