"""Helpers for the edge's mutual-TLS tests: a PKI in a temp home, client SSL contexts from arbitrary
certificates, and a single call that says how the edge answered (a status, or refused at the handshake)."""

from __future__ import annotations

import json
import ssl
from pathlib import Path

import aiohttp
import numpy as np
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from mesh.pki.files import cert_pem, key_pem, write_file
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki

TASK = "digit-classification"
SITE = Identity("site", "edge-test")
ACME, GLOBEX = Identity("tenant", "acme"), Identity("tenant", "globex")
HANDSHAKE = "refused at the handshake"
IO_TIMEOUT = aiohttp.ClientTimeout(total=15)


def make_pki(home: Path) -> LocalPki:
    pki = LocalPki.under(home)
    pki.init()
    pki.issue(SITE, addresses=["127.0.0.1"])
    pki.issue(ACME)
    pki.issue(GLOBEX)
    return pki


def client_context(ca: Path, cert: x509.Certificate | None = None, key: ec.EllipticCurvePrivateKey | None = None,
                   where: Path | None = None) -> ssl.SSLContext:
    """Trusts ``ca``; presents ``cert``/``key`` (written under ``where``) if given."""
    ctx = ssl.create_default_context(cafile=str(ca))
    if cert is not None and key is not None and where is not None:
        name = f"{cert.serial_number:x}"
        write_file(where / f"{name}.pem", cert_pem(cert))
        write_file(where / f"{name}-key.pem", key_pem(key), private=True)
        ctx.load_cert_chain(where / f"{name}.pem", where / f"{name}-key.pem")
    return ctx


def tenant_context(pki: LocalPki, who: Identity) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.paths.ca_cert))
    ctx.load_cert_chain(pki.paths.cert(who), pki.paths.key(who))
    return ctx


def infer_body(x: np.ndarray, **params: object) -> bytes:
    return json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                   "data": x.ravel().tolist()}],
                       "parameters": {"latency_ms": 5000, **params}}).encode()


async def call(base: str, ctx: ssl.SSLContext, *, infer: bool = True, headers: dict[str, str] | None = None,
               params: dict[str, object] | None = None) -> tuple[int | str, dict[str, object]]:
    """One infer (or, ``infer=False``, task-metadata) request on a fresh connection. Returns (status, JSON
    body), or (HANDSHAKE, {}) when TLS refused the client (TLS 1.3: a reset or alert at the first read)."""
    url = f"{base}/v2/models/{TASK}" + ("/infer" if infer else "")
    body = infer_body(np.full((1, 64), 0.5, np.float32), **(params or {})) if infer else None
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx, force_close=True),
                                     timeout=IO_TIMEOUT) as session:
        try:
            async with session.request("POST" if infer else "GET", url, data=body, headers=headers) as resp:
                data = await resp.read()
                return resp.status, (json.loads(data) if data else {})
        except (aiohttp.ClientConnectionError, ssl.SSLError):
            return HANDSHAKE, {}
