"""The asyncio event loop a service runs on, by config name: ``uvloop`` (libuv: faster sockets
and scheduling — most of a proxy's or a request router's time is loop and socket overhead) or
``asyncio`` (the standard library's)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from shared.config import ConfigError


def loop_factory(name: str, key: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop ``name`` names (None: asyncio's default); ``key`` is the config key, for
    the error when uvloop is asked for and missing."""
    if name == "asyncio":
        return None
    try:
        import uvloop
    except ImportError as e:
        raise ConfigError(f"{key}: uvloop is not installed here (pip install uvloop), or set it to asyncio") from e
    return uvloop.new_event_loop  # type: ignore[no-any-return]


__all__ = ["loop_factory"]
