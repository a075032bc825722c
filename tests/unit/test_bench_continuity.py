"""bench.coordinator's worker across coordinator takeovers, and its idle-phase arithmetic.

The bench worker talks to a fake NATS client whose answers come from the real core
(``coordinator.core``): a takeover suspends the worker's epoch, and the worker must resume
it (never re-register) with an inventory the core recognises replica for replica.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from bench.coordinator.harness import drive, h
from bench.coordinator.idle import idle_rates
from bench.coordinator.run import goals
from bench.coordinator.synthetic_worker import BenchWorker, commit_transition
from coordinator import core
from shared import messages as m
from shared.subjects import Subjects

SUBJECTS = Subjects("kvlunitbench")


class _Reply:
    def __init__(self, data: bytes) -> None:
        self.data = data


class FakeCoordinator:
    """Answers the bench worker's requests from a core ``LedgerState`` (no log, no JetStream)."""

    def __init__(self, heartbeat_ms: int = 1000) -> None:
        self.state = core.LedgerState.empty(core.CoreParams(heartbeat_interval_ms=heartbeat_ms))
        self.now = 1_000_000
        self.leases = 0
        self.seen: list[str] = []
        self.parts: list[bytes] = []

    def _apply(self, events: list[Any]) -> None:
        for e in events:
            core.apply(self.state, e)

    def takeover(self) -> None:
        self.now += 1
        self._apply(core.resume(self.state, self.now))

    def suspended(self, worker_id: str) -> bool:
        return self.state.workers[worker_id].suspended

    def commit(self, w: BenchWorker, hashes: list[str], lease_id: str) -> None:
        pairs = []
        for i, bh in enumerate(hashes):
            w.emitted_seq += 1
            t = commit_transition(w.epoch, w.emitted_seq, hashes, i, lease_id, self.now, w.worker_id)
            self._apply(core.ingest_transition(self.state, t, self.now))
            pairs.append((bh, w.emitted_seq))
        w.note_committed(pairs)

    # the part of nats.aio.client.Client the bench worker uses
    async def request(self, subject: str, data: bytes, timeout: float = 0) -> _Reply:
        await asyncio.sleep(0)  # let concurrent requests interleave, as over a socket
        msg = m.decode(data)
        self.seen.append(type(msg).__name__)
        self.now += 1
        s = self.state
        if isinstance(msg, m.WorkerRegister):
            reply, events = core.register_worker(s, msg, self.now)
        elif isinstance(msg, m.WorkerResume) and msg.parts > 1 and msg.part < msg.parts - 1:
            # a part of a multi-part inventory (as coordinator.nats_service assembles them)
            assert msg.part == len(self.parts), "parts out of order"
            self.parts.append(msg.held)
            reply, events = m.ResumeReply(worker_id=msg.worker_id, epoch=msg.epoch, complete=False), []
        elif isinstance(msg, m.WorkerResume):
            held, self.parts = b"".join(self.parts) + msg.held, []
            reply, events = core.resume_worker(s, msgspec.structs.replace(msg, held=held, part=0, parts=1), self.now)
        elif isinstance(msg, m.Heartbeat):
            reply, events = core.heartbeat(s, msg, self.now)
        elif isinstance(msg, m.LeaseAcquire):
            self.leases += 1
            reply, events = core.acquire_lease(s, msg, self.now, f"l{self.leases:015x}")
        elif isinstance(msg, m.LeaseRelease):
            reply, events = core.release_lease(s, msg, self.now)
        else:
            raise AssertionError(f"unexpected request {msg}")
        self._apply(events)
        return _Reply(m.encode(reply))

    async def subscribe(self, subject: str, cb: Any = None, **_: Any) -> None:
        return None


async def _worker_with_cache(fake: FakeCoordinator, blocks: int = 8) -> tuple[BenchWorker, list[str]]:
    w = BenchWorker(fake, SUBJECTS, slots=max(64, blocks))
    await w.register()
    hashes = [h(i + 1) for i in range(blocks)]
    g = await w.request(SUBJECTS.request("acquire", w.worker_id), w.acquire(hashes, write=True, reuse=False))
    assert isinstance(g, m.LeaseGrant) and g.write["compressed"] == list(range(blocks))
    fake.commit(w, hashes, g.lease_id)
    assert isinstance(await w.request(SUBJECTS.request("release", w.worker_id), w.release(g.lease_id)), m.LeaseReleased)
    return w, hashes


async def test_a_suspended_request_resumes_with_what_the_worker_committed() -> None:
    fake = FakeCoordinator()
    w, hashes = await _worker_with_cache(fake)
    try:
        fake.takeover()
        assert fake.suspended(w.worker_id)
        g = await w.request(SUBJECTS.request("acquire", w.worker_id), w.acquire(hashes[:4], write=False, reuse=True))
        assert isinstance(g, m.LeaseGrant) and g.usable_blocks == 4
        assert len(w.resumes) == 1 and w.resumes[0][1].kept == len(hashes) and w.resumes[0][1].drop == b""
        assert not fake.suspended(w.worker_id)
        assert "WorkerRegister" not in fake.seen[1:]
        ready = [r for r in fake.state.replicas.values() if r.state is m.ReplicaState.READY]
        assert len(ready) == len(hashes)  # nothing invalidated: the inventory matched the ledger
    finally:
        w.stop()


