"""The core's two indexes, each the answer a scan would give without the scan:

* the LRU index a write grant takes its victims from: the same victims as a scan of the pool
  (least recently used first, ties by block hash), whatever pins, uses and evictions came before;
* the deadline index expiry takes due leases from: the same leases as a scan of every live one.

A decision that is not applied leaves either index as it was. A whole-log fold rebuilds both at
its end instead of keeping them (``indexes_deferred``), and the replayed state decides as the
live one does."""

from __future__ import annotations

import random

import pytest

from coordinator.core import (
    CoreParams, acquire_lease, check_invariants, expire, from_snapshot, heartbeat, ingest_transition,
    lease_deadline, register_worker, release_lease, renew_lease, resume, resume_worker, state_hash, to_snapshot,
)
from coordinator.core import replay
from coordinator.core.events import encode_event
from coordinator.core.state import LRU_CHECK_EVERY, LedgerState, fold_rows, indexes_deferred
from shared.messages import LeaseGrant, ReplicaState as S

from .support import FORMS, Driver, acquire, h, hb, register, release, renew, resume_msg, transition


def _workload(d: Driver, rng: random.Random, steps: int, slots: int, now: int = 1, n_lease: int = 0,
              seq: int = 0) -> list[tuple[object, list[object]]]:
    """Random leases (reads of READY blocks, new writes that evict once the pool is full), their
    commits and releases, on worker w1; every decision's ``(reply, events)``, in order."""
    out: list[tuple[object, list[object]]] = []
    held: list[str] = []
    fresh = iter(range(10_000 + 1000 * n_lease, 10**9))
    for _ in range(steps):
        now += rng.choice([0, 0, 1, 2])
        if held and rng.random() < 0.4:
            out.append(release_lease(d.state, release("w1", 1, held.pop(rng.randrange(len(held)))), now))
            d.commit(out[-1][1])
            continue
        pool = d.state.pools.get(("w1", "compressed"), {})
        ready = sorted(k[0] for k in pool if d.state.replicas[k].state is S.READY)
        req = rng.sample(ready, min(len(ready), rng.randint(0, 3))) + [h(next(fresh)) for _ in range(rng.randint(1, 3))]
        n_lease += 1
        lid = f"L{n_lease}"
        reply, events = acquire_lease(d.state, acquire("w1", 1, req, forms=("compressed",)), now, lid)
        out.append((reply, events))
        d.commit(events)
        if isinstance(reply, LeaseGrant):
            for form, idx in reply.write.items():
                for i in idx:
                    seq += 1
                    out.append((None, d.run(ingest_transition, transition(
                        "w1", 1, seq, req[i], form, S.ALLOCATED, S.READY, lease_id=lid, index=i), now)))
            held.append(lid)
    return out


def test_a_replayed_state_decides_as_the_live_one() -> None:
    live = Driver()
    live.run(register_worker, register("w1", slots=24), 0)
    _workload(live, random.Random(11), 200, 24)
    # the same log folded two ways, each rebuilding the indexes once at its end
    by_events = Driver()
    by_events.state = replay(live.log, live.state.params)
    by_rows = Driver(live.state.params)
    with indexes_deferred(by_rows.state):
        fold_rows(by_rows.state, [(i + 1, encode_event(e)) for i, e in enumerate(live.log)])
    for d in (by_events, by_rows):
        assert not d.state.indexes_deferred
        assert state_hash(d.state) == state_hash(live.state) and check_invariants(d.state) == []
    # the heaps held no stale entries: at most one per evictable replica
    assert sum(map(len, by_rows.state.lru.values())) < sum(map(len, live.state.lru.values()))
    # then the same requests get the same answers and the same events (victims included)
    later = [_workload(d, random.Random(12), 150, 24, now=10_000, n_lease=1000, seq=10_000)
             for d in (live, by_events, by_rows)]
    assert later[0] == later[1] == later[2]
    assert sum(len(r.evict) for r, _ in later[0] if isinstance(r, LeaseGrant)) > 50   # the pool stayed full


def test_a_failed_deferred_fold_still_leaves_the_indexes_whole() -> None:
    d = Driver()
    d.run(register_worker, register("w1", slots=8), 0)
    _workload(d, random.Random(3), 40, 8)
    d.state.lru.clear()
    with pytest.raises(RuntimeError), indexes_deferred(d.state):
        raise RuntimeError("a fold that failed half-way")
    assert not d.state.indexes_deferred and check_invariants(d.state) == []


def _brute_force_victims(state: LedgerState, form: str, k: int, mine: set[str]) -> list[str]:
    pool = state.pools[("w1", form)]
    cand = [state.replicas[key] for key in pool]
    cand = [r for r in cand if r.state is S.READY and not r.pins and r.block_hash not in mine]
    return [r.block_hash for r in sorted(cand, key=lambda r: (r.last_used_ms, r.block_hash))[:k]]


