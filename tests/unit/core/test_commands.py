"""Commands at their edges: what each refuses and why, and what it decides when it grants."""

from __future__ import annotations

import pytest

from coordinator.core import (
    CoreParams, Invalidated, ReplicaPinned, SnapshotError, TransitionApplied, TransitionRejected, UnknownReplica,
    UnknownScope, UnknownWorker, WorkerLost, WorkerRegistered, acquire_lease, collect_disk, drop_controls,
    drain_worker,
    evict_host, evict_replica,
    expire, from_snapshot, heartbeat, ingest_transition, invalidate, register_worker, release_lease,
    renew_lease, replay, resume, state_hash, switch_cache, to_snapshot,
)
from coordinator.core.route import route
from shared import messages
from shared.messages import (
    Control, DiskBlock, DiskGc, ErrorCode, ErrorReply, HostEvict, LeaseGrant, ReplicaState as S, RouteQuery,
)

from .support import FORMS, NS, Driver, acquire, consistent, h, hb, register, release, renew, transition


def fresh(params: CoreParams | None = None, slots: int = 8, workers: tuple[str, ...] = ("w1",)) -> Driver:
    d = Driver(params)
    for w in workers:
        d.run(register_worker, register(w, slots=slots), 0)
    return d


class Seq:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> int:
        self.n += 1
        return self.n


def fill(d: Driver, g: LeaseGrant, blocks: list[str], seq: Seq, wid: str = "w1", epoch: int = 1,
         now: int = 5) -> None:
    """Commit every write of ``g`` (generation = seq, checksum = c<block>)."""
    for form, idx in g.write.items():
        for i in idx:
            out = d.run(ingest_transition, transition(wid, epoch, seq(), blocks[i], form, S.ALLOCATED, S.READY,
                                                      generation=7, checksum=f"c{i}", lease_id=g.lease_id,
                                                      location=f"gpu:{wid}"), now)
            assert isinstance(out[0], TransitionApplied), out


def warm(d: Driver, blocks: list[str], seq: Seq, wid: str = "w1", now: int = 5) -> None:
    g = d.run(acquire_lease, acquire(wid, 1, blocks), now, f"warm-{wid}-{now}")
    fill(d, g, blocks, seq, wid, now=now)
    d.run(release_lease, release(wid, 1, g.lease_id), now)


def named(controls: list[Control]) -> list[tuple[str, dict[str, int] | None]]:
    """The blocks ``invalidate_blocks`` controls name, each with its generations, in order."""
    assert all(c.action == "invalidate_blocks" for c in controls), controls
    return [(b.block_hash, b.generations) for c in controls for b in c.blocks]


def err(reply: object, code: ErrorCode, *fragments: str) -> None:
    assert isinstance(reply, ErrorReply), reply
    assert reply.code is code, reply
    for f in fragments:
        assert f in reply.message, reply.message


# --- registration and heartbeats ----------------------------------------------------------

def test_register_refuses_pool_slots_for_undeclared_forms() -> None:
    d = Driver()
    r = d.run(register_worker, register("w1").__class__(worker_id="w1", namespace=NS,
                                                        catalogue=register("w1").catalogue,
                                                        pool_slots={"kv": 3}), 0)
    err(r, ErrorCode.INVALID, "'kv'", "declared: ['compressed', 'swa', 'tail']")
    assert d.state.workers == {}


def test_reregistration_fences_first_then_registers() -> None:
    d = fresh()
    reply, events = register_worker(d.state, register("w1"), 10)
    assert reply.epoch == 2
    assert [type(e) for e in events] == [WorkerLost, WorkerRegistered]
    assert events[0].reason == "superseded by epoch 2"
    d.commit(events)
    # A lost worker re-registers without a second WorkerLost.
    d.commit(expire(d.state, 10 + 301))            # silent: suspended
    d.commit(expire(d.state, 10 + 301 + 1001))     # past the grace: lost
    assert not d.state.workers["w1"].alive
    reply, events = register_worker(d.state, register("w1"), 1400)
    assert reply.epoch == 3 and [type(e) for e in events] == [WorkerRegistered]
    d.commit(events)
    consistent(d)


def test_heartbeats() -> None:
    d = fresh()
    err(d.run(heartbeat, hb("w9", 1), 1), ErrorCode.NOT_FOUND, "w9 is not registered")
    err(d.run(heartbeat, hb("w1", 2), 1), ErrorCode.FENCED)
    before = d.hash
    assert d.run(heartbeat, hb("w1", 1), 50).committed_seq == 0
    assert d.hash == before and d.log[-1].__class__.__name__ != "WorkerHeartbeat"   # soft state: no event
    d.run(expire, 301)
    err(d.run(heartbeat, hb("w1", 1), 302), ErrorCode.SUSPENDED, "resume")
    consistent(d)


def test_watermark_is_the_contiguous_prefix_of_recorded_seqs() -> None:
    d = fresh()
    blocks = [h(0), h(1), h(2)]
    d.run(acquire_lease, acquire("w1", 1, blocks, forms=("compressed",)), 1, "L")
    c = lambda seq, i: transition("w1", 1, seq, blocks[i], "compressed", S.ALLOCATED, S.READY)  # noqa: E731
    d.run(ingest_transition, c(1, 0), 2)
    d.run(ingest_transition, c(3, 2), 2)
    assert d.run(heartbeat, hb("w1", 1), 3).committed_seq == 1   # seq 2 still missing: keep 3 in the outbox
    assert d.run(ingest_transition, c(3, 2), 4) == []          # redelivered: already recorded
    d.run(ingest_transition, c(2, 1), 5)
    assert d.run(heartbeat, hb("w1", 1), 6).committed_seq == 3
    consistent(d)


