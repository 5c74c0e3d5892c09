"""The one room that talks to etcd (gRPC on grpclib, etcd's messages from aetcd's package); a server role's extra
brings them."""

from mesh.extras import require

require(("agent", "scheduler", "store"), "aetcd", "grpclib")
