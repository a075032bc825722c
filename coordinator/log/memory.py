"""In-memory twin of the PostgreSQL event log, for fast unit tests of the shell.

It keeps exactly the guarantees listed in :mod:`coordinator.log.port` (the shared contract
test proves it); it is never a stand-in for PostgreSQL in integration tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime

from coordinator.log.chain import GENESIS, chain_batch
from coordinator.log.port import LeaderInfo, NewEvent, NotLeader, Snapshot, StoredEvent, plan_append


class InMemoryEventLog:
    def __init__(self) -> None:
        self._events: list[StoredEvent] = []
        self._by_stream: dict[str, list[StoredEvent]] = {}
        self._sources: dict[str, int] = {}
        self._snapshots: dict[int, Snapshot] = {}
        self._leader = LeaderInfo(leader_epoch=0, holder="", since=None)
        self._lock = asyncio.Lock()

    async def append(self, batch: Sequence[NewEvent], leader_epoch: int) -> list[int | None]:
        async with self._lock:
            if leader_epoch != self._leader.leader_epoch:
                raise NotLeader(leader_epoch, self._leader.leader_epoch)
            streams = {ev.stream_id for ev in batch}
            rows, out = plan_append(
                batch, len(self._events), {s: len(self._by_stream.get(s, ())) for s in streams},
                {ev.source_id for ev in batch if ev.source_id in self._sources})
            now = datetime.now(UTC)
            # the same chain as the PostgreSQL adapter's (the contract test compares them)
            prev = self._events[-1].chain_hash if self._events else GENESIS
            hashes = chain_batch(prev or GENESIS, len(self._events) + 1, leader_epoch,
                                 [(ev.stream_id, ev.type, ev.source_id, bytes(ev.payload)) for _, _, ev in rows])
            staged = [StoredEvent(pos, ev.stream_id, ver, ev.type, bytes(ev.payload), ev.source_id, leader_epoch, now, h)
                      for (pos, ver, ev), h in zip(rows, hashes)]
            for s in staged:  # commit
                self._events.append(s)
                self._by_stream.setdefault(s.stream_id, []).append(s)
                if s.source_id is not None:
                    self._sources[s.source_id] = s.position
            return out

    async def read(self, from_position: int = 1, limit: int = 1000) -> list[StoredEvent]:
        start = max(from_position, 1) - 1
        return self._events[start:start + max(limit, 0)]

    async def read_payloads(self, from_position: int = 1, limit: int = 1000) -> list[tuple[int, bytes]]:
        return [(e.position, e.payload) for e in await self.read(from_position, limit)]

    async def read_stream(self, stream_id: str, from_version: int = 1, limit: int = 10_000) -> list[StoredEvent]:
        start = max(from_version, 1) - 1
        return self._by_stream.get(stream_id, [])[start:start + max(limit, 0)]

    async def read_streams(self, stream_ids: Sequence[str], limit: int = 10_000) -> list[StoredEvent]:
        wanted = set(stream_ids)
        return [e for e in self._events if e.stream_id in wanted][:max(limit, 0)]

    async def head(self) -> int:
        return len(self._events)

    async def take_leadership(self, holder: str) -> int:
        async with self._lock:
            now = datetime.now(UTC)
            self._leader = LeaderInfo(self._leader.leader_epoch + 1, holder, now, now)
            return self._leader.leader_epoch

    async def leader(self) -> LeaderInfo:
        return self._leader

    async def latest_snapshot(self) -> Snapshot | None:
        return self._snapshots[max(self._snapshots)] if self._snapshots else None

    async def archived_upto(self) -> int:
        return 0

    async def archive_anchor(self) -> tuple[int, Snapshot | None]:
        return 0, None  # the twin is never archived (archiving is an operator action on PostgreSQL)

    async def save_snapshot(self, snapshot: Snapshot, leader_epoch: int) -> None:
        async with self._lock:
            if leader_epoch != self._leader.leader_epoch:
                raise NotLeader(leader_epoch, self._leader.leader_epoch)
            if snapshot.position > len(self._events):
                raise ValueError(f"snapshot at position {snapshot.position} is past the head {len(self._events)}")
            chain = self._events[snapshot.position - 1].chain_hash if snapshot.position else GENESIS
            self._snapshots.setdefault(snapshot.position, Snapshot(
                snapshot.position, snapshot.state_hash, bytes(snapshot.state), leader_epoch, datetime.now(UTC), chain))

    async def chain_anchor(self) -> tuple[int, bytes]:
        return 0, GENESIS

    async def close(self) -> None:
        return None