# --- acquire -----------------------------------------------------------------------------

def test_acquire_refusals() -> None:
    d = fresh()
    err(d.run(acquire_lease, acquire("w9", 1, [h(0)]), 1, "L"), ErrorCode.NOT_FOUND)
    err(d.run(acquire_lease, acquire("w1", 2, [h(0)]), 1, "L"), ErrorCode.FENCED, "epoch 2 is fenced")
    bad_ns = acquire("w1", 1, [h(0)]).__class__(worker_id="w1", epoch=1, namespace="cd" * 16, block_hashes=[h(0)])
    err(d.run(acquire_lease, bad_ns, 1, "L"), ErrorCode.INVALID, "namespace")
    err(d.run(acquire_lease, acquire("w1", 1, [h(0)], forms=("swa", "kv")), 1, "L"), ErrorCode.INVALID,
        "write form 'kv' is not declared", "declared: ['compressed', 'swa', 'tail']")
    err(d.run(acquire_lease, acquire("w1", 1, [h(0)], forms=("swa", "swa")), 1, "L"), ErrorCode.INVALID, "twice")
    err(d.run(acquire_lease, acquire("w1", 1, [h(0), h(0)]), 1, "L"), ErrorCode.INVALID, "repeats")
    d.run(acquire_lease, acquire("w1", 1, [h(0)]), 1, "L")
    err(d.run(acquire_lease, acquire("w1", 1, [h(1)]), 1, "L"), ErrorCode.INVALID, "already live")
    consistent(d)


def test_cache_disabled_request_reads_nothing_and_skips_live_blocks() -> None:
    d, seq = fresh(), Seq()
    blocks = [h(0), h(1)]
    warm(d, blocks[:1], seq)
    g = d.run(acquire_lease, acquire("w1", 1, blocks, reuse=False), 10, "L")
    assert g.usable_blocks == 0 and g.read == [] and g.write == {f: [1] for f in FORMS}
    consistent(d)


def test_pool_full_of_pinned_replicas_grants_fewer_writes_then_none() -> None:
    d, seq = fresh(slots=3), Seq()
    blocks = [h(i) for i in range(5)]
    warm(d, blocks[:2], seq)
    cs = ("compressed", "swa")  # both pinned for blocks 0,1 by a resume at p=2 (tail only at block 1)
    # Pin blocks 0,1 with a live lease; one slot per form is left.
    g1 = d.run(acquire_lease, acquire("w1", 1, blocks[:3], forms=cs), 10, "L1")
    assert g1.usable_blocks == 2 and g1.write == {f: [2] for f in cs}
    # Nothing evictable now (2 pinned + 1 ALLOCATED per form): a request for other blocks gets nothing.
    other = [h(100), h(101)]
    err(d.run(acquire_lease, acquire("w1", 1, other, forms=cs), 11, "L2"), ErrorCode.OVER_CAPACITY, "pinned")
    # A request that can read still gets its reads, with no writes.
    g3 = d.run(acquire_lease, acquire("w1", 1, blocks, forms=cs), 12, "L3")
    assert g3.usable_blocks == 2 and g3.write == {} and g3.evict == []
    # Block 2 committed and L1 released: block 2 is evictable (0,1 still pinned by L3), so one write fits.
    fill(d, g1, blocks, seq, now=13)
    d.run(release_lease, release("w1", 1, "L1"), 14)
    g4 = d.run(acquire_lease, acquire("w1", 1, other, forms=cs), 15, "L4")
    assert g4.write == {f: [0] for f in cs}
    assert sorted((int(r.block_hash, 16), r.form) for r in g4.evict) == [(2, f) for f in cs]
    consistent(d)


def test_tenant_quota_grants_whole_blocks_only() -> None:
    d = fresh(CoreParams(tenant_quota_replicas=4))
    # Room for 4 replicas: block 0 takes 3 (one per form); block 1 would need 3 more.
    g = d.run(acquire_lease, acquire("w1", 1, [h(0), h(1)]), 1, "L1")
    assert g.write == {f: [0] for f in FORMS}
    err(d.run(acquire_lease, acquire("w1", 1, [h(5)]), 2, "L2"), ErrorCode.OVER_CAPACITY, "quota")
    g3 = d.run(acquire_lease, acquire("w1", 1, [h(5)], tenant="t2"), 3, "L3")
    assert g3.write == {f: [0] for f in FORMS}
    assert d.state.tenant_used == {"t1": 3, "t2": 3}
    consistent(d)


def test_draining_worker_gets_reads_but_no_writes() -> None:
    d, seq = fresh(), Seq()
    warm(d, [h(0)], seq)
    with pytest.raises(UnknownWorker):
        drain_worker(d.state, "w9")
    d.run(drain_worker, "w1", 10, "upgrade")
    assert d.state.workers["w1"].draining and drain_worker(d.state, "w1", 11) == []
    g = d.run(acquire_lease, acquire("w1", 1, [h(0), h(1)]), 12, "L")
    assert g.usable_blocks == 1 and g.write == {}
    err(d.run(acquire_lease, acquire("w1", 1, [h(7)]), 13, "L2"), ErrorCode.OVER_CAPACITY, "draining")
    consistent(d)


