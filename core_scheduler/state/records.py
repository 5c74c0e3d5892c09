"""Every value a cluster view holds, from what etcd delivered to a record that cannot be invalid.

The view follows keys that other processes write, and a site may write its own ``live/<site>`` and
``pki/sites/<site>``, so a compromised one any bytes etcd takes. :func:`decode_record` is the one way in: it
turns a value (strict JSON, or the store's :class:`~mesh.etcd.store.Undecodable`) into the record of its key's
kind, or raises ``ProtocolError``, and nothing else, whatever the value holds. A short ``except (KeyError,
TypeError, ValueError)`` around each parser was how one ``Infinity`` (``OverflowError``) stopped the view.

    kind       key                       record
    site       topology/sites/<s>        topology.schema.Site: named as its key, a known tier, finite coordinates
    link       topology/links/<a>/<b>    Link: the key's ends, latency and jitter >= 0, bandwidth > 0
    tenant     tenants/<t>               Tenant: named as its key, a known isolation, quotas >= 0
    task       catalog/<t>/_task         TaskSignature of task <t> (variant_store.catalog.signature_from_json)
    variant    catalog/<t>/<v>           VariantMeta of task <t>, id <v> (VariantMeta.from_json)
    live       live/<s>                  Heartbeat of site <s> (Heartbeat.from_json)
    placement  placement/<s>             {"variants": [{"task", "variant_id"}, ...], and its scalar fields}
    service    services/<name>           a flat object of scalars (the variant store: url, site, pid)
    crl        pki/crl                   the list's PEM (verified by the trust stores, not here)
    site_cert  pki/sites/<s>             the certificate's PEM (verified by the site keys, not here)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from core_scheduler.state.heartbeat import Heartbeat
from mesh.errors import ProtocolError
from mesh.etcd.keys import KeyKind
from mesh.etcd.store import Undecodable
from mesh.pki.published import cert_pem_from_record
from mesh.types import TIERS
from topology.schema import ISOLATIONS, Link, Site, Tenant
from variant_store.catalog import signature_from_json
from variant_store.meta import VariantMeta

__all__ = ["decode_record"]

_MAX_TEXT = 4096
_MAX_FIELDS = 64  # of a flat record: a service announces a handful


def decode_record(kind: KeyKind, names: tuple[str, ...], value: Any) -> Any:
    """The record of ``value`` at a key of ``kind`` naming ``names`` (see the module's table); ``ProtocolError``
    for anything else, the only error this raises."""
    if isinstance(value, Undecodable):
        raise ProtocolError(f"{kind} value is no JSON: {value.reason}")
    try:
        return _DECODERS[kind](names, value)
    except Exception as exc:  # untrusted data: RecursionError, OverflowError... are as likely as ValueError
        raise ProtocolError(f"bad {kind} value: {type(exc).__name__}: {str(exc)[:200]}") from exc


def _need(ok: bool, why: str) -> None:
    if not ok:
        raise ValueError(why)


def _object(value: Any) -> dict[str, Any]:
    _need(isinstance(value, dict), f"an object expected, not a {type(value).__name__}")
    return value


def _finite(*numbers: float) -> bool:
    return all(math.isfinite(x) for x in numbers)


def _scalar(value: Any) -> bool:
    if isinstance(value, str):
        return len(value) <= _MAX_TEXT
    if isinstance(value, float):
        return math.isfinite(value)
    return value is None or (isinstance(value, bool | int) and abs(value) <= 2**63)


def _site(names: tuple[str, ...], value: Any) -> Site:
    d = _object(value)
    _need(d.get("name") == names[0], "a site is named as its key")
    site = Site.from_dict(d)
    hw = site.hardware
    _need(site.tier in TIERS, f"a site's tier is one of {TIERS}")
    _need(_finite(site.lat, site.lon, hw.price_per_hour) and hw.price_per_hour >= 0, "finite coordinates and price")
    _need(hw.cpu_cores >= 0 and hw.memory_mb >= 0 and all(g.memory_mb >= 0 for g in hw.gpus), "no negative size")
    return site


def _link(names: tuple[str, ...], value: Any) -> Link:
    link = Link.from_dict(_object(value))
    _need(link.ends == tuple(names), "a link joins the sites its key names")
    _need(_finite(link.latency_ms, link.bandwidth_mbps, link.jitter_ms), "finite latency, bandwidth and jitter")
    _need(link.latency_ms >= 0 and link.jitter_ms >= 0 and link.bandwidth_mbps > 0,
          "latency and jitter >= 0, bandwidth > 0")  # a negative weight fails every shortest path
    return link


def _tenant(names: tuple[str, ...], value: Any) -> Tenant:
    d = _object(value)
    _need(d.get("name") == names[0], "a tenant is named as its key")
    _need(isinstance(d.get("quotas", {}), dict), "quotas are an object")
    tenant = Tenant.from_dict(d)
    _need(tenant.isolation in ISOLATIONS, f"a tenant's isolation is one of {ISOLATIONS}")
    _need(all(_finite(q) and q >= 0 for q in tenant.quotas.values()), "quotas are finite and >= 0")
    return tenant


def _task(names: tuple[str, ...], value: Any) -> Any:
    sig = signature_from_json(value)
    _need(sig.task == names[0], "a signature is its key's task's")
    return sig


def _variant(names: tuple[str, ...], value: Any) -> VariantMeta:
    meta = VariantMeta.from_json(value)
    _need((meta.task, meta.variant_id) == names, "a variant entry is its key's task's and id's")
    return meta


def _placement(names: tuple[str, ...], value: Any) -> dict[str, Any]:
    d = _object(value)
    _need(d.get("site", names[0]) == names[0], "a placement is its key's site's")
    variants = d.get("variants")
    if not isinstance(variants, list):
        raise ValueError("a placement lists its variants")
    wanted = []
    for v in variants:
        _need(isinstance(v, dict) and _scalar(v.get("task")) and isinstance(v.get("task"), str)
              and isinstance(v.get("variant_id"), str) and _scalar(v["variant_id"]), "a variant is a task and an id")
        wanted.append({"task": v["task"], "variant_id": v["variant_id"]})
    return {**{k: x for k, x in d.items() if k != "variants" and _scalar(x)}, "variants": wanted}


def _service(names: tuple[str, ...], value: Any) -> dict[str, Any]:
    d = _object(value)
    _need(len(d) <= _MAX_FIELDS and all(_scalar(x) for x in d.values()), "a service record is flat")
    _need(all(isinstance(d.get(k, ""), str) for k in ("url", "site")), "a service's url and site are strings")
    return d


def _crl(names: tuple[str, ...], value: Any) -> bytes:
    from mesh.pki.crl import crl_pem_from_record  # cryptography: only once a mesh publishes one

    return crl_pem_from_record(value)


def _site_cert(names: tuple[str, ...], value: Any) -> bytes:
    return cert_pem_from_record(value)


def _live(names: tuple[str, ...], value: Any) -> Heartbeat:
    return Heartbeat.from_json(value, site=names[0])


_DECODERS: dict[KeyKind, Callable[[tuple[str, ...], Any], Any]] = {
    "site": _site, "link": _link, "tenant": _tenant, "task": _task, "variant": _variant, "live": _live,
    "placement": _placement, "service": _service, "crl": _crl, "site_cert": _site_cert,
}
