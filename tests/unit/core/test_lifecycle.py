"""The replica transition table: every (state, kind) pair is legal or an IllegalTransition, and
an illegal move — by table, or by a worker's transition the coordinator refuses — changes nothing."""

from __future__ import annotations

import itertools

import pytest

from coordinator.core import (
    TRANSITIONS, IllegalTransition, TransitionApplied, TransitionRejected, acquire_lease, apply, ingest_transition,
    register_worker, step,
)
from coordinator.core.lifecycle import KIND_OF_PAIR, KINDS, LIVE, TERMINAL, kind_of
from shared.messages import ReplicaState as S

from .support import Driver, acquire, h, register, transition

STATES: list[S | None] = [None, *S]

#: The table, spelled out once more by hand: (state, kind) → next state.
EXPECTED = {
    (None, "grant"): S.ALLOCATED, (None, "offload"): S.READY,
    (S.ALLOCATED, "commit"): S.READY, (S.ALLOCATED, "abort"): S.EVICTED,
    (S.ALLOCATED, "invalidate"): S.INVALID, (S.ALLOCATED, "lose"): S.LOST,
    (S.READY, "evict"): S.EVICTED, (S.READY, "invalidate"): S.INVALID, (S.READY, "lose"): S.LOST,
    **{(t, k): nxt for t in (S.EVICTED, S.INVALID, S.LOST) for k, nxt in (("grant", S.ALLOCATED),
                                                                          ("offload", S.READY))},
    (S.EVICTED, "invalidate"): S.INVALID,    # retired: no longer a source an offload may copy from
}


@pytest.mark.parametrize(("state", "kind"), list(itertools.product(STATES, KINDS)),
                         ids=lambda x: str(x.value if isinstance(x, S) else x))
def test_every_pair_is_legal_or_illegal(state: S | None, kind: str) -> None:
    if (state, kind) in EXPECTED:
        assert step(state, kind) is EXPECTED[(state, kind)]
    else:
        with pytest.raises(IllegalTransition) as err:
            step(state, kind, key=("b", "f", "gpu:w"))
        assert err.value.state is state and err.value.kind == kind
        assert "cannot" in str(err.value) and "allowed from" in str(err.value)


def test_table_shape() -> None:
    assert set(TRANSITIONS) == set(STATES)
    assert all(k in KINDS for row in TRANSITIONS.values() for k in row)
    assert LIVE | TERMINAL == set(S) and not LIVE & TERMINAL
    for (frm, to), kind in KIND_OF_PAIR.items():
        assert kind_of(frm, to) == kind
        if frm is not None:
            assert step(frm, kind) is to
    assert kind_of(S.READY, S.ALLOCATED) is None


def _world() -> tuple[Driver, list[str]]:
    d = Driver()
    d.run(register_worker, register("w1", slots=4), 0)
    blocks = [h(0), h(1)]
    g = d.run(acquire_lease, acquire("w1", 1, blocks, forms=("compressed",)), 1, "L1")
    assert g.write == {"compressed": [0, 1]}
    d.run(ingest_transition, transition("w1", 1, 1, blocks[0], "compressed", S.ALLOCATED, S.READY,
                                        generation=7, checksum="c0"), 2)
    return d, blocks


def test_illegal_event_in_the_log_raises_and_changes_nothing() -> None:
    d, blocks = _world()
    before = d.hash
    # A forged TransitionApplied asking READY → READY (commit of a committed replica).
    forged = TransitionApplied(kind="commit", at_ms=3, transition=(
        transition("w1", 1, 2, blocks[0], "compressed", S.ALLOCATED, S.READY)))
    with pytest.raises(IllegalTransition):
        apply(d.state, forged)
    forged2 = TransitionApplied(kind="evict", at_ms=3, transition=(
        transition("w1", 1, 2, blocks[1], "compressed", S.READY, S.EVICTED)))
    with pytest.raises(IllegalTransition):
        apply(d.state, forged2)
    assert d.hash == before


