"""One ``access`` line per API request, in the worker and the gateway alike.

:func:`install` adds an aiohttp middleware (outermost, so it sees the status the error
middleware answered with) and a response-prepare hook to an app. For every request under
the logged prefixes it writes, at info level, when the request is done::

    {"event": "access", "service": "worker", "id": "3f2a…", "method": "POST",
     "path": "/v1/completions", "status": 200, "tenant": "acme", "prompt_tokens": 12,
     "completion_tokens": 8, "cached_tokens": 0, "fallbacks": 0, "ttfb_ms": 41.2,
     "duration_ms": 97.5, "level": "info", "timestamp": "…"}

* ``id`` — the client's ``X-Request-Id`` when it is a plain token (1–64 of ``[A-Za-z0-9._:-]``),
  else a new one; it is sent back in the ``X-Request-Id`` response header, so one failed
  request can be followed from the client through the gateway's line to the worker's.
* ``ttfb_ms`` — until the response's headers went out: a stream's time to first token (a
  plain JSON response's is its ``duration_ms``: it is sent whole when the handler is done).
* Counts the handler knows (tokens, cached tokens, fallbacks, the tenant where no request key
  holds it) are added with :func:`note` / :func:`note_usage` from anywhere in the request's task
  (a context variable carries the record; tasks the handler starts share it).

Never content: the fields are ids, counts and times (the path without its query string), and
the line passes through :func:`shared.logging.redact_content` like every other.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from aiohttp import web

from shared.logging import get_logger

REQUEST_ID_HEADER = "X-Request-Id"
_VALID_ID = re.compile(r"[A-Za-z0-9._:\-]{1,64}")
#: The record of the request whose task this is (None outside a logged request).
_record: ContextVar[dict[str, Any] | None] = ContextVar("kvl_access_record", default=None)
_RECORD_KEY = web.RequestKey("kvl_access_record", dict)
_T0_KEY = web.RequestKey("kvl_access_t0", float)

log = get_logger("access")


def note(**fields: Any) -> None:
    """Add fields (counts, ids: never content) to the current request's access line, if any."""
    record = _record.get()
    if record is not None:
        record.update(fields)


def note_usage(usage: Any) -> Any:
    """Take the token counts of an OpenAI ``usage`` object for the access line; returns it unchanged."""
    record = _record.get()
    if record is not None and isinstance(usage, dict):
        for key in ("prompt_tokens", "completion_tokens"):
            if isinstance(usage.get(key), int):
                record[key] = usage[key]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if isinstance(cached, int):
            record["cached_tokens"] = cached
    return usage


def current_id() -> str | None:
    """The id of the request whose task this is (to pass on as ``X-Request-Id``), if it is logged."""
    record = _record.get()
    return None if record is None else record["id"]


def request_id(request: web.Request) -> str:
    """The client's ``X-Request-Id`` when it is a plain token, else a new random one."""
    given = request.headers.get(REQUEST_ID_HEADER, "")
    return given if _VALID_ID.fullmatch(given) else uuid.uuid4().hex


def install(app: web.Application, service: str, *, enabled: bool = True, prefixes: tuple[str, ...] = ("/v1/",),
            tenant_of: Callable[[web.Request], str | None] | None = None) -> None:
    """Log every request under ``prefixes`` of ``app`` (call before the app starts).

    ``tenant_of(request)`` names the request's tenant when the app keeps it on the request;
    otherwise the handler calls ``note(tenant=…)``. Disabled (``logging.access_log`` false):
    nothing is installed."""
    if not enabled:
        return

    @web.middleware
    async def access_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        if not request.path.startswith(prefixes):
            return await handler(request)
        t0 = time.perf_counter()
        record: dict[str, Any] = {"id": request_id(request)}
        request[_RECORD_KEY] = record
        request[_T0_KEY] = t0
        token = _record.set(record)
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except web.HTTPException as e:
            status = e.status
            raise
        except BaseException as e:
            status = 499 if isinstance(e, (ConnectionResetError, asyncio.CancelledError)) else 500  # 499: client left
            raise
        finally:
            _record.reset(token)
            if "tenant" not in record and tenant_of is not None:
                try:
                    record["tenant"] = tenant_of(request)
                except Exception:  # noqa: BLE001 - the line matters more than one field
                    record["tenant"] = None
            duration_ms = round((time.perf_counter() - t0) * 1000, 2)
            # NOTE: a plain response is sent after this (its headers at once): its ttfb is its duration
            record.setdefault("ttfb_ms", duration_ms)
            fields = {"service": service, "method": request.method, "path": request.path, "status": status,
                      **record, "duration_ms": duration_ms}
            fields.pop("event", None)
            log.info("access", **fields)

    async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        record = request.get(_RECORD_KEY)
        if record is None:
            return
        response.headers[REQUEST_ID_HEADER] = record["id"]
        record.setdefault("ttfb_ms", round((time.perf_counter() - request[_T0_KEY]) * 1000, 2))

    app.middlewares.insert(0, access_middleware)
    app.on_response_prepare.append(on_prepare)


__all__ = ["REQUEST_ID_HEADER", "current_id", "install", "note", "note_usage", "request_id"]
