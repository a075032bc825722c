"""Builders shared by the core tests: a small catalogue, messages, and a driver that runs
commands the way the shell does (decide → append → apply)."""

from __future__ import annotations

from typing import Any

from coordinator.core import (
    CoreParams, LedgerState, apply, encode_event, decode_event, state_hash,
)
from shared.forms import FormCatalogue, FormScope, FormSpec
from shared.hashing import replica_digest
from shared.messages import (
    Heartbeat, LeaseAcquire, LeaseRelease, LeaseRenew, ReplicaState, TransitionEvent, WorkerRegister,
    WorkerResume,
)

NS = "ab" * 16
BS = 4
CAT = FormCatalogue(model_id="m", block_size=BS, forms=(
    FormSpec(name="compressed", scope=FormScope.FULL_HISTORY, bytes_per_block=64, dtype="float32"),
    FormSpec(name="swa", scope=FormScope.WINDOW, bytes_per_block=32, dtype="float32", window_tokens=6),
    FormSpec(name="tail", scope=FormScope.RESUME_POINT, bytes_per_block=16, dtype="float32"),
))
FORMS = ("compressed", "swa", "tail")


def h(i: int) -> str:
    """A fake 32-hex block hash."""
    return f"{i:032x}"


def register(wid: str = "w1", slots: int = 8, **kw: Any) -> WorkerRegister:
    return WorkerRegister(worker_id=wid, namespace=NS, catalogue=CAT,
                          pool_slots={f: slots for f in FORMS}, **kw)


def acquire(wid: str, epoch: int, blocks: list[str], forms: tuple[str, ...] = FORMS, tenant: str = "t1",
            **kw: Any) -> LeaseAcquire:
    return LeaseAcquire(worker_id=wid, epoch=epoch, namespace=NS, tenant=tenant, block_hashes=blocks,
                        write_forms=list(forms), **kw)


def release(wid: str, epoch: int, lease_id: str) -> LeaseRelease:
    return LeaseRelease(worker_id=wid, epoch=epoch, lease_id=lease_id)


def renew(wid: str, epoch: int, lease_id: str, ttl_ms: int = 30000) -> LeaseRenew:
    return LeaseRenew(worker_id=wid, epoch=epoch, lease_id=lease_id, ttl_ms=ttl_ms)


def hb(wid: str, epoch: int) -> Heartbeat:
    return Heartbeat(worker_id=wid, epoch=epoch)


def transition(wid: str, epoch: int, seq: int, block: str, form: str, frm: ReplicaState | None,
               to: ReplicaState, *, location: str | None = None, generation: int = 1, checksum: str = "c",
               tenant: str = "t1", lease_id: str = "", index: int = 0) -> TransitionEvent:
    return TransitionEvent(worker_id=wid, epoch=epoch, seq=seq, namespace=NS, tenant=tenant, block_hash=block,
                           parent_hash="0" * 32, token_start=index * BS, token_end=(index + 1) * BS, form=form,
                           location=location or f"gpu:{wid}", from_state=frm, to_state=to,
                           generation=generation, checksum=checksum, lease_id=lease_id, block_size=BS)


class Driver:
    """Runs commands like the shell: decide, append (through encode/decode), apply."""

    def __init__(self, params: CoreParams | None = None) -> None:
        self.state = LedgerState.empty(params or CoreParams(lease_ttl_ms=1000, heartbeat_interval_ms=100,
                                                            missed_heartbeats=3, resume_grace_ms=1000))
        self.log: list[Any] = []

    def commit(self, events: list[Any]) -> list[Any]:
        for e in events:
            e2 = decode_event(encode_event(e))
            # NOTE: the same event, as the log stores it (a transition decided live is the worker's
            # checked message; read back, the same fields unchecked: equal JSON, not equal types)
            assert type(e2) is type(e) and encode_event(e2) == encode_event(e)
            self.log.append(e2)
            apply(self.state, e2)
        return events

    def run(self, command: Any, *args: Any, **kw: Any) -> Any:
        out = command(self.state, *args, **kw)
        if isinstance(out, tuple):
            reply, events = out
            self.commit(events)
            return reply
        self.commit(out)
        return out

    @property
    def hash(self) -> str:
        return state_hash(self.state)


def consistent(d: Driver) -> None:
    """Invariants hold, and replay and snapshot rebuild exactly the live state."""
    from coordinator.core import check_invariants, from_snapshot, replay, to_snapshot

    assert check_invariants(d.state) == []
    assert state_hash(replay(d.log, d.state.params)) == d.hash
    assert state_hash(from_snapshot(to_snapshot(d.state))) == d.hash


def resume_msg(wid: str, epoch: int, items: list[bytes], emitted_seq: int = 0, **kw: Any) -> WorkerResume:
    """A resume as a worker sends it (the catalogue and pools it registered with, unless ``kw`` changes them);
    ``items`` are :func:`held` digests."""
    base = register(wid)
    fields: dict[str, Any] = dict(namespace=base.namespace, catalogue=base.catalogue, pool_slots=base.pool_slots)
    fields.update(kw)
    return WorkerResume(worker_id=wid, epoch=epoch, emitted_seq=emitted_seq, held=b"".join(items), **fields)


def held(block: str, form: str, location: str, generation: int = 7, checksum: str = "c0") -> bytes:
    """The digest a worker sends for a replica it holds."""
    return replica_digest(block, form, location, generation, checksum)
