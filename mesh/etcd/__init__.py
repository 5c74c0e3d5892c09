"""The one room that talks to etcd (aetcd, and gRPC for its TLS channels); a server role's extra brings them."""

from mesh.extras import require

require(("agent", "scheduler", "store"), "aetcd", "grpc")
