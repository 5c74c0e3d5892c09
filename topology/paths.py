"""The mesh's one shortest-path computation: routing, placement and the harness's WAN shaping all
read the path between two sites from here, so they never disagree about which path that is.

:func:`shortest_paths` computes every pair at once over plain link tuples; :func:`topology_paths`
is the same for a :class:`~topology.schema.Topology`. Both return a read-only :class:`PathTables`.

Conventions (one place, so no two callers disagree):

* a path is the **lowest-latency** one; its one-way latency is the sum of its links' latencies,
  its bandwidth the smallest of its links' (the bottleneck), its jitter the sum of its links'
  declared jitter. Bandwidth and jitter follow the latency path, not the widest or calmest one.
* **ties** (equal latency within a relative 1e-9) are broken the same way everywhere: each site's
  predecessor is the lowest-named one that lies on a shortest path, and the path between ``a``
  and ``b`` is the one grown from the lower-named of the two, so ``a -> b`` and ``b -> a`` are the
  same path walked both ways.
* ``latency_ms`` is one-way; ``rtt_ms`` twice it. Unreachable pairs: latency ``inf``, bandwidth
  ``0``, jitter ``0``. A site to itself: latency ``0``, bandwidth ``inf``, jitter ``0``.
* parallel links between one pair: the lower latency wins, then the wider.

Tables are cached by content (the sites and the links), so a heartbeat, which changes neither,
reuses the tables, and a changed link rebuilds them. Up to ``DENSE_MAX_SITES`` sites the distances come
from a vectorised Floyd–Warshall in numpy (n steps over an n x n matrix: ~0.1 ms at 20 sites, ~10 ms at
256); beyond that from scipy's Dijkstra, imported only then. So an agent of an ordinary mesh never loads
scipy (tens of MB resident, a quarter of a second of start-up on a small box).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from mesh.cache import BoundedCache
from mesh.errors import NoRoute, TopologyError

if TYPE_CHECKING:
    from topology.schema import Topology

__all__ = ["DENSE_MAX_SITES", "LinkSpec", "PathTables", "shortest_paths", "topology_paths"]

# (site a, site b, one-way latency ms, bandwidth Mbit/s, jitter ms); links are undirected
LinkSpec = tuple[str, str, float, float, float]

# Dijkstra drops zero-weight edges of a sparse matrix built from a dense one: a 0 ms link keeps
# this much weight for the search (the tables report its real 0 ms). It must stay far above what the tie
# tolerance allows on any path length (1e-12 x 10^5 ms = 1e-7 ms), or a detour over 0 ms links reads as a tie
# in one build and not in the other (hypothesis found that at 1e-9 for both).
_MIN_WEIGHT = 1e-4
# Two path lengths this close (relatively) are a tie; float sums of the same links in another
# order differ by a few ulps, real latencies by far more.
_TIE_RTOL = 1e-12
_NONE = -9999  # "no predecessor", scipy's convention
# Largest mesh whose distances are computed in numpy (O(n^3) work, O(n^2) memory); scipy's Dijkstra beyond.
DENSE_MAX_SITES = 256


@dataclass(frozen=True, eq=False)
class PathTables:
    """All-pairs lowest-latency paths over one set of sites and links. Rows and columns follow
    ``sites`` (sorted names). Arrays are read-only: the tables are shared through the cache."""

    sites: tuple[str, ...]
    latency_ms: NDArray[np.float64]       # one-way
    bandwidth_mbps: NDArray[np.float64]   # bottleneck
    jitter_ms: NDArray[np.float64]        # one-way sum of declared jitter
    pred: NDArray[np.int32]               # pred[i, j]: the site before j on the path from i
    index: Mapping[str, int] = field(init=False, repr=False)
    rtt_ms: NDArray[np.float64] = field(init=False, repr=False)
    jitter_rtt_ms: NDArray[np.float64] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "index", {n: i for i, n in enumerate(self.sites)})
        object.__setattr__(self, "rtt_ms", 2.0 * self.latency_ms)
        object.__setattr__(self, "jitter_rtt_ms", 2.0 * self.jitter_ms)
        for arr in (self.latency_ms, self.bandwidth_mbps, self.jitter_ms, self.pred, self.rtt_ms,
                    self.jitter_rtt_ms):
            arr.setflags(write=False)

    def _ends(self, a: str, b: str) -> tuple[int, int]:
        for n in (a, b):
            if n not in self.index:
                raise NoRoute(f"unknown site {n!r}")
        i, j = self.index[a], self.index[b]
        if not math.isfinite(self.latency_ms[i, j]):
            raise NoRoute(f"no path from {a!r} to {b!r}")
        return i, j

    def path(self, a: str, b: str) -> list[str]:
        """Sites along the path, both ends included (``[a]`` when ``a == b``)."""
        i, j = self._ends(a, b)
        # grown from the lower-named end, so both directions walk one path
        lo, hi = min(i, j), max(i, j)
        walk = [hi]
        while walk[-1] != lo:
            walk.append(int(self.pred[lo, walk[-1]]))
        names = [self.sites[k] for k in walk]
        return names if i == hi else names[::-1]

    def path_latency_ms(self, a: str, b: str) -> float:
        """One-way latency of the path; 0 for ``a == b``."""
        i, j = self._ends(a, b)
        return float(self.latency_ms[i, j])

    def rtt(self, a: str, b: str) -> float:
        return 2.0 * self.path_latency_ms(a, b)

    def bottleneck_bandwidth_mbps(self, a: str, b: str) -> float:
        """Smallest link bandwidth along the path; ``inf`` for ``a == b``."""
        i, j = self._ends(a, b)
        return float(self.bandwidth_mbps[i, j])

    def path_jitter_ms(self, a: str, b: str) -> float:
        """One-way sum of the declared jitter of the path's links."""
        i, j = self._ends(a, b)
        return float(self.jitter_ms[i, j])

    def transfer_ms(self, a: str, b: str, nbytes: int) -> float:
        """Serialisation time of ``nbytes`` over the path's bottleneck, without propagation
        latency (the cost model adds the path's latency separately). 0 for ``a == b``."""
        bw = self.bottleneck_bandwidth_mbps(a, b)
        if math.isinf(bw) or nbytes <= 0:
            return 0.0
        # bytes * 8 bits / (Mbit/s * 1e6) s  ->  * 1e3 ms
        return nbytes * 8.0 / (bw * 1000.0)


