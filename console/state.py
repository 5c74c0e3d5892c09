"""The console's model of the mesh: etcd (through a ``MeshView``: topology, live records, placements; plus the
placement events and the last topology apply) joined with what each live agent's ``/metrics`` says, rebuilt
every ``tick_s`` into one JSON-able snapshot that the pages and the server-sent event stream share.

Health of a site, worst first (a SIGKILLed agent is ``unreachable`` at the next scrape, ``down`` when its
lease ends):

    down          in the topology, no live record (never started, or its lease expired)
    unreachable   live record, but its edge API refused or timed out the last scrape
    degraded      the agent says so (etcd lost), or it reports a peer unreachable
    up            otherwise

With nobody watching (no event stream open, no page or API request in the last ``WATCH_S``) a round runs
only every ``IDLE_TICK_S``: the attainment history goes on, at a fraction of the cost to the scheduler's
process and the agents; the first request wakes the loop at once.

Counters from the agents are folded into running totals by their increase since the previous scrape of the
same site (a restarted agent counts from zero), so totals and the SLO attainment series never go backwards
when an agent restarts or disappears.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from console.digest import SiteMetrics, attainment, rate
from console.scrape import Scrape, Scraper
from core_scheduler.state.view import MeshView
from mesh.errors import PkiError, StoreError
from mesh.etcd.keys import CATALOG, EVENTS_PLACEMENT, TOPOLOGY_LAST_APPLY
from mesh.etcd.store import Store
from mesh.lifecycle import Service, cancel_and_wait
from mesh.log import get_logger
from topology.paths import topology_paths

__all__ = ["HEALTH", "ConsoleState"]

log = get_logger(__name__)
HEALTH = ("up", "degraded", "unreachable", "down")
SERIES_POINTS = 180        # attainment points kept per tenant and class (at tick_s: 3 minutes at 1 s)
WINDOW_S = 10.0            # an attainment point covers the queries of the last WINDOW_S
MAX_EVENTS = 100
IDLE_TICK_S = 5.0
WATCH_S = 30.0


class ConsoleState(Service):
    def __init__(self, store: Store, scraper: Scraper, *, tick_s: float = 1.0,
                 crl_sink: Callable[[bytes], bool] | None = None) -> None:
        self.store = store
        self.crl_sink = crl_sink  # the console's TLS adopts a newer revocation list published at pki/crl
        self._crl_seen: bytes | None = None
        self.scraper = scraper
        self.tick_s = tick_s
        self.view = MeshView(store, "console")
        self.version = 0
        self.snapshot: dict[str, Any] = {"version": 0, "sites": [], "links": [], "tenants": [], "events": []}
        self.last_apply: dict[str, Any] | None = None
        self._scrapes: dict[str, Scrape] = {}
        self._prev: dict[str, tuple[float, SiteMetrics]] = {}   # site -> (monotonic, last parsed metrics)
        self._rates: dict[str, float] = {}                     # site -> requests/s
        self._fwd_rates: dict[tuple[str, str], float] = {}     # (site, destination) -> forwards/s
        self._acc: dict[tuple[str, ...], float] = {}           # running totals (see the module docstring)
        self._series: deque[tuple[float, dict[tuple[str, str], tuple[float, float]]]] = deque(
            maxlen=SERIES_POINTS + int(WINDOW_S / max(tick_s, 0.1)) + 1)
        self._events: list[dict[str, Any]] = []
        self._changed = asyncio.Condition()
        self.viewers = 0                         # open event streams
        self._seen_at = -math.inf                # monotonic time of the last page or API request
        self._wake = asyncio.Event()
        self._paths: tuple[object, Any] | None = None  # (topology, its path tables): rebuilt when it changes
        self._task: asyncio.Task[None] | None = None
        self._listeners: list[Callable[[dict[str, Any]], None]] = []

    async def _start(self) -> None:
        await self.view.start()
        self._task = asyncio.create_task(self._loop(), name="console-state")

    async def _stop(self) -> None:
        await cancel_and_wait(self._task)
        await self.view.stop()

    async def wait_newer(self, version: int, timeout: float) -> dict[str, Any]:  # noqa: ASYNC109
        """The snapshot once it is newer than ``version`` (or the current one after ``timeout``)."""
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._changed.wait_for(lambda: self.version > version)
        return self.snapshot

    def live_urls(self) -> dict[str, str]:
        """site -> edge API URL: what of the live records' ``http`` the sites' certificates vouch for
        (:meth:`console.scrape.Scraper.targets`: never a URL a site chose for the console to fetch)."""
        return self.scraper.targets(self.view.live, self.view.site_certs)

    # -- the loop ----------------------------------------------------------------------------
    def touch(self) -> None:
        """Someone looks: rounds every ``tick_s`` from now (waking an idle loop at once)."""
        idle = not self.watching
        self._seen_at = time.monotonic()
        if idle:
            self._wake.set()

    @property
    def watching(self) -> bool:
        return self.viewers > 0 or time.monotonic() - self._seen_at < WATCH_S

    async def _loop(self) -> None:
        while True:
            started = time.monotonic()
            self._wake.clear()
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("console refresh failed; the last snapshot stays")
            period = self.tick_s if self.watching else max(self.tick_s, IDLE_TICK_S)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.05, period - (time.monotonic() - started))):
                    await self._wake.wait()

    async def refresh(self) -> None:
        """One round: read events and the last apply, scrape every live agent, rebuild the snapshot."""
        try:
            events, last_apply = await asyncio.gather(self.store.get(EVENTS_PLACEMENT),
                                                      self.store.get(TOPOLOGY_LAST_APPLY))
        except StoreError as exc:
            log.warning("console cannot read etcd: %s", exc)
        else:
            if events is not None and isinstance(events.value, dict):
                self._events = [e for e in events.value.get("events", []) if isinstance(e, dict)][-MAX_EVENTS:]
            self.last_apply = last_apply.value if last_apply is not None and isinstance(last_apply.value, dict) \
                else None
        self._adopt_crl()
        urls = self.live_urls()
        scrapes = await asyncio.gather(*(self.scraper.metrics(n, u) for n, u in sorted(urls.items())))
        self._scrapes = {s.site: s for s in scrapes}
        for s in scrapes:
            self._fold(s)
        self._series.append((time.time(), self._slo_totals()))
        snap = self.build()
        async with self._changed:
            self.version += 1
            self.snapshot = {**snap, "version": self.version}
            self._changed.notify_all()

    def _adopt_crl(self) -> None:
        pem = self.view.crl
        if self.crl_sink is None or pem is None or pem == self._crl_seen:
            return
        self._crl_seen = pem
        try:
            if self.crl_sink(pem):
                log.info("revocation list from etcd adopted by the console")
        except PkiError as exc:
            log.warning("revocation list from etcd not adopted by the console: %s", exc)

    def _fold(self, s: Scrape) -> None:
        if s.metrics is None:
            return
        m = s.metrics
        prev_at, prev = self._prev.get(s.site, (None, None))
        dt = s.at - prev_at if prev_at is not None else 0.0

        def grow(key: tuple[str, ...], cur: float, before: float | None) -> None:
            delta = cur if before is None or cur < before else cur - before
            self._acc[key] = self._acc.get(key, 0.0) + delta

        for k, v in m.slo.items():
            grow(("slo", *k), v, prev.slo.get(k) if prev else None)
        for k2, v in m.requests.items():
            grow(("req", *k2), v, prev.requests.get(k2) if prev else None)
        for t, v in m.quota_rejections.items():
            grow(("quota", t), v, prev.quota_rejections.get(t) if prev else None)
        r = rate(prev.requests_total if prev else None, m.requests_total, dt)
        if r is not None:
            self._rates[s.site] = r
        for dest, v in m.forwards.items():
            fr = rate(prev.forwards.get(dest) if prev else None, v, dt)
            if fr is not None:
                self._fwd_rates[(s.site, dest)] = fr
        self._prev[s.site] = (s.at, m)

    def _slo_totals(self) -> dict[tuple[str, str], tuple[float, float]]:
        flat = {(k[1], k[2], k[3]): v for k, v in self._acc.items() if k[0] == "slo"}
        return {(t, c): mm for t, per in attainment(flat).items() for c, mm in per.items()}

    # -- the snapshot ------------------------------------------------------------------------
    def build(self) -> dict[str, Any]:
        view = self.view
        topo = view.topology
        sites_out: list[dict[str, Any]] = []
        if topo is not None:
            for name in sorted(topo.sites):
                sites_out.append(self._site(name))
        return {"ts": time.time(), "revision": view.revision, "etcd_connected": view.connected,
                "metrics": any(s.metrics is not None for s in self._scrapes.values()),
                "sites": sites_out, "links": self._links(), "tenants": self._tenants(),
                "events": list(self._events), "last_apply_ts": (self.last_apply or {}).get("ts"),
                "topology_digest": (self.last_apply or {}).get("digest"),
                # catalog entries every reader skips (one that does not decode, an id another task holds)
                "catalog_broken": [{"key": k, "reason": why} for k, why in sorted(view.rejected.items())
                                   if k.startswith(CATALOG)]}

    def _healthy(self, site: str) -> bool:
        scrape = self._scrapes.get(site)
        return site in self.view.live and (scrape is None or scrape.reachable)

    def _site(self, name: str) -> dict[str, Any]:
        assert self.view.topology is not None
        spec = self.view.topology.sites[name]
        hb = self.view.live.get(name)
        scrape = self._scrapes.get(name)
        m = scrape.metrics if scrape is not None else None
        out: dict[str, Any] = {"name": name, "tier": spec.tier, "region": spec.region, "lat": spec.lat,
                               "lon": spec.lon, "hardware_class": spec.hardware.hardware_class,
                               "placement": [v.get("variant_id") for v in
                                             (self.view.placement.get(name) or {}).get("variants", [])],
                               "qps": self._rates.get(name), "metrics_error": scrape.error if scrape else None}
        if hb is None:
            return {**out, "health": "down", "why": "no live record (not started, or its lease expired)",
                    "load": 0.0, "variants": []}
        health, why = "up", ""
        # a peer that is down or unreachable itself (no live record, or the console cannot reach it either) is
        # shown so on its own marker: it does not make the sites that lost it degraded
        unreachable = sorted(p for p, ok in (m.peer_reachable.items() if m else []) if not ok and self._healthy(p))
        if scrape is not None and not scrape.reachable:
            health, why = "unreachable", f"edge API: {scrape.error}"
        elif hb.degraded:
            health, why = "degraded", "lost etcd (serving on its last view)"
        elif unreachable:
            health, why = "degraded", f"peers unreachable: {', '.join(unreachable)}"
        budgets: dict[str, float] = {}
        for d in hb.demand:
            budgets[d.task] = min(budgets.get(d.task, d.budget_ms), d.budget_ms)
        variants = [{"id": vid, "task": lv.task, "queue_ms": round(lv.queue_ms, 2), "queued_rows": lv.queued_rows,
                     "compute_ms": round(lv.ewma_compute_ms, 2), "served": lv.served,
                     "queue_depth": m.queue_depth.get(vid) if m else None,
                     "memory_bytes": m.memory_bytes.get(vid) if m else None}
                    for vid, lv in sorted(hb.loaded.items())]
        return {**out, "health": health, "why": why, "http": hb.http, "gpu": hb.gpu, "gpu_note": hb.gpu_note,
                "real_hardware_class": hb.hardware_class, "inflight": hb.inflight, "capacity": hb.capacity,
                "load": min(1.0, (hb.inflight + sum(lv.queued_rows for lv in hb.loaded.values())) / hb.capacity),
                "memory_used_bytes": hb.memory_used_bytes, "memory_budget_bytes": hb.model_memory_budget_bytes,
                "served": hb.served, "forwarded": hb.forwarded, "cold_starts": hb.cold_starts,
                "p99_ms": {t: round(v, 2) for t, v in m.p99_ms().items()} if m else {},
                "slo_budget_ms": budgets, "variants": variants, "peers_unreachable": unreachable,
                "loaded_variants": m.loaded_variants if m else None}

    def _links(self) -> list[dict[str, Any]]:
        topo = self.view.topology
        if topo is None:
            return []
        if self._paths is None or self._paths[0] is not topo:
            self._paths = (topo, topology_paths(topo))
        paths = self._paths[1]
        traffic: dict[tuple[str, str], float] = {}
        for (src, dst), qps in self._fwd_rates.items():
            if src not in topo.sites or dst not in topo.sites:
                continue
            hops = paths.path(src, dst)
            for a, b in itertools.pairwise(hops):
                key = (min(a, b), max(a, b))
                traffic[key] = traffic.get(key, 0.0) + qps
        out = []
        for lk in topo.links:
            measured = [hb.peer_rtt_ms[peer] for me, peer in ((lk.a, lk.b), (lk.b, lk.a))
                        if (hb := self.view.live.get(me)) is not None and peer in hb.peer_rtt_ms
                        and paths.path(me, peer) == [me, peer]]
            out.append({"a": lk.a, "b": lk.b, "latency_ms": lk.latency_ms, "declared_rtt_ms": 2 * lk.latency_ms,
                        "measured_rtt_ms": round(sum(measured) / len(measured), 2) if measured else None,
                        "traffic_qps": round(traffic.get((min(lk.a, lk.b), max(lk.a, lk.b)), 0.0), 2),
                        "bandwidth_mbps": lk.bandwidth_mbps})
        return out

    def _tenants(self) -> list[dict[str, Any]]:
        topo = self.view.topology
        names = set(topo.tenants) if topo is not None else set()
        names |= {k[1] for k in self._acc if k[0] in ("slo", "req", "quota")}
        totals = self._series[-1][1] if self._series else {}
        out = []
        for t in sorted(names):
            spec = topo.tenants.get(t) if topo is not None else None
            classes = {c: {"met": mm[0], "missed": mm[1], "attainment": mm[0] / (mm[0] + mm[1])
                           if mm[0] + mm[1] else None} for (tt, c), mm in sorted(totals.items()) if tt == t}
            requests = sum(v for k, v in self._acc.items() if k[0] == "req" and k[1] == t)
            out.append({"name": t, "isolation": spec.isolation if spec else None,
                        "quota_qps": spec.quotas.get("qps") if spec else None, "qps": self._tenant_qps(t),
                        "requests": requests, "rejections": self._acc.get(("quota", t), 0.0),
                        "classes": classes, "series": self._tenant_series(t)})
        return out

    def _window_start(self) -> int:
        """Index of the series point WINDOW_S before the newest (the oldest one when the series is shorter)."""
        newest = self._series[-1][0]
        for i in range(len(self._series) - 1, -1, -1):
            if newest - self._series[i][0] >= WINDOW_S:
                return i
        return 0

    def _tenant_qps(self, tenant: str) -> float | None:
        if len(self._series) < 2:
            return None
        i = self._window_start()
        t0, old = self._series[i]
        t1, new = self._series[-1]
        if t1 <= t0:
            return None
        count = sum(sum(v) for (t, _), v in new.items() if t == tenant) - \
            sum(sum(v) for (t, _), v in old.items() if t == tenant)
        return round(max(0.0, count) / (t1 - t0), 2)

    def _tenant_series(self, tenant: str) -> dict[str, list[list[float | None]]]:
        """SLO class -> [[unix time, attainment over the WINDOW_S before it, or None without queries]]."""
        pts = list(self._series)
        classes = sorted({c for _, tot in pts for (t, c) in tot if t == tenant})
        out: dict[str, list[list[float | None]]] = {c: [] for c in classes}
        j = 0
        for i, (ts, tot) in enumerate(pts):
            while j < i and ts - pts[j + 1][0] >= WINDOW_S:
                j += 1
            if i == 0:
                continue
            base = pts[j][1]
            for c in classes:
                met = tot.get((tenant, c), (0.0, 0.0))[0] - base.get((tenant, c), (0.0, 0.0))[0]
                miss = tot.get((tenant, c), (0.0, 0.0))[1] - base.get((tenant, c), (0.0, 0.0))[1]
                out[c].append([round(ts, 3), round(met / (met + miss), 4) if met + miss > 0 else None])
        return {c: v[-SERIES_POINTS:] for c, v in out.items()}
