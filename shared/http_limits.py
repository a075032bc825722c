"""How long and how much an HTTP client may make a server hold: the bounds the worker's API and
the gateway share (aiohttp servers both).

* **Headers** — aiohttp's keep-alive timer runs from a connection's start (and again from each
  answer) and closes the connection if no complete request arrived by then, so it bounds an idle
  connection and a client that sends its headers slowly alike (:func:`handler_args`). Nothing
  is answered: there is no request to answer yet.
* **Body** — :func:`read_body`: a ``Content-Length`` over the limit is refused before a byte is
  read; a body is read within a timeout (:class:`BodyTimeout`, a 408) and up to the limit, a
  chunked one included (the app's ``client_max_size``, which must be the limit: aiohttp stops
  reading past it). A caller that refuses a request before reading its body (a 401) leaves the
  body unread: aiohttp then drains it, discarding it, for at most the ``lingering_time`` of
  :func:`handler_args` before it closes the connection.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web


class BodyTimeout(Exception):
    """The body did not arrive within the read timeout (the caller answers 408, Connection: close)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"the request body was not received within {timeout_s:g} s; send it at once")
        self.timeout_s = timeout_s


def handler_args(keepalive_timeout_ms: int, lingering_ms: int | None = None) -> dict[str, Any]:
    """``web.Application(handler_args=...)``: connections idle, or sending their headers, for
    longer than ``keepalive_timeout_ms`` are closed; an unread body is drained (discarded) for at
    most ``lingering_ms`` (aiohttp's 10 s when None) after the answer, then the connection closed."""
    args: dict[str, Any] = {"keepalive_timeout": keepalive_timeout_ms / 1000}
    if lingering_ms is not None:
        args["lingering_time"] = lingering_ms / 1000
    return args


async def read_body(request: web.Request, limit: int, timeout_s: float) -> bytes:
    """The body, at most ``limit`` bytes, received within ``timeout_s``.

    Raises :class:`aiohttp.web.HTTPRequestEntityTooLarge` for a longer body (before reading when
    its ``Content-Length`` says so, else once ``limit`` bytes are exceeded) and
    :class:`BodyTimeout`. Cached by aiohttp: a second call returns the same bytes at once.
    """
    assert request.client_max_size == limit, "the app's client_max_size must be the body limit"
    if request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()    # the app's client_max_size stops a longer chunked body
    except TimeoutError:
        raise BodyTimeout(timeout_s) from None


__all__ = ["BodyTimeout", "handler_args", "read_body"]
