"""Every message between workers and the coordinator: versioned, frozen msgspec structs.

One tagged union (``type`` field) covers NATS request/reply bodies, JetStream transition
events and control messages; the same structs are the payload stored in the event log.
Wire format is JSON (readable with ``nats sub``; the log stores it as JSONB).

Decoding is two-phase: an envelope (``type``, ``v``) is read first so that an unknown type
or an unsupported schema version gets a clear :class:`MessageError` naming what was
received and what is accepted, instead of a confusing field error.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgspec

# NOTE: the field types and base, the transitions and the audit's messages live in modules of
# their own (message_base, transition_messages, audit_messages); every name of theirs is
# re-exported here, where callers import them from, and the union below covers them all.
from shared.audit_messages import (
    MAX_CONTROL_BLOCKS, BlockDrop, Control, ControlAck, DiskRef, InventoryItem, InventoryReply, InventoryRequest,
)
from shared.forms import FormCatalogue
from shared.ids import TenantId
from shared.message_base import (
    _HEX32, _NAME_CHARS, ErrorCode, Hex32, Len32, Name, NameChars, NonNeg, Pos, ReplicaState, _hex32s, _Msg,
    check_hex32_list, check_names, now_ms,
)
from shared.transition_messages import (
    MAX_TRANSITION_BATCH, CommitWatermark, TransitionBatch, TransitionEvent, TransitionFields,
)
from shared.versions import SCHEMA_VERSION


# --- registration and liveness -------------------------------------------------------

class WorkerRegister(_Msg, tag="worker.register", kw_only=True):
    worker_id: Name
    namespace: Hex32
    catalogue: FormCatalogue
    #: Pool slots per form (one slot holds one block of that form).
    pool_slots: dict[str, NonNeg] = {}
    #: Where the worker serves (for operators), e.g. ``http://127.0.0.1:8400``.
    endpoint: str = ""
    #: What this worker computed may not match a cold run (a fused forward gave other bits than
    #: the same request alone): every replica it owns that is still live — its offload copies on
    #: the shared disk too, which outlive an epoch — is invalidated with the old epoch.
    disown_replicas: bool = False


class RegisterReply(_Msg, tag="worker.registered", kw_only=True):
    worker_id: Name
    epoch: Pos
    #: Replicas invalidated because the request said ``disown_replicas``.
    disowned: NonNeg = 0
    heartbeat_interval_ms: Pos = 1000
    lease_ttl_ms: Pos = 30000
    #: How long the coordinator holds a silent epoch suspended before fencing it; a worker out
    #: of contact for longer registers anew instead of resuming.
    resume_grace_ms: NonNeg = 0


class WorkerResume(_Msg, tag="worker.resume", kw_only=True):
    """A worker whose process (and memory) lived through an outage asks to keep its epoch.

    ``held`` names every replica it holds on its GPU and its host tier: the concatenated
    :func:`shared.hashing.replica_digest` of each (key, generation, checksum). ``emitted_seq``
    is the last transition seq it had emitted when it took that inventory (the coordinator
    answers only once the log holds all of them, so inventory and log describe one moment).
    """

    worker_id: Name
    epoch: Pos
    namespace: Hex32
    catalogue: FormCatalogue
    pool_slots: dict[str, NonNeg] = {}
    endpoint: str = ""
    emitted_seq: NonNeg = 0
    held: bytes = b""
    #: A large inventory comes in ``parts`` messages (each within NATS max_payload), numbered
    #: from 0; the coordinator decides on the last one.
    part: NonNeg = 0
    parts: Pos = 1


class ResumeReply(_Msg, tag="worker.resumed", kw_only=True):
    worker_id: Name
    epoch: Pos
    #: False: a part of a multi-part inventory was received; send the next one.
    complete: bool = True
    #: Replicas the ledger keeps READY (the worker holds them as the ledger says).
    kept: NonNeg = 0
    #: Digests (from ``held``) of copies the worker must drop: the ledger does not list them live.
    drop: bytes = b""
    committed_seq: NonNeg = 0
    heartbeat_interval_ms: Pos = 1000
    lease_ttl_ms: Pos = 30000
    resume_grace_ms: NonNeg = 0


#: Most fallback reasons one heartbeat may report (the worker has a handful).
MAX_FALLBACK_REASONS = 32


class CacheCounters(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A worker process's prefix-cache counters since it started, in prompt tokens: the values
    of its ``kvl_worker_prefix_cache_{queries,hits,validated_hits}_total`` and
    ``kvl_worker_fallbacks_total{reason}`` (requests). Only the worker knows them (validation
    and fallbacks happen there); heartbeats carry them to the coordinator's status page."""

    queried: NonNeg = 0
    hits: NonNeg = 0
    validated: NonNeg = 0
    fallbacks: Annotated[dict[Name, NonNeg], msgspec.Meta(max_length=MAX_FALLBACK_REASONS)] = {}


