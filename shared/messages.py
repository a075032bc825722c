"""Every message between workers and the coordinator: versioned, frozen msgspec structs.

One tagged union (``type`` field) covers NATS request/reply bodies, JetStream transition
events and control messages; the same structs are the payload stored in the event log.
Wire format is JSON (readable with ``nats sub``; the log stores it as JSONB).

Decoding is two-phase: an envelope (``type``, ``v``) is read first so that an unknown type
or an unsupported schema version gets a clear :class:`MessageError` naming what was
received and what is accepted, instead of a confusing field error.
"""

from __future__ import annotations

import enum
import re
import time
from typing import Annotated, Any, Literal, Union

import msgspec

from shared.forms import FormCatalogue
from shared.ids import Generation, TenantId
from shared.versions import SCHEMA_VERSION

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Pos = Annotated[int, msgspec.Meta(gt=0)]
Hex32 = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{32}\Z")]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:\-]+\Z")]
#: A :data:`Name` whose characters the message's ``__post_init__`` checks (:func:`check_names`).
#: NOTE: msgspec's ``pattern`` cost ~0.65 µs a field here, half of a transition's decode (a
#: transition has three names); one set check of all of a message's names costs ~0.3 µs.
NameChars = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:-")


#: Exactly 32 characters; the hex check is the message's ``__post_init__`` (see :func:`_hex32s`).
Len32 = Annotated[str, msgspec.Meta(min_length=32, max_length=32)]


def _hex32s(joined: str) -> bool:
    """Whether ``joined`` (a concatenation of 32-character strings) is all lowercase hex.

    NOTE: ``bytes.fromhex`` checks every character in C (it also skips whitespace, hence the
    length check, and takes upper case, hence the ``lower()`` comparison): a tenth of a regex
    per value, which is what msgspec's ``pattern`` runs.
    """
    try:
        return len(bytes.fromhex(joined)) * 2 == len(joined) and joined == joined.lower()
    except ValueError:
        return False


def check_hex32_list(field: str, values: list[str]) -> None:
    """ValueError (a ValidationError when decoding) unless every value is 32 lowercase hex characters."""
    joined = "".join(values)
    if not (len(joined) == 32 * len(values) and _hex32s(joined)):
        bad = next((i for i, v in enumerate(values) if not _HEX32.fullmatch(v)), None)
        where = f"[{bad}]" if bad is not None else ""
        raise ValueError(f"{field}{where}: expected 32 lowercase hex characters (a block hash)")


_HEX32 = re.compile(r"[0-9a-f]{32}")


def check_names(msg: msgspec.Struct, fields: tuple[str, ...], lists: tuple[str, ...] = ()) -> None:
    """ValueError (a ValidationError when decoding) unless every name in ``fields`` (and in the
    lists ``lists``) is made of :data:`Name`'s characters; their lengths are checked by the type."""
    values = [getattr(msg, f) for f in fields]
    for f in lists:
        values.extend(getattr(msg, f))
    if _NAME_CHARS.issuperset("".join(values)):
        return
    for f in fields + lists:
        for v in ([getattr(msg, f)] if f in fields else getattr(msg, f)):
            if not _NAME_CHARS.issuperset(v):
                raise ValueError(f"{f}: {v[:40]!r} has a character outside A-Z a-z 0-9 _ . : -")


class ReplicaState(enum.StrEnum):
    ALLOCATED = "ALLOCATED"
    READY = "READY"
    EVICTED = "EVICTED"
    INVALID = "INVALID"
    LOST = "LOST"


class ErrorCode(enum.StrEnum):
    UNAVAILABLE = "unavailable"        # the log (PostgreSQL) cannot be written right now
    OVER_CAPACITY = "over_capacity"    # pool or tenant quota full and nothing evictable
    FENCED = "fenced"                  # the caller's epoch or the replica's generation is stale
    INVALID = "invalid"                # the message itself is malformed or illegal
    NOT_FOUND = "not_found"            # unknown lease, worker or block
    NOT_LEADER = "not_leader"          # this coordinator is a standby
    SUSPENDED = "suspended"            # the caller's epoch is suspended: resume with an inventory first
    FORBIDDEN = "forbidden"            # the message speaks for another identity than the one it came from
    WRONG_SHARD = "wrong_shard"        # another coordinator shard owns this chain (or it is moving): ask by the current shard map


class _Msg(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="type", kw_only=True):
    v: int = SCHEMA_VERSION


def now_ms() -> int:
    return time.time_ns() // 1_000_000


# --- registration and liveness -------------------------------------------------------