async def test_concurrent_suspended_answers_cause_one_resume() -> None:
    fake = FakeCoordinator()
    w, hashes = await _worker_with_cache(fake)
    try:
        fake.takeover()
        replies = await asyncio.gather(*(w.request(SUBJECTS.request("acquire", w.worker_id),
                                                   w.acquire(hashes[:2], write=False, reuse=True, request_id=f"r{i}"))
                                         for i in range(5)))
        assert all(isinstance(r, m.LeaseGrant) for r in replies)
        assert fake.seen.count("WorkerResume") == 1

        fake.takeover()
        payloads = [m.encode(w.acquire(hashes[:3], write=False, reuse=True, request_id=f"d{i}")) for i in range(8)]
        _, _, out = await drive(fake, SUBJECTS.request("acquire", w.worker_id), payloads, inflight=4, recover=w.recover)
        assert all(isinstance(m.decode(r), m.LeaseGrant) for r in out)
        assert fake.seen.count("WorkerResume") == 2
    finally:
        w.stop()


async def test_heartbeats_resume_an_idle_suspended_worker() -> None:
    fake = FakeCoordinator(heartbeat_ms=10)
    w, _ = await _worker_with_cache(fake, blocks=3)
    try:
        fake.takeover()
        await w.wait_resumed(0.0, timeout_s=5)
        assert not fake.suspended(w.worker_id) and w.resumes[0][1].kept == 3
        beats = w.heartbeats_ok
        await asyncio.sleep(0.1)
        assert w.heartbeats_ok > beats
    finally:
        w.stop()


async def test_a_fenced_epoch_is_an_error_not_a_new_registration() -> None:
    fake = FakeCoordinator()
    w, _ = await _worker_with_cache(fake, blocks=1)
    try:
        fake.takeover()
        fake.now += fake.state.params.resume_grace_ms + 1  # suspended past the grace: resume fences it
        with pytest.raises(RuntimeError, match="cannot resume"):
            await w.request(SUBJECTS.request("acquire", w.worker_id), w.acquire([h(1)], write=False, reuse=True))
        assert "WorkerRegister" not in fake.seen[1:]
    finally:
        w.stop()


async def test_an_inventory_larger_than_one_message_goes_in_parts() -> None:
    fake = FakeCoordinator()
    w, hashes = await _worker_with_cache(fake, blocks=100)
    try:
        fake.takeover()
        # a real server's default is 1 MiB (~98k replicas); here 400 bytes a part: 37 digests
        fake.max_payload = 16 * 1024 + 400  # type: ignore[attr-defined]
        g = await w.request(SUBJECTS.request("acquire", w.worker_id), w.acquire(hashes[:2], write=False, reuse=True))
        assert isinstance(g, m.LeaseGrant)
        assert fake.seen.count("WorkerResume") == 3
        assert w.resumes[0][1].kept == 100 and not fake.suspended(w.worker_id)
    finally:
        w.stop()


def test_idle_rates_scale_to_the_default_heartbeat_interval() -> None:
    # 4 workers, 10 s at 100 ms = 100 intervals each: one event per heartbeat is 3600 an hour.
    r = idle_rates(events=400, heartbeats=400, workers=4, window_s=10, interval_ms=100)
    assert r == {"idle_events_per_worker_per_hour": 3600.0, "idle_heartbeats_per_worker_per_hour": 3600.0,
                 "idle_time_scale": 10.0}
    assert idle_rates(0, 400, 4, 10, 100)["idle_events_per_worker_per_hour"] == 0.0
    # at the default interval there is nothing to scale
    assert idle_rates(3, 120, 2, 60, 1000)["idle_events_per_worker_per_hour"] == 90.0


def test_goals_include_takeover_and_idle_events() -> None:
    g = goals({"takeover_to_ready_s": 2.5, "idle_events_per_worker_per_hour": 0.0})
    assert g == {"takeover_to_ready_s <= 2.0": False, "idle_events_per_worker_per_hour <= 10.0": True}


def test_lease_ab_takes_only_kvledger_checkouts(tmp_path) -> None:
    import argparse
    from pathlib import Path

    from bench.lease_ab import checkout, main
    repo = Path(__file__).resolve().parents[2]
    assert checkout(str(repo)) == repo
    with pytest.raises(argparse.ArgumentTypeError, match="not a kvledger checkout"):
        checkout(str(tmp_path))
    with pytest.raises(SystemExit):                      # argparse: a clear error, no stack trace
        main(["--a", str(repo), "--b", str(tmp_path)])


def test_host_evict_bench_refuses_impossible_batches(capsys) -> None:
    from bench.host_evict import main
    for argv in (["--per-request", "0"], ["--per-request", "5000"], ["--blocks", "0"]):
        with pytest.raises(SystemExit):                  # argparse: a clear error, no stack trace
            main(argv)
        assert "--per-request 1–4096" in capsys.readouterr().err


def test_controls_bench_sends_an_invalidation_both_ways(nats_url: str, capsys) -> None:
    """bench.controls end to end on a real NATS: both ways acked, the batched one in
    ceil(blocks / MAX_CONTROL_BLOCKS) messages; nonsense arguments are a clear error."""
    from bench.controls import main
    from shared.messages import MAX_CONTROL_BLOCKS
    out = main(["--blocks", str(MAX_CONTROL_BLOCKS + 1), "--reps", "1", "--nats-url", nats_url])
    assert (out["per_block_messages"], out["batched_messages"]) == (MAX_CONTROL_BLOCKS + 1, 2)
    assert out["per_block_s"] > 0 and out["batched_s"] > 0
    with pytest.raises(SystemExit):
        main(["--blocks", "0"])
    assert "--blocks and --reps must be ≥ 1" in capsys.readouterr().err
