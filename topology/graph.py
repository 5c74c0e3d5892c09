"""Network model of a topology: shortest paths by latency, bottleneck bandwidth, transfer time.

Single pairs go through networkx (Dijkstra); the all-pairs table for the vectorised routing
policy goes through ``scipy.sparse.csgraph``, which is an order of magnitude faster in bulk.
Link latencies are one-way milliseconds; ``rtt_ms`` doubles them.
"""

from __future__ import annotations

import math
from itertools import pairwise
from typing import TYPE_CHECKING

import networkx as nx
import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import shortest_path

from mesh.errors import NoRoute

if TYPE_CHECKING:
    from topology.schema import Topology

__all__ = ["TopologyGraph"]


class TopologyGraph:
    """Read-only graph view of a :class:`~topology.schema.Topology`. Unknown or unreachable
    sites raise :class:`mesh.errors.NoRoute`."""

    def __init__(self, topology: Topology) -> None:
        self._g: nx.Graph = nx.Graph()
        self._g.add_nodes_from(sorted(topology.sites))
        for lk in topology.links:
            self._g.add_edge(lk.a, lk.b, latency_ms=lk.latency_ms, bandwidth_mbps=lk.bandwidth_mbps)
        self._paths: dict[tuple[str, str], tuple[float, list[str]]] = {}
        self._table: tuple[list[str], np.ndarray] | None = None

    @property
    def nx_graph(self) -> nx.Graph:
        return self._g

    def _shortest(self, a: str, b: str) -> tuple[float, list[str]]:
        for n in (a, b):
            if n not in self._g:
                raise NoRoute(f"unknown site {n!r}")
        if a == b:
            return 0.0, [a]
        key = (a, b)
        hit = self._paths.get(key)
        if hit is None:
            try:
                dist, path = nx.single_source_dijkstra(self._g, a, b, weight="latency_ms")
            except nx.NetworkXNoPath as exc:
                raise NoRoute(f"no path from {a!r} to {b!r}") from exc
            hit = (float(dist), list(path))
            self._paths[key] = hit
            self._paths[(b, a)] = (hit[0], list(reversed(hit[1])))
        return hit[0], list(hit[1])

    def path(self, a: str, b: str) -> list[str]:
        """Sites along the latency-shortest path, both ends included (``[a]`` when ``a == b``)."""
        return self._shortest(a, b)[1]

    def path_latency_ms(self, a: str, b: str) -> float:
        """One-way latency of the latency-shortest path; 0 for ``a == b``."""
        return self._shortest(a, b)[0]

    def rtt_ms(self, a: str, b: str) -> float:
        return 2.0 * self.path_latency_ms(a, b)

    def bottleneck_bandwidth_mbps(self, a: str, b: str) -> float:
        """Smallest link bandwidth along the latency-shortest path; ``inf`` for ``a == b``."""
        path = self.path(a, b)
        if len(path) == 1:
            return math.inf
        return min(float(self._g.edges[u, v]["bandwidth_mbps"]) for u, v in pairwise(path))

    def transfer_ms(self, a: str, b: str, nbytes: int) -> float:
        """Serialisation time of ``nbytes`` over the path's bottleneck, without propagation
        latency (the cost model adds ``path_latency_ms`` separately). 0 for ``a == b``."""
        bw = self.bottleneck_bandwidth_mbps(a, b)
        if math.isinf(bw) or nbytes <= 0:
            return 0.0
        # bytes * 8 bits / (Mbit/s * 1e6) s  ->  * 1e3 ms
        return nbytes * 8.0 / (bw * 1000.0)

    def latency_table(self) -> tuple[list[str], np.ndarray]:
        """All-pairs one-way latency (ms): sorted site names and a square float64 matrix
        (``inf`` where no path). The matrix is a copy, safe to modify."""
        if self._table is None:
            names = list(self._g.nodes)
            index = {n: i for i, n in enumerate(names)}
            rows, cols, data = [], [], []
            for u, v, w in self._g.edges(data="latency_ms"):
                rows += [index[u], index[v]]
                cols += [index[v], index[u]]
                data += [float(w), float(w)]
            n = len(names)
            # csgraph treats explicit zeros in sparse input as edges, so 0 ms links survive.
            m = csr_matrix((np.asarray(data, dtype=np.float64), (rows, cols)), shape=(n, n))
            dist = shortest_path(m, method="D", directed=False)
            self._table = (names, np.asarray(dist, dtype=np.float64))
        names, dist = self._table
        return list(names), dist.copy()
