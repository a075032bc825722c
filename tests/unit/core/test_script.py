"""A narrated life of one worker: each step asserts the whole relevant state (h11 style)."""

from __future__ import annotations

from coordinator.core import (
    acquire_lease, check_invariants, expire, from_snapshot, heartbeat, ingest_transition, register_worker,
    release_lease, renew_lease, replay, state_hash, to_snapshot,
)
from coordinator.core.state import LedgerState
from shared.messages import ErrorCode, ErrorReply, HeartbeatReply, LeaseGrant, ReplicaState as S

from .support import FORMS, Driver, acquire, h, hb, register, release, renew, transition


def replicas(state: LedgerState) -> dict[tuple[str, str, str], tuple[str, int, int]]:
    """Every replica as (state, pins, generation), keyed by (block index, form, location)."""
    return {(int(k[0], 16), k[1], k[2]): (r.state.value, r.pins, r.generation)
            for k, r in sorted(state.replicas.items())}


def consistent(d: Driver) -> None:
    assert check_invariants(d.state) == []
    assert state_hash(replay(d.log, d.state.params)) == d.hash
    assert state_hash(from_snapshot(to_snapshot(d.state))) == d.hash


def commit_all(d: Driver, grant: LeaseGrant, blocks: list[str], seq: int, now: int, epoch: int = 1) -> int:
    for form, idx in grant.write.items():
        for i in idx:
            seq += 1
            out = d.run(ingest_transition, transition("w1", epoch, seq, blocks[i], form, S.ALLOCATED, S.READY,
                                                      generation=seq, checksum=f"c{i}", lease_id=grant.lease_id),
                        now)
            assert [type(e).__name__ for e in out] == ["TransitionApplied"], out
    return seq


