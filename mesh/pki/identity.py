"""Who a certificate speaks for: an :class:`Identity` is a kind and a name, written in a certificate as its
single URI SAN ``spiffe://tiermesh/<kind>/<name>``.

Kinds: ``tenant`` (a caller of the inference API), ``site`` (an agent), ``admin`` (an operator), ``scheduler``,
``store`` (the variant store) and ``etcd`` (etcd's own certificate: its client and peer ports, and the CRL follower
beside it, an etcd client of ``pki/crl`` only). An ``etcd`` identity is for etcd alone: no tiermesh server admits
it as a caller (:data:`CALLER_KINDS`), so a stolen etcd key reads no blob and calls no edge.

Names follow one rule (:data:`NAME_RE`, the topology's rule for site and tenant names): lowercase letters,
digits and '-', at most 63 characters, not starting or ending with '-'. It is checked here and nowhere else:
an ``Identity`` that exists is valid.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, get_args

from mesh.errors import ConfigError

__all__ = ["CALLER_KINDS", "KINDS", "NAME_RE", "TRUST_DOMAIN", "Identity", "Kind"]

Kind = Literal["tenant", "site", "admin", "scheduler", "store", "etcd"]
KINDS: tuple[Kind, ...] = get_args(Kind)
# who a tiermesh server (an edge, the variant store, the console) admits as a caller at all: every kind but etcd's
CALLER_KINDS: tuple[Kind, ...] = tuple(k for k in KINDS if k != "etcd")
TRUST_DOMAIN = "tiermesh"
NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_PREFIX = f"spiffe://{TRUST_DOMAIN}/"


@dataclass(frozen=True, slots=True, order=True)
class Identity:
    kind: Kind
    name: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"unknown identity kind {self.kind!r}: one of {', '.join(KINDS)}")
        if not isinstance(self.name, str) or not NAME_RE.match(self.name):
            raise ConfigError(f"invalid {self.kind} name {self.name!r}: use lowercase letters, digits and '-' "
                              f"(at most 63, not starting or ending with '-')")

    @property
    def uri(self) -> str:
        return f"{_PREFIX}{self.kind}/{self.name}"

    @property
    def common_name(self) -> str:
        """The certificate's subject CN (etcd takes the CN as the user name under client-cert auth)."""
        return f"{self.kind}:{self.name}"

    @classmethod
    def from_uri(cls, uri: str) -> Identity:
        """Parse ``spiffe://tiermesh/<kind>/<name>`` exactly (no query, fragment, port or extra segments)."""
        if not isinstance(uri, str) or not uri.startswith(_PREFIX):
            raise ConfigError(f"not a tiermesh identity URI: {uri!r} (expected {_PREFIX}<kind>/<name>)")
        parts = uri[len(_PREFIX):].split("/")
        if len(parts) != 2:
            raise ConfigError(f"not a tiermesh identity URI: {uri!r} (expected {_PREFIX}<kind>/<name>)")
        kind, name = parts
        if kind not in KINDS:
            raise ConfigError(f"unknown identity kind {kind!r} in {uri!r}: one of {', '.join(KINDS)}")
        return cls(kind, name)  # type: ignore[arg-type]  # checked just above

    def __str__(self) -> str:
        return self.uri
