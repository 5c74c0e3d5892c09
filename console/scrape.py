"""The console's HTTP client to the agents: ``/metrics`` and decision traces from each site's edge API, over
HTTPS with the console's admin certificate (plain HTTP when the mesh runs ``--insecure``).

Each call has a short timeout and reports failure as a value, never an exception: one dead or slow agent
must not hold up the view of the others.

Which URL is a site's (:meth:`Scraper.targets`): a site writes its own live record, so its ``http`` is believed
only as far as its certificate vouches for it (:func:`mesh.pki.site_names.believe`: https, on an address the
certificate names), never a URL of the site's choosing (SSRF through the console); and each answer is used only
from a server that proves to be that site (its certificate's URI SAN). The certificates are the ones the sites
publish at etcd ``pki/sites/``, believed when the CA this client's TLS trusts signed them for that site. An
``--insecure`` console (no TLS) has nothing to check a URL by and takes them as written.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp

from console.digest import Sample, SiteMetrics, digest, parse_samples
from mesh.errors import MeshError
from mesh.lifecycle import Service
from mesh.pki.site_names import Believer, Claim, SiteNames, response_ssl_object, server_site

if TYPE_CHECKING:  # cryptography: a secured console only
    from cryptography import x509

    from mesh.pki.identity import Identity, Kind

__all__ = ["Scrape", "Scraper"]

_TRACE_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:")
_SITE: tuple[Kind, ...] = ("site",)
T = TypeVar("T")
_RECHECK_S = 30.0  # a published certificate believed is verified again this often (it expires without changing)


class _NotThatSite(Exception):
    """The server behind a site's URL proved to be someone else (or nobody)."""


def _context_ca(ctx: ssl.SSLContext) -> x509.Certificate | None:
    """The CA certificate ``ctx`` verifies servers with (the mesh CA: ``ReloadingCredentials`` loads exactly one)."""
    from cryptography import x509

    cas = ctx.get_ca_certs(binary_form=True)
    return x509.load_der_x509_certificate(cas[0]) if len(cas) == 1 else None


@dataclass(frozen=True, slots=True)
class Scrape:
    """One site's ``/metrics`` answer: ``metrics`` when it parsed; ``reachable`` False when the connection
    failed (refused, reset, timed out); ``error`` says what went wrong (a 404 means an agent without metrics)."""

    site: str
    at: float                      # monotonic
    reachable: bool
    metrics: SiteMetrics | None = None
    error: str | None = None


