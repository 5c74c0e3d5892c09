"""The admin web console, served by the scheduler process (any replica): a live map of the mesh, placements and
events, per-tenant SLO attainment, decision traces and the topology, for admins only.

It reads etcd (through ``core_scheduler.state``) and scrapes the agents' ``/metrics`` and traces over their edge
APIs; it imports nothing of ``edge_agent``. Its front end (``static/``) ships its vendored libraries with their
licences (``scripts/vendor_console.sh`` re-creates them), so it needs no network and no Node.

    digest     Prometheus text -> samples (prometheus_client's parser) -> per-site metrics (pure)
    scrape     the agents' HTTP client                state    etcd + scrapes -> one snapshot, every tick
    auth       the admin gate (certificate or token)  app      routes, server-sent events
    server     ConsoleServer: the service a scheduler process runs
"""

from console.server import ConsoleConfig, ConsoleServer, new_token

__all__ = ["ConsoleConfig", "ConsoleServer", "new_token"]
