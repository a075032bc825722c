"""Small asyncio helpers for shutdown paths that must not hang."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any


async def bounded(aw: Awaitable[Any], timeout_s: float) -> bool:
    """Await ``aw`` for at most ``timeout_s``; True if it finished (errors are swallowed).

    NOTE: unlike ``asyncio.wait_for``, this never waits for a timed-out operation to finish
    cancelling: some drivers shield their cleanup, and a shutdown must not hang on it.
    """
    task = asyncio.ensure_future(aw)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        task.cancel()
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return False
    if not task.cancelled():
        task.exception()  # retrieved: a failed cleanup step is not worth a traceback here
    return True
