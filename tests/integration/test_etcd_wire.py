"""mesh.etcd.wire against a real etcd and a port nobody listens on: unary calls and streams answer, a member
that cannot be reached is ``UNAVAILABLE`` "failed to connect" (never sent, so the store may send even a txn
again), and a closed stream resets its HTTP/2 stream at once."""

from __future__ import annotations

import asyncio
import socket

import pytest

from mesh.etcd import messages as rpc
from mesh.etcd.channels import not_sent
from mesh.etcd.server import EmbeddedEtcd
from mesh.etcd.wire import RpcError, Service, StatusCode, WireChannel, prefix_end

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def _target(url: str) -> str:
    return url.split("://", 1)[1]


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_unary_and_watch_stream_on_a_real_member(etcd_server: EmbeddedEtcd) -> None:
    channel = WireChannel(_target(etcd_server.url), None)
    kv, watch = Service(channel, "KV"), Service(channel, "Watch")
    try:
        key = b"/wire-test/a"
        async with watch.Watch.open() as call:
            await call.send(rpc.WatchRequest(create_request=rpc.WatchCreateRequest(key=key,
                                                                                   range_end=prefix_end(key))))
            created = await asyncio.wait_for(call.recv(), 5.0)
            assert created.created
            put = await kv.Put(rpc.PutRequest(key=key, value=b"1"), timeout=5.0)
            assert put.header.revision > 0
            resp = await asyncio.wait_for(call.recv(), 5.0)
            assert [(e.kv.key, e.kv.value) for e in resp.events] == [(key, b"1")]
        got = await kv.Range(rpc.RangeRequest(key=key), timeout=5.0)
        assert [kv_.value for kv_ in got.kvs] == [b"1"]
        await kv.DeleteRange(rpc.DeleteRangeRequest(key=key), timeout=5.0)
    finally:
        channel.close()


async def test_an_unreachable_member_is_unavailable_and_never_sent() -> None:
    channel = WireChannel(f"127.0.0.1:{_dead_port()}", None)
    try:
        with pytest.raises(RpcError) as unary:
            await Service(channel, "KV").Range(rpc.RangeRequest(key=b"k"), timeout=2.0)
        assert unary.value.code() is StatusCode.UNAVAILABLE and not_sent(unary.value)
        with pytest.raises(RpcError) as stream:
            async with Service(channel, "Watch").Watch.open():
                pass
        assert stream.value.code() is StatusCode.UNAVAILABLE and not_sent(stream.value)
    finally:
        channel.close()


async def test_a_passed_timeout_is_deadline_exceeded(etcd_server: EmbeddedEtcd) -> None:
    channel = WireChannel(_target(etcd_server.url), None)
    try:
        with pytest.raises(RpcError) as caught:
            await Service(channel, "KV").Range(rpc.RangeRequest(key=b"k"), timeout=1e-6)
        assert caught.value.code() is StatusCode.DEADLINE_EXCEEDED
    finally:
        channel.close()
