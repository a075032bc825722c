"""The worker's replica transitions on JetStream (one or a batch) and the coordinator's commit watermark."""

from __future__ import annotations

from typing import Annotated

import msgspec

from shared.ids import Generation, TenantId
from shared.message_base import (
    _HEX32, _NAME_CHARS, Len32, Name, NameChars, NonNeg, Pos, ReplicaState, _hex32s, _Msg, check_names,
)


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