def test_prefix_read_from_disk_gets_a_gpu_write_to_reload_into() -> None:
    d, seq = fresh(), Seq()
    blocks = [h(0), h(1)]
    warm(d, blocks, seq)
    for i, b in enumerate(blocks):   # offload every form to disk, then drop the GPU copies
        for f in FORMS:
            assert isinstance(d.run(ingest_transition, transition("w1", 1, seq(), b, f, None, S.READY,
                                                                  location="disk", generation=7,
                                                                  checksum=f"c{i}"), 20)[0], TransitionApplied)
            d.run(ingest_transition, transition("w1", 1, seq(), b, f, S.READY, S.EVICTED, generation=7), 21)
    g = d.run(acquire_lease, acquire("w1", 1, blocks), 30, "L")
    assert g.usable_blocks == 2 and {r.location for r in g.read} == {"disk"}
    # Reads that the resume needs come from disk and get GPU slots; tail of block 0 is not needed.
    assert g.write == {"compressed": [0, 1], "swa": [0, 1], "tail": [1]}
    consistent(d)


# --- renew and release -------------------------------------------------------------------

def test_renew() -> None:
    d = fresh()
    d.run(acquire_lease, acquire("w1", 1, [h(0)], ttl_ms=500), 0, "L")
    assert d.state.leases["L"].expires_at_ms == 500
    err(d.run(renew_lease, renew("w1", 1, "nope"), 1), ErrorCode.NOT_FOUND)
    err(d.run(renew_lease, renew("w2", 1, "L"), 1), ErrorCode.INVALID, "belongs to worker w1")
    err(d.run(renew_lease, renew("w1", 2, "L"), 1), ErrorCode.FENCED)
    assert d.run(renew_lease, renew("w1", 1, "L", ttl_ms=99999), 100).expires_at_ms == 1100  # capped at TTL
    err(d.run(renew_lease, renew("w1", 1, "L"), 1100), ErrorCode.NOT_FOUND, "expired")
    consistent(d)


def test_release_aborts_only_uncommitted_writes_of_this_lease() -> None:
    d, seq = fresh(), Seq()
    blocks = [h(0), h(1)]
    g = d.run(acquire_lease, acquire("w1", 1, blocks, forms=("compressed",)), 0, "L")
    d.run(ingest_transition, transition("w1", 1, seq(), blocks[0], "compressed", S.ALLOCATED, S.READY), 1)
    err(d.run(release_lease, release("w2", 1, "L"), 2), ErrorCode.INVALID)
    _, events = release_lease(d.state, release("w1", 1, "L"), 2)
    assert [type(e).__name__ for e in events] == ["LeaseReleased"]   # the release aborts by itself
    d.commit(events)
    assert d.state.replica_state((blocks[0], "compressed", "gpu:w1")) is S.READY
    assert d.state.replica_state((blocks[1], "compressed", "gpu:w1")) is S.EVICTED
    assert g.write == {"compressed": [0, 1]}
    err(d.run(release_lease, release("w1", 1, "L"), 3), ErrorCode.NOT_FOUND)
    consistent(d)


# --- expiry ------------------------------------------------------------------------------

def test_lease_expiry_aborts_writes_and_late_commit_is_refused() -> None:
    d = fresh()
    d.run(acquire_lease, acquire("w1", 1, [h(0)], forms=("swa",), ttl_ms=200), 0, "L")
    d.run(heartbeat, hb("w1", 1), 150)
    assert d.run(expire, 199) == []
    events = d.run(expire, 200)
    assert [type(e).__name__ for e in events] == ["LeaseExpired"]
    assert d.state.replica_state((h(0), "swa", "gpu:w1")) is S.EVICTED   # the unfilled write aborted
    late = d.run(ingest_transition, transition("w1", 1, 1, h(0), "swa", S.ALLOCATED, S.READY), 201)
    assert isinstance(late[0], TransitionRejected) and "EVICTED" in late[0].reason
    consistent(d)


def test_silent_worker_is_suspended_then_lost_with_its_leases() -> None:
    d = fresh(workers=("w1", "w2"))
    d.run(acquire_lease, acquire("w1", 1, [h(0)]), 0, "L")
    seen = {("w2", 1): 250}                     # the shell's soft liveness: only w2 was heard from
    events = d.run(expire, 301, seen)
    assert [type(e).__name__ for e in events] == ["WorkerSuspended"] and events[0].worker_id == "w1"
    w1 = d.state.workers["w1"]
    assert w1.alive and w1.suspended and len(d.state.live_keys(w1)) == 3   # the cache is kept
    err(d.run(acquire_lease, acquire("w1", 1, [h(0)]), 302, "L2"), ErrorCode.SUSPENDED, "resume")
    err(d.run(renew_lease, renew("w1", 1, "L"), 302), ErrorCode.SUSPENDED)
    assert d.run(expire, 999, {("w2", 1): 900}) == []             # within the grace (L still within TTL)
    events = d.run(expire, 1302, {("w2", 1): 1200})
    assert [type(e).__name__ for e in events] == ["WorkerLost"]       # no separate LeaseExpired
    assert events[0].worker_id == "w1" and events[0].released == ["L"] and len(events[0].lost) == 3
    assert d.state.workers["w2"].alive and not d.state.workers["w1"].alive
    err(d.run(acquire_lease, acquire("w1", 1, [h(0)]), 1303, "L2"), ErrorCode.FENCED, "lost")
    consistent(d)