class Heartbeat(_Msg, tag="worker.heartbeat", kw_only=True):
    worker_id: Name
    epoch: Pos
    #: Replicas per form the worker holds READY (for drift hints; the log is authoritative).
    ready: dict[str, NonNeg] = {}
    #: Requests running and waiting in its scheduler: soft state the coordinator hands to
    #: gateways with route answers (their load signal across gateways), never logged.
    running: NonNeg = 0
    queued: NonNeg = 0
    #: Its prefix-cache counters (soft state like the load: kept in memory for the status
    #: page, never logged); None from a worker that does not send them.
    cache: CacheCounters | None = None
    #: What it computes on and in (``cpu``, ``cuda:0``; ``float32``, ``bfloat16``) and the dtype
    #: its cache stores: soft state for the status page, like ``cache``.
    device: Annotated[str, msgspec.Meta(max_length=64)] = ""
    dtype: Annotated[str, msgspec.Meta(max_length=64)] = ""
    cache_dtype: Annotated[str, msgspec.Meta(max_length=64)] = ""


class HeartbeatReply(_Msg, tag="worker.heartbeat.ok", kw_only=True):
    #: Highest transition seq of this worker epoch committed to the log (commit watermark).
    committed_seq: NonNeg


# --- leases --------------------------------------------------------------------------

class ReplicaRefFields(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A :class:`ReplicaRef`'s fields, typed but not checked: what the ledger stores (a grant's
    pins) and folds. As :class:`TransitionFields` is for a transition, so a grant's event holds
    the refs its reply carries rather than a copy of each."""

    block_hash: str
    form: str
    location: str
    generation: int
    checksum: str = ""

    def to_message(self) -> ReplicaRef:
        """The message (checked: raises ``msgspec.ValidationError`` or ``ValueError`` if a field is not)."""
        if type(self) is ReplicaRef:
            return self
        ref = msgspec.convert(msgspec.structs.asdict(self), ReplicaRef)
        check_refs("ref", [ref])
        return ref


class ReplicaRef(ReplicaRefFields, kw_only=True):
    """A READY replica a read lease pins: where it is and which generation to expect.

    ``block_hash`` is 32 lowercase hex characters and ``form`` a name: the message carrying refs
    checks their characters for all of them at once (:func:`check_refs`)."""

    # NOTE: the fields whose values are bounded, with their bounds; the others are the base's.
    block_hash: Len32
    form: NameChars
    generation: NonNeg


def check_refs(field: str, refs: list[ReplicaRef]) -> None:
    """ValueError (a ValidationError when decoding) unless every decoded ref's ``block_hash`` is
    32 lowercase hex characters and its ``form`` a name.

    NOTE: a pattern per field cost ~1 µs a ref, ~1 ms of a long prompt's grant at the worker
    (1,000 refs); two joined checks cost ~0.4 µs a ref. Only decoded refs are checked, as msgspec
    checks only what it decodes: a list decoded from the wire holds ``ReplicaRef`` alone, while
    one the coordinator builds from its ledger holds the unchecked base (``_ref``), which it
    trusts as it trusts its log.
    """
    if not refs or type(refs[0]) is not ReplicaRef:
        return
    if not _hex32s("".join(r.block_hash for r in refs)):
        bad = next(i for i, r in enumerate(refs) if not _HEX32.fullmatch(r.block_hash))
        raise ValueError(f"{field}[{bad}].block_hash: expected 32 lowercase hex characters")
    if not _NAME_CHARS.issuperset("".join(r.form for r in refs)):
        bad = next(i for i, r in enumerate(refs) if not _NAME_CHARS.issuperset(r.form))
        raise ValueError(f"{field}[{bad}].form: {refs[bad].form[:40]!r} has a character outside "
                         f"A-Z a-z 0-9 _ . : -")


class LeaseAcquire(_Msg, tag="lease.acquire", kw_only=True):
    #: ``worker_id``, ``request_id``, ``tenant`` and ``write_forms``: names (``__post_init__``).
    worker_id: NameChars
    epoch: Pos
    request_id: NameChars = "r"
    namespace: Hex32
    tenant: NameChars = TenantId("default")
    #: Chained hashes of the request's whole blocks, in order (32 lowercase hex characters each:
    #: checked in ``__post_init__``).
    block_hashes: list[str] = []
    #: Forms the worker will write for blocks it computes (must be declared by its catalogue).
    write_forms: list[NameChars] = []
    #: Allow reuse (False = a cache-disabled request: no read lease, only writes if any).
    reuse: bool = True
    ttl_ms: Pos = 30000

    def __post_init__(self) -> None:
        # NOTE: one check over the whole list instead of a regex per hash (``Hex32``): a long
        # prompt has hundreds of blocks, and the per-item pattern was most of its decode time.
        check_hex32_list("block_hashes", self.block_hashes)
        check_names(self, ("worker_id", "request_id", "tenant"), ("write_forms",))


class LeaseGrant(_Msg, tag="lease.granted", kw_only=True):
    lease_id: Name
    expires_at_ms: NonNeg = 0
    #: Longest usable prefix, in blocks; 0 = nothing reusable.
    usable_blocks: NonNeg = 0
    #: Replicas pinned for reading (every form needed for the usable prefix).
    read: list[ReplicaRef] = []
    #: Blocks (by index into the request's block_hashes) the worker may fill, per form.
    write: dict[str, list[NonNeg]] = {}
    #: Replicas the worker must drop before filling (LRU victims, already EVICTED in the log).
    evict: list[ReplicaRef] = []
    #: Why each longer boundary was rejected, longest first (for metrics and debugging).
    rejected: list[str] = []

    def __post_init__(self) -> None:
        check_refs("read", self.read)
        check_refs("evict", self.evict)


class LeaseRenew(_Msg, tag="lease.renew", kw_only=True):
    worker_id: Name
    epoch: Pos
    lease_id: Name
    ttl_ms: Pos = 30000


class LeaseRenewed(_Msg, tag="lease.renewed", kw_only=True):
    lease_id: Name
    expires_at_ms: NonNeg = 0


class LeaseRelease(_Msg, tag="lease.release", kw_only=True):
    worker_id: Name
    epoch: Pos
    lease_id: Name


class LeaseReleased(_Msg, tag="lease.released", kw_only=True):
    lease_id: Name


class DiskBlock(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One block's form on a tier: the shared disk tier (location ``disk``) in a :class:`DiskGc`,
    the worker's own host tier or GPU pool in a :class:`HostEvict`."""

    block_hash: Hex32
    form: Name


