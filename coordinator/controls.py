"""Sending the controls one decision needs (:func:`coordinator.core.drop_controls`) to workers.

The ledger already records the decision; a control only makes a worker act on it now. A worker
that misses one finds the replicas INVALID at its next lease, and the audit shows what it kept.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from shared.messages import Control

#: Controls of one decision in flight at once (an invalidated worker gets one per
#: ``MAX_CONTROL_BLOCKS`` blocks it held).
IN_FLIGHT = 32


async def send_controls(control: Callable[[str, Control], Awaitable[str]],
                        held: dict[str, list[Control]]) -> dict[str, str]:
    """Send each worker its controls; per worker ``acked``, or how many were not and why."""
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def one(wid: str, c: Control) -> str:
        async with gate:
            return await control(wid, c)
    sent = [(wid, c) for wid, cs in held.items() for c in cs]
    got = await asyncio.gather(*(one(wid, c) for wid, c in sent))
    out: dict[str, list[str]] = {}
    for (wid, _), r in zip(sent, got):
        out.setdefault(wid, []).append(r)
    summary = {}
    for wid, rs in sorted(out.items()):
        failed = [r for r in rs if r != "acked"]
        summary[wid] = f"{len(failed)} of {len(rs)} not acked: {failed[0]}" if failed else "acked"
    return summary
