"""PostgreSQL goes away under a serving coordinator: every lease request is still answered,
quickly, with UNAVAILABLE; when PostgreSQL is back the coordinator recovers by itself."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import nats

from shared.embedded import EmbeddedPostgres
from shared.messages import ErrorCode, ErrorReply, LeaseGrant, ResumeReply
from shared.subjects import Subjects
from tests.integration.coordinator_kit import Worker, block, fast_config, running_coordinator, wait_ready

#: connect_timeout_ms is 1000 in fast_config: an answer must come well within a few of those.
BOUND_S = 4.0


async def test_postgres_outage_is_answered_unavailable_and_recovers_by_itself(
        tmp_path: Path, nats_url: str, subjects: Subjects) -> None:
    pg = EmbeddedPostgres(tmp_path / "pg")
    await asyncio.to_thread(pg.start)
    try:
        cfg = fast_config(pg.url, nats_url, subjects)
        async with running_coordinator(cfg) as (app, base):
            nc = await nats.connect(nats_url)
            try:
                w = Worker(nc, subjects)
                await w.register()
                before = await w.acquire([block(1)])
                assert isinstance(before, LeaseGrant)

                await asyncio.to_thread(pg.stop)
                slowest = 0.0
                for i in range(6):
                    t0 = time.monotonic()
                    reply = await w.acquire([block(100 + i)], timeout=10)
                    slowest = max(slowest, time.monotonic() - t0)
                    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.UNAVAILABLE, reply
                    assert reply.retry_after_ms > 0
                    await asyncio.sleep(0.2)
                assert slowest < BOUND_S, f"an UNAVAILABLE answer took {slowest:.2f}s"
                status = await wait_ready(base, 5, want=503)
                assert status["status"] == "degraded"

                await asyncio.to_thread(pg.start)  # same port, same data
                t0 = time.monotonic()
                status = await wait_ready(base, 30)
                assert status["leader_epoch"] == 2, status
                # the new leader epoch suspended w1; it resumes its epoch rather than re-registering
                suspended = await w.acquire([block(200)])
                assert isinstance(suspended, ErrorReply) and suspended.code == ErrorCode.SUSPENDED, suspended
                resumed = await w.resume()
                assert isinstance(resumed, ResumeReply) and resumed.epoch == w.epoch == 1, resumed
                after = await w.acquire([block(200)])
                assert isinstance(after, LeaseGrant), after
                recovery_s = time.monotonic() - t0
                assert recovery_s < 30
                # nothing acknowledged before the outage was lost; the audit agrees with the log
                async with aiohttp.ClientSession() as http:
                    async with http.get(f"{base}/v1/leases") as r:
                        leases = {lease["lease_id"] for lease in (await r.json())["leases"]}
                    async with http.post(f"{base}/v1/audit", json={"check_workers": False}) as r:
                        report = await r.json()
                assert {before.lease_id, after.lease_id} <= leases
                assert report["ok"], report
            finally:
                await nc.drain()
    finally:
        await asyncio.to_thread(pg.stop)
