"""Where etcd is and how to speak to it: the endpoints of a cluster and the TLS files, checked once.

``parse_endpoints`` is the one door for etcd addresses (the CLI's ``--etcd URL[,URL...]``, the
``TIERMESH_ETCD`` setting, ``Store.connect``): it returns an :class:`EtcdEndpoints` that cannot be
invalid, or raises ``ConfigError`` saying what is wrong. It reads the certificate files here, so a
missing or unreadable file is reported at start-up rather than as a TLS failure later.

This module does not import the etcd client or gRPC.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from mesh.errors import ConfigError

__all__ = ["EtcdEndpoints", "TLSFiles", "parse_endpoints", "split_urls"]

DEFAULT_PORT = 2379


@dataclass(frozen=True)
class TLSFiles:
    """PEM bytes read from the files given: the CA that signed the etcd members' certificates,
    and optionally this client's certificate and key (etcd with ``--client-cert-auth``)."""

    ca: bytes
    cert: bytes | None = None
    key: bytes | None = None
    ca_path: str = ""

    @property
    def client_auth(self) -> bool:
        return self.cert is not None


@dataclass(frozen=True)
class EtcdEndpoints:
    """The members of one etcd cluster as ``host:port`` targets, in the order given, and the TLS
    material when the URLs are ``https://``."""

    targets: tuple[str, ...]
    tls: TLSFiles | None = None

    @property
    def urls(self) -> tuple[str, ...]:
        scheme = "https" if self.tls is not None else "http"
        return tuple(f"{scheme}://{t}" for t in self.targets)

    def __str__(self) -> str:
        return ",".join(self.urls)


def split_urls(urls: str | Sequence[str] | None) -> list[str]:
    """``"a,b"``, ``["a", "b,c"]`` -> ``["a", "b", "c"]`` (blanks dropped)."""
    if urls is None:
        return []
    items = [urls] if isinstance(urls, str) else list(urls)
    return [u.strip() for item in items for u in str(item).split(",") if u.strip()]


def _read(path: str | Path | None, what: str) -> bytes | None:
    if path is None or str(path) == "":
        return None
    p = Path(path).expanduser()
    try:
        data = p.read_bytes()
    except FileNotFoundError as exc:
        raise ConfigError(f"etcd {what} file not found: {p}") from exc
    except OSError as exc:
        raise ConfigError(f"etcd {what} file {p} cannot be read: {exc.strerror or exc}") from exc
    if b"-----BEGIN" not in data:
        raise ConfigError(f"etcd {what} file {p} is not PEM (no '-----BEGIN' line)")
    return data


def _target(url: str) -> tuple[str, str]:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https"):
        raise ConfigError(f"etcd URL {url!r}: scheme must be http:// or https://")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"etcd URL {url!r}: expected scheme://host:port and nothing after it")
    try:
        host, port = parts.hostname, parts.port or DEFAULT_PORT
    except ValueError as exc:
        raise ConfigError(f"etcd URL {url!r}: {exc}") from exc
    if not host:
        raise ConfigError(f"etcd URL {url!r}: no host")
    return parts.scheme, (f"[{host}]:{port}" if ":" in host else f"{host}:{port}")


def parse_endpoints(urls: str | Sequence[str] | EtcdEndpoints | None, *, ca: str | Path | None = None,
                    cert: str | Path | None = None, key: str | Path | None = None) -> EtcdEndpoints:
    """Check and read the etcd URLs (a list, or comma-separated) and TLS files.

    All URLs use one scheme. ``https://`` needs ``ca``; ``cert`` and ``key`` come together, and only
    with ``https://``. Raises ``ConfigError`` naming the problem."""
    if isinstance(urls, EtcdEndpoints):
        if ca is not None or cert is not None or key is not None:
            raise ConfigError("TLS files are given twice: in the EtcdEndpoints and as arguments")
        return urls
    items = split_urls(urls)
    if not items:
        raise ConfigError("no etcd URL given (expected http[s]://host:port[,http[s]://host:port...])")
    parsed = [_target(u) for u in items]
    schemes = {s for s, _ in parsed}
    if len(schemes) > 1:
        raise ConfigError(f"etcd URLs mix http:// and https://: {','.join(items)}")
    targets = tuple(dict.fromkeys(t for _, t in parsed))  # order kept, duplicates dropped
    if (cert is None) != (key is None):
        given, missing = ("--etcd-cert", "--etcd-key") if key is None else ("--etcd-key", "--etcd-cert")
        raise ConfigError(f"etcd client certificate needs both files: {given} given without {missing}")
    if schemes == {"http"}:
        if ca is not None or cert is not None:
            raise ConfigError("etcd TLS files given but the etcd URLs are http://; use https:// URLs")
        return EtcdEndpoints(targets)
    if ca is None:
        raise ConfigError("https:// etcd URLs need the CA certificate that signed the members' "
                          "certificates (--etcd-ca FILE / TIERMESH_ETCD_CA)")
    ca_pem = _read(ca, "CA")
    assert ca_pem is not None
    tls = TLSFiles(ca=ca_pem, cert=_read(cert, "client certificate"), key=_read(key, "client key"),
                   ca_path=str(ca))
    return EtcdEndpoints(targets, tls)
