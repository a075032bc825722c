"""Suspension and resume: a worker that kept its memory through an outage keeps its epoch and
its cache; the ledger reconciles its inventory and never trusts what it cannot check."""

from __future__ import annotations

from coordinator.core import (
    WorkerLost, WorkerResumed, acquire_lease, check_invariants, expire, ingest_transition, register_worker,
    release_lease, replay, resume, resume_worker, state_hash,
)
from shared.hashing import split_digests
from shared.messages import ErrorCode, ResumeReply, ReplicaState as S

from .support import FORMS, acquire, consistent, h, held, register, release, resume_msg, transition
from .test_commands import Seq, err, fresh, warm


def _warm_with_host_copy(d, seq):  # type: ignore[no-untyped-def]
    warm(d, [h(0), h(1)], seq)     # generation 7, checksum c0 / c1 on gpu:w1
    out = d.run(ingest_transition, transition("w1", 1, seq(), h(0), "swa", None, S.READY, location="host:w1",
                                              generation=0, checksum="c0"), 6)
    assert type(out[0]).__name__ == "TransitionApplied"


def _inventory(d, wid="w1"):  # type: ignore[no-untyped-def]
    """What the worker really holds: every READY GPU/host replica the ledger lists for it."""
    w = d.state.workers[wid]
    return [held(*k, d.state.replicas[k].generation, d.state.replicas[k].checksum)
            for k in d.state.live_keys(w) if k[2] != "disk" and d.state.replicas[k].state is S.READY]


def test_resume_after_takeover_keeps_everything_the_worker_holds() -> None:
    d, seq = fresh(), Seq()
    _warm_with_host_copy(d, seq)
    d.run(resume, 100)                                  # a coordinator took over: w1 suspended
    assert d.state.workers["w1"].suspended
    inv = _inventory(d)
    assert len(inv) == 7                                # 2 blocks × 3 forms on the GPU + 1 host copy
    reply = d.run(resume_worker, resume_msg("w1", 1, inv, emitted_seq=seq.n), 200)
    assert isinstance(reply, ResumeReply) and reply.kept == 7 and reply.drop == b"" and reply.epoch == 1
    assert reply.committed_seq == seq.n
    e = d.log[-1]
    assert isinstance(e, WorkerResumed) and e.invalidated == [] and e.dropped == 0
    w = d.state.workers["w1"]
    assert w.alive and not w.suspended and w.epoch == 1
    g = d.run(acquire_lease, acquire("w1", 1, [h(0), h(1), h(2)]), 201, "L")
    assert g.usable_blocks == 2                         # the cache is still usable
    consistent(d)


def test_resume_reconciles_an_inventory_that_disagrees() -> None:
    d, seq = fresh(), Seq()
    _warm_with_host_copy(d, seq)
    d.run(expire, 400)                                  # silent: suspended
    gone = (h(1), "swa", "gpu:w1")                      # the worker no longer holds it
    changed = (h(1), "tail", "gpu:w1")                  # holds another generation
    corrupt = (h(0), "swa", "host:w1")                  # holds other bytes
    forged = held(h(9), "swa", "gpu:w1")                # holds something the ledger never granted
    foreign = held(h(0), "swa", "gpu:w2")               # claims another worker's replica
    inv = {k: held(*k, d.state.replicas[k].generation, d.state.replicas[k].checksum)
           for k in d.state.live_keys(d.state.workers["w1"]) if k[2] != "disk"}
    del inv[gone]
    inv[changed] = held(*changed, 8, "c1")
    inv[corrupt] = held(*corrupt, 0, "cX")
    reply = d.run(resume_worker, resume_msg("w1", 1, [*inv.values(), forged, foreign], emitted_seq=seq.n), 500)
    assert isinstance(reply, ResumeReply) and reply.kept == 4
    assert sorted(split_digests(reply.drop)) == sorted([inv[changed], inv[corrupt], forged, foreign])
    e = d.log[-1]
    assert e.invalidated == sorted([gone, changed, corrupt]) and e.dropped == 4
    for k in (gone, changed, corrupt):
        assert d.state.replicas[k].state is S.INVALID
    assert (h(9), "swa", "gpu:w1") not in d.state.replicas   # a claim is never trusted into the ledger
    g = d.run(acquire_lease, acquire("w1", 1, [h(0), h(1)]), 501, "L")
    assert g.usable_blocks == 1                         # block 1 lost two forms: not usable
    consistent(d)


def test_resume_waits_for_the_log_to_hold_what_the_worker_emitted() -> None:
    d, seq = fresh(), Seq()
    warm(d, [h(0)], seq)
    d.run(resume, 10)
    err(d.run(resume_worker, resume_msg("w1", 1, _inventory(d), emitted_seq=seq.n + 2), 20),
        ErrorCode.UNAVAILABLE, f"up to seq {seq.n}")
    assert d.state.workers["w1"].suspended              # nothing changed
    consistent(d)


