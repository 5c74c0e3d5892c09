"""The console as a service a scheduler process runs: :class:`ConsoleServer` owns the state (an etcd view and
the scrapes), the agents' HTTP client, the admin gate and the listener, and stops them in reverse order.

TLS (the default): the listener presents the scheduler identity ``scheduler/<server_name>`` (the kind the
PKI issues for serving the console) and admits admins; agents are scraped as ``admin/<scrape_admin>``.
Both certificates come from ``pki_dir`` (``tiermesh pki issue --scheduler NAME --address HOST`` and
``tiermesh pki issue --admin NAME``; ``tiermesh up`` issues them). Insecure: plain HTTP and a token.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from console.app import Route, make_app
from console.auth import AdminGate
from console.scrape import Scraper
from console.state import ConsoleState
from mesh.addresses import http_url
from mesh.errors import ConfigError, PkiError
from mesh.etcd.store import Store
from mesh.lifecycle import Service
from mesh.log import get_logger, kv
from mesh.pki.files import PkiPaths
from mesh.pki.identity import Identity
from mesh.pki.peers import TlsPeers
from mesh.pki.reload import ReloadingCredentials

__all__ = ["ConsoleConfig", "ConsoleServer", "new_token"]

log = get_logger(__name__)


def new_token() -> str:
    return secrets.token_urlsafe(24)


@dataclass(slots=True)
class ConsoleConfig:
    bind: str = "127.0.0.1"
    port: int = 0                       # 0: any free port (``ConsoleServer.url`` says which)
    advertise: str | None = None        # the host in the printed URL (default: the bind address)
    pki_dir: Path | None = None         # TLS with certificates from here; None: insecure, token required
    server_name: str = "console"        # serves as scheduler/<server_name>
    scrape_admin: str = "console"       # scrapes agents as admin/<scrape_admin>
    token: str | None = None            # insecure mode's token (None: a fresh one)
    tick_s: float = 1.0                 # snapshot and scrape period


class ConsoleServer(Service):
    def __init__(self, store: Store, cfg: ConsoleConfig, *, extra_routes: Sequence[Route] = ()) -> None:
        self.cfg = cfg
        self.tls: TlsPeers | None = None
        self.scrape_credentials: ReloadingCredentials | None = None
        if cfg.pki_dir is not None:
            paths = PkiPaths(Path(cfg.pki_dir))
            try:
                self.tls = TlsPeers(paths, Identity("scheduler", cfg.server_name))
                self.scrape_credentials = ReloadingCredentials.for_identity(paths,
                                                                            Identity("admin", cfg.scrape_admin))
            except PkiError as exc:
                raise PkiError(f"the console cannot serve HTTPS: {exc} (issue them with `tiermesh pki issue "
                               f"--scheduler {cfg.server_name} --address HOST` and `tiermesh pki issue --admin "
                               f"{cfg.scrape_admin}`, or run with --insecure)") from exc
            self.token: str | None = None
            gate = AdminGate(tls=self.tls)
        else:
            self.token = cfg.token or new_token()
            gate = AdminGate(token=self.token)
        scrape_ctx = self.scrape_credentials.client_context() if self.scrape_credentials else None
        self.scraper = Scraper(scrape_ctx)
        self.model = ConsoleState(store, self.scraper, tick_s=cfg.tick_s,
                                  crl_sink=self.tls.load_crl if self.tls is not None else None)
        self._closing = asyncio.Event()
        self.app = make_app(self.model, self.scraper, gate, self._closing, extra_routes)
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise ConfigError("the console is not listening yet")
        url = http_url(self.cfg.advertise or self.cfg.bind, self.port)
        return "https" + url.removeprefix("http") if self.tls is not None else url

    @property
    def login_url(self) -> str:
        """What a person opens: the URL, with the token in insecure mode."""
        return f"{self.url}/?token={self.token}" if self.token else f"{self.url}/"

    async def _start(self) -> None:
        for svc in (self.tls, self.scrape_credentials):
            if svc is not None:
                await svc.start()
        await self.scraper.start()
        await self.model.start()
        self._runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=2.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.bind, self.cfg.port,
                           ssl_context=self.tls.ssl_context if self.tls else None)
        await site.start()
        server = site._server  # the bound socket says which port 0 became
        assert server is not None
        self.port = int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]
        log.info("console serving at %s", self.url, extra=kv(event="console_up", reason=self.url))

    async def _stop(self) -> None:
        self._closing.set()  # event streams end at their next wake-up
        if self._runner is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(10):
                    await self._runner.cleanup()
            self._runner = None
        await self.model.stop()
        await self.scraper.stop()
        for svc in (self.scrape_credentials, self.tls):
            if svc is not None:
                await svc.stop()
