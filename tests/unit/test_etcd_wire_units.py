"""The pure parts of mesh.etcd.wire: etcd's prefix rule, and grpclib's, h2's and the socket's failures as the
``RpcError`` codes the store's failover reads."""

from __future__ import annotations

import pytest
from grpclib.exceptions import GRPCError, StreamTerminatedError

from mesh.etcd import messages as rpc
from mesh.etcd.channels import not_sent
from mesh.etcd.wire import RpcError, StatusCode, _errors, prefix_end

pytestmark = pytest.mark.unit


def test_prefix_end_is_etcds_rule() -> None:
    assert prefix_end(b"/tiermesh/") == b"/tiermesh0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"a\xff\xff") == b"b"
    assert prefix_end(b"\xff\xff") == b"\0"  # nothing above: every key from the prefix on
    assert prefix_end(b"") == b"\0"


def test_the_messages_are_etcds() -> None:
    # the full check against etcd's protos is tests/unit/test_etcd_messages.py
    req = rpc.RangeRequest(key=b"k", range_end=b"l", sort_order=rpc.RangeRequest.ASCEND)
    assert rpc.RangeRequest.FromString(req.SerializeToString()).key == b"k"
    assert rpc.Compare.EQUAL != rpc.Compare.GREATER and rpc.Event.DELETE != rpc.Event.PUT
    assert {"KV", "Lease", "Watch", "Auth"} <= set(rpc.SERVICES)


@pytest.mark.parametrize(("exc", "code"), [
    (GRPCError(StatusCode.PERMISSION_DENIED, "etcdserver: permission denied"), StatusCode.PERMISSION_DENIED),
    (GRPCError(StatusCode.UNAVAILABLE, "etcdserver: no leader"), StatusCode.UNAVAILABLE),
    (TimeoutError(), StatusCode.DEADLINE_EXCEEDED),
    (StreamTerminatedError("Connection lost"), StatusCode.UNAVAILABLE),
    (ConnectionResetError(104, "reset"), StatusCode.UNAVAILABLE),
])
def test_failures_become_status_codes(exc: BaseException, code: StatusCode) -> None:
    with pytest.raises(RpcError) as caught, _errors("127.0.0.1:2379"):
        raise exc
    assert caught.value.code() is code
    assert not not_sent(caught.value)  # it may have reached the member: a txn is not sent again


def test_other_errors_pass_through() -> None:
    with pytest.raises(ValueError), _errors("127.0.0.1:2379"):
        raise ValueError("a bug, not the wire")
