"""The one room that talks to etcd (gRPC on grpclib; etcd's messages are its own, mesh.etcd.messages); a server
role's extra brings grpclib."""

from mesh.extras import require

require(("agent", "scheduler", "store"), "grpclib")
