"""What the gateway takes in before it routes, in this order: the headers, the API key, the body
within its limits, the JSON.

* **Key first** (:func:`authenticate`): a request without a valid key is a 401 before a byte of
  its body is read (aiohttp then drains the unread body, discarding it, for at most
  ``gateway.body_read_timeout_ms`` and closes the connection), so an unauthenticated client
  cannot make the gateway hold its body.
* **Body** (:func:`read`): a ``Content-Length`` over ``gateway.max_body_bytes`` is a 413 before
  reading; a body without one (chunked) is cut at the limit, a 413 too; a body not received
  within ``gateway.body_read_timeout_ms`` is a 408 and the connection is closed. A client that
  sends its headers slowly never gets this far: ``gateway.keepalive_timeout_ms`` closes it
  (:mod:`shared.http_limits`, as on the workers).
* **JSON** (:func:`parse`): a body no worker could accept — empty, not UTF-8, not JSON, nested
  past the parser's depth, not an object — is a 400 here; everything else is the workers' to
  judge (wrong types, out-of-range values: their 400s pass through). The gateway never refuses
  what a worker would accept: Python's parser takes a superset of what the workers' takes.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from shared.config import Config
from shared.http_limits import BodyTimeout, read_body
from shared.tenants import AuthError, Tenant, TenantDirectory


class Refused(Exception):
    """A request answered before it is routed: an OpenAI-style error."""

    def __init__(self, status: int, message: str, type_: str, code: str,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code
        self.headers = headers

    def response(self) -> web.Response:
        return web.json_response({"error": {"message": self.message, "type": self.type, "param": None,
                                            "code": self.code}}, status=self.status, headers=self.headers)


def body_limit(cfg: Config) -> int:
    """``gateway.max_body_bytes``, or the workers' ``service.max_body_bytes`` when it is 0."""
    return cfg.gateway.max_body_bytes or cfg.service.max_body_bytes


def authenticate(tenants: TenantDirectory, request: web.Request) -> Tenant:
    """The request's tenant from its ``Authorization`` header alone; :class:`Refused` (401)."""
    try:
        return tenants.authenticate(request.headers.get("Authorization"))
    except AuthError as e:
        raise Refused(401, str(e), "authentication_error", "invalid_api_key",
                      {"WWW-Authenticate": "Bearer"}) from None


async def read(request: web.Request, cfg: Config) -> bytes:
    """The body within ``gateway.max_body_bytes`` and ``gateway.body_read_timeout_ms``; :class:`Refused`."""
    limit = body_limit(cfg)
    try:
        return await read_body(request, limit, cfg.gateway.body_read_timeout_ms / 1000)
    except web.HTTPRequestEntityTooLarge:
        raise Refused(413, f"the request body is larger than gateway.max_body_bytes ({limit} bytes)",
                      "invalid_request_error", "body_too_large", {"Connection": "close"}) from None
    except BodyTimeout as e:
        raise Refused(408, str(e), "timeout_error", "body_timeout", {"Connection": "close"}) from None


def parse(body: bytes) -> dict[str, Any]:
    """The body's JSON object; :class:`Refused` (400) for a body no worker could accept."""
    def bad(why: str) -> Refused:
        return Refused(400, f"the request body {why}; send a JSON object", "invalid_request_error", "invalid_json")

    if not body.strip():
        raise bad("is empty")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(f"is not valid JSON: not UTF-8 at byte {e.start}") from None
    try:
        doc = json.loads(text)
    except RecursionError:
        raise bad("nests JSON too deeply") from None
    except ValueError as e:
        raise bad(f"is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise bad(f"is not an object (expected `object`, got `{_json_type(doc)}`)")
    return doc


def _json_type(doc: Any) -> str:
    return {list: "array", str: "str", bool: "bool", int: "int", float: "float"}.get(type(doc), "null")


__all__ = ["Refused", "authenticate", "body_limit", "parse", "read"]
