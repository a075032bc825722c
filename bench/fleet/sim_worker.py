"""A simulated worker of a sharded fleet: a member of every shard, each lease routed to the shard
that owns its chain (:func:`shared.shards.shard_of`), as the real worker does.

Per shard it keeps what the real worker keeps (docs/architecture.md, "The ledger sharded"): its
own epoch (registered with that shard), heartbeats to it at the interval it answers, its own seq
space and commit watermark, and its pool share — ``slots × (partitions the shard owns) / P`` — so
the shards' shares add up to the pool. One turn: acquire on the owner (reuse, writes for the
compressed form) → one :class:`~shared.messages.TransitionBatch` of the granted writes' commits
through JetStream → the commit watermark covering it → release. LRU victims in a grant need
nothing from the worker (they are EVICTED in the log already), so pools may fill.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from bench.fleet.mix import WorkerMix
from shared.shards import ShardMap, shard_of, shard_subjects

BLOCK = 16
#: Lease TTL asked for (the production default): every lease here is released within moments.
LEASE_TTL_MS = 30_000


def catalogue() -> Any:
    from shared.forms import FormCatalogue, FormScope, FormSpec
    return FormCatalogue(model_id="bench-fleet", block_size=BLOCK, forms=(
        FormSpec(name="compressed", scope=FormScope.FULL_HISTORY, bytes_per_block=512, dtype="bfloat16"),))


@dataclass(slots=True)
class Tally:
    """What a driver's workers did: leases completed per shard, refusals and errors by kind."""
    leases: Counter[int] = field(default_factory=Counter)
    blocks_read: int = 0
    blocks_written: int = 0
    wrong_shard: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    heartbeats: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"leases": {str(k): v for k, v in sorted(self.leases.items())}, "blocks_read": self.blocks_read,
                "blocks_written": self.blocks_written, "wrong_shard": self.wrong_shard,
                "errors": dict(self.errors), "heartbeats": self.heartbeats}


class Membership:
    """The worker's standing with one shard: epoch, seqs, watermark, heartbeats."""

    def __init__(self, shard: int, subjects: Any, slots: int) -> None:
        self.shard, self.subjects, self.slots = shard, subjects, slots
        self.epoch = 0
        self.seq = 0
        self.watermark = 0
        self.refused: list[int] = []
        self.covered = asyncio.Event()
        self.target = 0
        self.heartbeats: asyncio.Task[None] | None = None


