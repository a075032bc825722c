"""Sending an invalidation's controls: what a worker's reply says, and a worker of an older
release (which does not know ``invalidate_blocks``) told one block at a time."""

from __future__ import annotations

import asyncio

from coordinator.controls import REFUSED_AS_INVALID, outcome, send_controls
from shared.messages import BlockDrop, Control, ControlAck, ErrorCode, ErrorReply, encode

H1, H2 = "a" * 32, "b" * 32
BATCH = Control(action="invalidate_blocks", reason="bad gpu", blocks=[
    BlockDrop(block_hash=H1, generations={"swa": 3}), BlockDrop(block_hash=H2, generations={})])


def test_a_reply_is_an_ack_of_that_worker_or_says_why_not() -> None:
    assert outcome("w1", encode(ControlAck(worker_id="w1", affected=2))) == "acked"
    assert outcome("w1", encode(ControlAck(worker_id="w2"))) == "bad reply: an ack from w2"
    refused = outcome("w1", encode(ErrorReply(code=ErrorCode.INVALID, message="x" * 500)))
    assert refused.startswith(REFUSED_AS_INVALID) and len(refused) < 250      # the worker's text, bounded
    assert outcome("w1", encode(ErrorReply(code=ErrorCode.FENCED, message="no"))) == "refused (fenced): no"
    assert outcome("w1", b"not json").startswith("bad reply: ")


def test_an_older_worker_is_told_the_same_blocks_one_control_each() -> None:
    got: list[Control] = []

    async def older(wid: str, c: Control) -> str:      # an older worker: invalidate_blocks is unknown
        got.append(c)
        return f"{REFUSED_AS_INVALID}: unknown action" if c.action == "invalidate_blocks" else "acked"
    assert asyncio.run(send_controls(older, {"w1": [BATCH]})) == {"w1": "acked"}
    assert [(c.action, c.block_hash, c.generations, c.reason) for c in got[1:]] == [
        ("invalidate_block", H1, {"swa": 3}, "bad gpu"), ("invalidate_block", H2, {}, "bad gpu")]


def test_what_was_not_acked_is_counted_per_worker() -> None:
    async def flaky(wid: str, c: Control) -> str:
        if wid == "w2":
            return "timed out"
        return f"{REFUSED_AS_INVALID}: x" if c.action == "invalidate_blocks" or c.block_hash == H2 else "acked"
    assert asyncio.run(send_controls(flaky, {"w1": [BATCH], "w2": [BATCH, BATCH]})) == {
        "w1": f"1 of 2 not acked: {REFUSED_AS_INVALID}: x", "w2": "2 of 2 not acked: timed out"}
