"""Job notification webhooks (issue 32 item 4): which URLs a tenant's jobs may notify, and what became of a delivery.

A job's notification goes only to a URL under one of the prefixes the operator listed for the job's tenant in the
topology (``tenants[].webhooks``): never to a URL a caller chose alone, which would let any tenant make the mesh
POST to whatever it can reach from inside (SSRF). The check runs twice, on the same pure functions: at the door
when the job is submitted (``edge_agent.jobs_api``) and at send time on the scheduler leader
(``core_scheduler.job_notify``), since the operator may have removed the prefix meanwhile.

Rules (one place, so the door, the topology loader and the sender never disagree):

- a prefix is ``https://host[:port]/path/``: scheme https only; no userinfo, query or fragment; the port defaults
  to 443; a host is a lowercase DNS name or an IP literal;
- a notify URL is the same, and may carry a query (never a fragment or userinfo);
- a URL is under a prefix when scheme, host and port are equal and its path starts with the prefix's path at a
  segment boundary (``/hooks`` admits ``/hooks`` and ``/hooks/x``, never ``/hooks-evil``);
- paths are refused rather than normalised when they could mean two things: ``.`` or ``..`` segments, ``//``,
  backslashes, percent-encoded ``/``, ``\\``, ``.`` or NUL, malformed escapes, control characters or spaces.

:func:`parse_prefix` and :func:`parse_target` raise :class:`ValueError` (a message that says what is wrong) and
nothing else whatever the text; the canonical text of a parsed URL (:meth:`WebhookUrl.text`) is what is stored and
what is sent to, so the URL checked is the URL used.

:class:`NotifyOutcome` is the record of a finished delivery (``mesh.etcd.keys.job_notify_key``), read back as
hostile input (``ProtocolError`` only).
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, get_args

from mesh.errors import ProtocolError

__all__ = ["MAX_URL", "NotifyOutcome", "NotifyState", "WebhookUrl", "allowed_target", "parse_prefix",
           "parse_target", "under"]

MAX_URL = 2048
NotifyState = Literal["delivered", "failed"]
_NOTIFY_STATES: tuple[str, ...] = get_args(NotifyState)
_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_PATH_CHARS = re.compile(r"^[A-Za-z0-9\-._~!$&'()*+,;=:@/%]*$")
_QUERY_CHARS = re.compile(r"^[A-Za-z0-9\-._~!$&'()*+,;=:@/?%]*$")
_ESCAPE = re.compile(r"%(.{0,2})")
_FORBIDDEN_ESCAPES = frozenset({"2f", "5c", "2e", "00"})


@dataclass(frozen=True, slots=True)
class WebhookUrl:
    """A checked https URL: ``host`` lowercase (an IPv6 literal without brackets), ``path`` starting with ``/``."""

    host: str
    port: int
    path: str
    query: str = ""

    @property
    def netloc(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == 443 else f"{host}:{self.port}"

    @property
    def text(self) -> str:
        """The canonical form: what is stored, compared and sent to."""
        return f"https://{self.netloc}{self.path}" + (f"?{self.query}" if self.query else "")


def _host(raw: str) -> str:
    if "%" in raw:
        raise ValueError("a host may not hold '%' (an escape or an IPv6 zone)")
    if raw.startswith("["):
        if not raw.endswith("]"):
            raise ValueError("an IPv6 host is written in brackets")
        try:
            return str(ipaddress.IPv6Address(raw[1:-1]))
        except ValueError as exc:
            raise ValueError(f"{raw[:60]!r} is not an IPv6 address") from exc
    host = raw.lower()
    if not host:
        raise ValueError("the URL names no host")
    if re.fullmatch(r"[0-9.]+", host):
        try:
            return str(ipaddress.IPv4Address(host))
        except ValueError as exc:
            raise ValueError(f"{raw[:60]!r} is not an IPv4 address") from exc
    labels = host.split(".")
    if len(host) > 253 or not all(_LABEL.match(label) for label in labels):
        raise ValueError(f"host {raw[:60]!r} is not a DNS name (lowercase letters, digits, '-' and '.'; no "
                         f"trailing dot)")
    return host


def _path(raw: str) -> str:
    path = raw or "/"
    if not path.startswith("/"):
        raise ValueError("the path must start with '/'")
    if not _PATH_CHARS.match(path):
        raise ValueError("the path holds characters a URL path may not (spaces, control characters, backslashes, "
                         "'#' ...): percent-encode them")
    for m in _ESCAPE.finditer(path):
        code = m.group(1).lower()
        if not re.fullmatch(r"[0-9a-f]{2}", code):
            raise ValueError("the path holds a malformed percent-escape")
        if code in _FORBIDDEN_ESCAPES:
            raise ValueError(f"the path holds an encoded {bytes.fromhex(code).decode()!r} (%{code.upper()}): "
                             f"a receiver might decode it into another path")
    segments = path.split("/")[1:]
    if any(s in (".", "..") for s in segments):
        raise ValueError("the path holds a '.' or '..' segment")
    if "" in segments[:-1]:
        raise ValueError("the path holds an empty segment ('//')")
    return path


def _parse(text: Any, *, what: str, query_ok: bool) -> WebhookUrl:
    if not isinstance(text, str):
        raise ValueError(f"a {what} is a string, not {type(text).__name__}")
    if not text or len(text) > MAX_URL:
        raise ValueError(f"a {what} is 1 to {MAX_URL} characters long")
    if not text.isascii() or any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in text):
        raise ValueError(f"a {what} holds only printable ASCII, without spaces")
    scheme, sep, rest = text.partition("://")
    if not sep or scheme.lower() != "https":
        raise ValueError(f"a {what} must be an https:// URL, got {text[:60]!r}")
    if "#" in rest:
        raise ValueError(f"a {what} may not hold a fragment ('#')")
    if "\\" in rest:
        raise ValueError(f"a {what} may not hold a backslash")
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    netloc, tail = rest[:cut], rest[cut:]
    path, qsep, query = tail.partition("?")
    if "@" in netloc:
        raise ValueError(f"a {what} may not hold a user name or password ('@' before the host)")
    if qsep and not query_ok:
        raise ValueError(f"a {what} may not hold a query ('?')")
    if query and not _QUERY_CHARS.match(query):
        raise ValueError(f"the query of a {what} holds characters a URL may not")
    m = re.fullmatch(r"(\[[^\]]*\]|[^:\[\]]*)(?::([0-9]{1,5}))?", netloc)
    if m is None:
        raise ValueError(f"a {what} has a malformed host or port: {netloc[:60]!r}")
    port = int(m.group(2)) if m.group(2) is not None else 443
    if not 1 <= port <= 65535:
        raise ValueError(f"a {what} has port {port}, outside 1..65535")
    try:
        return WebhookUrl(host=_host(m.group(1)), port=port, path=_path(path), query=query)
    except ValueError as exc:
        raise ValueError(f"{what} {text[:80]!r}: {exc}") from None


def parse_prefix(text: Any) -> WebhookUrl:
    """An allowed destination as the operator writes it in the topology (no query)."""
    return _parse(text, what="webhook prefix", query_ok=False)


def parse_target(text: Any) -> WebhookUrl:
    """A job's notify URL (a query is allowed: a receiver may route on it)."""
    return _parse(text, what="notify URL", query_ok=True)