class InventoryItem(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One replica a worker holds (for the audit and for a resume)."""

    block_hash: Hex32
    form: Name
    location: str
    generation: NonNeg
    state: ReplicaState
    checksum: str = ""


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


# --- state transitions (JetStream) ---------------------------------------------------

class TransitionFields(_Msg, tag="transition", kw_only=True):
    """A replica state change's fields, typed but not checked: what the ledger stores and folds.

    NOTE: :class:`TransitionEvent`, the message a worker publishes, is this with every field's
    bounds and characters checked. The ledger keeps the message it accepted as it is (a copy
    into a mirror type cost a tenth of the coordinator's ingest), and a replay decodes this
    base, trusting its own log, without the checks (they were two thirds of a replayed
    event's decode). Both encode to the same JSON.
    """

    worker_id: str
    epoch: int
    seq: int
    namespace: str
    tenant: str = "default"
    block_hash: str
    parent_hash: str
    token_start: int = 0
    token_end: int = 0
    form: str = "compressed"
    #: ``gpu:<worker>``, ``host:<node>`` or ``disk`` (the "medium" of other event streams).
    location: str = ""
    from_state: ReplicaState | None = None
    to_state: ReplicaState = ReplicaState.READY
    generation: int = 0
    checksum: str = ""
    lease_id: str = ""
    reason: str = ""
    block_size: int = 16
    model_name: str = ""
    ts_ms: int = 0

    @property
    def source_id(self) -> str:
        """``<worker>.<epoch>.<seq>``: the Nats-Msg-Id and the log's unique source key."""
        return f"{self.worker_id}.{self.epoch}.{self.seq}"

    def to_message(self) -> TransitionEvent:
        """The worker's message (checked: raises ``msgspec.ValidationError`` if a field is not)."""
        if type(self) is TransitionEvent:
            return self
        return msgspec.convert(msgspec.structs.asdict(self), TransitionEvent)


class TransitionEvent(TransitionFields, tag="transition", kw_only=True):
    """One replica state change, as a worker publishes it (and the log stores it).

    A superset of the fields public KV-event streams carry (event id, tenant, medium,
    block size, parent hash, block hashes, model name).
    """

    # NOTE: the fields whose values are bounded, with their bounds; the others are the base's.
    #: ``worker_id``, ``tenant`` and ``form``: names (``__post_init__``).
    worker_id: NameChars
    epoch: Pos
    seq: Pos
    #: 32 lowercase hex characters, as are ``block_hash`` and ``parent_hash`` (``__post_init__``).
    namespace: Len32
    tenant: NameChars = TenantId("default")
    block_hash: Len32
    parent_hash: Len32
    token_start: NonNeg = 0
    token_end: NonNeg = 0
    form: NameChars = "compressed"
    generation: NonNeg = Generation(0)
    block_size: Pos = 16
    ts_ms: NonNeg = 0

    def __post_init__(self) -> None:
        # NOTE: one check of the three hashes, one of the three names (every transition the
        # coordinator ingests passes here)
        if not _hex32s(self.namespace + self.block_hash + self.parent_hash):
            bad = next(f for f in ("namespace", "block_hash", "parent_hash") if not _HEX32.fullmatch(getattr(self, f)))
            raise ValueError(f"{bad}: expected 32 lowercase hex characters")
        if not _NAME_CHARS.issuperset(self.worker_id + self.tenant + self.form):
            check_names(self, ("worker_id", "tenant", "form"))


#: Most transitions one :class:`TransitionBatch` may carry (~700 bytes each: ~0.7 MB, under
#: NATS's default 1 MB ``max_payload``).
MAX_TRANSITION_BATCH = 1000


class TransitionBatch(_Msg, tag="transitions", kw_only=True):
    """Several transitions of one worker epoch in one JetStream message, in seq order.

    NOTE: a JetStream publish is a broker round trip (~0.2 ms here); one message per transition
    capped a worker near 4k transitions/s and cost the coordinator a fetch and an ack each. The
    batch is stored or not as a whole, so the stream keeps the worker's order (the coordinator
    judges transitions in stream order); each transition keeps its own source id, so a batch
    stored twice (a resend after a lost broker ack) is deduplicated transition by transition.
    """

    worker_id: Name
    epoch: Pos
    events: Annotated[list[TransitionEvent], msgspec.Meta(min_length=1, max_length=MAX_TRANSITION_BATCH)]

    def __post_init__(self) -> None:
        prev = 0
        for t in self.events:
            if t.worker_id != self.worker_id or t.epoch != self.epoch:
                raise ValueError(f"a batch of worker {self.worker_id} epoch {self.epoch} carries a transition of "
                                 f"worker {t.worker_id} epoch {t.epoch}")
            if t.v != self.v:
                raise ValueError(f"a batch of schema version {self.v} carries a transition of version {t.v}")
            if t.seq <= prev:
                raise ValueError(f"transition seqs must increase within a batch ({t.seq} after {prev})")
            prev = t.seq

    @property
    def source_id(self) -> str:
        """``<worker>.<epoch>.<first seq>-<last seq>``: the batch's ``Nats-Msg-Id`` (before the nonce)."""
        return f"{self.worker_id}.{self.epoch}.{self.events[0].seq}-{self.events[-1].seq}"


class CommitWatermark(_Msg, tag="watermark", kw_only=True):
    """Published by the coordinator after each commit: seqs ≤ ``seq`` of this epoch are durable.

    ``refused``: seqs among them that the ledger refused and that left the worker holding bytes
    the ledger does not list, which it drops: a copy to its host tier (the source it named is no
    longer known, or was invalidated), or a commit of a GPU slot it filled (the lease had ended
    first, aborting the write)."""

    worker_id: Name
    epoch: Pos
    seq: NonNeg
    refused: Annotated[list[NonNeg], msgspec.Meta(max_length=4096)] = []


# --- audit and control ---------------------------------------------------------------

class DiskRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A READY disk replica (its offload file's name and the checksum recorded at commit) the
    audit asks a worker to verify; in a reply, ``reason`` says what is wrong with it."""

    block_hash: Hex32
    form: Name
    namespace: Hex32
    tenant: Name
    checksum: str = ""
    reason: str = ""


class InventoryRequest(_Msg, tag="inventory.request", kw_only=True):
    """What a worker holds (for the audit). By default the reply lists ``items``; with
    ``digests`` it carries the :func:`shared.hashing.replica_digest` of every replica held on
    the GPU and host tier instead, in pages that fit NATS max_payload: page 0 takes the
    inventory, later pages (same ``request_id``) come from that same inventory. A request with
    ``disk`` refs is a disk check: the worker verifies those offload files (existence, header,
    checksum) and the reply carries only the verdicts."""

    request_id: Name = "audit"
    digests: bool = False
    page: NonNeg = 0
    #: Largest ``digests`` per page, in bytes (0 = what the connection's max_payload allows).
    page_bytes: NonNeg = 0
    disk: list[DiskRef] = []


class InventoryReply(_Msg, tag="inventory.reply", kw_only=True):
    worker_id: Name
    epoch: Pos
    items: list[InventoryItem] = []
    #: A digest inventory: this page's concatenated replica digests. The whole inventory is
    #: grouped by location, in the order and counts of ``locations`` (``[location, count]``).
    digests: bytes = b""
    locations: list[tuple[str, NonNeg]] = []
    page: NonNeg = 0
    pages: Pos = 1
    #: The last transition seq the worker had emitted when it took the inventory.
    emitted_seq: NonNeg = 0
    #: A disk check: whether this worker has the offload directory (configured and up), how
    #: many files it verified, and those it could not find or that failed verification.
    disk_tier: bool = False
    disk_checked: NonNeg = 0
    disk_missing: list[DiskRef] = []
    disk_damaged: list[DiskRef] = []


#: Most blocks one ``invalidate_blocks`` control names (an entry is ~60 bytes plus ~20 a form:
#: far below NATS's default 1 MB payload); an invalidation of more goes in several.
MAX_CONTROL_BLOCKS = 1024


class BlockDrop(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One block an ``invalidate_blocks`` control names, with what ``invalidate_block`` says of one."""

    block_hash: Hex32
    generations: dict[Name, NonNeg] | None = None


class Control(_Msg, tag="control", kw_only=True):
    action: Literal["evict", "drain", "invalidate_namespace", "invalidate_block", "invalidate_blocks"] = "drain"
    namespace: str = ""
    block_hash: str = ""
    reason: str = ""
    #: ``invalidate_block``: the GPU replicas of the block the decision named at this worker,
    #: form → generation; only those are dropped (a slot refilled since, a new incarnation the
    #: ledger lists READY, stays). None: every form's. The host tier's copies go either way.
    generations: dict[Name, NonNeg] | None = None
    #: ``invalidate_blocks``: several blocks at once, each as ``invalidate_block`` would name it
    #: (what the coordinator sends: a worker invalidation of 10k blocks is 10 messages, not 10k).
    blocks: Annotated[list[BlockDrop], msgspec.Meta(max_length=MAX_CONTROL_BLOCKS)] = []


class ControlAck(_Msg, tag="control.ack", kw_only=True):
    worker_id: Name
    affected: NonNeg = 0


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
