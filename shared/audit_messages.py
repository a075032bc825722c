"""The audit's and the operator's messages to a worker: inventories, disk checks and controls."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from shared.message_base import Hex32, Name, NonNeg, Pos, ReplicaState, _Msg


class InventoryItem(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One replica a worker holds (for the audit and for a resume)."""

    block_hash: Hex32
    form: Name
    location: str
    generation: NonNeg
    state: ReplicaState
    checksum: str = ""

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
