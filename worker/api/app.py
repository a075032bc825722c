"""The app factory: routes, middlewares, and the state the handlers read through typed keys."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from shared import access_log, tracing
from shared.address_allowlist import allowlist_middleware, parse_networks
from shared.config import Config
from shared.http_limits import handler_args
from shared.logging import get_logger
from worker.api import handlers as h
from worker.api.errors import Handler, error_middleware
from worker.api.keys import (
    CHAT_TEMPLATE, CONFIG, ENGINE, METRICS, SAMPLING, SCHEDULER, SERVED, STRUCTURED, TENANT, TENANTS, TOKENIZER,
    TOOL_FORMAT, Served,
)
from worker.api.tools import choose_format
from worker.capacity import capacity_ctx
from shared.text.chat_template import ChatTemplate
from worker.engine import Engine
from shared.text.generation_config import SamplingDefaults
from worker.scheduler import Scheduler
from worker.structured import StructuredLimits, StructuredOutput
from shared.tenant_header import SIGNATURE_HEADER, TENANT_HEADER, verify
from shared.tenants import TenantDirectory
from shared.text.tokenizer import Tokenizer

#: Routes that need an API key (everything under /v1/); probes and metrics do not.
AUTH_PREFIX = "/v1/"
#: Routes traced when tracing is on (the ones that run the model).
TRACED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})

@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The request's tenant: the one a gateway signed for (``shared.tenant_header``: only with
    ``auth.gateway_secret``; a forged or stale signature is a 401), else its API key's."""
    if request.path.startswith(AUTH_PREFIX):
        tenants = request.app[TENANTS]
        if TENANT_HEADER in request.headers:
            auth = request.app[CONFIG].auth
            body = await h.read_body(request, request.app[SERVED])    # cached: the handler reads it again
            tenant_id = verify(auth.gateway_secret, request.headers.get(TENANT_HEADER),
                               request.headers.get(SIGNATURE_HEADER), request.method, request.path_qs, body,
                               time.time(), auth.gateway_signature_max_age_ms / 1000)
            request[TENANT] = tenants.tenant(tenant_id)
        else:
            request[TENANT] = tenants.authenticate(request.headers.get("Authorization"))
    return await handler(request)


def _count_status(request: web.Request, status: int) -> None:
    route = request.match_info.route.resource
    name = route.canonical if route is not None else "unmatched"
    request.app[METRICS].http.labels(route=name, status=str(status)).inc()


def _tracing_middleware(worker_id: str) -> Any:
    """``worker.request``: a generation request's span, a child of the gateway's (or a client's)
    ``traceparent`` or a new trace; the scheduler's and the session's spans are its children."""
    def attributes(request: web.Request) -> dict[str, str]:
        tenant = request.get(TENANT)
        return {"kvl.worker_id": worker_id, **({"kvl.tenant": tenant.id} if tenant is not None else {})}

    return tracing.http_middleware("worker.request", TRACED_PATHS, attributes)


def create_app(engine: Engine, cfg: Config, tokenizer: Tokenizer, scheduler: Scheduler, *,
               chat_template: ChatTemplate, sampling: SamplingDefaults) -> web.Application:
    """The worker's HTTP application. The scheduler is stopped when the app is cleaned up.

    ``chat_template`` and ``sampling`` (the defaults of omitted sampling fields) come from the
    checkpoint like the tokenizer (:func:`worker.http_server.start_http` loads all three).
    """
    limit = cfg.service.max_body_bytes
    # NOTE: outermost, so the request's span sees the status error_middleware answered with
    traced = [_tracing_middleware(engine.worker_id)] if tracing.enabled() else []
    # NOTE: first of all: an address outside worker.allowed_networks gets a 403 before auth or tracing
    allow = allowlist_middleware("worker.allowed_networks",
                                 parse_networks("worker.allowed_networks", cfg.worker.allowed_networks),
                                 engine.metrics.address_refused.inc)
    app = web.Application(client_max_size=limit,
                          middlewares=[*([allow] if allow else []), *traced, error_middleware(limit, _count_status),
                                       auth_middleware],
                          # NOTE: the keep-alive timer also bounds a client that sends its headers
                          # slowly; the body has its own limit (read_body; shared.http_limits).
                          handler_args=handler_args(cfg.service.keepalive_timeout_ms))
    access_log.install(app, "worker", enabled=cfg.logging.access_log,
                       tenant_of=lambda r: getattr(r.get(TENANT), "id", None))
    app[ENGINE] = engine
    app[CONFIG] = cfg
    app[TOKENIZER] = tokenizer
    app[CHAT_TEMPLATE] = chat_template
    app[SAMPLING] = sampling
    app[SCHEDULER] = scheduler
    app[TENANTS] = TenantDirectory.from_config(cfg.auth)
    app[METRICS] = scheduler.metrics
    app[STRUCTURED] = StructuredOutput(tokenizer, engine.model.cfg.vocab_size, StructuredLimits.of(cfg.service),
                                       engine.metrics.registry)
    app[TOOL_FORMAT] = choose_format(cfg.service.tool_call_parser, chat_template.tool_format)
    app[SERVED] = Served(model_id=engine.model.cfg.model_id, fingerprint=f"kvl-{engine.namespace[:16]}",
                         created=int(time.time()), max_body_bytes=limit,
                         body_read_timeout_s=cfg.service.body_read_timeout_ms / 1000)

    async def scheduler_ctx(app: web.Application) -> AsyncIterator[None]:
        yield
        await app[SCHEDULER].stop()
        await app[STRUCTURED].close()       # the grammar compiler's child processes

    app.cleanup_ctx.append(scheduler_ctx)
    # the pools against service.max_concurrency at start, over_capacity refusals while serving
    app.cleanup_ctx.append(capacity_ctx(engine, cfg, get_logger("kvl.worker.capacity")))
    app.router.add_post("/v1/completions", h.completions)
    app.router.add_post("/v1/chat/completions", h.chat_completions)
    app.router.add_get("/v1/models", h.models)
    # the routes vLLM serves beside the OpenAI ones: load generators and health checkers use them
    app.router.add_get("/health", h.healthz)
    app.router.add_get("/version", h.version)
    app.router.add_post("/tokenize", h.tokenize)
    app.router.add_post("/detokenize", h.detokenize)
    app.router.add_get("/healthz", h.healthz)
    app.router.add_get("/readyz", h.readyz)
    app.router.add_get("/metrics", h.metrics)
    return app