def test_floor_spares_workers_a_coordinator_stall() -> None:
    d = fresh()
    assert d.run(expire, 5_000, {("w1", 1): 1_000}, 4_900) == []   # silent, but we were the ones stalled
    assert [type(e).__name__ for e in d.run(expire, 5_201, {("w1", 1): 1_000}, 4_900)] == ["WorkerSuspended"]


def test_takeover_suspends_every_live_epoch_and_gives_leases_a_grace_period() -> None:
    d = fresh(workers=("w1", "w2"))
    d.run(acquire_lease, acquire("w1", 1, [h(0)], ttl_ms=100), 0, "L")
    events = d.run(resume, 10_000)
    assert [type(e).__name__ for e in events] == ["CoordinatorResumed", "WorkerSuspended", "WorkerSuspended"]
    assert all(w.suspended for w in d.state.workers.values())
    assert d.run(expire, 10_299) == []                       # leases: heartbeat timeout 300 ms from the takeover
    assert [type(e).__name__ for e in d.run(expire, 10_301)][-1] == "LeaseExpired"
    assert [type(e).__name__ for e in d.run(expire, 11_001)] == ["WorkerLost", "WorkerLost"]
    consistent(d)


# --- transitions: offload, fencing, pins -----------------------------------------------------

def offloaded_by_w1() -> Driver:
    """w1 and w2 registered; w1 holds block h(0) on its GPU and has copied every form of it to
    disk and to its host tier."""
    d, seq = fresh(workers=("w1", "w2")), Seq()
    warm(d, [h(0)], seq)
    for f in FORMS:
        for loc in ("disk", "host:w1"):
            out = d.run(ingest_transition, transition("w1", 1, seq(), h(0), f, None, S.READY, location=loc,
                                                      generation=7, checksum="c0"), 10)
            assert isinstance(out[0], TransitionApplied), out
    return d

def test_offloads_survive_fencing_on_disk_only_and_serve_other_workers() -> None:
    d = offloaded_by_w1()
    assert set(d.state.workers["w1"].offloaded) == {(h(0), f, loc) for f in FORMS for loc in ("disk", "host:w1")}
    # w2 reads w1's disk copies (not w1's GPU or host) and pins them.
    g = d.run(acquire_lease, acquire("w2", 1, [h(0), h(1)]), 11, "L2")
    assert g.usable_blocks == 1 and {r.location for r in g.read} == {"disk"}
    d.run(register_worker, register("w1"), 20)  # w1 restarts
    states = {k: r.state for k, r in d.state.replicas.items()}
    assert {k[2]: v for k, v in states.items() if k[1] == "swa" and k[2] != "gpu:w2"} == {
        "gpu:w1": S.LOST, "host:w1": S.LOST, "disk": S.READY}
    assert d.state.replicas[(h(0), "swa", "disk")].pins == 1
    consistent(d)


def test_a_worker_that_disowns_what_it_computed_invalidates_its_disk_copies_too() -> None:
    """After a failed run-time batch-invariance check a worker registers with
    ``disown_replicas``: its GPU and host replicas go with the old epoch as always, and every
    disk copy it made (whatever the epoch; readers' pins included) becomes INVALID, so no other
    worker reloads bytes that may differ from a cold run. Other workers' copies stay READY."""
    d = offloaded_by_w1()
    seq = Seq()
    warm(d, [h(5)], seq, wid="w2", now=12)
    for f in FORMS:
        out = d.run(ingest_transition, transition("w2", 1, seq(), h(5), f, None, S.READY, location="disk",
                                                  generation=7, checksum="c0"), 13)
        assert isinstance(out[0], TransitionApplied), out
    g = d.run(acquire_lease, acquire("w2", 1, [h(0), h(1)]), 14, "L2")
    assert {r.location for r in g.read} == {"disk"}
    for f in FORMS:                                   # w2 reloads w1's disk copy of h(0): the same bytes
        assert 0 in g.write[f]
        out = d.run(ingest_transition, transition("w2", 1, seq(), h(0), f, S.ALLOCATED, S.READY, generation=7,
                                                  checksum="c0", lease_id="L2"), 15)
        assert isinstance(out[0], TransitionApplied), out
    reply, events = register_worker(d.state, register("w1", disown_replicas=True), 20)
    assert [type(e).__name__ for e in events] == ["WorkerLost", "Invalidated", "WorkerRegistered"]
    # w1's disk copies, and w2's reload of them (selected by content: same block, form and checksum)
    assert reply.epoch == 2 and reply.disowned == 2 * len(FORMS)
    assert sorted(events[1].affected) == sorted((h(0), f, loc) for f in FORMS for loc in ("disk", "gpu:w2"))
    # told to drop it: the GPU replicas at the generations the decision covered
    assert named(drop_controls(d.state, events[1], but="w1")["w2"]) == [(h(0), {f: 7 for f in FORMS})]
    d.commit(events)
    states = {k: r.state for k, r in d.state.replicas.items()}
    assert {k[2]: v for k, v in states.items() if k[0] == h(0) and k[1] == "swa"} == {
        "gpu:w1": S.LOST, "host:w1": S.LOST, "disk": S.INVALID, "gpu:w2": S.INVALID}
    assert d.state.replicas[(h(0), "swa", "disk")].pins == 0
    assert all(states[(h(5), f, "disk")] is S.READY for f in FORMS)        # w2's own copies
    g2 = d.run(acquire_lease, acquire("w2", 1, [h(0), h(1)]), 21, "L3")
    assert not [r for r in g2.read if r.location == "disk"]
    # nothing live is left to disown: the reply says 0 and no Invalidated is logged
    reply, events = register_worker(d.state, register("w1", disown_replicas=True), 30)
    assert reply.disowned == 0 and [type(e).__name__ for e in events] == ["WorkerLost", "WorkerRegistered"]
    consistent(d)