#: Most blocks one :class:`DiskGc` may name (a worker sends a larger segment's in parts).
MAX_DISK_GC_BLOCKS = 4096


class DiskGc(_Msg, tag="disk.gc", kw_only=True):
    """A worker's garbage collector asks to delete records of the shared disk tier: every
    named READY disk replica is evicted unless a live lease pins one of them — then none is,
    and the reply lists the pinned ones (the worker keeps the segment for now)."""

    worker_id: Name
    epoch: Pos
    blocks: Annotated[list[DiskBlock], msgspec.Meta(min_length=1, max_length=MAX_DISK_GC_BLOCKS)]


class DiskGcReply(_Msg, tag="disk.gc.ok", kw_only=True):
    #: How many live disk replicas were evicted (the others named were not live: nothing to do).
    evicted: NonNeg = 0
    #: Those a live lease pins (then ``evicted`` is 0).
    pinned: list[DiskBlock] = []


#: Most blocks one :class:`HostEvict` may name (the worker sends more in several).
MAX_HOST_EVICT_BLOCKS = 4096


class HostEvict(_Msg, tag="host.evict", kw_only=True):
    """A worker asks to drop its LRU victims on one of its own tiers: each named READY replica
    at the worker's ``tier`` location is evicted unless a live lease pins it; the reply lists the
    pinned ones, whose bytes the worker keeps. Decided in the ledger's order, as a grant's GPU
    victims are: a lease granted before it keeps its replica, one granted after it cannot pin it.

    ``tier`` ``host`` (the host tier's LRU) or ``gpu`` (room in a GPU pool whose view diverged
    from the ledger's: a granted write found the pool full)."""

    worker_id: Name
    epoch: Pos
    blocks: Annotated[list[DiskBlock], msgspec.Meta(min_length=1, max_length=MAX_HOST_EVICT_BLOCKS)]
    tier: Literal["host", "gpu"] = "host"


class HostEvictReply(_Msg, tag="host.evict.ok", kw_only=True):
    #: How many live host replicas were evicted (the others named were not live: nothing to do).
    evicted: NonNeg = 0
    #: Those a live lease pins: still READY, the worker must keep their bytes.
    pinned: list[DiskBlock] = []


class ErrorReply(_Msg, tag="error", kw_only=True):
    code: ErrorCode = ErrorCode.INVALID
    message: str = ""
    retry_after_ms: NonNeg = 0

# --- routing (gateway → coordinator; read-only, answered from live state) --------------

