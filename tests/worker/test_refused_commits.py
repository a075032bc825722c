"""A GPU commit the ledger refused leaves no bytes on the worker.

The NATS-cluster drill (``tests/faults/test_nats_cluster.py``) once found four GPU replicas of
one worker unknown to the ledger after every outbox had drained. The mechanism: while the
transitions stream elects a new leader, requests (leases, renewals, releases) are still
answered but a worker's commits wait in its outbox. A session that cannot settle releases its
lease after ``settle_timeout_s`` plus the background wait (max 5 s, 0.8 × the lease TTL); the
release aborts the lease's uncommitted writes (EVICTED), and the commits, published once the
stream is back, are refused as stale. The worker kept the slots it had filled: bytes no grant
pins (never read) that the audit reports as ``unknown_to_ledger``. The commit watermark now
names refused commits as it names refused host-tier copies, and the worker frees those slots.
"""

from __future__ import annotations

import asyncio
import time

from coordinator.audit import compare_tiers
from coordinator.core import CoreParams
from shared.messages import InventoryRequest, ReplicaState
from tests.twin import InProcessCoordinator
from tests.worker.conftest import prompt
from worker.client import PublishFailed

LEASE_TTL_MS = 4000


class StreamWithoutLeader(InProcessCoordinator):
    """The twin while the transitions stream has no leader: requests are answered, publishes fail."""

    def __init__(self) -> None:
        super().__init__(CoreParams(lease_ttl_ms=LEASE_TTL_MS, heartbeat_interval_ms=100, missed_heartbeats=50))
        self.stream_down = False

    async def _store(self, worker_id: str, epoch: int, events: list) -> None:
        if self.stream_down:
            raise PublishFailed("the stream has no leader")
        await super()._store(worker_id, epoch, events)


async def test_a_commit_refused_after_its_lease_was_released_frees_its_slot(make_engine) -> None:
    twin = StreamWithoutLeader()
    async with make_engine(twin, worker_id="wb") as w:
        w.settle_timeout_s = 0.05
        await w.generate(prompt(40, seed=91), max_tokens=1)        # a chain committed before the outage
        assert await w.flush(timeout=10)
        before = {(f, m.block_hash, m.generation) for f, _, m in w.store.items()}
        twin.stream_down = True
        await w.generate(prompt(40, seed=92), max_tokens=1)        # its commits wait in the outbox
        filled = {(f, m.block_hash, m.generation) for f, _, m in w.store.items()} - before
        assert filled and w.publisher.depth >= len(filled)
        # the background release goes once its wait is over, the commits still unsettled: it aborts them
        deadline = time.monotonic() + 30
        while any(lease.worker_id == "wb" for lease in twin.state.leases.values()):
            assert time.monotonic() < deadline, "the unsettled lease was never released"
            await asyncio.sleep(0.1)
        twin.stream_down = False
        assert await w.flush(timeout=10)
        refused = {(e.form, e.block_hash, e.generation) for e, _ in twin.rejected
                   if e.location == "gpu:wb" and e.to_state is ReplicaState.READY}
        assert refused == filled, "every commit of the released lease is refused as stale"
        held = {(f, m.block_hash, m.generation) for f, _, m in w.store.items()}
        assert not held & filled, "the slots of the refused commits are freed"
        assert held == before, "what the ledger lists READY stays"
        assert w.metrics.value("kvl_worker_refused_commits_total") == len(filled)
        assert not w.replicas.commits, "every commit settled"
        # the audit's comparison (coordinator.audit): nothing held that the ledger does not list, nor the reverse
        reply = await twin.inventory("wb", request=InventoryRequest(digests=True))
        tiers = compare_tiers(twin.state, "wb", reply)
        assert not any(t.worker_only or t.ledger_only for t in tiers.values()), {
            loc: (len(t.worker_only), len(t.ledger_only)) for loc, t in tiers.items()}