def test_disk_gc_evicts_all_or_none_of_a_segments_replicas() -> None:
    """A worker's disk GC: every named live disk replica is evicted, unless a lease pins one of
    them (then none is, and the reply names the pinned ones); names that are not live are no-ops."""
    d, seq = fresh(workers=("w1", "w2")), Seq()
    warm(d, [h(0), h(1)], seq)
    for i, b in enumerate([h(0), h(1)]):
        for f in FORMS:
            d.run(ingest_transition, transition("w1", 1, seq(), b, f, None, S.READY, location="disk",
                                                generation=7, checksum=f"c{i}"), 10)
            d.run(ingest_transition, transition("w1", 1, seq(), b, f, S.READY, S.EVICTED, generation=7), 11)
    g = d.run(acquire_lease, acquire("w2", 1, [h(0)]), 12, "L2")            # w2 pins h(0)'s disk replicas
    assert {r.location for r in g.read} == {"disk"}
    both = [DiskBlock(block_hash=b, form=f) for b in (h(0), h(1)) for f in FORMS]
    reply = d.run(collect_disk, DiskGc(worker_id="w1", epoch=1, blocks=both), 13)
    assert reply.evicted == 0 and {(p.block_hash, p.form) for p in reply.pinned} == \
        {(h(0), r.form) for r in g.read}
    assert all(d.state.replica_state((b.block_hash, b.form, "disk")) is S.READY for b in both)
    d.run(release_lease, release("w2", 1, "L2"), 14)
    ghost = DiskBlock(block_hash=h(9), form=FORMS[0])                        # never offloaded
    reply = d.run(collect_disk, DiskGc(worker_id="w1", epoch=1, blocks=[*both, ghost]), 15)
    assert reply.evicted == len(both) and reply.pinned == []
    assert all(d.state.replica_state((b.block_hash, b.form, "disk")) is S.EVICTED for b in both)
    err(d.run(collect_disk, DiskGc(worker_id="w1", epoch=2, blocks=both), 16), ErrorCode.FENCED)
    consistent(d)


def test_host_evict_evicts_each_unpinned_host_replica_and_keeps_the_pinned() -> None:
    """A worker's host-tier LRU victims, decided by the coordinator: each named READY replica at
    the worker's host location is evicted unless a lease pins it (kept READY, named in the
    reply); names that are not live are no-ops; a stale epoch is fenced; another worker's names
    touch only its own host tier."""
    d, seq = fresh(workers=("w1", "w2")), Seq()
    warm(d, [h(0), h(1)], seq)
    for i, b in enumerate((h(0), h(1))):
        for f in FORMS:
            for frm, to in ((None, S.READY), (S.READY, S.EVICTED)):    # copied to host:w1, then gone from the GPU
                loc = "host:w1" if frm is None else "gpu:w1"
                out = d.run(ingest_transition, transition("w1", 1, seq(), b, f, frm, to, location=loc,
                                                          generation=7, checksum=f"c{i}"), 10)
                assert isinstance(out[0], TransitionApplied), out
    g = d.run(acquire_lease, acquire("w1", 1, [h(0)]), 11, "L1")              # pins h(0)'s host replicas
    assert {r.location for r in g.read} == {"host:w1"}
    named = [DiskBlock(block_hash=b, form=f) for b in (h(0), h(1)) for f in FORMS]
    ghost = DiskBlock(block_hash=h(9), form=FORMS[0])
    err(d.run(evict_host, HostEvict(worker_id="w1", epoch=2, blocks=named), 12), ErrorCode.FENCED)
    reply = d.run(evict_host, HostEvict(worker_id="w2", epoch=1, blocks=named), 12)   # w2's own host tier: nothing
    assert reply.evicted == 0 and reply.pinned == []
    reply = d.run(evict_host, HostEvict(worker_id="w1", epoch=1, blocks=[*named, ghost, named[0]]), 13)
    assert {(p.block_hash, p.form) for p in reply.pinned} == {(h(0), r.form) for r in g.read}
    assert reply.evicted == len(FORMS)
    assert all(d.state.replica_state((h(0), f, "host:w1")) is S.READY for f in FORMS)
    assert all(d.state.replica_state((h(1), f, "host:w1")) is S.EVICTED for f in FORMS)
    d.run(release_lease, release("w1", 1, "L1"), 14)
    reply = d.run(evict_host, HostEvict(worker_id="w1", epoch=1, blocks=named), 15)
    assert reply.evicted == len(FORMS) and reply.pinned == []
    assert all(d.state.replica_state((b.block_hash, b.form, "host:w1")) is S.EVICTED for b in named)
    consistent(d)


