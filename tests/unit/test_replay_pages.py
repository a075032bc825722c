"""``coordinator.replay.load_state`` over pages of stored rows: the state it folds equals the
live one, and a log it cannot fold is named by position (a gap, bytes that are no event, an
event of another schema version, an illegal move), whichever page the row falls in."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import msgspec
import pytest

from coordinator.core import (
    CoreParams, acquire_lease, encode_event, ingest_transition, register_worker, release_lease, state_hash,
)
from coordinator.log.port import Snapshot
from coordinator.replay import LogCorrupt, LogGap, load_state
from shared.messages import ReplicaState as S
from tests.unit.core.support import Driver, acquire, h, register, release, transition


class RowsLog:
    """Only what a replay from empty reads: ``(position, payload)`` rows, no snapshot, no archive."""

    def __init__(self, rows: list[tuple[int, bytes]]) -> None:
        self.rows = rows

    async def read_payloads(self, from_position: int = 1, limit: int = 1000) -> Sequence[tuple[int, bytes]]:
        return [r for r in self.rows if r[0] >= from_position][:limit]

    async def latest_snapshot(self) -> Snapshot | None:
        return None

    async def archive_anchor(self) -> tuple[int, Snapshot | None]:
        return 0, None


def driven(requests: int = 12) -> Driver:
    """A worker with a 4-slot pool serving ``requests`` two-block prompts: grants evict, commits,
    releases (every kind of row a busy log holds)."""
    d = Driver()
    d.run(register_worker, register("w1", slots=4), 0)
    seq = 0
    for k in range(requests):
        blocks = [h(1000 + 2 * k), h(1001 + 2 * k)]
        g = d.run(acquire_lease, acquire("w1", 1, blocks, forms=("compressed",)), 10 * k, f"L{k}")
        for i in g.write.get("compressed", []):
            seq += 1
            d.run(ingest_transition, transition("w1", 1, seq, blocks[i], "compressed", S.ALLOCATED, S.READY,
                                                lease_id=f"L{k}", index=i), 10 * k + 1)
        d.run(release_lease, release("w1", 1, f"L{k}"), 10 * k + 2)
    return d


def rows_of(d: Driver) -> list[tuple[int, bytes]]:
    return [(i, encode_event(e)) for i, e in enumerate(d.log, 1)]


def replay(rows: list[tuple[int, bytes]], page: int = 7) -> object:
    return asyncio.run(load_state(RowsLog(rows), CoreParams(lease_ttl_ms=1000, heartbeat_interval_ms=100,
                                                            missed_heartbeats=3, resume_grace_ms=1000),
                                  use_snapshot=False, page=page))


@pytest.mark.parametrize("page", [1, 7, 1000])
def test_paged_replay_rebuilds_the_live_state(page: int) -> None:
    d = driven()
    res = replay(rows_of(d), page)
    assert res.events == len(d.log) and res.position == len(d.log)
    assert state_hash(res.state) == d.hash
    assert res.state.applied == len(d.log)


@pytest.mark.parametrize("at", [1, 7, 8, 20])
def test_a_missing_position_is_named(at: int) -> None:
    rows = rows_of(driven())
    del rows[at - 1]
    with pytest.raises(LogGap, match=f"position {at} is missing"):
        replay(rows)


@pytest.mark.parametrize("bad, why", [
    (b"{not json", "not a ledger event"),
    (b'{"type":"nonsense.event","v":1}', "unknown ledger event type"),
    (b'{"type":"lease.released","v":9,"lease_id":"L0","worker_id":"w1","epoch":1}', "schema version 9"),
])
def test_an_undecodable_row_is_named_by_its_position(bad: bytes, why: str) -> None:
    rows = rows_of(driven())
    rows[9] = (10, bad)
    with pytest.raises(LogCorrupt, match=f"position 10 cannot be folded: .*{why}"):
        replay(rows)


def test_an_illegal_move_is_named_by_its_position() -> None:
    d = driven()
    rows = rows_of(d)
    # the last commit again, under a new seq: the replica is READY, a commit needs ALLOCATED
    again = [e for e in d.log if type(e).__name__ == "TransitionApplied"][-1]
    t = msgspec.structs.replace(again.transition, seq=999)
    rows.append((len(rows) + 1, encode_event(msgspec.structs.replace(again, transition=t))))
    with pytest.raises(LogCorrupt, match=f"position {len(rows)} cannot be folded: .*cannot commit a replica that is READY"):
        replay(rows)
