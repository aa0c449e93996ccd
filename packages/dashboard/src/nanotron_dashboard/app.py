"""The FastAPI application: database, writer, cache and hub wired together."""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from sqlalchemy.engine import Engine

from . import __version__, api, ingest, layer_api, moe_api, prediction_api, telemetry_api
from .alerts import StallWatch, WebhookSender
from .auth import AuthMiddleware, CookieSigner
from .backend import PgLock, is_url, pg_url, redact
from .db import lock_database, open_database
from .db_files import private_dir
from .errors import DatabaseFileError, MissingAssetError, StartupConfigError
from .grants import GrantSigner
from .guard import BrowserGuard, HostPolicy
from .hub import Hub
from .launch import Launcher
from .memory import fits, limit_malloc_arenas
from .queries import load_series
from .security import Redactor
from .series import SeriesCache
from .telemetry_store import StallCheck
from .writer import Writer

# The API and page modules: a new view is a module with its router here, plus its script
ROUTERS = (
    ingest.router, api.router, telemetry_api.router, moe_api.router, layer_api.router,
    prediction_api.router,
)  # fmt: skip
VENDOR = Path(__file__).parent / "static" / "vendor"
REQUIRED_ASSETS = ("uPlot.iife.min.js", "uPlot.min.css")


@dataclass
class Settings:
    db: str
    host: str = "127.0.0.1"
    port: int = 8008
    token: str | None = None  # the access token: reading and streaming
    launch_token: str | None = None  # the owner's: also launching (needed by allow_launch)
    allow_launch: bool = False
    stall_seconds: float = 120.0
    allowed_hosts: tuple[str, ...] = ()  # served besides the bound host and loopback names
    cache_bytes: int = 192 << 20  # series cache budget (memory.py: the whole server's)
    # writer queue budget (parsed messages, ~12x their JSON); then 503 / slower acks
    queue_bytes: int = 64 << 20
    stall_after: float = 300.0  # a running run silent this long gets one `stall` event
    alert_webhooks: tuple[str, ...] = ()  # a JSON POST per stored event to each
    webhook_attempts: int = 5
    webhook_backoff_s: float = 1.0  # doubled after each failed attempt
    webhook_timeout_s: float = 10.0

    @property
    def public_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"


def launch_log_dir(db: str) -> Path:
    """Where Resume's launches write their logs: beside an SQLite file; for a PostgreSQL
    database, under the user's cache folder ($XDG_CACHE_HOME or ~/.cache), named after the
    server and the database."""
    if is_url(db):
        url = pg_url(db)
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        name = f"{url.host or 'local'}-{url.port or 5432}-{url.database or 'postgres'}"
        return cache / "nanotron-dashboard" / (name + ".launches")
    return Path(str(db) + ".launches")


def check_assets() -> None:
    missing = [a for a in REQUIRED_ASSETS if not (VENDOR / a).is_file()]
    if missing:
        raise MissingAssetError(
            f"the charting library is missing from {VENDOR} ({', '.join(missing)}): "
            "this installation is incomplete: reinstall nanotron-dashboard (it ships uPlot)"
        )


def stall_check_period(stall_after: float) -> float:
    """How often to look for silent runs: a quarter of the threshold, 0.2 s to 30 s."""
    return min(max(stall_after / 4, 0.2), 30.0)


def check_launch(settings: Settings) -> None:
    if settings.allow_launch and not settings.launch_token:
        raise StartupConfigError(
            "--allow-launch needs a launch token: --launch-token-file FILE (mode 600) or "
            "NANOTRON_DASHBOARD_LAUNCH_TOKEN; anyone on this machine reaches 127.0.0.1"
        )
    if settings.launch_token and settings.launch_token == settings.token:
        raise StartupConfigError(
            "the launch token equals the access token: a trainer's credential must not be "
            "enough to launch; give two different tokens"
        )