def test_gpu_evict_frees_room_in_the_ledger_and_keeps_pinned_and_in_flight_replicas() -> None:
    """``tier`` gpu (a granted write found the worker's pool full: its view diverged): each named
    READY GPU replica is evicted unless a lease pins it; an in-flight write (ALLOCATED) and a
    host replica of the same block are untouched; the slots evicted are the ledger's again."""
    d, seq = fresh(slots=2), Seq()
    warm(d, [h(0), h(1)], seq)                                   # the pool of 2 slots per form is full
    g = d.run(acquire_lease, acquire("w1", 1, [h(0)]), 11, "L1")  # pins h(0) on the GPU
    assert {r.location for r in g.read} == {"gpu:w1"}
    named = [DiskBlock(block_hash=b, form=f) for b in (h(0), h(1)) for f in FORMS]
    reply = d.run(evict_host, HostEvict(worker_id="w1", epoch=1, blocks=named, tier="gpu"), 12)
    assert {(p.block_hash, p.form) for p in reply.pinned} == {(h(0), f) for f in FORMS}
    assert reply.evicted == len(FORMS)
    assert all(d.state.replica_state((h(0), f, "gpu:w1")) is S.READY for f in FORMS)
    assert all(d.state.replica_state((h(1), f, "gpu:w1")) is S.EVICTED for f in FORMS)
    w = d.run(acquire_lease, acquire("w1", 1, [h(2)]), 13, "L2")  # the freed slots: a write, no victim
    assert w.write == {f: [0] for f in FORMS} and not w.evict
    reply = d.run(evict_host, HostEvict(worker_id="w1", epoch=1, blocks=[DiskBlock(block_hash=h(2), form=f)
                                                                           for f in FORMS], tier="gpu"), 14)
    assert reply.evicted == 0 and reply.pinned == []
    assert all(d.state.replica_state((h(2), f, "gpu:w1")) is S.ALLOCATED for f in FORMS)
    consistent(d)


def test_a_worker_collects_and_changes_only_its_own_tiers() -> None:
    """Trust boundaries of the shared disk tier and the host tiers: w2's disk GC naming w1's disk
    replicas evicts none of them (their records are in w1's segments, which stay), while w1's
    own GC does; no worker moves a replica in another worker's host tier."""
    d = offloaded_by_w1()
    named = [DiskBlock(block_hash=h(0), form=f) for f in FORMS]
    reply = d.run(collect_disk, DiskGc(worker_id="w2", epoch=1, blocks=named), 11)
    assert reply.evicted == 0 and reply.pinned == []
    assert all(d.state.replica_state((h(0), f, "disk")) is S.READY for f in FORMS)
    seq2 = Seq()
    for frm, to in ((S.READY, S.EVICTED), (S.READY, S.INVALID)):
        out = d.run(ingest_transition, transition("w2", 1, seq2(), h(0), FORMS[0], frm, to, location="host:w1",
                                                  generation=7), 12)
        assert isinstance(out[0], TransitionRejected), out
        assert "cannot change replicas at host:w1 (its host tier is host:w2)" in out[0].reason
    out = d.run(ingest_transition, transition("w2", 1, seq2(), h(0), FORMS[0], None, S.READY, location="host:",
                                              generation=7, checksum="c0"), 12)
    assert isinstance(out[0], TransitionRejected), out
    out = d.run(ingest_transition, transition("w2", 1, seq2(), h(0), FORMS[0], S.READY, S.EVICTED, location="disk",
                                              generation=7), 12)
    assert isinstance(out[0], TransitionRejected) and "only its writer may evict it" in out[0].reason, out
    assert d.state.replica_state((h(0), FORMS[0], "host:w1")) is S.READY
    reply = d.run(collect_disk, DiskGc(worker_id="w1", epoch=1, blocks=named), 13)
    assert reply.evicted == len(FORMS)
    assert all(d.state.replica_state((h(0), f, "disk")) is S.EVICTED for f in FORMS)
    consistent(d)


def test_reuse_switched_off_pins_and_reserves_nothing_until_switched_back_on() -> None:
    d, seq = fresh(workers=("w1", "w2")), Seq()
    warm(d, [h(0), h(1)], seq)
    live = {w: d.state.workers[w] for w in ("w1", "w2")}
    d.run(switch_cache, NS, False, "suspect cache", 10)
    g = d.run(acquire_lease, acquire("w1", 1, [h(0), h(1), h(2)]), 11, "L1")
    assert g.usable_blocks == 0 and g.read == [] and g.write == {} and g.evict == []
    assert all(c.usable_blocks == 0 for c in route(d.state, RouteQuery(gateway_id="g", namespace=NS,
                                                                        block_hashes=[h(0)]), set(live)).workers)
    d.run(release_lease, release("w1", 1, "L1"), 12)
    d.run(switch_cache, "", False, "", 13)                    # every namespace off as well
    d.run(switch_cache, NS, True, "", 14)                     # NS's own switch on: "" still says off
    assert not d.state.reuse_enabled(NS)
    snap = from_snapshot(to_snapshot(d.state))
    assert snap.reuse_off == {"": ""} and state_hash(snap) == d.hash
    d.run(switch_cache, "", True, "", 15)
    g = d.run(acquire_lease, acquire("w1", 1, [h(0), h(1), h(2)]), 16, "L2")
    assert g.usable_blocks == 2 and g.write
    consistent(d)


def test_offload_source_must_be_readable_by_the_offloader() -> None:
    d, seq = fresh(workers=("w1", "w2")), Seq()
    warm(d, [h(0)], seq)
    out = d.run(ingest_transition, transition("w2", 1, 1, h(0), "swa", None, S.READY, location="disk",
                                              generation=7, checksum="c0"), 10)
    assert isinstance(out[0], TransitionRejected) and "gpu:w2" in out[0].reason


