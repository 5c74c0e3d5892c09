"""What an agent's view hands its ``SiteKeys``: the site certificates as published in etcd ``pki/sites/``. Tests of
the CURVE layer alone (no etcd) take them from the operator's PKI instead; what etcd delivers them is tested with a
real etcd in the agent's integration and system tests."""

from __future__ import annotations

from mesh.pki.local import LocalPki

__all__ = ["published_certs"]


def published_certs(pki: LocalPki, *, skip: tuple[str, ...] = ()) -> dict[str, bytes]:
    """site -> PEM of every site certificate the operator's PKI holds (as each site would publish its own)."""
    sites = pki.paths.root / "sites"
    return {p.name[:-4]: p.read_bytes() for p in sorted(sites.glob("*.pem"))
            if not p.name.endswith("-key.pem") and p.name[:-4] not in skip}