class Scraper(Service):
    def __init__(self, ssl_context: ssl.SSLContext | None, *, timeout_s: float = 1.5) -> None:
        self.ssl_context = ssl_context
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._ca = _context_ca(ssl_context) if ssl_context is not None else None
        self._believer = Believer("console")
        self._names: dict[str, tuple[bytes, SiteNames | None, float]] = {}  # site -> (PEM, its names, checked at)

    # -- which URL is a site's -------------------------------------------------------------------------------------
    def targets(self, live: Mapping[str, Any], certs: Mapping[str, bytes]) -> dict[str, str]:
        """site -> the edge URL to scrape, from the live records (``endpoint``, ``http``) and the site
        certificates published in etcd (``certs``: site -> PEM). See the module docstring."""
        if self.ssl_context is None:  # --insecure: no certificates to check a URL by
            return {n: hb.http for n, hb in live.items() if getattr(hb, "http", None)}
        claims = {n: Claim(getattr(hb, "endpoint", None), getattr(hb, "http", None)) for n, hb in live.items()}
        names = {n: found for n in claims if (found := self._site_names(n, certs.get(n))) is not None}
        return {n: b.http for n, b in self._believer.update(claims, names).items() if b.http is not None}

    def _site_names(self, site: str, pem: bytes | None) -> SiteNames | None:
        """The addresses ``site``'s published certificate binds, if the CA signed it for ``site``."""
        if pem is None or self._ca is None:
            return None
        now = time.monotonic()
        held = self._names.get(site)
        if held is not None and held[0] == pem and now - held[2] < _RECHECK_S:
            return held[1]
        from mesh.pki.verify import load_certificate

        try:
            cert = load_certificate(pem)
            found = SiteNames.of(cert) if self._verify_site(cert).name == site else None
        except (MeshError, ValueError):
            found = None
        self._names[site] = (pem, found, now)
        return found

    def _verify_site(self, cert: x509.Certificate) -> Identity:
        from mesh.pki.verify import verify_certificate

        assert self._ca is not None
        return verify_certificate(cert, ca=self._ca, crl=None, use="server", kinds=_SITE)

    def _check_server(self, resp: aiohttp.ClientResponse, site: str) -> None:
        """With TLS, the server that answered must prove to be ``site``; ``_NotThatSite`` if it does not."""
        if self.ssl_context is None:
            return
        if self._ca is None:
            raise _NotThatSite("no mesh CA to check the server by")
        try:
            proved = server_site(response_ssl_object(resp), self._verify_site)
        except MeshError as exc:
            raise _NotThatSite(str(exc)) from exc
        if proved != site:
            raise _NotThatSite(f"the server is site {proved}, not {site}")

    async def _start(self) -> None:
        connector = aiohttp.TCPConnector(ssl=self.ssl_context if self.ssl_context is not None else False,
                                         limit_per_host=2)
        self._session = aiohttp.ClientSession(connector=connector, timeout=self.timeout)

    async def _stop(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("Scraper is not started")
        return self._session

    async def metrics_text(self, site: str, base_url: str) -> tuple[str | None, str | None]:
        """``site``'s ``/metrics`` text as it sent it (checked to come from that site), or None and why not. For
        views that read families the digest leaves out (``console.cascades``)."""
        try:
            async with self.session.get(f"{base_url.rstrip('/')}/metrics", allow_redirects=False) as resp:
                self._check_server(resp, site)
                body = await resp.text()
                if resp.status != 200:
                    return None, f"HTTP {resp.status}"
        except _NotThatSite as exc:
            return None, f"not {site}: {exc}"[:200]
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return None, f"{type(exc).__name__}: {exc}"[:200]
        return body, None

    async def read_all(self, urls: Mapping[str, str], read: Callable[[list[Sample]], T]
                       ) -> tuple[dict[str, T], dict[str, str]]:
        """Every site's ``/metrics`` (asked at once, each bounded by the timeout), parsed and given to ``read``; and
        the sites that did not answer, with why. For views of families the digest leaves out (cascades, versions)."""
        async def one(site: str) -> tuple[T | None, str]:
            text, error = await self.metrics_text(site, urls[site])
            if text is None:
                return None, error or "no answer"
            try:
                return read(parse_samples(text)), ""
            except ValueError as exc:
                return None, f"unparseable metrics: {exc}"[:200]

        names = sorted(urls)
        got = await asyncio.gather(*(one(n) for n in names))
        ok = {n: value for n, (value, _) in zip(names, got, strict=True) if value is not None}
        return ok, {n: error for n, (value, error) in zip(names, got, strict=True) if value is None}

    async def metrics(self, site: str, base_url: str) -> Scrape:
        now = time.monotonic()
        body, error = await self.metrics_text(site, base_url)
        if body is None:
            return Scrape(site, now, error is not None and error.startswith("HTTP "), error=error)
        try:
            return Scrape(site, now, True, metrics=digest(parse_samples(body)))
        except ValueError as exc:
            return Scrape(site, now, True, error=f"unparseable metrics: {exc}"[:200])

    async def _json(self, site: str, url: str) -> tuple[int, Any]:
        try:
            async with self.session.get(url, allow_redirects=False) as resp:
                self._check_server(resp, site)
                if resp.status != 200:
                    return resp.status, None
                return 200, await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, _NotThatSite):
            return 0, None

    async def trace(self, request_id: str, sites: dict[str, str]) -> tuple[str, dict[str, Any]] | None:
        """The trace of ``request_id`` from whichever agent answered it (each is asked at once):
        ``(site, trace)``, or None when no agent holds it."""
        if not request_id or len(request_id) > 128 or not set(request_id) <= _TRACE_ID_CHARS:
            raise ValueError(f"not a request id: {request_id[:40]!r}")
        names = sorted(sites)
        answers = await asyncio.gather(*(self._json(n, f"{sites[n].rstrip('/')}/v2/traces/{request_id}")
                                         for n in names))
        for name, (status, body) in zip(names, answers, strict=True):
            if status == 200 and isinstance(body, dict) and isinstance(body.get("hops"), list):
                return name, body
        return None

    async def recent_traces(self, sites: dict[str, str], limit: int = 20) -> list[dict[str, Any]]:
        """Trace summaries from every agent (``GET /v2/traces?limit=N``), each tagged with its ``site``."""
        names = sorted(sites)
        answers = await asyncio.gather(*(self._json(n, f"{sites[n].rstrip('/')}/v2/traces?limit={limit}")
                                         for n in names))
        out: list[dict[str, Any]] = []
        for name, (status, body) in zip(names, answers, strict=True):
            items = body.get("traces") if isinstance(body, dict) else body
            if status == 200 and isinstance(items, list):
                out.extend({**t, "site": t.get("site", name)} for t in items if isinstance(t, dict))
        out.sort(key=lambda t: -float(t.get("at_unix") or t.get("ts") or 0))
        return out[:limit]