def test_pinned_replica_cannot_be_evicted_but_can_be_found_invalid() -> None:
    d, seq = fresh(), Seq()
    warm(d, [h(0)], seq)
    d.run(acquire_lease, acquire("w1", 1, [h(0)]), 10, "L")
    key = (h(0), "tail", "gpu:w1")
    assert d.state.replicas[key].pins == 1
    out = d.run(ingest_transition, transition("w1", 1, seq(), h(0), "tail", S.READY, S.EVICTED, generation=7), 11)
    assert isinstance(out[0], TransitionRejected) and "pinned by 1" in out[0].reason
    with pytest.raises(ReplicaPinned):
        evict_replica(d.state, key)
    out = d.run(ingest_transition, transition("w1", 1, seq(), h(0), "tail", S.READY, S.INVALID, generation=7), 12)
    assert isinstance(out[0], TransitionApplied)
    assert d.state.replicas[key].pins == 0 and key not in d.state.leases["L"].pins
    consistent(d)


def test_holder_may_invalidate_its_own_allocated_write() -> None:
    d = fresh()
    d.run(acquire_lease, acquire("w1", 1, [h(0)], forms=("swa",)), 0, "L")
    out = d.run(ingest_transition, transition("w1", 1, 1, h(0), "swa", S.ALLOCATED, S.INVALID), 1)
    assert isinstance(out[0], TransitionApplied) and out[0].kind == "invalidate"
    d.run(release_lease, release("w1", 1, "L"), 2)
    assert d.state.replica_state((h(0), "swa", "gpu:w1")) is S.INVALID
    consistent(d)


def test_transitions_of_unknown_or_future_epochs_are_rejected() -> None:
    d = fresh()
    for t, why in ((transition("w9", 1, 1, h(0), "swa", S.ALLOCATED, S.READY), "not registered"),
                   (transition("w1", 5, 1, h(0), "swa", S.ALLOCATED, S.READY), "never registered")):
        out = d.run(ingest_transition, t, 1)
        assert isinstance(out[0], TransitionRejected) and why in out[0].reason
    consistent(d)


# --- operator commands -------------------------------------------------------------------

def test_invalidate_scopes() -> None:
    d, seq = fresh(workers=("w1", "w2")), Seq()
    warm(d, [h(0), h(1)], seq)
    warm(d, [h(0)], Seq(), wid="w2")
    d.run(acquire_lease, acquire("w1", 1, [h(0), h(1)]), 10, "L")
    with pytest.raises(UnknownScope):
        invalidate(d.state, "tenant", "t1", "x")
    with pytest.raises(UnknownWorker):
        invalidate(d.state, "worker", "w9", "x")
    (e,) = d.run(invalidate, "block", h(1), "corrupt", 11)
    assert e.affected == [(h(1), f, "gpu:w1") for f in FORMS]
    assert d.state.leases["L"].pins and all(k[0] != h(1) for k in d.state.leases["L"].pins)
    (e,) = d.run(invalidate, "worker", "w2", "bad gpu", 12)
    assert e.affected == [(h(0), f, "gpu:w2") for f in FORMS]
    (e,) = d.run(invalidate, "namespace", NS, "upgrade", 13)
    assert e.affected == [(h(0), f, "gpu:w1") for f in FORMS]
    assert {r.state for r in d.state.replicas.values()} == {S.INVALID}
    consistent(d)


def test_an_offload_in_flight_from_an_invalidated_block_is_refused() -> None:
    """w1 evicts h(0) from its GPU and copies it to its host tier; the copy's transition is still
    on its way when an operator invalidates the block (the control that follows makes w1 drop
    the copy). The EVICTED replica is retired with the live ones, so the copy is refused: the
    ledger does not list, READY, bytes that were invalidated and that w1 no longer holds."""
    d, seq = fresh(workers=("w1", "w2")), Seq()
    warm(d, [h(0), h(1)], seq)
    for f in FORMS:
        out = d.run(ingest_transition, transition("w1", 1, seq(), h(0), f, S.READY, S.EVICTED, generation=7), 6)
        assert isinstance(out[0], TransitionApplied), out
    in_flight = [transition("w1", 1, seq(), h(0), f, None, S.READY, location="host:w1", generation=7,
                            checksum="c0") for f in FORMS]
    (e,) = d.run(invalidate, "block", h(0), "corrupt", 7)
    assert e.affected == [] and e.retired == [(h(0), f, "gpu:w1") for f in FORMS]
    (c,) = drop_controls(d.state, e)["w1"]     # w1 holds the bytes until it handles the grant's eviction
    assert named([c]) == [(h(0), {f: 7 for f in FORMS})] and c.reason == "corrupt"
    for t in in_flight:
        out = d.run(ingest_transition, t, 8)
        assert isinstance(out[0], TransitionRejected) and "no READY or EVICTED replica" in out[0].reason, out
    assert {r.state for k, r in d.state.replicas.items() if k[0] == h(0)} == {S.INVALID}
    # h(1), not named, is untouched; a new write of h(0) starts a fresh incarnation as always
    assert all(d.state.replica_state((h(1), f, "gpu:w1")) is S.READY for f in FORMS)
    warm(d, [h(0)], seq, now=9)
    assert all(d.state.replica_state((h(0), f, "gpu:w1")) is S.READY for f in FORMS)
    consistent(d)