def under(url: WebhookUrl, prefix: WebhookUrl) -> bool:
    """Whether ``url`` is under ``prefix``: same host and port, path below the prefix's at a segment boundary."""
    if (url.host, url.port) != (prefix.host, prefix.port):
        return False
    p = prefix.path
    if p.endswith("/"):
        return url.path.startswith(p)
    return url.path == p or url.path.startswith(p + "/")


def allowed_target(text: Any, prefixes: Iterable[str], tenant: str) -> WebhookUrl:
    """``text`` as a notify URL under one of ``prefixes`` (the tenant's, from the topology); ``ValueError`` saying
    why not. A prefix that does not parse admits nothing (the loader refuses it; etcd is not trusted to)."""
    url = parse_target(text)
    allowed = []
    for raw in prefixes:
        try:
            allowed.append(parse_prefix(raw))
        except ValueError:
            continue
    if not allowed:
        raise ValueError(f"notify URL refused: tenant {tenant!r} has no webhook destinations allowed in the topology "
                         f"(tenants[].webhooks): an operator must list one")
    if not any(under(url, p) for p in allowed):
        raise ValueError(f"notify URL {url.text!r} is not under a webhook prefix the operator allowed for tenant "
                         f"{tenant!r} ({', '.join(p.text for p in allowed)})")
    return url


@dataclass(frozen=True, slots=True)
class NotifyOutcome:
    """What became of a job's notification: ``delivered`` (the receiver answered 2xx) or ``failed`` (every attempt
    failed, or the URL was no longer allowed; ``error`` says why). ``at``: epoch seconds of the last attempt;
    ``status``: the receiver's last HTTP status (0: none, e.g. the connection was refused)."""

    state: NotifyState
    attempts: int
    at: float
    status: int = 0
    error: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"schema": 1, "state": self.state, "attempts": self.attempts, "at": self.at, "status": self.status,
                "error": self.error}

    @classmethod
    def from_json(cls, value: Any) -> NotifyOutcome:
        try:
            if not isinstance(value, dict) or value.get("schema") != 1:
                raise ValueError("not a schema-1 object")
            state, attempts, at = value.get("state"), value.get("attempts"), value.get("at")
            status, error = value.get("status", 0), value.get("error", "")
            if state not in _NOTIFY_STATES:
                raise ValueError("unknown state")
            if isinstance(attempts, bool) or not isinstance(attempts, int) or not 0 <= attempts <= 1000:
                raise ValueError("attempts is not a count")
            if isinstance(at, bool) or not isinstance(at, int | float) or not (math.isfinite(at) and 0 <= at <= 1e11):
                raise ValueError("at is not a time")
            if isinstance(status, bool) or not isinstance(status, int) or not 0 <= status <= 999:
                raise ValueError("status is not an HTTP status")
            if not isinstance(error, str):
                raise ValueError("error is not text")
        except ValueError as exc:
            raise ProtocolError(f"notify record: {exc}") from exc
        return cls(state=state, attempts=attempts, at=float(at), status=status, error=error[:2000])
