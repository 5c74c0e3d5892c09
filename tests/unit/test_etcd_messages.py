"""mesh.etcd.messages (on mesh.protowire) against etcd's own protos: every field's number, type and
cardinality as protobuf generates them (aetcd ships etcd 3.5's ``rpc.proto``, ``kv.proto`` and ``auth.proto``
compiled; a dev dependency), every service method's types, and bytes that protobuf reads back as we meant them
and that we read back from protobuf.

The generated modules are loaded from aetcd's package without running its ``__init__`` (which imports grpcio)."""

from __future__ import annotations

import importlib.util
import random
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from mesh.etcd import messages as rpc
from mesh.protowire import Field, Message

pytestmark = pytest.mark.unit

pb = pytest.importorskip("google.protobuf.descriptor")
FD = pb.FieldDescriptor
_KIND = {FD.TYPE_INT64: "int64", FD.TYPE_UINT64: "uint64", FD.TYPE_INT32: "int32", FD.TYPE_ENUM: "enum",
         FD.TYPE_BOOL: "bool", FD.TYPE_BYTES: "bytes", FD.TYPE_STRING: "string", FD.TYPE_MESSAGE: "message"}


def _generated() -> dict[str, Any]:
    spec = importlib.util.find_spec("aetcd")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("aetcd (etcd's generated protos) not installed")
    name = "tests_etcd_pb"
    if name not in sys.modules:
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(Path(next(iter(spec.submodule_search_locations))) / "rpc")]
        sys.modules[name] = pkg
    mods = [importlib.import_module(f"{name}.{m}") for m in ("auth_pb2", "kv_pb2", "rpc_pb2")]
    out: dict[str, Any] = {n: getattr(m, n) for m in mods for n in dir(m) if not n.startswith("_")}
    out["DESCRIPTOR"] = mods[-1].DESCRIPTOR
    return out


def message_class(name: str) -> type[Message]:
    cls: type[Message] = getattr(rpc, name)
    return cls


GEN = _generated()
OURS = sorted(n for n, c in vars(rpc).items()
              if isinstance(c, type) and issubclass(c, Message) and c is not Message)


def _label_repeated(f: Any) -> bool:
    rep = getattr(f, "is_repeated", None)  # protobuf >= 6 (label is deprecated there); a property or a method
    if rep is None:
        return bool(f.label == FD.LABEL_REPEATED)
    return bool(rep() if callable(rep) else rep)


@pytest.mark.parametrize("name", OURS)
def test_every_field_is_etcds(name: str) -> None:
    desc = GEN[name].DESCRIPTOR
    ours = message_class(name)
    theirs = {f.name: f for f in desc.fields}
    assert [f.name for f in ours.FIELDS] == [f.name for f in desc.fields], f"{name}: not etcd's fields"
    for f in ours.FIELDS:
        t = theirs[f.name]
        assert f.number == t.number, (name, f.name)
        assert f.kind == _KIND[t.type], (name, f.name)
        assert f.repeated == _label_repeated(t), (name, f.name)
        if f.kind == "message":
            assert f.message == t.message_type.name, (name, f.name)
        real_oneof = t.containing_oneof is not None and not t.containing_oneof.name.startswith("_")
        assert bool(f.oneof) == real_oneof and (not f.oneof or f.oneof == t.containing_oneof.name), (name, f.name)


@pytest.mark.parametrize("name", OURS)
def test_every_enum_value_is_etcds(name: str) -> None:
    desc = GEN[name].DESCRIPTOR
    for enum in desc.enum_types:
        for v in enum.values:
            if hasattr(message_class(name), v.name):
                assert getattr(message_class(name), v.name) == v.number, (name, v.name)


def test_every_method_is_etcds() -> None:
    services = GEN["DESCRIPTOR"].services_by_name
    for service, methods in rpc.SERVICES.items():
        desc = services[service]
        assert desc.full_name == f"{rpc.PACKAGE}.{service}"
        for method, (req, reply, streaming) in methods.items():
            m = desc.methods_by_name[method]
            assert (m.input_type.name, m.output_type.name) == (req, reply), method
            assert streaming == (m.client_streaming or m.server_streaming), method