def test_a_workers_invalidation_retires_what_it_evicted_and_tells_it_per_block() -> None:
    """An operator invalidates a worker: its live replicas become INVALID, the EVICTED ones on
    its GPU and host tier are retired (a copy from one may be in flight), and the worker is told
    every block, each with its GPU generations; other workers are not told."""
    d, seq = fresh(workers=("w1", "w2")), Seq()
    warm(d, [h(0), h(1)], seq)
    warm(d, [h(0)], Seq(), wid="w2")
    for f in FORMS:
        d.run(ingest_transition, transition("w1", 1, seq(), h(1), f, S.READY, S.EVICTED, generation=7), 6)
    (e,) = d.run(invalidate, "worker", "w1", "bad gpu", 7)
    assert e.affected == [(h(0), f, "gpu:w1") for f in FORMS]
    assert e.retired == [(h(1), f, "gpu:w1") for f in FORMS]
    controls = drop_controls(d.state, e)
    assert list(controls) == ["w1"] and len(controls["w1"]) == 1      # one control names both blocks
    assert named(controls["w1"]) == [(b, {f: 7 for f in FORMS}) for b in sorted([h(0), h(1)])]
    assert all(d.state.replica_state((h(0), f, "gpu:w2")) is S.READY for f in FORMS)
    consistent(d)


def test_a_large_invalidation_is_told_in_controls_of_at_most_max_control_blocks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block once, in order, split across controls of at most ``MAX_CONTROL_BLOCKS``
    (a worker that held 100k blocks gets 98 messages, not 100k), each with the reason."""
    monkeypatch.setattr(messages, "MAX_CONTROL_BLOCKS", 2)
    d, seq = fresh(), Seq()
    blocks = [h(i) for i in range(5)]
    warm(d, blocks, seq)
    (e,) = d.run(invalidate, "worker", "w1", "bad gpu", 7)
    controls = drop_controls(d.state, e)["w1"]
    assert [len(c.blocks) for c in controls] == [2, 2, 1] and {c.reason for c in controls} == {"bad gpu"}
    assert named(controls) == [(b, {f: 7 for f in FORMS}) for b in sorted(blocks)]


def test_a_disown_retires_evicted_copies_whose_offload_may_be_in_flight() -> None:
    """w2 reloaded w1's disk copy of h(0) into its GPU pool, then evicted it and is copying it
    to its host tier when w1 disowns what it computed: w2's EVICTED reload has w1's content, so
    it is retired, w2 is told to drop the block, and the copy, ingested after, is refused."""
    d = offloaded_by_w1()
    seq = Seq()
    g = d.run(acquire_lease, acquire("w2", 1, [h(0)]), 14, "L2")
    assert {r.location for r in g.read} == {"disk"}
    for f in FORMS:
        out = d.run(ingest_transition, transition("w2", 1, seq(), h(0), f, S.ALLOCATED, S.READY, generation=7,
                                                  checksum="c0", lease_id="L2"), 15)
        assert isinstance(out[0], TransitionApplied), out
    d.run(release_lease, release("w2", 1, "L2"), 16)
    for f in FORMS:
        out = d.run(ingest_transition, transition("w2", 1, seq(), h(0), f, S.READY, S.EVICTED, generation=7), 17)
        assert isinstance(out[0], TransitionApplied), out
    in_flight = [transition("w2", 1, seq(), h(0), f, None, S.READY, location="host:w2", generation=7,
                            checksum="c0") for f in FORMS]
    reply, events = register_worker(d.state, register("w1", disown_replicas=True), 20)
    inv = events[1]
    assert isinstance(inv, Invalidated) and sorted(inv.retired) == sorted((h(0), f, "gpu:w2") for f in FORMS)
    assert [b for b, _ in named(drop_controls(d.state, inv, but="w1")["w2"])] == [h(0)]
    d.commit(events)
    for t in in_flight:
        out = d.run(ingest_transition, t, 21)
        assert isinstance(out[0], TransitionRejected), out
    assert all(d.state.replica_state((h(0), f, loc)) is not S.READY for f in FORMS
               for loc in ("disk", "gpu:w2", "host:w2"))
    consistent(d)


def test_operator_eviction() -> None:
    d, seq = fresh(), Seq()
    warm(d, [h(0)], seq)
    with pytest.raises(UnknownReplica):
        evict_replica(d.state, (h(5), "swa", "gpu:w1"))
    (e,) = d.run(evict_replica, (h(0), "swa", "gpu:w1"), 3)
    assert e.reason == "control" and d.state.replica_state((h(0), "swa", "gpu:w1")) is S.EVICTED
    consistent(d)


# --- snapshots ---------------------------------------------------------------------------

def test_snapshot_plus_tail_equals_full_replay() -> None:
    d, seq = fresh(workers=("w1", "w2")), Seq()
    warm(d, [h(0), h(1)], seq)
    d.run(acquire_lease, acquire("w1", 1, [h(0), h(1), h(2)]), 10, "L")
    d.run(register_worker, register("w2"), 11)
    for k in range(len(d.log) + 1):
        head = replay(d.log[:k], d.state.params)
        resumed = replay(d.log[k:], start=from_snapshot(to_snapshot(head)))
        assert state_hash(resumed) == d.hash, k
    assert from_snapshot(to_snapshot(d.state), CoreParams(lease_ttl_ms=5)).params.lease_ttl_ms == 5


def test_snapshot_errors() -> None:
    with pytest.raises(SnapshotError, match="not a ledger snapshot"):
        from_snapshot(b"\xc1")
    import msgspec
    with pytest.raises(SnapshotError, match="snapshot version 9"):
        from_snapshot(msgspec.msgpack.encode({"v": 9}))