def topology_paths(topology: Topology) -> PathTables:
    """:func:`shortest_paths` over a topology's sites and links (cached by their content)."""
    return shortest_paths(tuple(sorted(topology.sites)),
                          tuple((lk.a, lk.b, lk.latency_ms, lk.bandwidth_mbps, lk.jitter_ms)
                                for lk in topology.links))


def shortest_paths(sites: Iterable[str], links: Iterable[LinkSpec]) -> PathTables:
    """All-pairs path tables over ``sites`` (any order; the tables sort them) and undirected
    ``(a, b, latency_ms, bandwidth_mbps, jitter_ms)`` links. A link naming a site not in ``sites``
    is a :class:`TopologyError`. Cached by content."""
    # canonical key: the same sites and links in any order or direction hit one entry
    canon = sorted((min(a, b), max(a, b), float(lat), float(bw), float(jit)) for a, b, lat, bw, jit in links)
    key = (tuple(sorted(set(sites))), tuple(canon))
    return _TABLES.get_or_make(key, lambda: _build(*key))


# Built when the topology changes, read on every snapshot (every heartbeat): the key is the
# topology's content, so hashing it (microseconds for a mesh's few dozen links) replaces a
# Dijkstra walk per snapshot. A handful of entries covers a topology being swapped and back.
_TABLES: BoundedCache[tuple[tuple[str, ...], tuple[LinkSpec, ...]], PathTables] = BoundedCache(8)


def _distances(weight: NDArray[np.float64], edge: NDArray[np.bool_], dense: bool) -> NDArray[np.float64]:
    """All-pairs shortest distances over the undirected ``weight`` matrix (links where ``edge``)."""
    if dense:
        dist = np.where(edge, weight, np.inf)
        np.fill_diagonal(dist, 0.0)
        for k in range(len(dist)):  # Floyd–Warshall, one vectorised relaxation through each site
            np.minimum(dist, dist[:, k, None] + dist[None, k, :], out=dist)
        return dist
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import shortest_path

    return np.asarray(shortest_path(csr_matrix(weight), method="D", directed=False), dtype=np.float64)


