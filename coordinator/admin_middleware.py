"""The admin API's middleware: errors become HTTP responses in one place, and the bearer token is checked."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import time

from aiohttp import web

from coordinator.admin_context import LOGGER, AdminContext, ApiError, Handler, _ctx, error_response
from coordinator.core import CoreError, UnknownReplica, UnknownWorker
from coordinator.unavailable import Unavailable


_HTTP_CODES = {400: "invalid", 401: "unauthorized", 403: "forbidden", 404: "not_found",
               405: "method_not_allowed", 413: "too_large"}


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The one place where errors become HTTP responses."""
    try:
        return await handler(request)
    except ApiError as e:
        return error_response(e.status, e.code, e.message)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        response = error_response(e.status, _HTTP_CODES.get(e.status, "error"), e.reason)
        if "Allow" in e.headers:  # a 405 names the methods the path has (RFC 9110 15.5.6)
            response.headers["Allow"] = e.headers["Allow"]
        return response
    except Unavailable as e:
        return error_response(503, e.code.value, str(e))
    except (UnknownWorker, UnknownReplica) as e:
        return error_response(404, "not_found", str(e))
    except CoreError as e:
        return error_response(400, "invalid", str(e))
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - a bug: logged with its traceback, answered without it
        request.app[LOGGER].error("admin_request_failed", path=request.path, method=request.method, exc_info=True)
        return error_response(500, "internal", "internal error (logged)")


def rotate_token(ctx: AdminContext, token: str, grace_s: float, now: float | None = None) -> None:
    """Use ``token`` from now on; the one it replaces stays valid for ``grace_s`` seconds."""
    now = time.monotonic() if now is None else now
    kept = {t: d for t, d in ctx.retired_tokens.items() if d > now and t != token}
    if ctx.admin_token and ctx.admin_token != token and grace_s > 0:
        kept[ctx.admin_token] = now + grace_s
    ctx.admin_token, ctx.retired_tokens = token, kept


def _token_ok(ctx: AdminContext, given: str) -> bool:
    now = time.monotonic()
    ok = hmac.compare_digest(given.encode(), ctx.admin_token.encode())
    for token, deadline in ctx.retired_tokens.items():   # each compared, so the time says nothing
        ok |= hmac.compare_digest(given.encode(), token.encode()) and deadline > now
    return ok


def _loopback(request: web.Request) -> bool:
    try:
        return ipaddress.ip_address(request.remote or "").is_loopback
    except ValueError:
        return False


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path == "/ui" and not _ctx(request).admin_token and not _loopback(request):
        raise ApiError(401, "unauthorized", "the status page without an admin token (coordinator.admin_token or "
                                            "KVL_ADMIN_TOKEN) is served to loopback clients only")
    if request.path.startswith("/v1/"):
        token = _ctx(request).admin_token
        if token:
            given = request.headers.get("Authorization", "")
            if not given.startswith("Bearer "):
                raise ApiError(401, "unauthorized", "admin API: send 'Authorization: Bearer <token>'")
            if not _token_ok(_ctx(request), given[7:]):
                raise ApiError(401, "unauthorized", "admin API: wrong bearer token")
        elif not _loopback(request):
            raise ApiError(401, "unauthorized", "admin API without a token (coordinator.admin_token or "
                                                "KVL_ADMIN_TOKEN) is served to loopback clients only")
    return await handler(request)
