"""The state is bounded by the cache, not by history: ended replicas are kept as tombstones only
while they are among their owner's most recent (as many as its pool slots), then leave."""

from __future__ import annotations

from coordinator.core import (
    TransitionApplied, TransitionRejected, acquire_lease, check_invariants, from_snapshot, ingest_transition,
    register_worker, release_lease, replay, state_hash, to_snapshot,
)
from coordinator.core.state import tombstone_capacity
from shared.messages import LeaseGrant, ReplicaState as S

from .support import FORMS, Driver, acquire, h, register, release, transition


def _serve(d: Driver, seq: list[int], blocks: list[str], lid: str, now: int) -> LeaseGrant:
    """A request on w1: acquire (LRU evictions when the pool is full), commit every write, release."""
    g = d.run(acquire_lease, acquire("w1", 1, blocks), now, lid)
    assert isinstance(g, LeaseGrant)
    for form, idx in g.write.items():
        for i in idx:
            seq[0] += 1
            out = d.run(ingest_transition, transition("w1", 1, seq[0], blocks[i], form, S.ALLOCATED, S.READY,
                                                      checksum=f"c{seq[0]}", lease_id=lid, index=i), now)
            assert isinstance(out[0], TransitionApplied), out
    d.run(release_lease, release("w1", 1, lid), now)
    return g


def test_state_stays_bounded_by_the_pools_over_a_long_history() -> None:
    d = Driver()
    d.run(register_worker, register("w1", slots=4), 0)
    cap = tombstone_capacity(d.state, "w1")
    assert cap == 4 * len(FORMS)
    seq = [0]
    sizes = []
    for k in range(200):
        _serve(d, seq, [h(1000 + 2 * k), h(1001 + 2 * k)], f"L{k}", 10 + k)
        sizes.append(len(d.state.replicas))
    live = sum(1 for r in d.state.replicas.values() if r.state in (S.READY, S.ALLOCATED))
    assert live == cap                                   # the pools are full of READY replicas
    assert max(sizes) <= 2 * cap                         # live + tombstones, whatever the history
    assert len(d.state.tombstones["w1"]) == cap
    assert check_invariants(d.state) == []
    # 1,200 replicas were created; the snapshot holds 24, and the log rebuilds the same state.
    assert state_hash(replay(d.log, d.state.params)) == state_hash(d.state)
    assert state_hash(from_snapshot(to_snapshot(d.state))) == state_hash(d.state)
    assert len(to_snapshot(d.state)) < 8_000


def test_an_lru_victim_can_be_copied_down_while_its_tombstone_is_kept() -> None:
    d = Driver()
    d.run(register_worker, register("w1", slots=1), 0)   # capacity: 3 tombstones (one slot per form)
    seq = [0]
    _serve(d, seq, [h(1)], "L1", 1)
    victim = (h(1), "compressed", "gpu:w1")
    committed = d.state.replicas[victim].checksum
    g = _serve(d, seq, [h(2)], "L2", 2)                  # evicts block 1's three replicas
    assert {(r.block_hash, r.form) for r in g.evict} == {(h(1), f) for f in FORMS}
    assert d.state.replicas[victim].state is S.EVICTED    # a tombstone: the grant told the worker
    seq[0] += 1
    copy = transition("w1", 1, seq[0], h(1), "compressed", None, S.READY, location="host:w1", checksum=committed)
    assert isinstance(d.run(ingest_transition, copy, 3)[0], TransitionApplied)
    # Two more requests push block 1's remaining tombstones out: its swa copy can no longer be
    # judged against the checksum it was committed with, so it is refused, with the reason.
    _serve(d, seq, [h(3)], "L3", 4)
    _serve(d, seq, [h(4)], "L4", 5)
    assert (h(1), "swa", "gpu:w1") not in d.state.replicas
    seq[0] += 1
    late = transition("w1", 1, seq[0], h(1), "swa", None, S.READY, location="host:w1", checksum="c2")
    out = d.run(ingest_transition, late, 6)
    assert isinstance(out[0], TransitionRejected) and "no READY or EVICTED replica" in out[0].reason
    assert check_invariants(d.state) == []


def test_reregistration_with_fewer_slots_trims_the_tombstones_it_no_longer_keeps() -> None:
    d = Driver()
    d.run(register_worker, register("w1", slots=4), 0)
    seq = [0]
    for k in range(10):
        _serve(d, seq, [h(10 + k)], f"L{k}", 1 + k)
    assert len(d.state.tombstones["w1"]) == 12
    d.run(register_worker, register("w1", slots=1), 20)  # fences epoch 1 (its 12 GPU replicas LOST)
    assert len(d.state.tombstones["w1"]) == 3 and len(d.state.replicas) == 3
    assert check_invariants(d.state) == []
    assert state_hash(replay(d.log, d.state.params)) == state_hash(d.state)
