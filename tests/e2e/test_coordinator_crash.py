"""kill -9 of the coordinator process while transitions stream in, then a restart.

The check is Jepsen's queue checker in miniature: every transition whose publish was
acknowledged by JetStream *and* covered by a commit watermark must be in the log exactly
once, and the state rebuilt after the restart must hash equal to a replay of the log.
The publisher behaves like the worker's outbox: what no watermark covers is published
again (same Nats-Msg-Id) until one does.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import aiohttp
import asyncpg
import nats

from coordinator.core import decode_event, replay, state_hash
from shared.messages import LeaseGrant, encode
from shared.subjects import Subjects
from tests.e2e.coordinator_processes import CoordinatorProcess, coordinators  # noqa: F401 - fixture
from tests.integration.coordinator_kit import Worker, block

N = 600
LEASE_BLOCKS = 50


async def test_kill_9_mid_stream_loses_nothing_acknowledged_and_replays_to_the_same_state(
        tmp_path: Path, database_url: str, nats_url: str, subjects: Subjects,
        coordinators: list[CoordinatorProcess]) -> None:
    c1 = CoordinatorProcess("c1", tmp_path, database_url=database_url, nats_url=nats_url, subjects=subjects)
    coordinators.append(c1.start())
    await c1.wait_status("serving")
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    w = Worker(nc, subjects, slots=5 * N)
    beat: asyncio.Task[None] | None = None
    try:
        await w.register()
        await w.watch_watermarks()

        async def heartbeats() -> None:  # keeps the worker alive across the restart
            while True:
                with contextlib.suppress(Exception):
                    await w.heartbeat(timeout=1)
                await asyncio.sleep(0.2)
        beat = asyncio.create_task(heartbeats())

        commits = []
        for start in range(0, N, LEASE_BLOCKS):
            hashes = [block(i) for i in range(start, start + LEASE_BLOCKS)]
            grant = await w.acquire(hashes)
            assert isinstance(grant, LeaseGrant) and grant.write["compressed"] == list(range(LEASE_BLOCKS))
            commits += [w.commit(hashes, i, grant.lease_id) for i in range(LEASE_BLOCKS)]
        assert [t.seq for t in commits] == list(range(1, N + 1))

        acked: set[int] = set()
        killed_at_watermark = -1
        for t in commits:
            with contextlib.suppress(Exception):
                await js.publish(subjects.events("w1"), encode(t), headers={"Nats-Msg-Id": t.source_id})
                acked.add(t.seq)
            if t.seq == N // 3:
                killed_at_watermark = w.watermark
                c1.kill()  # mid-stream: the consumer is busy with what came before
            if t.seq % 25 == 0:
                await asyncio.sleep(0.005)
        assert len(acked) > N // 2, "JetStream accepts publishes while the coordinator is down"
        assert killed_at_watermark < N // 3, "the kill was not mid-stream"

        c1.start()  # the same process again: same config, port and log
        await c1.wait_status("serving")

        # the outbox: republish whatever no watermark covers, until everything is covered
        deadline = time.monotonic() + 60
        while w.watermark < N:
            assert time.monotonic() < deadline, f"watermark stuck at {w.watermark}"
            await asyncio.sleep(1.0)
            for t in commits[w.watermark:]:
                await js.publish(subjects.events("w1"), encode(t), headers={"Nats-Msg-Id": t.source_id})

        db = await asyncpg.connect(database_url)
        try:
            rows = await db.fetch("SELECT source_id, count(*) AS n FROM events WHERE source_id IS NOT NULL "
                                  "GROUP BY source_id")
            stored = {r["source_id"]: r["n"] for r in rows}
            covered = {t.source_id for t in commits if t.seq in acked and t.seq <= w.watermark}
            assert covered <= set(stored), f"lost: {sorted(covered - set(stored))[:10]}"
            assert all(n == 1 for n in stored.values())
            rejected = await db.fetch("SELECT source_id, payload::jsonb->>'reason' AS reason FROM events "
                                      "WHERE type = 'transition.rejected' LIMIT 5")
            assert not rejected, [dict(r) for r in rejected]

            async with aiohttp.ClientSession() as http:
                async with http.post(f"{c1.base}/v1/audit", json={"check_workers": False}) as r:
                    report = await r.json()
            assert report["ok"] and report["hash_match"], report
            # and an independent replay, here, of the log up to the audited position
            log = await db.fetch("SELECT payload::text FROM events WHERE position <= $1 ORDER BY position",
                                 report["position"])
            offline = replay(decode_event(r[0]) for r in log)
            assert state_hash(offline) == report["live_hash"]
            assert "replay_done" in c1.text()
        finally:
            await db.close()
    finally:
        if beat is not None:
            beat.cancel()
        await nc.drain()
    assert c1.terminate() == 0

