"""Which worker failures the gateway retries, where, and after how long (``gateway.retry_*``).

Only failures before any byte reached the client are ever retried — after that the answer is the
worker's, cut or not. Of those, ``gateway.retry_on`` names the ones that are: ``connect`` (the
connection was refused, reset or closed before the answer was whole, or connecting timed out:
the worker is gone or going) and worker statuses (503 by default: it is shutting down or not
ready). A retry goes to the next candidate the route gave, round again when there are fewer
candidates than ``gateway.retry_attempts``, after ``retry_backoff_ms`` doubled for each retry
(at most ``retry_backoff_max_ms``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TypeVar

import aiohttp

CONNECT = "connect"
T = TypeVar("T")


def attempt_order(choices: Sequence[T], attempts: int) -> list[T]:
    """The worker tried at each attempt: the candidates in the route's order, round again."""
    return [choices[i % len(choices)] for i in range(attempts)] if choices else []


def is_connect_failure(e: BaseException) -> bool:
    """A failure of the connection itself (refused, reset, closed mid-answer, connect timeout),
    as opposed to a request aiohttp could not make at all."""
    return isinstance(e, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError))


def error_retried(e: BaseException, retry_on: Sequence[str | int]) -> bool:
    return CONNECT in retry_on and is_connect_failure(e)


def status_retried(status: int, retry_on: Sequence[str | int]) -> bool:
    return status in retry_on


def backoff_s(retry: int, base_ms: int, max_ms: int) -> float:
    """The wait before retry number ``retry`` (1 = the first retry)."""
    return min(max_ms, base_ms * 2 ** (retry - 1)) / 1000 if retry > 0 else 0.0
