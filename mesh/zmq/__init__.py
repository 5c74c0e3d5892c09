"""Site-to-site transport over ZeroMQ (asyncio): a ROUTER server in front of a handler, and a DEALER
client that multiplexes many in-flight requests per peer, matching replies by request id.

Every request has a deadline, kept by each end on its own monotonic clock (the wire carries the
budget left, never an instant). The client fails a pending request with
``DeadlineExceeded`` when it passes, and fails all of a peer's pending requests with
``PeerUnavailable`` as soon as the peer is known dead (``fail_peer``, or the socket monitor's
disconnect / handshake-failure events): a CURVE-rejected or vanished peer otherwise just stays
silent. The server answers expired requests without calling the handler and turns every handler
failure into an error reply, so a caller always gets a ``MeshError`` subclass, never silence.
Every connection carries ZMTP heartbeats: a peer that goes silent without a reset is marked
unreachable by the client within a stated bound, routed around and probed back in
(:mod:`mesh.zmq.client`).

The data sockets do not go through ``zmq.asyncio`` but through :class:`mesh.zmq.pump.Pump`, which
drives them straight from the event loop; only the monitor uses ``zmq.asyncio``.

The parts:

    mesh.zmq.server   ZmqServer, Handler           the ROUTER end
    mesh.zmq.client   ZmqClient                    the DEALER end, one socket per peer
    mesh.zmq.base     SocketSecurity, Heartbeat    what both ends share (and their lifecycle state)
    mesh.zmq.pump     Pump                         the socket pump under both
    mesh.zmq.curve    CurveSecurity, SiteKeys      CURVE between sites, bound to the mesh CA (ZAP handler)
    mesh.zmq.sync     SyncZmqClient                the blocking client, for benchmarks
    mesh.zmq.protocol                              the wire codec (fast path)
    mesh.zmq.protocol_check                        the checked decoder the fast path falls back to
"""

from mesh.extras import require

require("agent", "zmq", "msgpack")
