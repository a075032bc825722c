"""Run the HTTP API inside the worker process: :func:`start_http` / ``await runner.cleanup()``.

Binds ``worker.host:worker.port``; port 0 picks a free port. The bound address is logged
and printed on stdout as one line ``listening on http://HOST:PORT`` (flushed), so that
tests and supervisors can find it; ``https://`` when ``tls.cert_file`` is set (see
:mod:`shared.tls`: TLS 1.2+, mutual TLS with ``tls.require_client_cert``).

The runner cancels a request's handler when its client disconnects
(``handler_cancellation``): the scheduler then cancels the request's work and the engine
releases its leases.
"""

from __future__ import annotations

from aiohttp import web

from shared.config import Config
from shared.logging import get_logger
from shared.tls import http_scheme, server_context
from worker.api import create_app
from worker.engine import Engine
from worker.scheduler import Scheduler
from worker.tokenizer import Tokenizer, load_tokenizer

log = get_logger("kvl.worker.http")


def bound_address(runner: web.AppRunner) -> tuple[str, int]:
    """``(host, port)`` of the runner's first listening socket."""
    addr = runner.addresses[0]
    return str(addr[0]), int(addr[1])


async def start_http(engine: Engine, cfg: Config, *, tokenizer: Tokenizer | None = None,
                     scheduler: Scheduler | None = None) -> web.AppRunner:
    """Build the app (tokenizer from ``worker.model_dir``, a scheduler on ``engine``), bind, serve."""
    tokenizer = tokenizer or load_tokenizer(cfg.worker.model_dir, engine.model.cfg.vocab_size)
    scheduler = scheduler or Scheduler(engine, cfg.service)
    ssl_context = server_context(cfg.tls)
    app = create_app(engine, cfg, tokenizer, scheduler)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, cfg.worker.host, cfg.worker.port, ssl_context=ssl_context)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    host, port = bound_address(runner)
    url = f"{http_scheme(cfg.tls)}://{host}:{port}"
    log.info("http_listening", url=url, tokenizer=tokenizer.name, max_concurrency=cfg.service.max_concurrency)
    print(f"listening on {url}", flush=True)
    return runner


__all__ = ["bound_address", "start_http"]
