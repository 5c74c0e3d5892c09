"""The pure parts of mesh.etcd.wire: etcd's prefix rule, and grpclib's, h2's and the socket's failures as the
``RpcError`` codes the store's failover reads."""

from __future__ import annotations

import pytest
from grpclib.exceptions import GRPCError, StreamTerminatedError

from mesh.errors import StoreUnavailable
from mesh.etcd import messages as rpc
from mesh.etcd.channels import Channels, connection_lost, not_sent
from mesh.etcd.endpoints import EtcdEndpoints
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


def _lost(target: str) -> RpcError:
    with pytest.raises(RpcError) as caught, _errors(target):
        raise StreamTerminatedError("Connection lost")
    return caught.value


@pytest.mark.parametrize("idempotent", [True, False])
async def test_one_member_sends_an_idempotent_request_again_through_a_reset_connection(idempotent: bool) -> None:
    """A revocation's bound resets every connection to etcd: a read out at that moment is sent again (briefly),
    a write that may have been carried out is not."""
    members = Channels(EtcdEndpoints(("127.0.0.1:9",)))
    sent: list[float] = []

    async def call(_: object, attempt_s: float) -> str:
        sent.append(attempt_s)
        if len(sent) == 1:
            raise _lost("127.0.0.1:9")
        return "answer"

    try:
        if idempotent:
            assert await members.call("get", call, 2.0) == "answer" and len(sent) == 2
        else:
            with pytest.raises(StoreUnavailable, match=r"connection to 127\.0\.0\.1:9 lost"):
                await members.call("txn", call, 2.0, idempotent=False)
            assert len(sent) == 1
        assert connection_lost(_lost("x:1")) and not connection_lost(RpcError(StatusCode.UNAVAILABLE, "no leader"))
    finally:
        await members.close()