def _build(sites: tuple[str, ...], links: Sequence[LinkSpec], dense: bool | None = None) -> PathTables:
    """The tables; ``dense``: numpy Floyd–Warshall (True) or scipy Dijkstra (False); None picks by size."""
    index = {n: i for i, n in enumerate(sites)}
    n = len(sites)
    if n == 0:
        empty = np.zeros((0, 0))
        return PathTables(sites=sites, latency_ms=empty, bandwidth_mbps=empty.copy(), jitter_ms=empty.copy(),
                          pred=np.zeros((0, 0), dtype=np.int32))
    lat = np.full((n, n), np.inf)
    bw = np.zeros((n, n))
    jit = np.zeros((n, n))
    for a, b, link_ms, mbps, link_jitter in links:
        if a not in index or b not in index:
            raise TopologyError(f"link {a}-{b} names an unknown site", file="<paths>", field="links")
        if a == b:
            continue
        i, j = index[a], index[b]
        if link_ms < lat[i, j] or (link_ms == lat[i, j] and mbps > bw[i, j]):
            lat[i, j] = lat[j, i] = link_ms
            bw[i, j] = bw[j, i] = mbps
            jit[i, j] = jit[j, i] = link_jitter
    edge = np.isfinite(lat)
    weight = np.where(edge, np.maximum(lat, _MIN_WEIGHT), 0.0)
    dist = _distances(weight, edge, n <= DENSE_MAX_SITES if dense is None else dense)
    pred = _lowest_named_predecessors(dist, weight, edge)
    latency_ms = _fold(pred, np.where(edge, lat, 0.0), np.add, 0.0)
    bandwidth = _fold(pred, bw, np.minimum, np.inf)
    jitter = _fold(pred, jit, np.add, 0.0)
    latency_ms[pred == _NONE] = np.inf
    np.fill_diagonal(latency_ms, 0.0)
    return PathTables(sites=sites, latency_ms=_symmetric(latency_ms), bandwidth_mbps=_symmetric(bandwidth),
                      jitter_ms=_symmetric(jitter), pred=pred)


def _lowest_named_predecessors(dist: NDArray[np.float64], weight: NDArray[np.float64],
                               edge: NDArray[np.bool_]) -> NDArray[np.int32]:
    """``pred[s, d]``: the lowest-indexed ``p`` with a link ``p - d`` on a shortest path from ``s``
    (``dist[s, p] + w(p, d) == dist[s, d]`` up to a tie). ``dist[s, p] < dist[s, d]`` strictly, so
    following predecessors always ends at ``s``."""
    n = len(dist)
    p_idx, d_idx = np.nonzero(edge)  # both directions of every link
    before, after = dist[:, p_idx], dist[:, d_idx]
    via = before + weight[p_idx, d_idx]
    with np.errstate(invalid="ignore"):  # inf - inf where d is unreachable; masked out by isfinite
        ok = np.isfinite(after) & (before < after) & (np.abs(via - after) <= _TIE_RTOL * after)
    best = np.full((n, n), n, dtype=np.int64)
    rows = np.broadcast_to(np.arange(n)[:, None], ok.shape)
    np.minimum.at(best, (rows[ok], np.broadcast_to(d_idx, ok.shape)[ok]),
                  np.broadcast_to(p_idx, ok.shape)[ok])
    pred = np.where(best < n, best, _NONE).astype(np.int32)
    np.fill_diagonal(pred, _NONE)
    return pred


def _fold(pred: NDArray[np.int32], per_link: NDArray[np.float64], op: np.ufunc, own: float
          ) -> NDArray[np.float64]:
    """``per_link`` folded with ``op`` along every path of the predecessor tree (``own`` from a
    site to itself, 0 where unreachable). One vectorised step per hop: after ``k`` steps every
    path of ``k`` hops is exact, and the loop stops when nothing changes."""
    n = len(pred)
    has = pred != _NONE
    rows = np.arange(n)[:, None]
    cols = np.arange(n)[None, :]
    p = np.where(has, pred, rows)
    step = np.where(has, per_link[p, cols], 0.0)
    out = np.zeros((n, n))
    np.fill_diagonal(out, own)
    for _ in range(n):
        nxt = np.where(has, op(out[rows, p], step), out)
        if np.array_equal(nxt, out):
            break
        out = nxt
    return out


def _symmetric(table: NDArray[np.float64]) -> NDArray[np.float64]:
    """The upper triangle (paths grown from the lower-named end) mirrored below the diagonal."""
    upper = np.triu(np.ones(table.shape, dtype=bool))
    return np.where(upper, table, table.T)