class FleetWorker:
    def __init__(self, nc: Any, prefix: str, worker_id: str, ns: str, shard_map: ShardMap | None, shards: int,
                 slots: int, mix: WorkerMix, tally: Tally) -> None:
        self.nc, self.worker_id, self.ns, self.shard_map = nc, worker_id, ns, shard_map
        self.mix, self.tally = mix, tally
        owned = [len(shard_map.owned_by(k)) if shard_map else 1 for k in range(shards)]
        parts = shard_map.partitions if shard_map else 1
        self.members = [Membership(k, shard_subjects(prefix, k), max(1, slots * owned[k] // parts))
                        for k in range(shards)]
        self.js = nc.jetstream(timeout=30)
        self.stopping = False

    async def _ask(self, m: Membership, op: str, msg: Any, timeout: float = 30) -> Any:
        from shared.messages import decode, encode
        return decode((await self.nc.request(m.subjects.request(op, self.worker_id), encode(msg), timeout=timeout)).data)

    async def join(self) -> None:
        """Register with every shard, follow each one's watermarks, heartbeat each."""
        from shared.messages import CommitWatermark, RegisterReply, WorkerRegister, decode
        for m in self.members:
            r = await self._ask(m, "register", WorkerRegister(
                worker_id=self.worker_id, namespace=self.ns, catalogue=catalogue(),
                pool_slots={"compressed": m.slots}))
            if not isinstance(r, RegisterReply):
                raise RuntimeError(f"{self.worker_id}: shard {m.shard} refused the registration: {r}")
            m.epoch = r.epoch

            async def on_wm(msg: Any, m: Membership = m) -> None:
                wm = decode(msg.data, expect=CommitWatermark)
                if wm.epoch == m.epoch and wm.seq > m.watermark:
                    m.watermark = wm.seq
                    m.refused.extend(wm.refused)
                    if m.watermark >= m.target:
                        m.covered.set()
            await self.nc.subscribe(m.subjects.watermark(self.worker_id), cb=on_wm)
            m.heartbeats = asyncio.create_task(self._heartbeat(m, r.heartbeat_interval_ms / 1000))

    async def _heartbeat(self, m: Membership, interval: float) -> None:
        from shared.messages import Heartbeat, HeartbeatReply
        beat = Heartbeat(worker_id=self.worker_id, epoch=m.epoch)
        while not self.stopping:
            await asyncio.sleep(interval)
            try:
                r = await self._ask(m, "heartbeat", beat, timeout=10)
            except Exception as e:  # noqa: BLE001 - counted: a missed beat is an error of the run
                self.tally.errors[f"heartbeat_{type(e).__name__}"] += 1
                continue
            if isinstance(r, HeartbeatReply):
                self.tally.heartbeats += 1
            else:
                self.tally.errors[f"heartbeat_{getattr(r, 'code', type(r).__name__)}"] += 1

    async def run(self) -> None:
        """Turns one after another until :attr:`stopping`; a failed turn is counted, not fatal."""
        while not self.stopping:
            conv, hashes = self.mix.next_turn()
            try:
                if await self.turn(hashes):
                    self.mix.done(conv, hashes)
            except Exception as e:  # noqa: BLE001 - counted, and the worker goes on
                self.tally.errors[type(e).__name__] += 1
                await asyncio.sleep(0.1)

    async def turn(self, hashes: list[str]) -> bool:
        from shared.messages import ErrorCode, ErrorReply, LeaseAcquire, LeaseGrant, LeaseRelease, LeaseReleased
        k = shard_of(self.shard_map, self.ns, hashes)
        assert k is not None        # the mix never asks for a lease with no whole block
        m = self.members[k]
        g = await self._ask(m, "acquire", LeaseAcquire(
            worker_id=self.worker_id, epoch=m.epoch, request_id=f"t{m.seq}", namespace=self.ns, block_hashes=hashes,
            write_forms=["compressed"], reuse=True, ttl_ms=LEASE_TTL_MS))
        if not isinstance(g, LeaseGrant):
            if isinstance(g, ErrorReply) and g.code is ErrorCode.WRONG_SHARD:
                self.tally.wrong_shard += 1
            else:
                self.tally.errors[f"acquire_{getattr(g, 'code', type(g).__name__)}"] += 1
            return False
        writes = g.write.get("compressed", [])
        if writes:
            await self._commit(m, hashes, writes, g.lease_id)
        r = await self._ask(m, "release", LeaseRelease(worker_id=self.worker_id, epoch=m.epoch, lease_id=g.lease_id))
        if not isinstance(r, LeaseReleased):
            self.tally.errors[f"release_{getattr(r, 'code', type(r).__name__)}"] += 1
            return False
        self.tally.leases[k] += 1
        self.tally.blocks_read += g.usable_blocks
        self.tally.blocks_written += len(writes)
        return True

    async def _commit(self, m: Membership, hashes: list[str], writes: list[int], lease_id: str) -> None:
        """The granted blocks' commits (ALLOCATED → READY) as one batch; returns once durable."""
        from shared.ids import ROOT_HASH
        from shared.messages import ReplicaState, TransitionBatch, TransitionEvent, encode, now_ms
        ts = now_ms()
        events = []
        for i in writes:
            m.seq += 1
            events.append(TransitionEvent(
                worker_id=self.worker_id, epoch=m.epoch, seq=m.seq, namespace=self.ns, block_hash=hashes[i],
                parent_hash=hashes[i - 1] if i else ROOT_HASH, token_start=BLOCK * i, token_end=BLOCK * (i + 1),
                form="compressed", location=f"gpu:{self.worker_id}", from_state=ReplicaState.ALLOCATED,
                to_state=ReplicaState.READY, generation=1, checksum=f"{m.seq:016x}", lease_id=lease_id,
                block_size=BLOCK, model_name="bench-fleet", ts_ms=ts))
        batch = TransitionBatch(worker_id=self.worker_id, epoch=m.epoch, events=events)
        m.target = m.seq
        m.covered.clear()
        await self.js.publish(m.subjects.events(self.worker_id), encode(batch),
                              headers={"Nats-Msg-Id": batch.source_id})
        if m.watermark < m.target:
            await asyncio.wait_for(m.covered.wait(), 30)
        if m.refused:
            self.tally.errors["commit_refused"] += len(m.refused)
            m.refused.clear()

    async def stop(self) -> None:
        """End the heartbeats (after :attr:`stopping` is set). NOTE: a cancel that lands while a
        request's own timeout fires can come back from it as that timeout (``asyncio.wait_for``
        before Python 3.12), which the loop counts and goes on from; it then ends at ``stopping``,
        so the wait here is bounded rather than for ever (a driver once hung at exit so)."""
        for m in self.members:
            if m.heartbeats is not None:
                m.heartbeats.cancel()
                await asyncio.wait({m.heartbeats}, timeout=15)


__all__ = ["BLOCK", "FleetWorker", "LEASE_TTL_MS", "Membership", "Tally", "catalogue"]