def check_settings(settings: Settings) -> None:
    """Refuse a server that could not run as asked, before anything is opened."""
    check_assets()
    check_launch(settings)
    if not fits(settings.cache_bytes, settings.queue_bytes):
        raise StartupConfigError(
            f"the series cache and writer queue ({settings.cache_bytes >> 20} + "
            f"{settings.queue_bytes >> 20} MiB) do not fit the memory budget"
        )
    if not settings.stall_after > 0:
        raise StartupConfigError(f"--stall-after {settings.stall_after}: must be > 0 seconds")


@dataclass
class Services:
    """The server's threads and shared state, started together and stopped in reverse."""

    engine: Engine
    lock: IO
    hub: Hub
    cache: SeriesCache
    writer: Writer
    webhooks: WebhookSender
    stall: StallWatch

    def stop(self) -> None:
        self.stall.stop()
        self.webhooks.stop()
        self.writer.stop()
        self.engine.dispose()
        self.lock.close()


def start_services(settings: Settings, webhooks: WebhookSender) -> Services:
    lock = lock_database(settings.db)  # one server per database
    try:
        engine = open_database(settings.db)
    except Exception:
        lock.close()
        raise
    if settings.allow_launch:  # the launch logs' folder: 0700 and ours, or no start
        try:
            private_dir(str(launch_log_dir(settings.db)))
        except DatabaseFileError:
            engine.dispose()
            lock.close()
            raise
    hub = Hub()

    def loader(run_pk: int, name: str):  # noqa: ANN202
        with engine.connect() as c:
            return load_series(c, run_pk, name)

    cache = SeriesCache(loader, settings.cache_bytes)
    writer = Writer(
        engine,
        cache,
        hub.notify,
        watching=hub.watching,
        max_bytes=settings.queue_bytes,
        on_events=webhooks.enqueue,
        # PostgreSQL: the writer writes on the lock's own connection (backend.PgLock.hold)
        db_lock=lock if isinstance(lock, PgLock) else None,
        redact=lambda message: redact(message, settings.db),
    )
    writer.start()
    webhooks.start()
    stall = StallWatch(
        writer.submit, StallCheck(settings.stall_after), stall_check_period(settings.stall_after)
    )
    stall.start()
    return Services(engine, lock, hub, cache, writer, webhooks, stall)


def create_app(settings: Settings) -> FastAPI:
    check_settings(settings)
    limit_malloc_arenas()  # before the threads: memory bounded whatever the readers
    webhooks = WebhookSender(
        settings.alert_webhooks,
        settings.public_url,
        attempts=settings.webhook_attempts,
        backoff_s=settings.webhook_backoff_s,
        timeout_s=settings.webhook_timeout_s,
    )  # checks the URLs before anything is opened
    sv = start_services(settings, webhooks)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        sv.hub.loop = asyncio.get_running_loop()
        yield
        sv.stop()

    # FastAPI's /docs and /redoc load scripts from a CDN: off; api.py serves a local page
    app = FastAPI(
        title="nanotron dashboard",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    st = app.state
    st.settings, st.engine, st.cache, st.writer = settings, sv.engine, sv.cache, sv.writer
    st.hub, st.webhooks, st.lock = sv.hub, sv.webhooks, sv.lock
    st.csrf = secrets.token_urlsafe(32)
    st.launcher = Launcher(launch_log_dir(settings.db))
    st.grants = GrantSigner(settings.launch_token)  # signs and checks launch grants
    for router in ROUTERS:
        app.include_router(router)
    api.error_handlers(app)
    app.mount("/static", StaticFiles(directory=Path(__file__).parent / "static"), name="static")
    st.cookies = CookieSigner(settings.port)
    st.redactor = Redactor([settings.token, settings.launch_token])
    app.add_middleware(
        AuthMiddleware, access=settings.token, launch=settings.launch_token, cookies=st.cookies
    )
    # outermost (added last): the Host and Origin checks run before anything else
    app.add_middleware(BrowserGuard, hosts=HostPolicy(settings.host, settings.allowed_hosts))
    return app
