"""Which of the addresses a site's live record claims are believed: those its CA-signed certificate binds.

A live record (``live/<site>``) is written by the site itself, so a compromised site chooses every value in it. Two
of them are addresses others act on: ``endpoint`` (the ZeroMQ endpoint peers dial, with the CURVE key they expect
there) and ``http`` (the edge URL peers fetch blobs from and the console scrapes). Taken as written, a site could
cut another off by claiming that site's endpoint (peers dialled it there under the wrong identity, or not at all),
and make peers and the console fetch any URL it liked (SSRF). So a claim is believed only as far as the site's
certificate vouches for it (:func:`believe`):

    endpoint   ``tcp://HOST:PORT`` whose HOST the certificate names (an IP SAN for an IP, a DNS SAN for a name), or,
               when the certificate names no address of that kind, any HOST (a Kubernetes pod: its certificate
               names ``agent-<site>.tiermesh.svc``, its IP is assigned after issuance). Two live sites whose claims
               are the same endpoint are never dialled under each other's identity: a site whose certificate names
               the host keeps it against one whose certificate does not; otherwise the site dialled there before
               keeps it; otherwise (a fresh view, or co-located sites whose certificates name the same address)
               neither is dialled. Each conflict is logged, naming both.
    http       an ``https://HOST[:PORT]`` base URL (no user, path, query or fragment) whose HOST the certificate
               names, or, when it names no IP address, the IP of the site's own believed endpoint (the pod again).
               A DNS name it does not name is never used, nor plain ``http``: TLS must be able to prove the
               server is that site (:func:`server_site`, checked on the connection before its answer is used).

What remains: a compromised site whose certificate names no IP may claim the endpoint of another such site; neither
is then dialled (a denial of service, logged, ended by revoking it) rather than one dialled under the other's key.
Issuing certificates with the addresses the sites advertise (or advertising the DNS name the certificate holds)
closes it. A request may still *connect* to the host of a believed URL whose server is not that site (two sites
on one host): it is refused at the TLS layer or its answer is dropped, never attributed to the site.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from mesh.errors import PermissionDenied
from mesh.log import get_logger, kv

if TYPE_CHECKING:  # cryptography: only where certificates are read
    from cryptography import x509

    from mesh.pki.identity import Identity

__all__ = ["Believed", "Believer", "Claim", "SiteNames", "believe", "endpoint_host", "https_base",
           "response_ssl_object", "server_site"]

log = get_logger(__name__)
_WARNED_MAX = 1024  # refusals said once each; past this many distinct ones, no more are remembered (nor said)


def _ip(host: str) -> str | None:
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return None


def _dns(host: str) -> str:
    return host.lower().rstrip(".")


@dataclass(frozen=True, slots=True)
class SiteNames:
    """The IP addresses (normalised) and DNS names (lowercase, no trailing dot) a site certificate names."""

    ips: frozenset[str] = frozenset()
    dns: frozenset[str] = frozenset()

    @classmethod
    def of(cls, cert: x509.Certificate) -> SiteNames:
        """What ``cert``'s subject alternative names hold; ``ValueError`` for a malformed extension."""
        from cryptography import x509

        try:
            san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except x509.ExtensionNotFound:
            return cls()
        return cls(frozenset(str(ip) for ip in san.get_values_for_type(x509.IPAddress)),
                   frozenset(_dns(name) for name in san.get_values_for_type(x509.DNSName)))

    def names(self, host: str) -> bool:
        """Whether the certificate names ``host`` itself (an IP among its IP SANs, a name among its DNS SANs)."""
        ip = _ip(host)
        return ip in self.ips if ip is not None else _dns(host) in self.dns

    def allows(self, host: str) -> bool:
        """Whether a site may be *dialled* at ``host``: named, or the certificate names no address of its kind."""
        ip = _ip(host)
        if ip is not None:
            return not self.ips or ip in self.ips
        return not self.dns or _dns(host) in self.dns


@dataclass(frozen=True, slots=True)
class Claim:
    """What a live record claims: its ``endpoint`` and ``http``; ``dial``: where this process would dial the
    endpoint (a WAN-emulation proxy from the operator's peer map; None: the endpoint itself)."""

    endpoint: str | None
    http: str | None
    dial: str | None = None


@dataclass(frozen=True, slots=True)
class Believed:
    """What is believed of one site's claims: the endpoint to dial it at and the https base URL to use (None:
    refused), and why anything was refused (for a warning)."""

    endpoint: str | None
    http: str | None
    why: str | None = None


def endpoint_host(endpoint: object) -> str | None:
    """The host of a ``tcp://HOST:PORT`` endpoint (IPv6 without brackets), or None for anything else."""
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
        return None
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    return host.strip("[]") if sep and host and port.isdigit() else None


