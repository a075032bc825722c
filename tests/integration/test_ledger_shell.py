"""The ledger shell on the in-memory twin of the log (fast, no services): replies wait for the
commit, a failed append is answered UNAVAILABLE and the state is rebuilt from the log, a
fenced append steps down, replay reports progress. The twin honours the same contract as
PostgreSQL (test_eventlog_contract.py); the wrapper below only injects failures."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
from structlog.testing import capture_logs

from coordinator.core import CoreParams, decode_event, heartbeat, register_worker, replay, state_hash
from coordinator.ledger import Ledger, Unavailable
from coordinator.log import InMemoryEventLog, LogUnavailable, NewEvent
from coordinator.metrics import CoordinatorMetrics
from coordinator.replay import load_state
from shared.logging import get_logger
from shared.messages import ErrorCode, Heartbeat, RegisterReply, WorkerRegister
from tests.integration.coordinator_kit import CATALOGUE, NS


class ControlledLog(InMemoryEventLog):
    """The twin, with appends that can be held back or made to fail."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail_next = 0

    async def append(self, batch: Sequence[NewEvent], leader_epoch: int) -> list[int | None]:
        await self.gate.wait()
        if self.fail_next:
            self.fail_next -= 1
            raise LogUnavailable("injected: connection reset", committed_unknown=False)
        return await super().append(batch, leader_epoch)


def register(worker: str) -> Any:
    msg = WorkerRegister(worker_id=worker, namespace=NS, catalogue=CATALOGUE, pool_slots={"compressed": 10})
    return lambda s: register_worker(s, msg, 1000)


async def serving_ledger(log: ControlledLog, **kw: Any) -> Ledger:
    ledger = Ledger(log, CoreParams(), batch_ms=1, batch_max=100, snapshot_every=10_000,
                    metrics=CoordinatorMetrics(), logger=get_logger("test"), **kw)
    await ledger.take_over(await log.take_leadership("test"))
    return ledger


async def log_state(log: InMemoryEventLog) -> str:
    return state_hash(replay(decode_event(e.payload) for e in await log.read(1, 10_000)))


async def test_a_reply_waits_for_its_commit_and_a_no_event_reply_for_earlier_commits() -> None:
    log = ControlledLog()
    ledger = await serving_ledger(log)
    log.gate.clear()
    reg = asyncio.create_task(ledger.execute(register("w1")))
    await asyncio.sleep(0.05)
    assert not reg.done() and ledger.state.workers["w1"].epoch == 1  # applied, not yet answered
    # a decision with no events computed on that state waits for it too
    peek = asyncio.create_task(ledger.execute(lambda s: (sorted(s.workers), [])))
    await asyncio.sleep(0.05)
    assert not peek.done()
    log.gate.set()
    assert isinstance(await reg, RegisterReply) and await peek == ["w1"]
    assert await log.head() == 2  # CoordinatorResumed + WorkerRegistered
    await ledger.stand_down("test")


async def test_execute_all_decides_in_order_and_commits_once() -> None:
    log = ControlledLog()
    ledger = await serving_ledger(log)
    assert ledger.committer is not None
    batches = ledger.committer.batches

    def broken(s: Any) -> Any:
        raise RuntimeError("a bug in one decision")

    log.gate.clear()
    task = asyncio.create_task(ledger.execute_all(
        [register("w1"), lambda s: (sorted(s.workers), []), broken, register("w2")]))
    await asyncio.sleep(0.05)
    assert not task.done() and sorted(ledger.state.workers) == ["w1", "w2"]  # applied, not yet answered
    log.gate.set()
    r1, seen, err, r2 = await task
    assert isinstance(r1, RegisterReply) and isinstance(r2, RegisterReply)
    assert seen == ["w1"] and isinstance(err, RuntimeError)  # later decisions see earlier ones; a failure is local
    assert ledger.committer.batches == batches + 1
    assert [e.type for e in await log.read(2, 10)] == ["worker.registered", "worker.registered"]
    assert await log_state(log) == state_hash(ledger.state)
    await ledger.stand_down("test")


async def test_failed_append_answers_unavailable_and_rebuilds_from_the_log() -> None:
    log = ControlledLog()
    ledger = await serving_ledger(log)
    await ledger.execute(register("w1"))
    durable = await log_state(log)
    log.gate.clear()
    log.fail_next = 1
    doomed = [asyncio.create_task(ledger.execute(register(f"x{i}"))) for i in range(5)]
    await asyncio.sleep(0.02)
    assert "x4" in ledger.state.workers  # applied live, never durable
    log.gate.set()
    results = await asyncio.gather(*doomed, return_exceptions=True)
    assert all(isinstance(r, Unavailable) and r.code == ErrorCode.UNAVAILABLE for r in results), results
    for _ in range(100):
        if ledger.serving:
            break
        await asyncio.sleep(0.01)
    assert ledger.serving
    assert "x0" not in ledger.state.workers and state_hash(ledger.state) == durable
    hb = await ledger.execute(lambda s: heartbeat(s, Heartbeat(worker_id="w1", epoch=1), 2000))
    assert hb.committed_seq == 0
    await ledger.stand_down("test")


async def test_a_fenced_append_steps_down() -> None:
    log = ControlledLog()
    told: list[str] = []
    ledger = await serving_ledger(log, on_not_leader=told.append)
    await log.take_leadership("someone else")
    with pytest.raises(Unavailable) as err:
        await ledger.execute(register("w1"))
    assert err.value.code == ErrorCode.NOT_LEADER
    assert ledger.status == "standby" and told and "stale" in told[0]
    with pytest.raises(Unavailable):
        await ledger.execute(register("w2"))
    await ledger.stand_down("test")


async def test_snapshot_then_replay_reports_progress_and_matches() -> None:
    log = ControlledLog()
    ledger = await serving_ledger(log)
    for i in range(30):
        await ledger.execute(register(f"w{i}"))
    snap = await ledger.snapshot()
    assert snap.position == await log.head() == 31
    for i in range(30, 45):
        await ledger.execute(register(f"w{i}"))
    with capture_logs() as logs:
        result = await load_state(log, CoreParams(), page=4, progress_every=5, logger=get_logger("test"))
    assert result.snapshot_position == 31 and result.events == 15
    assert state_hash(result.state) == state_hash(ledger.state)
    progress = [e for e in logs if e["event"] == "replay_progress"]
    assert [e["events"] for e in progress] == [8, 12, 15]  # per page of 4, at most once per 5 events
    assert all(e["events_per_s"] > 0 for e in progress)
    await ledger.stand_down("test")
