"""Run the HTTP API inside the worker process: :func:`start_http` / ``await runner.cleanup()``.

Binds ``worker.host:worker.port``; port 0 picks a free port. The bound address is logged
and printed on stdout as one line ``listening on http://HOST:PORT`` (flushed), so that
tests and supervisors can find it; ``https://`` when ``tls.cert_file`` is set (see
:mod:`shared.tls`: TLS 1.2+, mutual TLS with ``tls.require_client_cert``).

The text side comes from ``worker.model_dir`` as ``save_pretrained`` writes it, loaded and
validated before the socket is bound (a broken file refuses the start, naming it): the
tokenizer (:mod:`shared.text.tokenizer`), the chat template (:mod:`shared.text.chat_template`) and the
sampling defaults (:mod:`shared.text.generation_config`).

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
from shared.text.chat_template import ChatTemplate, load_chat_template
from worker.engine import Engine
from shared.text.generation_config import SamplingDefaults, load_generation_config
from worker.scheduler import Scheduler
from shared.text.tokenizer import Tokenizer, load_tokenizer

log = get_logger("kvl.worker.http")


def bound_address(runner: web.AppRunner) -> tuple[str, int]:
    """``(host, port)`` of the runner's first listening socket."""
    addr = runner.addresses[0]
    return str(addr[0]), int(addr[1])


async def start_http(engine: Engine, cfg: Config, *, tokenizer: Tokenizer | None = None,
                     chat_template: ChatTemplate | None = None, sampling: SamplingDefaults | None = None,
                     scheduler: Scheduler | None = None) -> web.AppRunner:
    """Build the app (tokenizer, chat template and sampling defaults from ``worker.model_dir``
    unless given, a scheduler on ``engine``), bind, serve.

    Raises :class:`ValueError` (:class:`shared.text.checkpoint_files.CheckpointFileError`) for a
    checkpoint file that cannot be used, before anything is bound.
    """
    model_dir = cfg.worker.model_dir
    tokenizer = tokenizer or load_tokenizer(model_dir, engine.model.cfg.vocab_size)
    chat_template = chat_template or load_chat_template(model_dir)
    sampling = sampling or load_generation_config(model_dir).sampling_defaults()
    if not chat_template.available:
        log.warning("chat_template_missing", reason=chat_template.origin,
                    note="every /v1/chat/completions request is answered 400; /v1/completions serves")
    scheduler = scheduler or Scheduler(engine, cfg.service)
    ssl_context = server_context(cfg.tls)
    app = create_app(engine, cfg, tokenizer, scheduler, chat_template=chat_template, sampling=sampling)
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
    log.info("http_listening", url=url, tokenizer=tokenizer.name, chat_template=chat_template.id,
             sampling_defaults=sampling.source, max_concurrency=cfg.service.max_concurrency)
    print(f"listening on {url}", flush=True)
    return runner


__all__ = ["bound_address", "start_http"]