def https_base(url: object) -> str | None:
    """The host of ``url`` when it is an ``https://HOST[:PORT][/]`` base URL and nothing else, else None."""
    if not isinstance(url, str) or len(url) > 2048:
        return None
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  # raises ValueError for a port that is not one
    except ValueError:
        return None
    if (parts.scheme != "https" or not parts.hostname or parts.username is not None or parts.password is not None
            or parts.path not in ("", "/") or parts.query or parts.fragment):
        return None
    return parts.hostname


def believe(claims: Mapping[str, Claim], names: Mapping[str, SiteNames],
            previous: Mapping[str, str] | None = None) -> dict[str, Believed]:
    """What to believe of each live site's ``claims`` given the ``names`` its valid certificate binds (a site
    missing there has no valid certificate here: nothing of it is believed). ``previous``: dialled endpoint ->
    the site believed there before (it keeps the endpoint in a conflict no certificate settles). See the module."""
    before = previous or {}
    ok: dict[str, tuple[str, bool]] = {}  # site -> (where it would be dialled, its certificate names the host)
    why: dict[str, str] = {}
    for site, claim in claims.items():
        site_names = names.get(site)
        host = endpoint_host(claim.endpoint)
        if site_names is None:
            why[site] = "no valid certificate"
        elif host is None:
            why[site] = f"endpoint {str(claim.endpoint)[:80]!r} is not tcp://HOST:PORT"
        elif not site_names.allows(host):
            why[site] = f"its certificate does not name {host} (endpoint {claim.endpoint})"
        else:
            ok[site] = (claim.dial or str(claim.endpoint), site_names.names(host))
    by_endpoint: dict[str, list[str]] = {}
    for site, (dial, _) in ok.items():
        by_endpoint.setdefault(dial, []).append(site)
    dialled: dict[str, str] = {}
    for dial, sites in by_endpoint.items():
        named = [s for s in sites if ok[s][1]]
        owner = (sites[0] if len(sites) == 1 else named[0] if len(named) == 1
                 else before.get(dial) if before.get(dial) in (named or sites) else None)
        for site in sites:
            if site == owner:
                dialled[site] = dial
            else:
                others = sorted(s for s in sites if s != site)
                why[site] = f"endpoint {dial} is claimed by {', '.join(others)} too" + (
                    f" (kept by {owner})" if owner else " (neither dialled)")
    out: dict[str, Believed] = {}
    for site, claim in claims.items():
        http, site_names = claim.http, names.get(site)
        http_host = https_base(http) if http else None
        used: str | None = None
        if site_names is not None and http_host is not None:
            ip, own = _ip(http_host), endpoint_host(claim.endpoint) if site in dialled else None
            if site_names.names(http_host) or (ip is not None and not site_names.ips and own is not None
                                               and _ip(own) == ip):
                used = http
        if http and used is None and site not in why:
            why[site] = f"http {str(http)[:120]!r} is not an https URL on an address its certificate names"
        out[site] = Believed(dialled.get(site), used, why.get(site))
    return out


class Believer:
    """:func:`believe` over successive views for one process (``here``): it remembers which site held each
    endpoint (so the incumbent keeps it in a conflict no certificate settles) and says each refusal once."""

    def __init__(self, here: str) -> None:
        self.here = here
        self._owners: dict[str, str] = {}
        self._warned: set[tuple[str, str]] = set()

    def update(self, claims: Mapping[str, Claim], names: Mapping[str, SiteNames]) -> dict[str, Believed]:
        believed = believe(claims, names, self._owners)
        self._owners = {b.endpoint: site for site, b in believed.items() if b.endpoint is not None}
        for site, b in believed.items():
            if b.why is not None and (site, b.why) not in self._warned and len(self._warned) < _WARNED_MAX:
                self._warned.add((site, b.why))
                log.warning("%s: %s: not believed", site, b.why,
                            extra=kv(site=self.here, peer=site, event="peer_claim_refused"))
        return believed


def server_site(ssl_object: object, verify: Callable[[x509.Certificate], Identity]) -> str:
    """The site the TLS server behind ``ssl_object`` proves to be, by its certificate's URI SAN, with ``verify``
    (a trust store's check, raising ``Unauthenticated``); ``PermissionDenied`` for an identity that is not a site's."""
    from mesh.pki.verify import peer_certificate

    who = verify(peer_certificate(ssl_object))  # type: ignore[arg-type]  # an SSLObject, or None
    if who.kind != "site":
        raise PermissionDenied(f"the server is {who}, not a site", reason="wrong_kind")
    return who.name


def response_ssl_object(resp: Any) -> object | None:
    """The TLS object of the connection an ``aiohttp.ClientResponse`` came over (None: not TLS, or gone). aiohttp
    hands a connection back to its pool as soon as a small body has arrived, and ``resp.connection`` is None from
    then on, so the protocol the response was read from (kept on the response) is asked instead."""
    conn = getattr(resp, "connection", None)
    protocol = conn.protocol if conn is not None else getattr(resp, "_protocol", None)
    transport = getattr(protocol, "transport", None)
    return transport.get_extra_info("ssl_object") if transport is not None else None
