"""The admin API's shared pieces (errors, input patterns, the app state): what handlers, input and middleware read."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from coordinator.ledger import Ledger
from coordinator.metrics import CoordinatorMetrics

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Every pattern is checked with ``fullmatch`` and ends in ``\Z`` (Python's ``$`` also matches before a
# final newline); /openapi.json declares the same text with JSON Schema's ``$`` (``_ecma_patterns``).
HEX32 = re.compile(r"^[0-9a-f]{32}\Z")
NAME = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}\Z")
#: A page cursor: the hex of the last key returned (any even-length hex is a valid position).
CURSOR = re.compile(r"^(?:[0-9a-f]{2}){1,1024}\Z")
MAX_PAGE = 1000
MAX_AFTER = 2**62


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


def error_response(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status)


# --- the app's state, as the handlers see it ---------------------------------------------------

@dataclass
class AdminContext:
    """What the admin API needs from the running coordinator (filled in once it has started)."""

    metrics: CoordinatorMetrics
    admin_token: str = ""
    ledger: Ledger | None = None
    #: Tokens a reload replaced (``shared.key_rotation``): token -> monotonic deadline.
    retired_tokens: dict[str, float] = field(default_factory=dict)
    #: Usage shares from which the status page draws a pool amber and red.
    ui_thresholds: dict[str, float] = field(default_factory=lambda: {"warn": 0.8, "critical": 0.95})
    #: ``(monotonic time, counts)`` of the last tier count (see :data:`TIERS_MAX_AGE_S`).
    tiers_memo: tuple[float, dict[str, dict[str, int]]] | None = None
    #: ``inventory(worker_id, timeout_s)`` and ``control(worker_id, Control)`` over NATS.
    inventory: Callable[..., Awaitable[Any]] | None = None
    control: Callable[..., Awaitable[str]] | None = None


ADMIN = web.AppKey("admin", AdminContext)
LOGGER = web.AppKey("logger", Any)


def _ctx(request: web.Request) -> AdminContext:
    return request.app[ADMIN]


def _ledger(request: web.Request) -> Ledger:
    ledger = _ctx(request).ledger
    if ledger is None:
        raise ApiError(503, "unavailable", "the coordinator is starting")
    return ledger


async def _serving_ledger(request: web.Request) -> Ledger:
    """The ledger, after everything queued so far has committed (see module docstring)."""
    ledger = _ledger(request)
    ledger.check_serving()
    if (b := ledger.barrier()) is not None:
        with contextlib.suppress(Exception):
            await asyncio.shield(b)
        ledger.check_serving()
    return ledger
