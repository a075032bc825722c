"""A served request's end: its last chunk waits for its commits to settle, not for its leases' release."""

from __future__ import annotations

import asyncio

from tests.serving.conftest import MODEL, until

BODY = {"model": MODEL, "prompt": "A prompt of three whole blocks and a few more bytes.", "max_tokens": 2,
        "temperature": 0}


async def test_a_response_ends_before_its_leases_are_released_and_they_are_released_after(serve) -> None:
    async with serve() as s:
        gate, sent = asyncio.Event(), []
        release = s.twin.release

        async def held_release(msg):
            sent.append(msg.lease_id)
            await gate.wait()
            return await release(msg)

        s.twin.release = held_release
        # (bounded: a response that waited for its release would wait for the gate forever)
        status, body, _ = await asyncio.wait_for(s.post("/v1/completions", BODY), 10)
        assert status == 200 and body["choices"][0]["text"]
        # the answer came back while the release it sent was still held: the lease is live
        await until("no release sent", lambda: sent)
        assert s.live_leases() >= 1 and s.engine.releasing and not s.engine.sessions
        assert "kvl_worker_releasing_sessions 1.0" in (await s.get("/metrics"))[1]
        gate.set()
        await until("the lease was not released", lambda: s.live_leases() == 0 and not s.engine.releasing)
        assert "kvl_worker_releasing_sessions 0.0" in (await s.get("/metrics"))[1]
        # the next turn reads the blocks the first one committed, released or not
        gate.clear()
        status, body, _ = await s.post("/v1/completions", BODY)
        assert status == 200 and body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        gate.set()


async def test_stopping_lets_a_deferred_release_finish(serve) -> None:
    async with serve() as s:
        gate = asyncio.Event()
        release = s.twin.release

        async def slow_release(msg):
            await gate.wait()
            return await release(msg)

        s.twin.release = slow_release
        status, _, _ = await s.post("/v1/completions", BODY)
        assert status == 200 and s.engine.releasing
        asyncio.get_running_loop().call_later(0.2, gate.set)     # well within stop()'s grace
        await s.engine.stop()
        assert s.live_leases() == 0 and not s.engine.releasing
