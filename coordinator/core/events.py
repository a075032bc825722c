"""The coordinator's ledger events: small frozen, versioned facts, one tagged union.

Every change to cache-block state is one of these, appended to the log before anyone is
told about it; the state is ``fold(apply, events)`` (:mod:`coordinator.core.state`).
An event records a *decision already taken* — it carries everything the fold needs (the
replicas a worker loss affected, the victims an eviction chose), so replay never has to
decide anything again and never reads a clock.

Wire format is JSON (the log stores it as JSONB). ``decode_event`` rejects an unknown
``type`` or an unsupported ``v`` with an :class:`EventDecodeError` naming what was received
and what is accepted.

Replica keys travel as ``[block_hash, form, location]`` arrays (``RKey``).
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal, Union

import msgspec

from shared.forms import FormCatalogue
from shared.messages import ReplicaRefFields, TransitionFields

#: Version of the ledger event schema; bump when a field changes meaning.
EVENT_SCHEMA_VERSION: Final = 1

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
#: ``(block_hash, form, location)``: a replica's identity.
RKey = tuple[str, str, str]
#: ``(block_hash, form, generation)`` of a grant's LRU victim (at the holder's GPU).
Victim = tuple[str, str, int]


class _Event(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="type", kw_only=True):
    v: int = EVENT_SCHEMA_VERSION
    #: Coordinator time (ms) at which the decision was taken; the fold's only clock.
    at_ms: NonNeg = 0


# --- records of worker messages ------------------------------------------------------------
# NOTE: the log is trusted input (only validated decisions reach it), so the worker messages
# it embeds are decoded into types that encode to the *same JSON* as the shared messages but
# skip their per-field checks: regex validation of hashes and names was two thirds of a
# replayed event's decode time. A transition's is the message's own unchecked base class.

#: A worker's :class:`shared.messages.TransitionEvent` as the ledger stores it: live, the
#: accepted message itself (a subclass); decoded from the log, its fields unchecked.
TransitionRecord = TransitionFields


#: A :class:`shared.messages.ReplicaRef` as the ledger stores it (a grant's pins): live, the
#: ref the grant's reply carries; decoded from the log, its fields unchecked.
PinRef = ReplicaRefFields


# --- workers ---------------------------------------------------------------------------

class WorkerRegistered(_Event, tag="worker.registered", kw_only=True):
    """A worker (re)registered and got ``epoch``; any older epoch was fenced just before."""

    worker_id: str
    epoch: int
    namespace: str
    catalogue: FormCatalogue
    pool_slots: dict[str, NonNeg] = {}
    endpoint: str = ""
    #: The host tier this worker reads and writes (``host:<node>``).
    node: str = ""


class WorkerHeartbeat(_Event, tag="worker.heartbeat", kw_only=True):
    """Read from older logs only: liveness is soft state now, and only its decisions
    (:class:`WorkerSuspended`, :class:`WorkerResumed`, :class:`WorkerLost`) are logged."""

    worker_id: str
    epoch: int


class WorkerSuspended(_Event, tag="worker.suspended", kw_only=True):
    """The epoch went silent (or a coordinator took over): its replicas are kept, it gets no
    lease until it resumes, and it is fenced if it has not resumed within the grace period."""

    worker_id: str
    epoch: int
    reason: str = ""


class WorkerResumed(_Event, tag="worker.resumed", kw_only=True):
    """The worker's process lived through the outage and kept its epoch.

    Its inventory was reconciled with the ledger: ``invalidated`` replicas (the ledger had
    them READY; the worker no longer holds those bytes, or holds another generation or
    checksum) become INVALID; ``dropped`` counts copies the worker held that the ledger
    does not list live (it drops them; no replica changes). ``kept`` counts the rest.
    """

    worker_id: str
    epoch: int
    kept: NonNeg = 0
    invalidated: list[RKey] = []
    dropped: NonNeg = 0


class WorkerDraining(_Event, tag="worker.draining", kw_only=True):
    """The worker gets no new write grants from now on (reads still allowed)."""

    worker_id: str
    epoch: int
    reason: str = ""


class WorkerLost(_Event, tag="worker.lost", kw_only=True):
    """``epoch`` of the worker is fenced: listed replicas become LOST, listed leases end."""

    worker_id: str
    epoch: int
    reason: str = ""
    #: Replicas that become LOST (ALLOCATED anywhere; READY at gpu:/host:). Disk READY survive.
    lost: list[RKey] = []
    #: Leases of that epoch, released without aborting (their ALLOCATED replicas are in ``lost``).
    released: list[str] = []


# --- leases ----------------------------------------------------------------------------

class LeaseGranted(_Event, tag="lease.granted", kw_only=True):
    """A lease, the whole decision in one event: the LRU victims it ``evicted`` (READY
    replicas on the holder's GPU, evicted first), the ``read`` replicas it pins, and — when
    ``allocated`` — the write replicas it reserves: one ALLOCATED replica at ``gpu:<worker>``
    per block index in ``write`` (its parent hash, token span, tenant and namespace follow from
    the grant and the holder's block size).

    NOTE: logs written before grants carried their effects hold the victims as
    ``ReplicaEvicted`` events before the grant and the writes as ``ReplicaAllocated`` events
    after it (``evicted`` empty, ``allocated`` false); both fold to the same state.
    """

    lease_id: str
    worker_id: str
    epoch: int
    tenant: str
    namespace: str
    request_id: str = ""
    block_hashes: list[str] = []
    usable_blocks: NonNeg = 0
    read: list[PinRef] = []
    #: Block indices (into ``block_hashes``) the worker may fill, per form.
    write: dict[str, list[NonNeg]] = {}
    expires_at_ms: NonNeg = 0
    #: LRU victims, evicted to make room for ``write`` (in eviction order): ``[block_hash, form,
    #: generation]`` of a READY replica at the holder's GPU.
    evicted: list[Victim] = []
    #: True: this event allocates the write replicas itself (see the class docstring).
    allocated: bool = False


class LeaseRenewed(_Event, tag="lease.renewed", kw_only=True):
    lease_id: str
    expires_at_ms: NonNeg


class LeaseReleased(_Event, tag="lease.released", kw_only=True):
    """The holder released the lease: its writes still ALLOCATED under it are aborted (EVICTED),
    its pins dropped.

    NOTE: the aborts are no choice (every unfilled write of the lease), so the event does not
    list them; logs written before that hold them as ``ReplicaEvicted(abort)`` events just
    before the release, which leave nothing for the release to abort.
    """

    lease_id: str


class LeaseExpired(_Event, tag="lease.expired", kw_only=True):
    """The lease passed its TTL: as ``LeaseReleased`` (its unfilled writes abort), decided by the clock."""

    lease_id: str


# --- replicas --------------------------------------------------------------------------

class ReplicaAllocated(_Event, tag="replica.allocated", kw_only=True):
    """A write grant reserved a pool slot: the replica is ALLOCATED at ``location``.

    Read from older logs only: a ``LeaseGranted`` with ``allocated`` does this for all its writes.
    """

    block_hash: str
    form: str
    location: str
    lease_id: str
    worker_id: str
    epoch: int
    tenant: str
    namespace: str
    parent_hash: str
    token_start: NonNeg
    token_end: NonNeg


class ReplicaEvicted(_Event, tag="replica.evicted", kw_only=True):
    """The coordinator evicted a replica: an operator's (control) eviction.

    Older logs also hold the LRU victims of grants and the aborts of released or expired
    leases as these; both are part of the lease events now.
    """

    block_hash: str
    form: str
    location: str
    generation: NonNeg = 0
    reason: Literal["lru", "abort", "control", "disk_gc"] = "lru"
    #: The lease whose grant chose the victim (lru) or whose end aborted the write (abort).
    lease_id: str = ""


class TransitionApplied(_Event, tag="transition.applied", kw_only=True):
    """A worker's transition, accepted into the ledger (its ``kind`` per the life cycle)."""

    transition: TransitionRecord
    kind: str

    @property
    def source_id(self) -> str:
        return self.transition.source_id


class TransitionRejected(_Event, tag="transition.rejected", kw_only=True):
    """A worker's transition, recorded but refused: it changes no replica.

    One row stands for every transition of the same worker epoch refused for the same ``kind``
    of reason in one commit (``coordinator.core.rejections``): ``transition`` and ``reason`` are
    the first's, ``count`` how many there were, ``more`` the others' seqs as inclusive ranges."""

    transition: TransitionRecord
    reason: str
    #: ``rejections.rejection_kind(reason)``; empty in rows written before kinds existed.
    kind: str = ""
    count: Annotated[int, msgspec.Meta(ge=1)] = 1
    more: list[tuple[NonNeg, NonNeg]] = []

    @property
    def source_id(self) -> str:
        return self.transition.source_id


class Invalidated(_Event, tag="invalidated", kw_only=True):
    """An operator (or control) invalidated every live replica in a scope.

    ``retired``: EVICTED incarnations of the same content, moved to INVALID so that an offload
    copy still in flight from one (published before its worker dropped the block, ingested
    after this) is refused rather than bringing the bytes back READY."""

    scope: Literal["namespace", "worker", "block"]
    value: str
    reason: str = ""
    affected: list[RKey] = []
    retired: list[RKey] = []


class CacheSwitched(_Event, tag="cache.switched", kw_only=True):
    """An operator turned reuse off (or back on) for one namespace, or for all (``namespace`` "").

    While off, leases of that namespace pin nothing and reserve nothing: every request is
    served by recomputation and nothing new is cached; routing hints offer no prefix.
    """

    namespace: str = ""
    enabled: bool = False
    reason: str = ""


class CoordinatorResumed(_Event, tag="coordinator.resumed", kw_only=True):
    """A coordinator took over the log: liveness clocks restart from ``at_ms``.

    NOTE: without it, the first expiry after a long outage would declare every worker lost
    and every lease expired merely because the coordinator itself was away.
    """


LedgerEvent = Union[
    WorkerRegistered, WorkerHeartbeat, WorkerSuspended, WorkerResumed, WorkerDraining, WorkerLost,
    LeaseGranted, LeaseRenewed, LeaseReleased, LeaseExpired,
    ReplicaAllocated, ReplicaEvicted,
    TransitionApplied, TransitionRejected, Invalidated, CacheSwitched, CoordinatorResumed,
]
EVENT_TYPES: Final[dict[str, type[_Event]]] = {
    t.__struct_config__.tag: t for t in LedgerEvent.__args__  # type: ignore[attr-defined]
}


class EventDecodeError(ValueError):
    """Bytes that are not a ledger event this build can read."""


class _Envelope(msgspec.Struct):
    type: str = ""
    v: int = -1


_envelope = msgspec.json.Decoder(_Envelope)
#: Decodes any ledger event; :func:`decode_event` adds the schema-version check and explains
#: a failure (a replay's inner loop uses it directly: see ``state.fold_rows``).
DECODER: Final = msgspec.json.Decoder(LedgerEvent)
_encoder = msgspec.json.Encoder()


def encode_event(e: _Event) -> bytes:
    """JSON bytes of one event (what the log stores)."""
    return _encoder.encode(e)


def decode_event(data: bytes | memoryview | str) -> Any:
    """One event from JSON, or :class:`EventDecodeError` naming what is wrong.

    NOTE: the fast path decodes once; only on failure is the envelope read to explain it.
    Replay decodes a million of these, so the happy path must not parse twice.
    """
    try:
        e = DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise _explain(data, err) from None
    if e.v != EVENT_SCHEMA_VERSION:
        raise EventDecodeError(f"ledger event {type(e).__struct_config__.tag!r} has schema version {e.v}; "
                               f"this build reads v{EVENT_SCHEMA_VERSION}")
    return e


def _explain(data: bytes | memoryview | str, err: Exception) -> EventDecodeError:
    try:
        env = _envelope.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        return EventDecodeError(f"not a ledger event (expected a JSON object with 'type' and 'v'): {e}")
    if env.type not in EVENT_TYPES:
        return EventDecodeError(f"unknown ledger event type {env.type!r}; known: {sorted(EVENT_TYPES)}")
    if env.v != EVENT_SCHEMA_VERSION:
        return EventDecodeError(f"ledger event {env.type!r} has schema version {env.v}; "
                                f"this build reads v{EVENT_SCHEMA_VERSION}")
    return EventDecodeError(f"invalid ledger event {env.type!r}: {err}")


def replica_stream(block_hash: str, form: str, location: str) -> str:
    return f"replica:{block_hash}:{form}:{location}"


def stream_of(e: _Event) -> str:
    """The stream an event belongs to, for per-stream versions (``UNIQUE(stream, version)``).

    ``worker:<id>`` for worker life and rejected transitions, ``lease:<id>`` for leases,
    ``replica:<block>:<form>:<location>`` for one replica's history, ``invalidation:<scope>:<value>``
    for operator invalidations, ``cache:<namespace or *>`` for reuse switches, ``coordinator`` for
    takeovers.
    """
    t = type(e)
    if t is TransitionApplied:
        tr = e.transition  # type: ignore[attr-defined]
        return replica_stream(tr.block_hash, tr.form, tr.location)
    if t is ReplicaAllocated or t is ReplicaEvicted:
        return replica_stream(e.block_hash, e.form, e.location)  # type: ignore[attr-defined]
    if t in (LeaseGranted, LeaseRenewed, LeaseReleased, LeaseExpired):
        return f"lease:{e.lease_id}"  # type: ignore[attr-defined]
    if t in (WorkerRegistered, WorkerHeartbeat, WorkerSuspended, WorkerResumed, WorkerDraining, WorkerLost):
        return f"worker:{e.worker_id}"  # type: ignore[attr-defined]
    if t is TransitionRejected:
        return f"worker:{e.transition.worker_id}"  # type: ignore[attr-defined]
    if t is Invalidated:
        return f"invalidation:{e.scope}:{e.value}"  # type: ignore[attr-defined]
    if t is CacheSwitched:
        return f"cache:{e.namespace or '*'}"  # type: ignore[attr-defined]
    if t is CoordinatorResumed:
        return "coordinator"
    raise TypeError(f"not a ledger event: {t.__name__}")
