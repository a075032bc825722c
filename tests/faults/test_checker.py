"""The history checker on made-up histories: it must pass a clean one and name every fault it claims to find.

Fast (no services): the drills trust this checker with the real run's history, so each of
its verdicts is shown here to fire on the smallest history that deserves it.
"""

from __future__ import annotations

from typing import Any

from tests.faults.checker import Observed, check, reason_kind

B1, B2 = "1" * 32, "2" * 32
CK = "c" * 32


class Log:
    """A log under construction: ``add`` appends an event at the next position."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def add(self, type_: str, **fields: Any) -> Log:
        event = {"type": type_, **fields}
        sid = None
        if type_.startswith("transition."):
            t = fields["transition"]
            sid = f"{t['worker_id']}.{t['epoch']}.{t['seq']}"
        self.rows.append({"position": len(self.rows) + 1, "type": type_, "source_id": sid, "event": event})
        return self

    def register(self, w: str = "w1", epoch: int = 1) -> Log:
        return self.add("worker.registered", worker_id=w, epoch=epoch, node="")

    def grant(self, lease: str, w: str = "w1", epoch: int = 1, read: list[dict[str, Any]] | None = None,
              alloc: list[tuple[str, str]] = ()) -> Log:
        self.add("lease.granted", lease_id=lease, worker_id=w, epoch=epoch, read=read or [])
        for block, form in alloc:
            self.add("replica.allocated", block_hash=block, form=form, location=f"gpu:{w}", lease_id=lease,
                     worker_id=w, epoch=epoch)
        return self

    def transition(self, seq: int, frm: str | None, to: str, *, w: str = "w1", epoch: int = 1, block: str = B1,
                   form: str = "swa", location: str | None = None, generation: int = 1, applied: bool = True,
                   reason: str = "") -> Log:
        t = transition(seq, frm, to, w=w, epoch=epoch, block=block, form=form, location=location,
                       generation=generation)
        if applied:
            return self.add("transition.applied", transition=t, kind="x")
        return self.add("transition.rejected", transition=t, reason=reason)


def transition(seq: int, frm: str | None, to: str, *, w: str = "w1", epoch: int = 1, block: str = B1,
               form: str = "swa", location: str | None = None, generation: int = 1) -> dict[str, Any]:
    return {"worker_id": w, "epoch": epoch, "seq": seq, "namespace": "n" * 32, "tenant": "default",
            "block_hash": block, "form": form, "location": location or f"gpu:{w}", "from_state": frm,
            "to_state": to, "generation": generation, "checksum": CK, "lease_id": ""}


def published(log: Log, acked: dict[tuple[str, int], int] | None = None) -> Observed:
    """What the observer would have seen: every logged transition published, and ``acked``."""
    seen = Observed()
    for row in log.rows:
        if row["type"].startswith("transition."):
            seen.on_transition(row["event"]["transition"])
    for (w, e), seq in (acked or {}).items():
        seen.on_watermark(w, e, seq)
    return seen


def clean_log() -> Log:
    """w1 fills B1 (swa), offloads it to disk, another lease reads it; w1 is lost, w1 epoch 2 reads disk."""
    log = Log().register()
    log.grant("L1", alloc=[(B1, "swa")]).transition(1, "ALLOCATED", "READY").add("lease.released", lease_id="L1")
    log.transition(2, None, "READY", location="disk", generation=0)
    pin_gpu = {"block_hash": B1, "form": "swa", "location": "gpu:w1", "generation": 1}
    pin_disk = {"block_hash": B1, "form": "swa", "location": "disk", "generation": 0}
    log.grant("L2", read=[pin_gpu]).add("lease.released", lease_id="L2")
    log.add("worker.lost", worker_id="w1", epoch=1, lost=[[B1, "swa", "gpu:w1"]], released=[])
    log.register(epoch=2).grant("L3", epoch=2, read=[pin_disk])
    return log


def test_a_clean_history_passes() -> None:
    log = clean_log()
    rep = check(log.rows, published(log, {("w1", 1): 2}))
    assert rep.ok, rep.problems()
    assert (rep.logged, rep.applied, rep.acknowledged, rep.grants, rep.pins) == (2, 2, 2, 3, 2)
    assert (rep.registrations, rep.losses, rep.unknown, rep.recovered, rep.unobserved) == (2, 1, 0, 0, 0)


def test_an_acknowledged_transition_missing_from_the_log_is_lost() -> None:
    log = clean_log()
    seen = published(log, {("w1", 1): 3})           # the watermark covers seq 3, the log has 1..2
    seen.on_transition(transition(3, "READY", "EVICTED"))
    rep = check(log.rows, seen)
    assert rep.lost == ["w1.1.3"] and not rep.ok


def test_published_but_never_acknowledged_is_unknown_not_lost() -> None:
    log = clean_log()
    seen = published(log, {("w1", 1): 2})
    seen.on_transition(transition(3, "READY", "EVICTED"))
    rep = check(log.rows, seen)
    assert rep.ok and rep.unknown == 1 and rep.lost == []


def test_a_transition_logged_twice_is_duplicated() -> None:
    log = clean_log()
    log.rows.insert(4, {**log.rows[3], "position": 0})
    for i, row in enumerate(log.rows, 1):
        row["position"] = i
    rep = check(log.rows, published(log, {("w1", 1): 2}))
    assert rep.duplicated and "w1.1.1" in rep.duplicated[0]


def test_a_logged_transition_unlike_the_published_one_is_unexpected() -> None:
    log = clean_log()
    seen = published(log)
    seen.published["w1.1.1"] = {**seen.published["w1.1.1"], "generation": 7}
    rep = check(log.rows, seen)
    assert rep.unexpected and "generation" in rep.unexpected[0]


def test_a_transition_of_a_fenced_epoch_applied_is_illegal_and_rejected_ones_are_counted() -> None:
    log = clean_log()
    log.transition(3, "READY", "EVICTED", applied=False, reason="epoch 1 of worker w1 is fenced (latest epoch 2)")
    rep = check(log.rows, published(log))
    assert rep.ok and dict(rep.rejected) == {"transition from a fenced epoch": 1}
    log.transition(4, "READY", "EVICTED", location="disk", generation=0)   # applied although epoch 1 is fenced
    rep = check(log.rows, published(log))
    assert rep.illegal and "not live" in rep.illegal[0]


def test_illegal_moves_applied_are_named() -> None:
    log = Log().register().grant("L1", alloc=[(B1, "swa")]).transition(1, "ALLOCATED", "READY")
    log.transition(2, "ALLOCATED", "READY")                        # commit twice
    log.transition(3, "READY", "EVICTED", generation=5)            # stale generation
    log.transition(4, None, "READY", block=B2, location="disk")    # offload with no source
    rep = check(log.rows, published(log))
    assert len(rep.illegal) == 3, rep.illegal
    assert "READY, not ALLOCATED" in rep.illegal[0] and "generation 5" in rep.illegal[1]
    assert "no READY or EVICTED source" in rep.illegal[2]


def test_an_offload_may_copy_an_evicted_source_with_the_committed_checksum() -> None:
    log = Log().register().grant("L1", alloc=[(B1, "swa")]).transition(1, "ALLOCATED", "READY")
    log.add("lease.released", lease_id="L1")
    log.add("replica.evicted", block_hash=B1, form="swa", location="gpu:w1", generation=1, reason="lru")
    log.transition(2, None, "READY", location="disk", generation=0)
    assert check(log.rows, published(log)).ok


def test_evicting_a_pinned_replica_is_illegal() -> None:
    log = Log().register().grant("L1", alloc=[(B1, "swa")]).transition(1, "ALLOCATED", "READY")
    log.add("lease.released", lease_id="L1")
    log.grant("L2", read=[{"block_hash": B1, "form": "swa", "location": "gpu:w1", "generation": 1}])
    log.add("replica.evicted", block_hash=B1, form="swa", location="gpu:w1", generation=1, reason="lru")
    rep = check(log.rows, published(log))
    assert rep.illegal and "pins" in rep.illegal[0]


def test_reading_a_replica_of_a_fenced_epoch_is_caught() -> None:
    log = Log().register().grant("L1", alloc=[(B1, "swa")]).transition(1, "ALLOCATED", "READY")
    log.add("lease.released", lease_id="L1")
    # the loss forgets to list B1's GPU replica; then epoch 2 is granted a read of it
    log.add("worker.lost", worker_id="w1", epoch=1, lost=[], released=[])
    log.register(epoch=2).grant("L2", epoch=2, read=[{"block_hash": B1, "form": "swa", "location": "gpu:w1",
                                                      "generation": 1}])
    rep = check(log.rows, published(log))
    assert any("stay live" in p for p in rep.fenced)
    assert any("older epoch" in p for p in rep.fenced)
    assert any("of fenced epoch ('w1', 1)" in p for p in rep.fenced)


def test_pins_of_replicas_that_are_not_ready_or_unreadable_are_caught() -> None:
    log = clean_log()
    lost_gpu = {"block_hash": B1, "form": "swa", "location": "gpu:w1", "generation": 1}
    log.grant("L4", epoch=2, read=[lost_gpu])                                    # LOST since epoch 1 ended
    log.grant("L5", epoch=2, alloc=[(B2, "swa")]).transition(1, "ALLOCATED", "READY", epoch=2, block=B2)
    log.register("w2").grant("L6", w="w2", read=[{"block_hash": B2, "form": "swa", "location": "gpu:w1",
                                                  "generation": 1}])            # another worker's GPU
    log.grant("L7", w="w2", read=[{"block_hash": B2, "form": "swa", "location": "gpu:w1", "generation": 2}])
    rep = check(log.rows, published(log, {("w1", 1): 2}))
    assert len(rep.fenced) == 4, rep.fenced
    assert "which is LOST" in rep.fenced[0]
    assert "which it cannot read" in rep.fenced[1]
    assert "generation 2, current 1" in rep.fenced[2] and "which it cannot read" in rep.fenced[3]


def test_a_gap_in_positions_is_reported() -> None:
    log = clean_log()
    del log.rows[3]
    rep = check(log.rows, published(log, {("w1", 1): 2}))
    assert rep.gaps == ["@5: position 5 follows 3"]


def test_rejection_reasons_are_grouped_without_their_numbers() -> None:
    assert reason_kind("stale generation 3 for ('ab', 'swa', 'gpu:w') (current 4)") == "stale generation"
    assert reason_kind("replica ('ab', 'swa', 'disk') already exists (READY)") == "offload target already live"
    assert reason_kind("something new 1234 about " + "f" * 32) == "something new # about #"


def test_suspension_and_resume_keep_the_epoch_and_invalidations_unpin() -> None:
    log = Log().register().grant("L1", alloc=[(B1, "swa"), (B2, "swa")])
    log.transition(1, "ALLOCATED", "READY").transition(2, "ALLOCATED", "READY", block=B2)
    log.add("lease.released", lease_id="L1")
    pin = {"block_hash": B1, "form": "swa", "location": "gpu:w1", "generation": 1}
    log.add("worker.suspended", worker_id="w1", epoch=1, reason="coordinator takeover")
    log.add("worker.resumed", worker_id="w1", epoch=1, kept=1, invalidated=[[B2, "swa", "gpu:w1"]], dropped=0)
    log.grant("L2", read=[pin])                                                   # same epoch reads B1 again
    rep = check(log.rows, published(log, {("w1", 1): 2}))
    assert rep.ok, rep.problems()
    assert (rep.suspensions, rep.resumes, rep.registrations) == (1, 1, 1)
    log.grant("L3", read=[{**pin, "block_hash": B2}])                             # B2 was invalidated by the resume
    rep = check(log.rows, published(log, {("w1", 1): 2}))
    assert any("which is INVALID" in p for p in rep.fenced), rep.fenced


def test_a_lease_for_a_suspended_epoch_or_a_resume_of_a_fenced_one_is_caught() -> None:
    log = Log().register()
    log.add("worker.suspended", worker_id="w1", epoch=1, reason="no heartbeat")
    log.grant("L1")                                                               # before any resume
    log.add("worker.lost", worker_id="w1", epoch=1, lost=[], released=["L1"])
    log.add("worker.resumed", worker_id="w1", epoch=1, kept=0, invalidated=[], dropped=0)
    rep = check(log.rows, published(log))
    assert any("suspended ('w1', 1)" in p for p in rep.fenced), rep.fenced
    assert any("resume of w1 epoch 1, which is fenced" in p for p in rep.fenced), rep.fenced


def folded_grant(log: Log, lease: str, writes: dict[str, list[int]], hashes: list[str], *, w: str = "w1",
                 epoch: int = 1, read: list[dict[str, Any]] | None = None,
                 evicted: list[list[Any]] | None = None) -> Log:
    """A grant as the coordinator writes it now: its victims, pins and allocations in one event."""
    return log.add("lease.granted", lease_id=lease, worker_id=w, epoch=epoch, read=read or [],
                   block_hashes=hashes, write=writes, evicted=evicted or [], allocated=True)


def test_grants_that_carry_their_allocations_and_victims_are_checked_like_separate_events() -> None:
    log = Log().register()
    folded_grant(log, "L1", {"swa": [0, 1]}, [B1, B2]).transition(1, "ALLOCATED", "READY")
    log.add("lease.released", lease_id="L1")            # B2 was never filled: the release aborts it
    rep = check(log.rows, published(log, {("w1", 1): 1}))
    assert rep.ok, rep.problems()
    # the aborted write cannot be committed afterwards, and a grant may not evict a pinned replica
    late = Log().register()
    folded_grant(late, "L1", {"swa": [0, 1]}, [B1, B2]).transition(1, "ALLOCATED", "READY")
    late.add("lease.released", lease_id="L1").transition(2, "ALLOCATED", "READY", block=B2)
    pin = {"block_hash": B1, "form": "swa", "location": "gpu:w1", "generation": 1}
    folded_grant(late, "L2", {}, [B1], read=[pin])
    folded_grant(late, "L3", {"swa": [0]}, [B2], evicted=[[B1, "swa", 1]])
    rep = check(late.rows, published(late, {("w1", 1): 2}))
    assert len(rep.illegal) == 2, rep.illegal
    assert "is EVICTED, not ALLOCATED" in rep.illegal[0] and "which a live lease pins" in rep.illegal[1]
