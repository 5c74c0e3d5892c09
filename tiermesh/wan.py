"""The wide-area links of a local mesh: a delay proxy per directed site pair (and per site to the variant
store's site), shaped by the topology's paths, and the drills that cut or black-hole a link. A mixin of
:class:`tiermesh.harness.LocalMesh` (it reads the mesh's topology, sites, proxies and namespaces)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from edge_agent.agent_config import BLOB_PEER
from mesh.errors import ConfigError
from tiermesh.drills import crosses_link
from tiermesh.mesh_options import path_shape

if TYPE_CHECKING:
    from tiermesh.delayproxy import ProxyPool
    from tiermesh.mesh_options import MeshOptions, SiteProcess
    from tiermesh.netns import DrillKind, NetnsLab
    from topology.schema import Topology

__all__ = ["WanLinks"]


class WanLinks:
    opts: MeshOptions
    topology: Topology
    sites: dict[str, SiteProcess]
    proxies: ProxyPool
    lab: NetnsLab | None
    store_url: str | None

    if TYPE_CHECKING:
        def _address(self, role: str) -> str: ...
        def _store_site(self) -> str | None: ...

    async def _start_proxies(self) -> None:
        for src in self.sites:
            peer_map: dict[str, str] = {}
            for dst, sp in self.sites.items():
                if dst == src:
                    continue
                shape = path_shape(self.topology, src, dst)
                proxy = await self.proxies.add(src, dst, (self._address(dst), sp.zmq_port), shape)
                peer_map[dst] = proxy.endpoint
            blob_proxy = await self._blob_proxy(src)
            if blob_proxy is not None:
                peer_map[BLOB_PEER] = blob_proxy
            path = self.opts.home / "sites" / src / "peers.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(peer_map, indent=1))
            self.sites[src].peer_map_path = path

    async def _blob_proxy(self, src: str) -> str | None:
        """URL through which ``src`` reaches the variant store over its path to the store's site."""
        home_site = self._store_site()
        if home_site is None or home_site == src or self.store_url is None:
            return None
        url = urlsplit(self.store_url)
        if url.hostname is None or url.port is None:
            return None
        shape = path_shape(self.topology, src, home_site, jitter=False)
        proxy = await self.proxies.add(src, BLOB_PEER, (url.hostname, url.port), shape)
        return f"{url.scheme}://{proxy.listen_host}:{proxy.port}"  # TLS goes through the TCP proxy

    def pairs_over(self, a: str, b: str) -> list[tuple[str, str]]:
        """The directed proxies (src, dst) whose planned path crosses the link ``a``-``b`` (a blob
        proxy's path ends at the store's site); without such a link, the pair's own two."""
        crosses = crosses_link(self.topology, a, b)
        store_site = self._store_site() or ""
        return sorted((src, dst) for src, dst in self.proxies.proxies
                      if crosses(src, store_site if dst == BLOB_PEER else dst))

    async def drill(self, kind: DrillKind, a: str, b: str) -> list[tuple[str, str]]:
        """Fail the link ``a``-``b`` both ways for every path that crosses it (:meth:`pairs_over`);
        ``cut``: connections are reset; ``blackhole``: packets vanish, connections stay open (a
        gray failure). Without netns the delay proxies do it. Returns the directed pairs it failed."""
        for site in (a, b):
            if site not in self.topology.sites:
                raise ConfigError(f"--{kind} {a}-{b}: {site!r} is not a site of {self.opts.topology}")
        if not self.opts.wan:  # no proxies: the two sites' own traffic
            if self.lab is None:
                raise ConfigError(f"--{kind} needs the delay proxies or --netns (it was started with no WAN)")
            await self.lab.block(a, peer=self._address(b), port=None, kind=kind)
            return [(a, b), (b, a)]
        pairs = self.pairs_over(a, b)
        for src, dst in pairs:
            proxy = self.proxies.proxies[(src, dst)]
            if self.lab is None and kind == "cut":
                await proxy.cut()
            elif self.lab is None:
                proxy.blackhole()
            else:  # src reaches dst through this proxy's port on the root address
                await self.lab.block(src, peer=self.lab.root_address, port=proxy.port, kind=kind)
        return pairs

    async def heal(self, a: str, b: str) -> None:
        """Undo :meth:`drill` on ``a``-``b`` (with netns: every drill rule in the namespaces involved)."""
        if self.lab is not None and not self.opts.wan:
            await self.lab.unblock(a)
        for src, dst in self.pairs_over(a, b):
            if self.lab is None:
                self.proxies.proxies[(src, dst)].restore()
            else:
                await self.lab.unblock(src)