#: Most block hashes one route query may carry (a 1M-token prompt in 16-token blocks).
MAX_ROUTE_BLOCKS = 65536


class RouteQuery(_Msg, tag="route.query", kw_only=True):
    """Which workers hold how much of these blocks. With no ``namespace``: every serving worker
    (the gateway's view of the fleet: endpoints, namespaces, block sizes), no prefix figures."""

    gateway_id: Name
    namespace: str = ""
    block_hashes: Annotated[list[Hex32], msgspec.Meta(max_length=MAX_ROUTE_BLOCKS)] = []


class RouteCandidate(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    worker_id: Name
    endpoint: str
    namespace: str
    block_size: Pos
    #: Longest boundary (in blocks) at which a resume on this worker would find every form READY
    #: at one of its readable locations (its GPU, its node's host tier, disk).
    usable_blocks: NonNeg = 0
    #: Draining or suspended workers are listed (so a gateway can say why) but not to be used.
    draining: bool = False
    suspended: bool = False
    #: Its scheduler's running and queued requests as of its last heartbeat.
    running: NonNeg = 0
    queued: NonNeg = 0


class RouteReply(_Msg, tag="route.ok", kw_only=True):
    workers: list[RouteCandidate] = []


Message = Union[
    WorkerRegister, RegisterReply, WorkerResume, ResumeReply, Heartbeat, HeartbeatReply,
    LeaseAcquire, LeaseGrant, LeaseRenew, LeaseRenewed, LeaseRelease, LeaseReleased, DiskGc, DiskGcReply,
    HostEvict, HostEvictReply,
    ErrorReply, TransitionEvent, TransitionBatch, CommitWatermark,
    InventoryRequest, InventoryReply, Control, ControlAck, RouteQuery, RouteReply,
]
MESSAGE_TYPES: dict[str, type[_Msg]] = {
    t.__struct_config__.tag: t for t in Message.__args__  # type: ignore[attr-defined]
}


class MessageError(ValueError):
    """A message that cannot be accepted: malformed, unknown type or unsupported version."""


class _Envelope(msgspec.Struct):
    type: str = ""
    v: int = -1


_envelope = msgspec.json.Decoder(_Envelope)
_decoder = msgspec.json.Decoder(Message)
_encoder = msgspec.json.Encoder()


def encode(msg: _Msg) -> bytes:
    return _encoder.encode(msg)


#: What a message that cannot be decoded raises inside msgspec (nesting too deep → RecursionError).
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)


def decode(data: bytes | memoryview | str, expect: type[_Msg] | tuple[type[_Msg], ...] | None = None) -> Any:
    """Decode and validate one message; ``expect`` restricts the accepted types. Anything that is
    not a valid message, however malformed (deeply nested JSON included), is a :class:`MessageError`.

    NOTE: a valid message is parsed once; only one that fails is read again for its envelope
    (``type``, ``v``), to say which of type, version or fields is wrong. Every lease request and
    transition passes here, and a second parse was a third of the decoding.
    """
    if isinstance(data, memoryview):
        data = data.tobytes()
    try:
        msg = _decoder.decode(data)
    except _DECODE_ERRORS as e:
        raise _explain(data, e) from e
    # a message must say its version (decoding alone would take the default): refused as before
    if ('"v"' if isinstance(data, str) else b'"v"') not in data:
        raise _explain(data, MessageError("no schema version"))
    if msg.v != SCHEMA_VERSION:
        raise MessageError(f"message {msg.__struct_config__.tag!r} has schema version {msg.v}; "
                           f"this build speaks v{SCHEMA_VERSION}")
    if expect is not None and not isinstance(msg, expect):
        names = [t.__struct_config__.tag for t in (expect if isinstance(expect, tuple) else (expect,))]
        raise MessageError(f"expected a message of type {names}, got {msg.__struct_config__.tag!r}")
    return msg


def _explain(data: bytes | memoryview | str, err: Exception) -> MessageError:
    """Why ``data``, which did not decode, is not a message: its envelope first, then its fields."""
    try:
        env = _envelope.decode(data)
    except _DECODE_ERRORS as e:
        return MessageError(f"not a kvledger message (expected a JSON object with 'type' and 'v'): {e}")
    if env.type not in MESSAGE_TYPES:
        return MessageError(f"unknown message type {env.type!r}; known: {sorted(MESSAGE_TYPES)}")
    if env.v != SCHEMA_VERSION:
        return MessageError(f"message {env.type!r} has schema version {env.v}; this build speaks v{SCHEMA_VERSION}")
    return MessageError(f"invalid {env.type!r} message: {err}")
