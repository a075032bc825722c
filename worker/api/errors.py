"""Errors at the edge: every failure becomes one OpenAI-style JSON error, in one place.

``{"error": {"message", "type", "param", "code"}}``. Domain errors raised below the API
(scheduler, tenants, chat template) are typed; :func:`error_middleware` maps each type to
its status here and nowhere else:

=================================  ======  ========================  =====================
error                              status  type                      code
=================================  ======  ========================  =====================
bad JSON, nesting > 64, limits     400     invalid_request_error     (per case)
prompt + max_tokens > context      400     invalid_request_error     context_length_exceeded
model has no chat template         400     invalid_request_error     chat_template_missing
chat template refuses the messages 400     invalid_request_error     chat_template_error
an image part refused (limits…)    400     invalid_request_error     (per case: shared.images)
missing / wrong / malformed key    401     authentication_error      invalid_api_key
unknown model                      404     invalid_request_error     model_not_found
unknown route                      404     invalid_request_error     not_found
wrong method                       405     invalid_request_error     method_not_allowed
body not sent in body_read_timeout 408     timeout_error             body_timeout
body larger than max_body_bytes    413     invalid_request_error     request_too_large
queue full                         429     rate_limit_error          queue_full (+ Retry-After)
shutting down                      503     service_unavailable       shutting_down
queue / request timeout            504     timeout_error             queue_timeout / request_timeout
engine failure, anything else      500     internal_error            internal_error
=================================  ======  ========================  =====================

Nothing a client sends can produce a 5xx: a 500 is a bug and is logged with its traceback
(never with the request's content).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from shared.logging import get_logger
from shared.images import ImageError
from shared.text.chat_template import ChatTemplateError
from worker.request import (
    ContextTooLong, InternalError, InvalidRequest, QueueFull, QueueTimeout, RequestTimeout, SchedulerError, ShuttingDown,
)
from shared.tenants import AuthError

log = get_logger("kvl.worker.api")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",  # noqa: A002
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    @classmethod
    def invalid(cls, message: str, param: str | None, code: str | None = None) -> ApiError:
        return cls(400, message, param=param, code=code)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.Response(status=self.status, body=msgspec.json.encode(self.body()),
                            content_type="application/json", headers=self.headers)


def to_api_error(e: BaseException) -> ApiError | None:
    """The HTTP form of a domain error; None for anything unexpected (a bug)."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, ContextTooLong):
        return ApiError(400, str(e), param=e.param, code="context_length_exceeded")
    if isinstance(e, InvalidRequest):
        return ApiError(400, str(e), param=e.param)
    if isinstance(e, ChatTemplateError):
        return ApiError(400, str(e), param=e.param, code=e.code)
    if isinstance(e, ImageError):
        return ApiError(400, str(e), param=e.param, code=e.code)
    if isinstance(e, AuthError):
        return ApiError(401, str(e), type="authentication_error", code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"})
    if isinstance(e, QueueFull):
        return ApiError(429, str(e), type="rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(e.retry_after_s)})
    if isinstance(e, QueueTimeout):
        return ApiError(504, str(e), type="timeout_error", code="queue_timeout")
    if isinstance(e, RequestTimeout):
        return ApiError(504, str(e), type="timeout_error", code="request_timeout")
    if isinstance(e, InternalError):
        return ApiError(500, str(e), type="internal_error", code="internal_error")
    if isinstance(e, ShuttingDown):
        return ApiError(503, str(e), type="service_unavailable", code="shutting_down")
    if isinstance(e, SchedulerError):
        return ApiError(503, str(e), type="service_unavailable", code="unavailable")
    return None


_HTTP = {404: ("not_found", "no such route: {path}"),
         405: ("method_not_allowed", "method {method} is not allowed on {path}"),
         413: ("request_too_large", "the request body is larger than service.max_body_bytes ({limit} bytes)")}


def internal_error() -> ApiError:
    return ApiError(500, "internal error (logged)", type="internal_error", code="internal_error")


def error_middleware(max_body_bytes: int, on_status: Callable[[web.Request, int], None]) -> Any:
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except web.HTTPException as e:
            if e.status < 400:
                status = e.status
                raise
            code, text = _HTTP.get(e.status, ("http_error", e.reason))
            err = ApiError(e.status, text.format(path=request.path, method=request.method, limit=max_body_bytes),
                           code=code)
            status = err.status
            return err.response()
        except asyncio.CancelledError:
            status = 499                        # the client went away (nginx's convention, for metrics)
            raise
        except Exception as e:  # noqa: BLE001 - the one place errors become responses
            err = to_api_error(e)
            if err is None:
                log.error("request_failed", path=request.path, method=request.method, error=type(e).__name__,
                          exc_info=True)
                err = internal_error()
            status = err.status
            return err.response()
        finally:
            on_status(request, status)

    return middleware