def test_resume_refusals_are_clear_and_change_nothing() -> None:
    d, seq = fresh(workers=("w1", "w2")), Seq()
    warm(d, [h(0)], seq)
    d.run(resume, 10)
    before = state_hash(d.state)
    err(d.run(resume_worker, resume_msg("w9", 1, []), 20), ErrorCode.NOT_FOUND, "register")
    err(d.run(resume_worker, resume_msg("w1", 2, []), 20), ErrorCode.FENCED, "epoch 2 is fenced")
    err(d.run(resume_worker, resume_msg("w1", 1, [], namespace="cd" * 16), 20), ErrorCode.FENCED, "another model")
    err(d.run(resume_worker, resume_msg("w1", 1, [], pool_slots={f: 1 for f in FORMS}), 20), ErrorCode.FENCED,
        "pool sizes")
    err(d.run(resume_worker, resume_msg("w1", 1, [b"short"]), 20), ErrorCode.INVALID, "whole number")
    assert state_hash(d.state) == before
    consistent(d)


def test_resume_past_the_grace_fences_and_a_fenced_epoch_never_resumes() -> None:
    d, seq = fresh(), Seq()
    warm(d, [h(0)], seq)
    d.run(resume, 10)
    err(d.run(resume_worker, resume_msg("w1", 1, _inventory(d), emitted_seq=seq.n), 10 + 1001), ErrorCode.FENCED,
        "grace")
    assert isinstance(d.log[-1], WorkerLost) and not d.state.workers["w1"].alive
    assert all(d.state.replicas[(h(0), f, "gpu:w1")].state is S.LOST for f in FORMS)
    err(d.run(resume_worker, resume_msg("w1", 1, []), 1100), ErrorCode.FENCED, "lost")
    # its next registration is a new epoch; a resume of the old one is still refused
    d.run(register_worker, register("w1"), 1200)
    err(d.run(resume_worker, resume_msg("w1", 1, []), 1201), ErrorCode.FENCED)
    consistent(d)


def test_a_worker_that_never_noticed_may_resume_while_alive() -> None:
    d, seq = fresh(), Seq()
    warm(d, [h(0)], seq)
    reply = d.run(resume_worker, resume_msg("w1", 1, _inventory(d), emitted_seq=seq.n), 20)
    assert isinstance(reply, ResumeReply) and reply.kept == 3
    consistent(d)


def test_pins_of_invalidated_replicas_are_dropped_and_allocated_writes_left_to_their_lease() -> None:
    d, seq = fresh(), Seq()
    warm(d, [h(0)], seq)
    g = d.run(acquire_lease, acquire("w1", 1, [h(0), h(1)]), 10, "L")   # pins block 0, writes block 1
    assert g.usable_blocks == 1 and g.write == {f: [1] for f in FORMS}
    d.run(resume, 20)
    inv = [held(h(0), f, "gpu:w1", 7, "c0") for f in FORMS if f != "swa"]   # block 0's swa is gone
    reply = d.run(resume_worker, resume_msg("w1", 1, inv, emitted_seq=seq.n), 30)
    assert isinstance(reply, ResumeReply)
    assert d.state.replicas[(h(0), "swa", "gpu:w1")].state is S.INVALID
    assert d.state.replicas[(h(0), "swa", "gpu:w1")].pins == 0
    assert all(d.state.replicas[(h(1), f, "gpu:w1")].state is S.ALLOCATED for f in FORMS)
    d.run(release_lease, release("w1", 1, "L"), 31)
    assert check_invariants(d.state) == []
    consistent(d)


def test_suspend_resume_and_expiry_replay_to_the_same_state() -> None:
    d, seq = fresh(workers=("w1", "w2")), Seq()
    warm(d, [h(0)], seq)
    d.run(resume, 10)
    d.run(resume_worker, resume_msg("w1", 1, _inventory(d), emitted_seq=seq.n), 20)
    d.run(expire, 2000, {("w1", 1): 1990})                          # w2 never resumed: lost
    assert d.state.workers["w1"].alive and not d.state.workers["w2"].alive
    assert state_hash(replay(d.log, d.state.params)) == state_hash(d.state)
    consistent(d)


def test_a_resume_with_more_to_drop_than_a_reply_can_carry_is_refused_and_changes_nothing() -> None:
    d, seq = fresh(), Seq()
    warm(d, [h(0)], seq)
    d.run(resume, 10)
    before = state_hash(d.state)
    strangers = [held(h(100 + i), "swa", "gpu:w1") for i in range(5)]
    err(d.run(resume_worker, resume_msg("w1", 1, _inventory(d) + strangers, emitted_seq=seq.n), 20, 4),
        ErrorCode.FENCED, "5 copies", "register")
    assert state_hash(d.state) == before
    reply = d.run(resume_worker, resume_msg("w1", 1, _inventory(d) + strangers, emitted_seq=seq.n), 20, 5)
    assert isinstance(reply, ResumeReply) and reply.kept == 3 and len(split_digests(reply.drop)) == 5