def _random(cls: type[Message], rng: random.Random, depth: int = 0) -> Message:
    values: dict[str, Any] = {}
    oneofs: dict[str, list[Field]] = {}
    for f in cls.FIELDS:
        if f.oneof:
            oneofs.setdefault(f.oneof, []).append(f)
            continue
        if rng.random() < 0.3:
            continue
        values[f.name] = ([_value(f, rng, depth) for _ in range(rng.randint(1, 3))] if f.repeated
                          else _value(f, rng, depth))
    for group in oneofs.values():  # one member of each oneof, zero included
        f = rng.choice(group)
        if f.kind != "message" or depth < 3:
            values[f.name] = _value(f, rng, depth, zero_ok=True)
    return cls(**values)


def _value(f: Field, rng: random.Random, depth: int, zero_ok: bool = False) -> Any:
    if f.kind == "message":
        return _random(message_class(f.message), rng, depth + 1)
    if f.kind == "bool":
        return rng.random() < 0.5 or (not zero_ok and True)
    if f.kind == "bytes":
        return bytes(rng.randrange(256) for _ in range(rng.randint(0 if zero_ok else 1, 40)))
    if f.kind == "string":
        return "".join(rng.choice("abcé/\\\"\u00fc\U0001f600") for _ in range(rng.randint(1, 12)))
    if f.kind == "uint64":
        return rng.choice([1, 127, 128, 2**32, 2**64 - 1, rng.randrange(1, 2**64)])
    if f.kind == "enum":
        return rng.randint(0, 2)
    bound = 2**31 if f.kind == "int32" else 2**63
    pick = rng.choice([0 if zero_ok else 1, -1, 1, 300, -(bound), bound - 1, rng.randrange(-bound, bound)])
    return pick or 1 if not zero_ok else pick


def _same(ours: Any, theirs: Any, cls: type[Message]) -> None:
    for f in cls.FIELDS:
        a = getattr(ours, f.name)
        if f.repeated:
            b = list(getattr(theirs, f.name))
            assert len(a) == len(b), f.name
            for x, y in zip(a, b, strict=True):
                if f.kind == "message":
                    _same(x, y, message_class(f.message))
                else:
                    assert x == y, f.name
        elif f.kind == "message" or f.oneof:
            present = theirs.HasField(f.name)
            assert (a is not None) == present, f.name
            if present and f.kind == "message":
                _same(a, getattr(theirs, f.name), message_class(f.message))
            elif present:
                assert a == getattr(theirs, f.name), f.name
        else:
            assert a == getattr(theirs, f.name), f.name


@pytest.mark.parametrize("name", OURS)
def test_bytes_round_trip_through_protobuf(name: str) -> None:
    cls, gen = message_class(name), GEN[name]
    rng = random.Random(name)
    for _ in range(40):
        msg = _random(cls, rng)
        data = msg.SerializeToString()
        theirs = gen.FromString(data)                 # protobuf reads what we wrote
        _same(msg, theirs, cls)
        assert cls.FromString(theirs.SerializeToString()) == msg  # and we read what protobuf wrote
        assert cls.FromString(data) == msg


def test_zero_scalars_are_not_written_but_set_oneof_members_are() -> None:
    assert rpc.RangeRequest(key=b"", limit=0).SerializeToString() == b""
    cmp = rpc.Compare(key=b"k", result=rpc.Compare.EQUAL, target=rpc.Compare.MOD, mod_revision=0)
    assert GEN["Compare"].FromString(cmp.SerializeToString()).HasField("mod_revision")
    assert rpc.Compare.FromString(cmp.SerializeToString()).mod_revision == 0
    assert rpc.Compare(key=b"k").mod_revision is None


def test_unknown_fields_are_skipped_and_bad_bytes_refused() -> None:
    resp = GEN["RangeResponse"](count=3, more=True)
    resp.kvs.add(key=b"a", value=b"1", mod_revision=7)
    resp.header.revision = 9
    data = resp.SerializeToString() + b"\xa8\x1f\x05" + b"\xb2\x1f\x02hi" + b"\xb9\x1f" + bytes(8)  # 501, 502, 503
    ours = rpc.RangeResponse.FromString(data)
    assert (ours.count, ours.more, ours.header.revision, ours.kvs[0].key, ours.kvs[0].mod_revision) == \
        (3, True, 9, b"a", 7)
    with pytest.raises(ValueError):
        rpc.RangeResponse.FromString(data[:-3])
    with pytest.raises(TypeError, match="no field"):
        rpc.RangeRequest(nonsense=1)