ILLEGAL = [
    # (description, transition args, reason fragment)
    ("commit twice", dict(block=0, frm=S.ALLOCATED, to=S.READY), "stale"),
    ("READY to ALLOCATED", dict(block=0, frm=S.READY, to=S.ALLOCATED), "cannot move"),
    ("evict with a stale generation", dict(block=0, frm=S.READY, to=S.EVICTED, generation=6), "stale generation"),
    ("commit without checksum", dict(block=1, frm=S.ALLOCATED, to=S.READY, checksum=""), "no checksum"),
    ("evict an ALLOCATED replica as if READY", dict(block=1, frm=S.READY, to=S.EVICTED), "stale"),
    ("worker reports LOST", dict(block=0, frm=S.READY, to=S.LOST), "cannot move"),
    ("undeclared form", dict(block=0, frm=S.READY, to=S.EVICTED, form="nope"), "not declared"),
    ("another worker's GPU", dict(block=0, frm=S.READY, to=S.EVICTED, location="gpu:w2"), "cannot change"),
    ("unknown location", dict(block=0, frm=S.READY, to=S.EVICTED, location="tape"), "expected gpu"),
    ("offload onto a GPU", dict(block=0, frm=None, to=S.READY, location="gpu:w1"), "already exists"),
    ("offload to a GPU", dict(block=5, frm=None, to=S.READY, location="gpu:w1"), "copies to host"),
    ("offload without a source", dict(block=1, frm=None, to=S.READY, location="disk"),
     "no READY or EVICTED replica"),
    ("offload with another checksum", dict(block=0, frm=None, to=S.READY, location="disk", checksum="x"),
     "no READY or EVICTED replica"),
    ("commit for another tenant", dict(block=1, frm=S.ALLOCATED, to=S.READY, tenant="t2"), "tenant"),
    ("commit for another lease", dict(block=1, frm=S.ALLOCATED, to=S.READY, lease_id="L9"), "lease"),
    ("unknown replica", dict(block=9, frm=S.READY, to=S.INVALID), "absent"),
]


@pytest.mark.parametrize(("what", "args", "reason"), ILLEGAL, ids=[x[0] for x in ILLEGAL])
def test_refused_transition_is_recorded_and_changes_no_replica(what: str, args: dict, reason: str) -> None:
    d, blocks = _world()
    a = dict(args)
    block = blocks[a.pop("block")] if a["block"] < 2 else h(a.pop("block"))
    a.setdefault("generation", 7)
    a.setdefault("checksum", "c0")
    form = a.pop("form", "compressed")
    frm, to = a.pop("frm"), a.pop("to")
    before = {k: (r.state, r.generation, r.checksum, r.pins) for k, r in d.state.replicas.items()}
    leases_before = {k: (l.expires_at_ms, dict(l.pins)) for k, l in d.state.leases.items()}
    out = d.run(ingest_transition, transition("w1", 1, 2, block, form, frm, to, **a), 5)
    assert [type(e) for e in out] == [TransitionRejected], out
    assert reason in out[0].reason, out[0].reason
    assert {k: (r.state, r.generation, r.checksum, r.pins) for k, r in d.state.replicas.items()} == before
    assert {k: (l.expires_at_ms, dict(l.pins)) for k, l in d.state.leases.items()} == leases_before
    # Recorded: the seq counts as committed, and a redelivery is a no-op.
    assert d.state.committed_seq("w1", 1) == 2
    h0 = d.hash
    assert d.run(ingest_transition, transition("w1", 1, 2, block, form, frm, to, **a), 6) == []
    assert d.hash == h0


def test_rejection_does_not_touch_the_hash_apart_from_the_watermark() -> None:
    d, blocks = _world()
    ref = Driver()
    ref.commit(list(d.log))
    # A rejected transition changes only its epoch's watermark: the same as a legal no-op would.
    d.run(ingest_transition, transition("w1", 1, 2, blocks[0], "compressed", S.READY, S.LOST), 5)
    ref.state.watermarks[("w1", 1)].contiguous = 2
    assert d.hash == ref.hash


def test_offload_from_an_evicted_source_is_accepted() -> None:
    """A worker copies an evicted replica down a tier (e.g. an LRU victim it learns of from
    the grant that evicted it): the committed checksum, not the source's state, vouches for it."""
    d, blocks = _world()
    key = (blocks[0], "compressed", "gpu:w1")
    r = d.state.replicas[key]
    assert r.state is S.READY and r.checksum
    out = d.run(ingest_transition, transition("w1", 1, 2, blocks[0], "compressed", S.READY, S.EVICTED,
                                              generation=r.generation, checksum=r.checksum), 5)
    assert [type(e) for e in out] == [TransitionApplied]
    assert d.state.replicas[key].state is S.EVICTED
    out = d.run(ingest_transition, transition("w1", 1, 3, blocks[0], "compressed", None, S.READY,
                                              location="host:w1", generation=r.generation, checksum=r.checksum), 6)
    assert [type(e) for e in out] == [TransitionApplied], out
    assert d.state.replicas[(blocks[0], "compressed", "host:w1")].state is S.READY
    out = d.run(ingest_transition, transition("w1", 1, 4, blocks[0], "compressed", None, S.READY,
                                              location="disk", generation=r.generation, checksum="other"), 7)
    assert [type(e) for e in out] == [TransitionRejected]
