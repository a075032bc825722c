"""Composition root: ``create_app(config) -> web.Application`` and the process entry point.

Every resource is owned by a ``cleanup_ctx`` generator that creates it, yields, and closes
it: the embedded PostgreSQL/NATS (only when no URL is configured), then the coordinator
(NATS, JetStream, pool, lock, ledger). A bench or a test can run the app in-process with
``aiohttp.web.AppRunner``; ``run()`` serves it as a process with clean shutdown on
SIGTERM/SIGINT (stop taking requests, flush pending commits, release the lock, drain NATS).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from coordinator.admin import add_routes
from coordinator.admin_context import ADMIN, LOGGER, AdminContext
from coordinator.admin_middleware import auth_middleware, error_middleware, rotate_token
from coordinator.log.leader import make_holder_id
from coordinator.metrics import CoordinatorMetrics
from coordinator.nats_service import StartupError
from coordinator.runtime import Coordinator
from shared import tracing
from shared.event_loop import loop_factory
from shared.config import Config, ConfigError
from shared.embedded import EmbeddedServiceError, Services, start_services
from shared.key_rotation import KeyReloader, config_loader
from shared.logging import configure_logging, get_logger
from shared.tls import http_scheme, server_context

COORDINATOR = web.AppKey("coordinator", Coordinator)
SERVICES = web.AppKey("services", Services)
CONFIG = web.AppKey("config", Config)


def admin_token(config: Config) -> str:
    return config.coordinator.admin_token or os.environ.get("KVL_ADMIN_TOKEN", "")


def create_app(config: Config, *, database_url: str | None = None, nats_url: str | None = None,
               holder: str | None = None, logger: Any = None, owns_process: bool = False) -> web.Application:
    """The coordinator as an aiohttp application (URLs default to the config, then embedded).
    ``owns_process``: this app is the process (``serve``), so it may tune the process's garbage
    collector (see ``Coordinator.freeze_gc``); an app run inside a test or a bench leaves it alone."""
    log = logger or get_logger("coordinator")
    app = web.Application(middlewares=[error_middleware, auth_middleware], client_max_size=1 << 20)
    app[CONFIG] = config
    app[LOGGER] = log
    app[ADMIN] = AdminContext(metrics=CoordinatorMetrics(), admin_token=admin_token(config),
                              ui_thresholds={"warn": config.coordinator.ui_warn_usage,
                                             "critical": config.coordinator.ui_critical_usage})
    db = database_url if database_url is not None else config.database.url
    nats_ = nats_url if nats_url is not None else config.nats.url
    app.cleanup_ctx.append(_services_ctx(db, nats_))
    app.cleanup_ctx.append(_coordinator_ctx(holder, owns_process))
    add_routes(app)
    return app


def _services_ctx(database_url: str, nats_url: str) -> Any:
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        log = app[LOGGER]
        if database_url and nats_url:
            app[SERVICES] = Services(database_url, nats_url)
            yield
            return
        try:
            svc = await asyncio.to_thread(start_services, database_url, nats_url, app[CONFIG].state_dir)
        except EmbeddedServiceError as e:
            raise StartupError(f"embedded services: {e}") from e
        log.info("embedded_services_started", postgres=svc.postgres is not None, nats=svc.nats is not None,
                 state_dir=app[CONFIG].state_dir)
        app[SERVICES] = svc
        try:
            yield
        finally:
            await asyncio.to_thread(svc.stop)
            log.info("embedded_services_stopped")
    return ctx


def _coordinator_ctx(holder: str | None, owns_process: bool) -> Any:
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        svc = app[SERVICES]
        admin = app[ADMIN]
        coord = Coordinator(app[CONFIG], database_url=svc.database_url, nats_url=svc.nats_url,
                            logger=app[LOGGER], metrics=admin.metrics, holder=holder, freeze_gc=owns_process)
        app[COORDINATOR] = coord
        try:
            await coord.start()
        except BaseException:
            await coord.stop()
            raise
        admin.ledger = coord.ledger
        assert coord.service is not None
        admin.inventory = coord.service.inventory
        admin.control = coord.service.control
        try:
            yield
        finally:
            await coord.stop()
    return ctx


# --- the process -------------------------------------------------------------------------------

def admin_site(runner: web.AppRunner, config: Config, host: str, port: int) -> web.TCPSite:
    """The admin API's listener: HTTPS when ``tls.cert_file`` is set (see :mod:`shared.tls`)."""
    return web.TCPSite(runner, host, port, ssl_context=server_context(config.tls))


async def serve(config: Config, *, host: str | None = None, port: int | None = None,
                config_path: str | None = None) -> int:
    """Run until SIGTERM/SIGINT (exit 0) or until the coordinator cannot continue (exit 1).
    SIGHUP (or a change of ``config_path``) reloads the admin token (``shared.key_rotation``)."""
    log = get_logger("coordinator")
    holder = make_holder_id()
    tracing.setup(config.tracing, "coordinator", instance=holder)
    app = create_app(config, logger=log, owns_process=True, holder=holder)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # SIGHUP or a changed file: the admin token is read again (the old one kept for auth.rotation_grace_s)
    load = config_loader(config_path)
    reloader = KeyReloader(load, config, log, path=config_path or os.environ.get("KVL_CONFIG"),
                           on_token=lambda token, grace: rotate_token(app[ADMIN], token, grace),
                           counter=app[ADMIN].metrics.auth_reloads) if load else None
    if reloader is not None:
        reloader.start()
    try:
        await runner.setup()
    except StartupError as e:
        print(f"kvledger coordinator: {e}", file=sys.stderr, flush=True)
        await runner.cleanup()
        return 2
    host = host or config.coordinator.host
    port = config.coordinator.port if port is None else port
    try:
        site = admin_site(runner, config, host, port)
        await site.start()
    except ConfigError as e:
        print(f"kvledger coordinator: {e}", file=sys.stderr, flush=True)
        await runner.cleanup()
        return 2
    except OSError as e:
        print(f"kvledger coordinator: cannot listen on {host}:{port}: {e.strerror}", file=sys.stderr, flush=True)
        await runner.cleanup()
        return 2
    coord = app[COORDINATOR]
    if not app[ADMIN].admin_token and host not in ("127.0.0.1", "::1", "localhost"):
        log.warning("admin_api_without_token", host=host, note="only loopback clients are served")
    log.info("coordinator_listening", url=f"{http_scheme(config.tls)}://{host}:{port}", holder=coord.holder)
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({stopped, coord.fatal}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    code = 0
    if coord.fatal.done():
        print(f"kvledger coordinator: {coord.fatal.result()}", file=sys.stderr, flush=True)
        code = 1
    log.info("coordinator_stopping", reason="fatal error" if code else "signal")
    if reloader is not None:
        await reloader.stop()
    await runner.cleanup()
    tracing.shutdown()      # the last spans flushed
    return code


def run(config: Config, *, host: str | None = None, port: int | None = None, config_path: str | None = None) -> int:
    configure_logging(config.logging.format, config.logging.level)
    try:
        factory = loop_factory(config.coordinator.event_loop, "coordinator.event_loop")
    except ConfigError as e:
        print(f"kvledger coordinator: {e}", file=sys.stderr, flush=True)
        return 2
    with contextlib.suppress(KeyboardInterrupt), asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(serve(config, host=host, port=port, config_path=config_path))
    return 130
