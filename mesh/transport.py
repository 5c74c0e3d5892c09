"""Site-to-site transport over ZeroMQ (asyncio): a ROUTER server in front of a handler, and a DEALER
client that multiplexes many in-flight requests per peer, matching replies by request id.

Every request has an absolute deadline. The client fails a pending request with
``DeadlineExceeded`` when it passes, and fails all of a peer's pending requests with
``PeerUnavailable`` as soon as the peer is known dead (``fail_peer``, or the socket monitor's
disconnect / handshake-failure events): a CURVE-rejected or vanished peer otherwise just stays
silent. The server answers expired requests without calling the handler and turns every handler
failure into an error reply, so a caller always gets a ``MeshError`` subclass, never silence.

The data sockets do not go through ``zmq.asyncio`` but through :class:`mesh.zmqio.Pump`, which
drives them straight from the event loop; only the monitor uses ``zmq.asyncio``.

This module is the public import path; the parts live next to it:

    mesh.zmqserver   ZmqServer, Handler           the ROUTER end
    mesh.zmqclient   ZmqClient                    the DEALER end, one socket per peer
    mesh.zmqbase     SocketSecurity               what both ends share (and their lifecycle state)
    mesh.zmqio       Pump                         the socket pump under both
    mesh.zmqsync     SyncZmqClient                the blocking client, for benchmarks
"""

from __future__ import annotations

from mesh.zmqbase import SocketSecurity
from mesh.zmqclient import ZmqClient
from mesh.zmqserver import Handler, ZmqServer
from mesh.zmqsync import SyncZmqClient  # re-exported: its home before the split

__all__ = ["Handler", "SocketSecurity", "SyncZmqClient", "ZmqClient", "ZmqServer"]