def test_life_of_a_worker() -> None:
    d = Driver()
    blocks = [h(i) for i in range(3)]

    # 1. Register: epoch 1, no replicas, no leases.
    reply = d.run(register_worker, register("w1", slots=4), 0)
    assert (reply.worker_id, reply.epoch) == ("w1", 1)
    w = d.state.workers["w1"]
    assert (w.epoch, w.alive, w.fenced_through, w.pool_slots) == (1, True, 0, {f: 4 for f in FORMS})
    assert d.state.replicas == {} and d.state.leases == {}
    consistent(d)

    # 2. Cold acquire: nothing reusable, every form of every block granted for writing, ALLOCATED.
    g = d.run(acquire_lease, acquire("w1", 1, blocks), 10, "L1")
    assert isinstance(g, LeaseGrant)
    assert (g.usable_blocks, g.read, g.evict) == (0, [], [])
    assert g.write == {f: [0, 1, 2] for f in FORMS}
    assert g.rejected == ["p=1..3 blocks: compressed of block 0 not READY"]
    assert g.expires_at_ms == 10 + 1000
    assert replicas(d.state) == {(i, f, "gpu:w1"): ("ALLOCATED", 0, 0) for i in range(3) for f in FORMS}
    assert d.state.pool_used("w1", "compressed") == 3 and d.state.tenant_used == {"t1": 9}
    assert set(d.state.leases) == {"L1"} and set(w.leases) == {"L1"}
    consistent(d)

    # 3. The worker commits every write: READY with its generation and checksum.
    seq = commit_all(d, g, blocks, 0, 20)
    assert {k: v[0] for k, v in replicas(d.state).items()} == {(i, f, "gpu:w1"): "READY"
                                                               for i in range(3) for f in FORMS}
    assert d.state.committed_seq("w1", 1) == 9
    hb_reply = d.run(heartbeat, hb("w1", 1), 25)
    assert hb_reply == HeartbeatReply(committed_seq=9)
    consistent(d)

    # 4. Release: no pins to drop, nothing left ALLOCATED, replicas stay READY.
    d.run(release_lease, release("w1", 1, "L1"), 30)
    assert d.state.leases == {} and w.leases == {}
    assert all(v == ("READY", 0, v[2]) for v in replicas(d.state).values())
    consistent(d)

    # 5. A second request with one more block reuses the three: reads pinned, one block to write.
    g2 = d.run(acquire_lease, acquire("w1", 1, blocks + [h(3)]), 40, "L2")
    assert g2.usable_blocks == 3
    assert [(int(r.block_hash, 16), r.form) for r in g2.read] == [
        (0, "compressed"), (1, "compressed"), (2, "compressed"), (1, "swa"), (2, "swa"), (2, "tail")]
    assert g2.write == {f: [3] for f in FORMS}
    assert g2.rejected == ["p=4 blocks: compressed of block 3 not READY"]
    pins = {k: v[1] for k, v in replicas(d.state).items() if v[1]}
    assert pins == {(0, "compressed", "gpu:w1"): 1, (1, "compressed", "gpu:w1"): 1,
                    (2, "compressed", "gpu:w1"): 1, (1, "swa", "gpu:w1"): 1, (2, "swa", "gpu:w1"): 1,
                    (2, "tail", "gpu:w1"): 1}
    assert d.state.pool_used("w1", "swa") == 4
    consistent(d)

    # 6. Renew, then release without committing block 3: pins drop, block 3 aborted (EVICTED).
    assert d.run(renew_lease, renew("w1", 1, "L2"), 50).expires_at_ms == 1050
    d.run(release_lease, release("w1", 1, "L2"), 60)
    assert all(v[1] == 0 for v in replicas(d.state).values())
    assert {k: v[0] for k, v in replicas(d.state).items() if k[0] == 3} == {
        (3, f, "gpu:w1"): "EVICTED" for f in FORMS}
    assert d.state.pool_used("w1", "swa") == 3
    consistent(d)

    # 7. Capacity: pool holds 4 per form, 3 used. A new 3-block prompt needs 3 slots per form, so
    #    2 unpinned READY replicas per form go, least recently used first: per form, blocks 0 and 1
    #    (ties on last use broken by block hash; block 2 was pinned last, at 40).
    other = [h(100 + i) for i in range(3)]
    g3 = d.run(acquire_lease, acquire("w1", 1, other), 70, "L3")
    assert g3.usable_blocks == 0 and g3.write == {f: [0, 1, 2] for f in FORMS}
    evicted = sorted((int(r.block_hash, 16), r.form) for r in g3.evict)
    assert evicted == [(0, "compressed"), (0, "swa"), (0, "tail"), (1, "compressed"), (1, "swa"), (1, "tail")]
    assert all(d.state.pool_used("w1", f) == 4 for f in FORMS)
    for i, f in evicted:
        assert d.state.replicas[(h(i), f, "gpu:w1")].state is S.EVICTED
    consistent(d)

    # 8. The worker restarts and re-registers: epoch 2; epoch 1 fenced, its GPU replicas LOST,
    #    its lease released; its late events and heartbeats are refused.
    reply = d.run(register_worker, register("w1", slots=4), 80)
    assert reply.epoch == 2
    assert (w := d.state.workers["w1"]).epoch == 2 and w.fenced_through == 1 and w.alive
    assert d.state.leases == {}
    # Every replica of epoch 1 ended: the worker's 12 GPU replicas are LOST, and the state keeps
    # its 12 most recent ended replicas (its pool slots) as tombstones — here those 12.
    assert {v[0] for v in replicas(d.state).values()} == {"LOST"} and len(d.state.replicas) == 12
    assert list(d.state.tombstones["w1"]) == sorted(d.state.replicas)
    assert d.state.tenant_used == {} and all(d.state.pool_used("w1", f) == 0 for f in FORMS)
    late = d.run(ingest_transition, transition("w1", 1, seq + 1, other[0], "swa", S.ALLOCATED, S.READY), 85)
    assert type(late[0]).__name__ == "TransitionRejected" and "fenced" in late[0].reason
    old_hb = d.run(heartbeat, hb("w1", 1), 86)
    assert isinstance(old_hb, ErrorReply) and old_hb.code is ErrorCode.FENCED
    consistent(d)

    # 9. The new epoch goes silent: expiry suspends it (its cache kept), then, past the grace
    #    period without a resume, declares it lost.
    assert d.run(expire, 80 + 300) == []
    suspended = d.run(expire, 80 + 301)
    assert [type(e).__name__ for e in suspended] == ["WorkerSuspended"] and d.state.workers["w1"].suspended
    assert d.run(expire, 80 + 301 + 1000) == []
    lost = d.run(expire, 80 + 301 + 1001)
    assert [type(e).__name__ for e in lost] == ["WorkerLost"] and not d.state.workers["w1"].alive
    consistent(d)
