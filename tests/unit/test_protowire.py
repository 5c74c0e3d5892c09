"""mesh.protowire on untrusted bytes: whatever they are, decoding gives a message or raises ``DecodeError`` and
nothing else (fuzzed with hypothesis over etcd's messages and the Open Inference Protocol's); the cases the
issue named (a truncated varint, a bad wire type, a length past the end; varints masked to 64 bits); and a reply
from etcd that does not decode is an ``RpcError`` the store fails over on."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mesh.errors import ProtocolError
from mesh.etcd import messages as rpc
from mesh.etcd.channels import FAILOVER_CODES, not_sent
from mesh.etcd.wire import RpcError, StatusCode, _errors
from mesh.protowire import DecodeError, Message, fields
from mesh.v2 import grpc_messages as oip

pytestmark = pytest.mark.unit


def _classes(module: object) -> list[type[Message]]:
    return [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, Message) and c is not Message]


ALL = _classes(rpc) + _classes(oip)


class Probe(Message):
    FIELDS = fields((1, "n", "int64"), (2, "u", "uint64"), (3, "s", "string"), (4, "i32", "int32"),
                    (5, "d", "double"), (6, "f", "float", True), (7, "sub", "message", False, "Probe"))


def _decode(cls: type[Message], data: bytes) -> None:
    try:
        cls.FromString(data)
    except DecodeError as exc:
        assert isinstance(exc, ProtocolError) and exc.code == "protocol"


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=200), which=st.integers(min_value=0))
def test_arbitrary_bytes_raise_only_decode_error(data: bytes, which: int) -> None:
    _decode(ALL[which % len(ALL)], data)
    _decode(Probe, data)


@settings(max_examples=200, deadline=None)
@given(prefix=st.binary(max_size=40), cut=st.integers(min_value=0, max_value=200))
def test_truncated_valid_messages_raise_only_decode_error(prefix: bytes, cut: int) -> None:
    # a real message, cut anywhere, with junk before it
    msg = oip.ModelInferRequest(model_name="digits", id="r1", parameters=oip.entries({"latency_ms": 20.5, "x": 3}),
                                inputs=[oip.InferInputTensor(name="x", datatype="FP32", shape=[1, 2],
                                                             contents=oip.InferTensorContents(fp32_contents=[1, 2]))],
                                raw_input_contents=[b"\x00" * 8])
    data = msg.SerializeToString()
    _decode(oip.ModelInferRequest, prefix + data[:cut])
    assert oip.ModelInferRequest.FromString(data) == msg


@pytest.mark.parametrize(("data", "words"), [
    (b"\x08", "truncated varint"),                       # field 1, varint, and nothing after the tag
    (b"\x08\xff\xff", "truncated varint"),                # a varint the data ends inside
    (b"\x80", "truncated varint"),                        # a tag the data ends inside
    (b"\x08" + b"\xff" * 10 + b"\x01", "longer than 10"),  # eleven bytes
    (b"\x1a\x05ab", "declares 5 bytes"),                  # a length past the end
    (b"\x1a\x80\x80\x80\x80\x10", "declares"),            # a huge length
    (b"\x0b", "wire type 3"),                             # start group
    (b"\x0c", "wire type 4"),
    (b"\x0e", "wire type 6"),
    (b"\x0f", "wire type 7"),
    (b"\x00\x00", "field number 0"),
    (b"\x29\x00\x00", "truncated"),                       # a double that ends early
    (b"\x1a\x02\xc3\x28", "UTF-8"),                       # a string that is no UTF-8
    (b"\x32\x03\x00\x00\x00", "no whole floats"),         # packed floats, 3 bytes
])
def test_each_malformation_is_a_decode_error(data: bytes, words: str) -> None:
    with pytest.raises(DecodeError) as info:
        Probe.FromString(data)
    assert words in str(info.value)


def test_varints_are_masked_to_64_bits() -> None:
    # a 10-byte varint carries 70 bits; protobuf keeps the low 64
    ten = b"\xff" * 9 + b"\x7f"
    msg = Probe.FromString(b"\x08" + ten + b"\x10" + ten + b"\x20" + ten)
    assert msg.n == -1 and msg.u == (1 << 64) - 1 and msg.i32 == -1
    assert Probe(n=-1).SerializeToString() == b"\x08" + b"\xff" * 9 + b"\x01"
    assert Probe.FromString(Probe(u=(1 << 64) - 1, n=-(1 << 63)).SerializeToString()) == Probe(u=(1 << 64) - 1,
                                                                                           n=-(1 << 63))


def test_doubles_floats_and_nesting_round_trip() -> None:
    msg = Probe(d=-2.5, f=[1.5, -0.25], sub=Probe(s="é", i32=-7))
    assert Probe.FromString(msg.SerializeToString()) == msg


def test_deep_nesting_is_a_decode_error() -> None:
    # RequestOp holds a TxnRequest that holds RequestOps: nested past the interpreter's stack
    data = b""
    for _ in range(3000):
        data = b"\x12" + _len(data) + data  # TxnRequest.success = RequestOp(...)
        data = b"\x22" + _len(data) + data  # RequestOp.request_txn = TxnRequest(...)
    with pytest.raises(DecodeError, match="nested too deep"):
        rpc.RequestOp.FromString(data)


def _len(data: bytes) -> bytes:
    out, n = bytearray(), len(data)
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def test_an_undecodable_reply_fails_over_like_a_dead_member() -> None:
    with pytest.raises(RpcError) as caught, _errors("10.0.0.1:2379"):
        rpc.RangeResponse.FromString(b"\x08")
    assert caught.value.code() == StatusCode.UNAVAILABLE and caught.value.code() in FAILOVER_CODES
    assert "undecodable reply" in caught.value.details()
    assert not not_sent(caught.value)  # the request reached the member: a txn is not sent again
