"""Two coordinator processes on one log: exactly one leader; a paused leader is replaced and,
when it wakes, cannot write; a clean SIGTERM hands the lock over at once.

Why SIGSTOP and not kill: a stopped process keeps its TCP connections (the kernel answers
for it), so PostgreSQL keeps its advisory lock forever. The standby must notice that the
leader stopped renewing, terminate its sessions and take over with a higher epoch; the
woken leader's append is then refused by PostgreSQL itself (epoch check in the append
transaction), not by its own good manners.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import asyncpg
import nats

from shared.messages import ErrorCode, ErrorReply, RegisterReply
from shared.subjects import Subjects
from tests.e2e.coordinator_processes import CoordinatorProcess, coordinators  # noqa: F401 - fixture
from tests.integration.coordinator_kit import Worker

#: heartbeat_interval_ms × missed_heartbeats: how long a silent leader keeps the lock.
FAST = {"heartbeat_interval_ms": 200, "missed_heartbeats": 5}


async def test_one_leader_a_paused_leader_is_fenced_and_sigterm_hands_over(
        tmp_path: Path, database_url: str, nats_url: str, subjects: Subjects,
        coordinators: list[CoordinatorProcess]) -> None:
    a = CoordinatorProcess("a", tmp_path, database_url=database_url, nats_url=nats_url, subjects=subjects, **FAST)
    b = CoordinatorProcess("b", tmp_path, database_url=database_url, nats_url=nats_url, subjects=subjects, **FAST)
    coordinators.append(a.start())
    first = await a.wait_status("serving")
    coordinators.append(b.start())
    await b.wait_status("standby")
    assert first["leader_epoch"] == 1
    nc = await nats.connect(nats_url)
    db = await asyncpg.connect(database_url)
    try:
        w = Worker(nc, subjects)
        assert isinstance(await w.register(), RegisterReply)  # served by a, the only subscriber

        a.signal(signal.SIGSTOP)
        await asyncio.sleep(0.2)
        # delivered to a (b is a standby and not subscribed): it waits in a's socket
        stranded = asyncio.create_task(w.heartbeat(timeout=30))
        t0 = time.monotonic()
        taken = await b.wait_status("serving", timeout_s=20)
        takeover_s = time.monotonic() - t0
        assert taken["leader_epoch"] == 2
        assert "leader_stale_taking_over" in b.text()
        takeover_at = await db.fetchval("SELECT min(position) FROM events WHERE leader_epoch = 2")

        a.signal(signal.SIGCONT)
        reply = await stranded
        assert isinstance(reply, ErrorReply), f"the paused leader answered a request after takeover: {reply}"
        assert reply.code in (ErrorCode.NOT_LEADER, ErrorCode.UNAVAILABLE)
        await a.wait_status("standby", timeout_s=20)
        assert "leadership_lost" in a.text()

        # exactly one leader; nothing of epoch 1 was written after epoch 2 began
        assert (await b.readyz())[0] == 200 and (await a.readyz())[0] == 503
        late = await db.fetchval("SELECT count(*) FROM events WHERE leader_epoch = 1 AND position > $1",
                                 takeover_at)
        assert late == 0
        epochs = [r[0] for r in await db.fetch("SELECT leader_epoch FROM events ORDER BY position")]
        assert epochs == sorted(epochs)
        # requests now reach the new leader only
        for _ in range(3):
            assert isinstance(await w.register(), RegisterReply)

        # a clean stop releases the lock at once: a takes over without waiting for staleness
        t0 = time.monotonic()
        assert b.terminate() == 0
        third = await a.wait_status("serving", timeout_s=10)
        assert third["leader_epoch"] == 3
        handover_s = time.monotonic() - t0
        assert handover_s < 5, handover_s
        assert isinstance(await w.register(), RegisterReply)
        assert "coordinator_stopped" in b.text()
    finally:
        await db.close()
        await nc.drain()
    assert takeover_s < 15
