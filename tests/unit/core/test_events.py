"""Ledger events: every type round-trips through JSON, bad bytes get a clear error, streams are named."""

from __future__ import annotations

import msgspec
import pytest

from coordinator.core import (
    EVENT_TYPES, CacheSwitched, CoordinatorResumed, EventDecodeError, Invalidated, LeaseExpired, LeaseGranted, LeaseReleased,
    LeaseRenewed, ReplicaAllocated, ReplicaEvicted, TransitionApplied, TransitionRejected, WorkerDraining,
    WorkerHeartbeat, WorkerLost, WorkerRegistered, WorkerResumed, WorkerSuspended, decode_event, encode_event,
    stream_of,
)
from coordinator.core.events import PinRef, TransitionRecord
from shared.messages import ReplicaRef, ReplicaState as S, TransitionEvent, encode

from .support import CAT, NS, h, transition

T = transition("w1", 2, 5, h(1), "swa", S.ALLOCATED, S.READY, lease_id="L1")
REC = msgspec.json.decode(encode(T), type=TransitionRecord)   # as a replay reads it: unchecked
K = (h(1), "swa", "gpu:w1")

SAMPLES = [
    WorkerRegistered(worker_id="w1", epoch=2, namespace=NS, catalogue=CAT, pool_slots={"swa": 3},
                     endpoint="http://x", node="n1", at_ms=1),
    WorkerHeartbeat(worker_id="w1", epoch=2, at_ms=2),
    WorkerDraining(worker_id="w1", epoch=2, reason="upgrade", at_ms=3),
    WorkerLost(worker_id="w1", epoch=2, reason="timeout", lost=[K], released=["L1"], at_ms=4),
    LeaseGranted(lease_id="L1", worker_id="w1", epoch=2, tenant="t", namespace=NS, request_id="r",
                 block_hashes=[h(0), h(1)], usable_blocks=1,
                 read=[PinRef(block_hash=h(0), form="swa", location="gpu:w1", generation=3, checksum="c")],
                 write={"swa": [1]}, expires_at_ms=99, at_ms=5),
    LeaseRenewed(lease_id="L1", expires_at_ms=120, at_ms=6),
    LeaseReleased(lease_id="L1", at_ms=7),
    LeaseExpired(lease_id="L1", at_ms=8),
    ReplicaAllocated(block_hash=h(1), form="swa", location="gpu:w1", lease_id="L1", worker_id="w1", epoch=2,
                     tenant="t", namespace=NS, parent_hash=h(0), token_start=4, token_end=8, at_ms=9),
    ReplicaEvicted(block_hash=h(1), form="swa", location="gpu:w1", generation=3, reason="lru", lease_id="L2",
                   at_ms=10),
    TransitionApplied(transition=REC, kind="commit", at_ms=11),
    TransitionRejected(transition=REC, reason="stale", at_ms=12),
    Invalidated(scope="namespace", value=NS, reason="upgrade", affected=[K], at_ms=13),
    CacheSwitched(namespace=NS, enabled=False, reason="rollback", at_ms=13),
    CoordinatorResumed(at_ms=14),
    WorkerSuspended(worker_id="w1", epoch=2, reason="coordinator takeover", at_ms=15),
    WorkerResumed(worker_id="w1", epoch=2, kept=3, invalidated=[K], dropped=2, at_ms=16),
]


def test_every_event_type_has_a_sample() -> None:
    assert {type(e) for e in SAMPLES} == set(EVENT_TYPES.values())


@pytest.mark.parametrize("e", SAMPLES, ids=lambda e: type(e).__name__)
def test_round_trip(e: object) -> None:
    data = encode_event(e)  # type: ignore[arg-type]
    assert decode_event(data) == e
    assert msgspec.json.decode(data)["v"] == 1


def test_transition_record_is_the_workers_message_byte_for_byte() -> None:
    assert msgspec.json.encode(REC) == encode(T)
    assert REC.to_message() == T and REC.source_id == T.source_id == "w1.2.5"
    # the ledger keeps the accepted message itself (a TransitionRecord with its fields checked)
    assert isinstance(T, TransitionRecord) and type(REC) is TransitionRecord and T.to_message() is T
    # what a replay reads is not checked (the log is trusted); turning it back into a message is
    bad = msgspec.json.decode(encode(T).replace(b'"tenant":"t1"', b'"tenant":"a b"'), type=TransitionRecord)
    assert bad.tenant == "a b"
    with pytest.raises(msgspec.ValidationError, match="tenant"):
        bad.to_message()
    ref = ReplicaRef(block_hash=h(0), form="swa", location="gpu:w1", generation=3, checksum="c")
    pin = msgspec.json.decode(msgspec.json.encode(ref), type=PinRef)
    assert msgspec.json.encode(pin) == msgspec.json.encode(ref) and type(pin) is PinRef
    assert pin.to_message() == ref and isinstance(ref, PinRef) and ref.to_message() is ref


def test_unknown_type_is_named() -> None:
    with pytest.raises(EventDecodeError, match=r"unknown ledger event type 'replica\.teleported'; known: \["):
        decode_event(b'{"type": "replica.teleported", "v": 1}')


def test_unsupported_version_is_named() -> None:
    data = encode_event(CoordinatorResumed(at_ms=1)).replace(b'"v":1', b'"v":7')
    with pytest.raises(EventDecodeError, match=r"'coordinator\.resumed' has schema version 7; this build reads v1"):
        decode_event(data)
    data = encode_event(SAMPLES[1]).replace(b'"v":1', b'"v":2').replace(b'"epoch":2', b'"epoch":"x"')
    with pytest.raises(EventDecodeError, match="schema version 2"):
        decode_event(data)


def test_not_json_and_bad_fields() -> None:
    with pytest.raises(EventDecodeError, match="not a ledger event"):
        decode_event(b"[1, 2")
    with pytest.raises(EventDecodeError, match=r"invalid ledger event 'lease\.renewed'.*expires_at_ms"):
        decode_event(b'{"type": "lease.renewed", "v": 1, "lease_id": "L"}')


def test_streams() -> None:
    assert [stream_of(e) for e in SAMPLES] == [
        "worker:w1", "worker:w1", "worker:w1", "worker:w1",
        "lease:L1", "lease:L1", "lease:L1", "lease:L1",
        f"replica:{h(1)}:swa:gpu:w1", f"replica:{h(1)}:swa:gpu:w1", f"replica:{h(1)}:swa:gpu:w1",
        "worker:w1", f"invalidation:namespace:{NS}", f"cache:{NS}", "coordinator", "worker:w1", "worker:w1",
    ]
    with pytest.raises(TypeError):
        stream_of(T)  # type: ignore[arg-type]


def test_transition_message_is_not_a_ledger_event() -> None:
    with pytest.raises(EventDecodeError, match="unknown ledger event type 'transition'"):
        decode_event(encode(T))
    assert isinstance(T, TransitionEvent)