def test_victims_are_those_a_scan_of_the_pool_would_choose() -> None:
    rng = random.Random(5)
    d = Driver()
    slots = 40
    d.run(register_worker, register("w1", slots=slots), 0)
    seq, now, n_lease = 0, 1, 0
    blocks = [h(1000 + i) for i in range(slots)]
    d.run(acquire_lease, acquire("w1", 1, blocks, forms=("compressed",)), now, "fill")
    for i, b in enumerate(blocks):
        seq += 1
        d.run(ingest_transition,
              transition("w1", 1, seq, b, "compressed", S.ALLOCATED, S.READY, lease_id="fill", index=i), now + i % 3)
    d.run(release_lease, release("w1", 1, "fill"), now)
    held: list[str] = []
    evicted = 0
    fresh = iter(range(10_000, 10**9))
    for step in range(300):
        now += rng.choice([0, 0, 1, 2])          # equal times too: ties go by block hash
        if held and rng.random() < 0.4:           # a reader lets go: its replicas are evictable again
            lid = held.pop(rng.randrange(len(held)))
            d.run(release_lease, release("w1", 1, lid), now)
            continue
        ready = [k[0] for k in d.state.pools[("w1", "compressed")] if d.state.replicas[k].state is S.READY]
        reads = rng.sample(ready, min(len(ready), rng.randint(0, 3)))
        new = [h(next(fresh)) for _ in range(rng.randint(0, 3))]
        req = reads + new
        if not req:
            continue
        n_lease += 1
        lid = f"L{n_lease}"
        mine = set(req)
        # what a scan would evict, decided on the state before the grant
        free = slots - len(d.state.pools[("w1", "compressed")])
        expected = _brute_force_victims(d.state, "compressed", max(0, len(new) - free), mine)
        reply, events = acquire_lease(d.state, acquire("w1", 1, req, forms=("compressed",)), now, lid)
        again, _ = acquire_lease(d.state, acquire("w1", 1, req, forms=("compressed",)), now, lid + "b")
        if isinstance(reply, LeaseGrant):
            assert [v.block_hash for v in reply.evict] == expected[:len(reply.evict)]
            assert [v.block_hash for v in again.evict] == [v.block_hash for v in reply.evict]  # index restored
            evicted += len(reply.evict)
            d.commit(events)
            for form, idx in reply.write.items():
                for i in idx:
                    seq += 1
                    d.run(ingest_transition,
                          transition("w1", 1, seq, req[i], form, S.ALLOCATED, S.READY, lease_id=lid, index=i), now)
            held.append(lid)
    assert evicted > 100                         # the pool was full most of the time
    assert check_invariants(d.state) == []
    rebuilt = from_snapshot(to_snapshot(d.state))
    assert state_hash(rebuilt) == state_hash(d.state) and check_invariants(rebuilt) == []


def test_the_index_stays_bounded_by_the_pool() -> None:
    d = Driver()
    d.run(register_worker, register("w1", slots=8), 0)
    seq = 0
    for k in range(500):                           # every request writes two blocks and evicts two
        bs = [h(5000 + 2 * k), h(5001 + 2 * k)]
        g = d.run(acquire_lease, acquire("w1", 1, bs), k, f"L{k}")
        for form, idx in g.write.items():
            for i in idx:
                seq += 1
                d.run(ingest_transition, transition("w1", 1, seq, bs[i], form, S.ALLOCATED, S.READY, lease_id=f"L{k}", index=i), k)
        d.run(release_lease, release("w1", 1, f"L{k}"), k)
    # rebuilt past twice the pool's slots + 64, a bound checked every LRU_CHECK_EVERY pushes
    assert all(len(heap) < 2 * 8 + 64 + LRU_CHECK_EVERY for heap in d.state.lru.values())
    assert check_invariants(d.state) == []


def test_expiry_finds_the_leases_a_scan_would_find() -> None:
    rng = random.Random(9)
    d = Driver(CoreParams(lease_ttl_ms=1000, heartbeat_interval_ms=100, missed_heartbeats=1000,
                          resume_grace_ms=100_000))
    d.run(register_worker, register("w1", slots=1000), 0)
    now, n, expired, takeovers = 0, 0, 0, 0
    for step in range(400):
        now += rng.choice([1, 5, 20, 50])
        d.run(heartbeat, hb("w1", 1), now)
        roll = rng.random()
        if roll < 0.4:
            n += 1
            d.run(acquire_lease, acquire("w1", 1, [h(100_000 + n)], forms=(), ttl_ms=rng.choice([50, 200, 1000])),
                  now, f"L{n}")
        elif roll < 0.6 and d.state.leases:
            lid = rng.choice(sorted(d.state.leases))
            d.run(renew_lease, renew("w1", 1, lid, ttl_ms=rng.choice([50, 300])), now)
        elif roll < 0.7 and d.state.leases:
            d.run(release_lease, release("w1", 1, rng.choice(sorted(d.state.leases))), now)
        elif roll < 0.72:   # a takeover: leases granted before it get a heartbeat timeout more
            takeovers += 1
            d.commit(resume(d.state, now))
            reply = d.run(resume_worker, resume_msg("w1", 1, [], pool_slots={f: 1000 for f in FORMS}), now)
            assert type(reply).__name__ == "ResumeReply", reply
        scan = sorted(lid for lid, lease in d.state.leases.items() if now >= lease_deadline(d.state, lease))
        first = expire(d.state, now, {("w1", 1): now})
        again = expire(d.state, now, {("w1", 1): now})   # not applied: the index is as it was
        assert [e.lease_id for e in first if type(e).__name__ == "LeaseExpired"] == scan
        assert again == first
        expired += len(scan)
        d.commit(first)
    assert expired > 50 and takeovers > 3
    assert check_invariants(d.state) == []
