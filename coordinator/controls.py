"""Sending the controls one decision needs (:func:`coordinator.core.drop_controls`) to workers.

The ledger already records the decision; a control only makes a worker act on it now. A worker
that misses one finds the replicas INVALID at its next lease, and the audit shows what it kept.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from shared.messages import Control, ControlAck, ErrorCode, ErrorReply, MessageError, decode

#: Controls of one decision in flight at once (an invalidated worker gets one per
#: ``MAX_CONTROL_BLOCKS`` blocks it held).
IN_FLIGHT = 32
#: How a control's outcome starts when the worker refused it as malformed: a worker of an older
#: release does not know ``invalidate_blocks`` (operations.md: workers of two releases may serve
#: side by side while a release rolls out).
REFUSED_AS_INVALID = "refused as invalid"
#: Characters of a worker's refusal kept in an outcome (the worker's text, shown to operators).
REASON_CHARS = 200


def outcome(worker_id: str, data: bytes) -> str:
    """What a worker's reply to a control says: ``acked``, or why not."""
    try:
        reply = decode(data, expect=(ControlAck, ErrorReply))
    except MessageError as e:
        return f"bad reply: {str(e)[:REASON_CHARS]}"
    if isinstance(reply, ErrorReply):
        why = reply.message[:REASON_CHARS]
        return f"{REFUSED_AS_INVALID}: {why}" if reply.code is ErrorCode.INVALID else f"refused ({reply.code}): {why}"
    if reply.worker_id != worker_id:
        return f"bad reply: an ack from {reply.worker_id[:REASON_CHARS]}"
    return "acked"


def one_by_one(c: Control) -> list[Control]:
    """``c``'s blocks as ``invalidate_block`` controls, one each (what older workers know)."""
    return [Control(action="invalidate_block", block_hash=b.block_hash, generations=b.generations, reason=c.reason)
            for b in c.blocks]


async def send_controls(control: Callable[[str, Control], Awaitable[str]],
                        held: dict[str, list[Control]]) -> dict[str, str]:
    """Send each worker its controls; per worker ``acked``, or how many were not and why.

    A worker that refuses an ``invalidate_blocks`` as invalid is sent its blocks again one
    control each; the outcome counts those."""
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def send(wid: str, c: Control) -> str:
        async with gate:
            return await control(wid, c)

    async def one(wid: str, c: Control) -> list[str]:
        r = await send(wid, c)
        if c.action == "invalidate_blocks" and r.startswith(REFUSED_AS_INVALID):
            return list(await asyncio.gather(*(send(wid, b) for b in one_by_one(c))))
        return [r]
    sent = [(wid, c) for wid, cs in held.items() for c in cs]
    got = await asyncio.gather(*(one(wid, c) for wid, c in sent))
    out: dict[str, list[str]] = {}
    for (wid, _), rs in zip(sent, got):
        out.setdefault(wid, []).extend(rs)
    summary = {}
    for wid, rs in sorted(out.items()):
        failed = [r for r in rs if r != "acked"]
        summary[wid] = f"{len(failed)} of {len(rs)} not acked: {failed[0]}" if failed else "acked"
    return summary
