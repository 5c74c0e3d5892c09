"""Issue 29, item 1: one bad etcd value must not stop the control plane.

A site may write its own ``live/<site>`` and ``pki/sites/<site>``, so a compromised one can put any bytes there.
These tests hold the readers to their contract: the typed records refuse anything malformed with ``ValueError``
alone (never ``OverflowError``, ``RecursionError``, ``TypeError``...), the strict JSON decode of etcd bytes with
``ProtocolError`` alone, and a view given a bad value keeps the last good one of that key, whatever its kind.

``HOSTILE`` (raw bytes by name), :func:`hostile_bytes` (a seeded generator of more), ``GOOD`` (a good value of
every kind) and :func:`good_view` are shared with the other tests of the same issue.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core_scheduler.state.heartbeat import Heartbeat, LoadedVariant
from core_scheduler.state.view import MeshView
from mesh.etcd.keys import (
    PKI_CRL,
    link_key,
    live_key,
    placement_key,
    site_cert_key,
    site_key,
    task_key,
    tenant_key,
)
from mesh.types import TaskSignature, TensorSpec
from topology.schema import Hardware, Link, Site, Tenant
from variant_store.catalog import signature_from_json, signature_to_json
from variant_store.meta import LatencyStats, Profile, VariantMeta

pytestmark = pytest.mark.unit

_PEM = "-----BEGIN CERTIFICATE-----\nMIIBfake\n-----END CERTIFICATE-----"


def _deep(opening: bytes, closing: bytes, n: int, inner: bytes = b"") -> bytes:
    return opening * n + inner + closing * n


# Raw values as a compromised site could write them; each is refused by a strict reader.
HOSTILE: dict[str, bytes] = {
    "infinity": b'{"schema": 1, "capacity": Infinity}',
    "nan": b'{"capacity": NaN, "ts": NaN}',
    "minus-infinity": b'{"ts": -Infinity}',
    "float-overflow": b'{"capacity": 1e400, "ts": 1e999}',
    "huge-int": b'{"ts": 1' + b"0" * 400 + b"}",
    "int-past-int64": b'{"inflight": 1' + b"0" * 30 + b"}",
    "too-many-digits": b'{"capacity": ' + b"9" * 5000 + b"}",
    "deep-list": _deep(b"[", b"]", 100_000),
    "deep-object": _deep(b'{"a":', b"}", 50_000, b"1"),
    "nested-past-limit": b'{"loaded": ' + _deep(b"[", b"]", 500) + b"}",
    "not-utf8": b"\xff\xfe\xfd\xfc",
    "not-utf8-in-string": b'{"gpu_note": "\xc3\x28"}',
    "utf16-json": '{"capacity": 1}'.encode("utf-16"),
    "lone-surrogate": b'{"endpoint": "tcp://\\udc80:1"}',
    "huge-string": b'{"gpu_note": "' + b"x" * 1_000_000 + b'"}',
    "truncated": b'{"capacity": 1',
    "garbage": b"\x00garbage",
    "empty": b"",
    # strict JSON, but no record of any kind
    "null": b"null",
    "list": b"[1, 2, 3]",
    "wrong-types": b'{"capacity": "lots", "loaded": [], "gpu": "yes"}',
}
# the names of HOSTILE that are strict JSON (the store hands them over; the records refuse them)
STRICT_JSON = {"huge-string", "null", "list", "wrong-types"}

# Values that are strict JSON but the wrong shape for the record at the key.
WRONG_SHAPES: dict[str, Any] = {
    "list": [1, 2, 3],
    "string": "a string",
    "number": 42,
    "bool-fields": {"schema": True, "capacity": True, "inflight": False, "gpu": "yes"},
    "object-for-string": {"hardware_class": {"x": 1}, "endpoint": ["tcp://x:1"], "tier": 7},
    "wrong-container": {"loaded": [], "demand": {}, "peer_rtt_ms": [1.0], "profiles": "p"},
    "negative": {"capacity": -5, "inflight": -1, "memory_used_bytes": -100, "ts": -1.0},
    "loaded-wrong": {"loaded": {"v": {"task": ["t"], "queue_ms": "slow"}}},
    "demand-bool": {"demand": [{"task": "t", "slo_class": "c", "qps": True, "budget_ms": 1, "min_accuracy": 0}]},
    "profile-keys": {"profiles": {"v": {"p50_ms": {"one": 1.0}}}},
    "profile-huge-batch": {"profiles": {"v": {"p50_ms": {"9" * 40: 1.0}}}},
    "long-text": {"gpu_note": "x" * 100_000, "endpoint": "tcp://" + "y" * 100_000},
    "many-keys": {"peer_rtt_ms": {f"p{i}": 1.0 for i in range(20_000)}, "zzz": 1},
    "other-site": {"site": "someone-else"},
    "newer-schema": {"schema": 2**40},
    "pem-huge": {"schema": 1, "pem": _PEM + "x" * 100_000},
    "pem-two": {"schema": 1, "pem": _PEM + "\n" + _PEM},
    "pem-not-string": {"schema": 1, "pem": {"a": 1}},
}


def _python_hostile() -> dict[str, Any]:
    """Hostile values as a lenient JSON decoder hands them over (what a reader of Python objects may meet)."""
    deep: Any = 1
    for _ in range(5_000):
        deep = [deep]
    return {"inf": {"capacity": math.inf, "ts": math.inf}, "nan": {"capacity": math.nan, "inflight": math.nan},
            "big-int": {"ts": 10**400, "capacity": 10**400}, "deep": {"loaded": {"v": deep}, "demand": deep},
            **WRONG_SHAPES}


def hostile_bytes(rng: random.Random) -> bytes:
    """One more hostile value: a known one, a heartbeat with a poisoned field, or random noise over one. Each is a
    heartbeat a reader must refuse (the base record carries two defects no single edit mends: a heartbeat that is
    well formed but lies is another test's); as a certificate record some are well formed, with a PEM no one signed."""
    roll = rng.random()
    if roll < 0.3:
        name = rng.choice(sorted(HOSTILE))
        return HOSTILE[name] if len(HOSTILE[name]) < 300_000 or rng.random() < 0.2 else HOSTILE["nan"]
    if roll < 0.8:
        doc = json.dumps(_base_doc(rng))
        poison = rng.choice(["Infinity", "-Infinity", "NaN", "1e400", "1" + "0" * rng.randint(20, 500),
                             '"' + "x" * rng.randint(1, 5000) + '"', "[" * 60 + "]" * 60, "{}", "[]", "null",
                             "true", '"\\ud800"', '{"a": ' * 40 + "1" + "}" * 40])
        field = rng.choice(["capacity", "inflight", "ts", "queue_ms", "qps", "memory_used_bytes", "schema",
                            "tier", "endpoint", "loaded", "demand", "peer_rtt_ms", "pem", "cpu_cap"])
        needle = f'"{field}": '
        at = doc.find(needle)
        if at < 0:
            return doc[:-1].encode() + f', "{field}": {poison}}}'.encode()
        end = at + len(needle)
        depth, i = 0, end
        while i < len(doc):  # skip the field's old value: up to the next ',' or '}' at its level
            c = doc[i]
            if c in "[{":
                depth += 1
            elif c in "]}":
                if depth == 0:
                    break
                depth -= 1
            elif c == "," and depth == 0:
                break
            i += 1
        return (doc[:end] + poison + doc[i:]).encode()
    noise = bytearray(json.dumps(_base_doc(rng)).encode())
    for _ in range(rng.randint(1, 8)):  # flipped, dropped and inserted bytes
        at = rng.randrange(len(noise))
        op = rng.random()
        if op < 0.4:
            noise[at] = rng.randrange(256)
        elif op < 0.7:
            del noise[at]
        else:
            noise[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
    return bytes(noise)


def _base_doc(rng: random.Random) -> dict[str, Any]:
    """A heartbeat (and a certificate record) with two defects: a negative count, a profiled batch of 0 (read
    last, so a poisoned field before it is what a reader meets first)."""
    return {"schema": 1, "capacity": rng.randint(1, 64), "inflight": -1, "ts": 1.7e9,
            "tier": "edge", "endpoint": "tcp://127.0.0.1:1", "cpu_cap": 0.5,
            "loaded": {"v": {"task": "t", "queue_ms": rng.random() * 10}},
            "demand": [{"task": "t", "slo_class": "c", "tenant": "public", "qps": 1.0, "budget_ms": 20.0,
                        "min_accuracy": 0.9}],
            "peer_rtt_ms": {"p": 1.0}, "memory_used_bytes": 10, "pem": _PEM,
            "profiles": {"v": {"p50_ms": {"0": 1.0}}}}


# -- the typed records: ValueError only ------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(_python_hostile()))
def test_a_heartbeat_refuses_hostile_records_with_value_error_alone(name: str) -> None:
    value = _python_hostile()[name]
    if name in ("many-keys", "pem-huge", "pem-two", "pem-not-string"):
        assert Heartbeat.from_json(value, site="s").site == "s"  # well formed (unknown fields are dropped): taken
        return
    with pytest.raises(ValueError):  # the contract is the type, not the words
        Heartbeat.from_json(value, site="s")


def _meta() -> VariantMeta:
    prof = Profile(hardware_class="cpu", load_ms=5.0, latency={1: LatencyStats(1.0, 2.0)}, peak_memory_bytes=1 << 20)
    return VariantMeta(task="t", family="f", variant_id="t.v1", format="onnx", precision="fp32",
                       runtime="onnxruntime", blob_digest="ab" * 32, size_bytes=1 << 20, accuracy=0.97,
                       inputs=[{"name": "x", "dtype": "float32", "shape": [-1, 4]}], profiles={"cpu": prof})


_META_POISON: dict[str, Any] = {
    "accuracy": math.inf, "size_bytes": 10**400, "batch_sizes": [0, math.nan], "format": {"x": 1},
    "precision": "fp64", "profiles": {"cpu": {"latency": {"1": {"p50_ms": math.inf, "p99_ms": 1.0}}}},
    "inputs": "x", "task": ["t"], "owner": None, "unknown_field": 1, "schema": math.nan,
}


@pytest.mark.parametrize("field", sorted(_META_POISON))
def test_variant_metadata_refuses_a_poisoned_field_with_value_error_alone(field: str) -> None:
    good = _meta().to_json()
    assert VariantMeta.from_json(good) == _meta()
    if field == "unknown_field":  # a newer writer's field: dropped, not fatal
        assert VariantMeta.from_json({**good, field: 1}) == _meta()
        return
    bad = {**good, field: _META_POISON[field]}
    if field == "profiles":
        bad["profiles"] = {"cpu": {**good["profiles"]["cpu"], **_META_POISON["profiles"]["cpu"]}}
    with pytest.raises(ValueError):
        VariantMeta.from_json(bad)


@pytest.mark.parametrize("bad", [
    None, [], {"task": "t"}, {"task": "t", "inputs": "x", "outputs": []},
    {"task": "t", "inputs": [{"name": "x", "dtype": "float32", "shape": [math.inf]}], "outputs": []},
    {"task": "t", "inputs": [{"name": "x", "dtype": "float32", "shape": [10**400]}], "outputs": []},
    {"task": "t", "inputs": [{"name": "x", "dtype": "no-such-dtype", "shape": [-1]}], "outputs": []},
    {"task": {"a": 1}, "inputs": [], "outputs": []},
])
def test_a_task_signature_refuses_hostile_values_with_value_error_alone(bad: Any) -> None:
    with pytest.raises(ValueError):
        signature_from_json(bad)


# -- the view: a bad value is ignored, the last good one kept ---------------------------------------------------

_SIG = TaskSignature("t", (TensorSpec("x", "float32", (-1, 4)),), (TensorSpec("y", "float32", (-1, 10)),))
_SITES = {"c": Site("c", "core", "r", 0.0, 0.0, Hardware(cpu_cores=4, memory_mb=8192)),
          "e": Site("e", "edge", "r", 0.0, 0.0, Hardware(cpu_cores=4, memory_mb=8192))}
GOOD: dict[str, Any] = {
    site_key("e"): _SITES["e"].to_dict(),
    site_key("c"): _SITES["c"].to_dict(),
    link_key("c", "e"): Link("c", "e", 2.0, 100.0).to_dict(),
    tenant_key("acme"): Tenant("acme", "shared", {"qps": 10.0}).to_dict(),
    task_key("t"): signature_to_json(_SIG),
    "catalog/t/t.v1": _meta().to_json(),
    live_key("e"): Heartbeat(site="e", endpoint="tcp://e:1", capacity=4,
                             loaded={"t.v1": LoadedVariant(task="t", queue_ms=1.0)}).to_json(),
    placement_key("e"): {"schema": 1, "site": "e", "variants": [{"task": "t", "variant_id": "t.v1"}]},
    "services/variant-store": {"url": "https://store:1", "site": "c"},
    PKI_CRL: {"schema": 1, "pem": "-----BEGIN X509 CRL-----\nfake\n-----END X509 CRL-----"},
    site_cert_key("e"): {"schema": 1, "pem": _PEM},
}


def _held(view: MeshView) -> dict[str, Any]:
    """Everything the view holds, comparable."""
    return {"sites": dict(view.sites), "links": dict(view.links), "tenants": dict(view.tenants),
            "signatures": dict(view.signatures), "variants": {t: dict(v) for t, v in view.variants.items()},
            "live": dict(view.live), "placement": dict(view.placement), "services": dict(view.services),
            "crl": view.crl, "site_certs": dict(view.site_certs), "topology": view.topology}


def good_view() -> MeshView:
    view = MeshView(cast(Any, None), "e")
    for rev, (key, value) in enumerate(GOOD.items(), start=1):
        view._apply(key, value, rev)
    assert view.topology is not None and set(view.topology.sites) == {"c", "e"}
    return view


# the part of the view each key kind lives in
_SLOT = {"topology/sites/": "sites", "topology/links/": "links", "tenants/": "tenants", "catalog/t/_task": "signatures",
         "catalog/": "variants", "live/": "live", "placement/": "placement", "services/": "services",
         PKI_CRL: "crl", "pki/sites/": "site_certs"}
# bad at every kind of key
_NEVER_GOOD = {"inf", "nan", "big-int", "deep", "list", "string", "number"}


def _slot(key: str) -> str:
    return next(slot for prefix, slot in _SLOT.items() if key.startswith(prefix))


@pytest.mark.parametrize("key", sorted(GOOD))
@pytest.mark.parametrize("name", sorted(_python_hostile()))
def test_the_view_keeps_the_last_good_value_of_a_key_given_a_bad_one(key: str, name: str) -> None:
    view = good_view()
    before = _held(view)
    view._apply(key, _python_hostile()[name], 100)  # never raises
    after = _held(view)
    changed = {k for k in after if after[k] != before[k]} - {"topology"}
    # a value well formed for its kind (a big heartbeat, a service record) is the key's new value; nothing else moves
    assert changed <= ({_slot(key)} if name not in _NEVER_GOOD else set()), (key, name, changed)
    assert view.topology is not None and set(view.topology.sites) == {"c", "e"}


async def test_a_deleted_key_goes_even_when_its_last_value_was_refused() -> None:
    view = good_view()
    view._apply(live_key("e"), {"capacity": math.inf}, 100)
    assert "e" in view.live
    view._apply(live_key("e"), None, 101)
    assert "e" not in view.live
    await asyncio.sleep(0)


# -- property: any value at any key, never a crash ---------------------------------------------------------------

_json_like = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
    | st.sampled_from([10**400, -(10**30), math.inf, -math.inf, math.nan, "\ud800"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["site", "schema", "capacity", "inflight", "loaded", "demand", "task", "qps", "pem",
                         "variants", "variant_id", "name", "tier", "hardware", "coordinates", "a", "b",
                         "latency_ms", "bandwidth_mbps", "quotas", "profiles", "p50_ms", "inputs", "outputs",
                         "shape", "dtype", "url", "ts", "queue_ms", "peer_rtt_ms", "gpus", "cpu_cores"]),
        inner, max_size=6),
    max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(key=st.sampled_from(sorted(GOOD)), value=_json_like.filter(lambda v: v is not None))  # None: a delete
def test_any_value_at_any_key_leaves_the_view_whole(key: str, value: Any) -> None:
    view = good_view()
    view._apply(key, value, 100)
    assert view.topology is not None and set(view.topology.sites) == {"c", "e"}


def test_the_generator_makes_varied_heartbeats_a_reader_refuses() -> None:
    from mesh.errors import ProtocolError
    from mesh.etcd.store import decode_json  # here: the rest of this file runs on a tree without it

    rng = random.Random(29)
    made = [hostile_bytes(rng) for _ in range(300)]
    assert len(set(made)) > 200
    for raw in made:
        try:
            value = decode_json(raw)
        except ProtocolError:
            continue
        with pytest.raises(ValueError):
            Heartbeat.from_json(value, site="s")
