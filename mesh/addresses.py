"""Bind and advertised addresses, in one place.

A server *binds* to one address (what the kernel listens on: ``127.0.0.1``, a host's interface
address, or a wildcard ``0.0.0.0`` / ``::``) and *advertises* another (what peers dial: it goes
into the live record and the variant store's announcement). The two differ behind NAT, in
containers, or whenever the bind address is a wildcard, which no peer can dial: so a wildcard
bind needs an explicit advertised address, and :func:`advertised_host` refuses without one.

IPv6 hosts are written in brackets inside URLs and ZeroMQ endpoints (``tcp://[::1]:5555``,
``http://[::1]:8080``); :func:`host_for_url` does that, and only that.
"""

from __future__ import annotations

import ipaddress

from mesh.errors import ConfigError

__all__ = ["DEFAULT_BIND", "advertised_host", "host_for_url", "http_url", "is_wildcard",
           "normalise_host", "tcp_endpoint"]

DEFAULT_BIND = "127.0.0.1"


def normalise_host(host: str, what: str = "address") -> str:
    """``host`` without brackets or surrounding blanks; a clear error when it is empty or has a port."""
    h = host.strip()
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    if not h:
        raise ConfigError(f"{what} is empty")
    try:
        return str(ipaddress.ip_address(h))
    except ValueError:
        pass
    if ":" in h or "/" in h or " " in h:
        raise ConfigError(f"{what} {host!r} is neither an IP address nor a host name "
                          f"(give the port separately, without brackets or a scheme)")
    return h


def is_wildcard(host: str) -> bool:
    """True for the any-address of either family (``0.0.0.0``, ``::``)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def advertised_host(bind: str, advertise: str | None) -> str:
    """What peers should dial: ``advertise`` when given, else the bind address. A wildcard bind
    without ``advertise`` is refused: ``0.0.0.0`` in a live record would send peers to themselves."""
    b = normalise_host(bind, "bind address")
    if advertise is not None and advertise.strip():
        a = normalise_host(advertise, "advertised address")
        if is_wildcard(a):
            raise ConfigError(f"advertised address {advertise!r} is a wildcard: peers cannot dial it; "
                              f"give the address they should use (--advertise HOST / TIERMESH_ADVERTISE)")
        return a
    if is_wildcard(b):
        raise ConfigError(f"bind address {bind!r} listens on every interface, so it cannot be advertised: "
                          f"say what peers should dial with --advertise HOST (or TIERMESH_ADVERTISE)")
    return b


def host_for_url(host: str) -> str:
    """``host`` as it appears in a URL or a ZeroMQ endpoint: IPv6 literals in brackets."""
    h = host.strip("[]")
    try:
        if ipaddress.ip_address(h).version == 6:
            return f"[{h}]"
    except ValueError:
        pass
    return h


def tcp_endpoint(host: str, port: int) -> str:
    """A ZeroMQ TCP endpoint: ``tcp://host:port`` (``tcp://[v6]:port``)."""
    return f"tcp://{host_for_url(host)}:{port}"


def http_url(host: str, port: int) -> str:
    """An HTTP base URL: ``http://host:port`` (``http://[v6]:port``)."""
    return f"http://{host_for_url(host)}:{port}"
