"""The ledger shell on the in-memory twin of the log (fast, no services): replies wait for the
commit, a failed append is answered UNAVAILABLE and the state is rebuilt from the log, a
fenced append steps down, replay reports progress. The twin honours the same contract as
PostgreSQL (test_eventlog_contract.py); the wrapper below only injects failures."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Sequence
from typing import Any

import pytest
from structlog.testing import capture_logs

from coordinator import snapshot_child
from coordinator.core import (
    CoreParams, decode_event, from_snapshot, heartbeat, register_worker, replay, state_hash, to_snapshot,
)
from coordinator.ledger import Ledger
from coordinator.log import InMemoryEventLog, LogUnavailable, NewEvent
from coordinator.metrics import CoordinatorMetrics
from coordinator.replay import load_state
from coordinator.snapshot_child import can_fork
from coordinator.unavailable import Unavailable
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


def _freezes(ledger: Ledger, how: str) -> float:
    return ledger.metrics.registry.get_sample_value("kvl_coordinator_snapshot_freeze_seconds_count",
                                                     {"how": how}) or 0.0


@pytest.mark.skipif(not can_fork(), reason="no fork() on this OS: snapshots are always taken in process")
async def test_a_snapshot_serialised_by_a_child_is_the_one_taken_in_process() -> None:
    log = ControlledLog()
    ledger = await serving_ledger(log)
    for i in range(12):
        await ledger.execute(register(f"w{i}"))
    expected = (state_hash(ledger.state), to_snapshot(ledger.state))
    forked = await ledger.snapshot()
    ledger.snapshot_fork = False
    here = await ledger.snapshot()
    assert (forked.state_hash, bytes(forked.state)) == expected == (here.state_hash, bytes(here.state))
    assert forked.position == here.position == await log.head()
    assert _freezes(ledger, "fork") == 1 and _freezes(ledger, "in_process") == 1
    await ledger.stand_down("test")


@pytest.mark.skipif(not can_fork(), reason="no fork() on this OS")
async def test_decisions_go_on_while_the_child_serialises_and_the_snapshot_is_of_the_fork(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    log = ControlledLog()
    ledger = await serving_ledger(log)
    await ledger.execute(register("w1"))
    at_fork = (await log.head(), state_hash(ledger.state))
    gate, seen = tmp_path / "go", tmp_path / "seen"

    def held_back(state: Any) -> bytes:   # runs in the child only: it finishes once the test says so
        deadline = time.monotonic() + 20  # (a bound for a broken build, not part of the check)
        while not gate.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        seen.write_text("gate" if gate.exists() else "no gate")
        return to_snapshot(state)
    monkeypatch.setattr(snapshot_child, "to_snapshot", held_back)
    taking = asyncio.create_task(ledger.snapshot())
    await asyncio.sleep(0.05)
    # NOTE: an order, not a duration: the gate opens only once this decision is answered, so
    # with the ledger frozen for the whole snapshot the child would finish without it
    reply = await ledger.execute(register("w2"))
    gate.touch()
    assert isinstance(reply, RegisterReply) and "w2" in ledger.state.workers
    snap = await taking
    assert seen.read_text() == "gate"
    assert (snap.position, snap.state_hash) == at_fork        # the state as it was at the fork
    assert state_hash(from_snapshot(snap.state)) == at_fork[1]
    assert (await log.latest_snapshot()).position == at_fork[0]  # type: ignore[union-attr]
    await ledger.stand_down("test")


@pytest.mark.skipif(not can_fork(), reason="no fork() on this OS")
async def test_a_failed_or_stuck_child_skips_that_snapshot_and_the_next_one_is_taken(
        monkeypatch: pytest.MonkeyPatch) -> None:
    log = ControlledLog()
    ledger = await serving_ledger(log)
    await ledger.execute(register("w1"))

    def broken(state: Any) -> bytes:
        raise MemoryError("in the child")
    monkeypatch.setattr(snapshot_child, "to_snapshot", broken)
    with pytest.raises(Unavailable, match=r"snapshot not taken: .*status 70 \(it raised\)"):
        await ledger.snapshot()

    def stuck(state: Any) -> bytes:
        time.sleep(30)
        return b""
    monkeypatch.setattr(snapshot_child, "to_snapshot", stuck)
    ledger.snapshot_timeout_s = 0.5
    with pytest.raises(Unavailable, match="ran past 0.5 s; killed"):
        await ledger.snapshot()
    assert ledger.metrics.registry.get_sample_value("kvl_coordinator_snapshot_failures_total") == 2
    assert await log.latest_snapshot() is None and ledger.serving
    monkeypatch.undo()
    snap = await ledger.snapshot()
    assert snap.state_hash == state_hash(ledger.state) and (await log.latest_snapshot()) is not None
    await ledger.stand_down("test")


@pytest.mark.skipif(not can_fork() or not os.path.isdir("/proc/self/fd"), reason="needs fork() and /proc")
async def test_the_snapshot_child_keeps_none_of_the_parents_sockets(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Any) -> None:
    log = ControlledLog()
    ledger = await serving_ledger(log)
    await ledger.execute(register("w1"))
    held = tmp_path / "fds"

    def listing(state: Any) -> bytes:   # in the child: which descriptors are open, and what they are
        fds = {int(f) for f in os.listdir("/proc/self/fd")}
        kinds = {}
        for f in fds:
            with contextlib.suppress(OSError):
                kinds[f] = os.readlink(f"/proc/self/fd/{f}")
        held.write_text(repr(kinds))
        return to_snapshot(state)
    monkeypatch.setattr(snapshot_child, "to_snapshot", listing)
    import socket
    a, b = socket.socketpair()   # a socket the parent holds (as it holds PostgreSQL and NATS sessions)
    try:
        await ledger.snapshot()
    finally:
        a.close()
        b.close()
    kinds = eval(held.read_text())  # noqa: S307 - our own repr of a dict of ints and strings
    others = {f: k for f, k in kinds.items() if f > 2}
    assert len(others) == 1 and next(iter(others.values())).startswith("pipe:"), kinds   # only the pipe back
    await ledger.stand_down("test")


@pytest.mark.skipif(not can_fork() or not os.path.exists("/proc/self/oom_score_adj"), reason="needs fork() and /proc")
async def test_the_snapshot_child_is_the_first_the_kernel_kills_when_memory_runs_out(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    log = ControlledLog()
    ledger = await serving_ledger(log)
    seen = tmp_path / "oom"

    def reading(state: Any) -> bytes:   # in the child
        with open("/proc/self/oom_score_adj") as f:
            seen.write_text(f.read().strip())
        return to_snapshot(state)
    monkeypatch.setattr(snapshot_child, "to_snapshot", reading)
    await ledger.snapshot()
    assert seen.read_text() == "1000"
    with open("/proc/self/oom_score_adj") as f:
        assert f.read().strip() != "1000"   # the coordinator's own is untouched
    await ledger.stand_down("test")


@pytest.mark.skipif(not can_fork(), reason="no fork() on this OS")
async def test_a_cancelled_snapshot_kills_and_reaps_its_child(monkeypatch: pytest.MonkeyPatch) -> None:
    log = ControlledLog()
    ledger = await serving_ledger(log)
    await ledger.execute(register("w1"))
    children: list[snapshot_child.ForkedSnapshot] = []
    forking = snapshot_child.fork_snapshot

    def spy(state: Any) -> snapshot_child.ForkedSnapshot:
        children.append(forking(state))
        return children[-1]

    def stuck(state: Any) -> bytes:   # in the child
        time.sleep(30)
        return b""
    monkeypatch.setattr(snapshot_child, "to_snapshot", stuck)
    monkeypatch.setattr("coordinator.ledger_snapshots.fork_snapshot", spy)
    taking = asyncio.create_task(ledger.snapshot())
    while not children:
        await asyncio.sleep(0.01)
    taking.cancel()
    with pytest.raises(asyncio.CancelledError):
        await taking
    with pytest.raises(ChildProcessError):   # killed and reaped: no such child any more
        os.waitpid(children[0].pid, os.WNOHANG)
    assert ledger.serving and isinstance(await ledger.execute(register("w2")), RegisterReply)
    await ledger.stand_down("test")
