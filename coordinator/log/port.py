"""The event-log port: what the coordinator needs from its append-only store, and nothing more.

Two adapters implement it: :class:`~coordinator.log.postgres.PostgresEventLog` (the real
one) and :class:`~coordinator.log.memory.InMemoryEventLog` (a twin for fast unit tests).
One contract test class (``tests/integration/test_eventlog_contract.py``) runs against both,
so the twin cannot drift from the database's behaviour.

Guarantees every adapter gives:

* **Dense positions in commit order.** ``position`` starts at 1 and has no gaps; a batch
  gets consecutive positions; a reader tailing by position never skips a committed row.
* **All or nothing.** A batch is one transaction.
* **Fenced single writer.** ``append`` names the caller's leader epoch; if a newer epoch has
  been taken (:meth:`EventLog.take_leadership`), the append fails with :class:`NotLeader`
  and writes nothing.
* **Idempotent by source id.** An event whose ``source_id`` is already stored (or appears
  earlier in the same batch) is not stored again; its slot in the result is ``None``.
* **A hash chain.** Each stored event carries ``chain_hash`` = sha256 over its content and the
  previous event's (:mod:`coordinator.log.chain`), computed by the writer for its batch.
* **Per-stream versions.** Each stored event gets ``stream_version`` = previous head + 1
  (heads derived from the stored rows, never from a counter that could drift); an event
  with ``expected_version`` set fails the batch with :class:`StreamConflict` unless the
  stream's head equals it at that point of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import NamedTuple, Protocol, runtime_checkable


# NOTE: NewEvent and StoredEvent are NamedTuples, not frozen dataclasses: one is built per
# event appended and per event replayed, and a frozen dataclass's __init__ (one
# object.__setattr__ per field) cost more than decoding the event's JSON.

class NewEvent(NamedTuple):
    """An event to append. ``payload`` is the encoded JSON of one ledger event."""

    stream_id: str
    type: str
    payload: bytes
    #: ``<worker>.<epoch>.<seq>`` for events that come from a worker transition; None otherwise.
    source_id: str | None = None
    #: Optimistic concurrency: the stream head this event expects (0 = new stream); None = any.
    expected_version: int | None = None


class StoredEvent(NamedTuple):
    position: int
    stream_id: str
    stream_version: int
    type: str
    payload: bytes
    source_id: str | None
    leader_epoch: int
    recorded_at: datetime
    #: sha256 over this event and the previous one's chain_hash (:mod:`coordinator.log.chain`).
    chain_hash: bytes | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The folded state after every event up to and including ``position``."""

    position: int
    state_hash: str
    state: bytes
    leader_epoch: int = 0
    created_at: datetime | None = field(default=None, compare=False)
    #: The log's chain head at ``position``, filled in by the log when it stores the snapshot.
    chain_hash: bytes | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class LeaderInfo:
    leader_epoch: int
    holder: str
    since: datetime | None
    renewed_at: datetime | None = None


# --- errors (driver errors are translated into these once, in the adapter) -------------

class LogError(Exception):
    """The log refused or failed an operation (not retried)."""


class LogUnavailable(LogError):
    """The store cannot be reached or timed out. Whether an append committed is unknown
    unless :attr:`committed_unknown` is False."""

    def __init__(self, message: str, *, committed_unknown: bool = False) -> None:
        super().__init__(message)
        self.committed_unknown = committed_unknown


class NotLeader(LogError):
    """The caller's leader epoch is stale: another coordinator has taken over."""

    def __init__(self, mine: int, current: int) -> None:
        super().__init__(f"leader epoch {mine} is stale: epoch {current} has taken over")
        self.mine = mine
        self.current = current


class StreamConflict(LogError):
    """An event's ``expected_version`` did not match its stream's head."""

    def __init__(self, stream_id: str, expected: int, actual: int) -> None:
        super().__init__(f"stream {stream_id!r}: expected version {expected}, head is {actual}")
        self.stream_id = stream_id
        self.expected = expected
        self.actual = actual


def plan_append(batch: Sequence[NewEvent], head: int, stream_head: dict[str, int],
                known_sources: set[str]) -> tuple[list[tuple[int, int, NewEvent]], list[int | None]]:
    """Positions and stream versions for ``batch``, shared by every adapter so they agree.

    ``stream_head`` maps each stream of the batch to its stored head (0 if new);
    ``known_sources`` are the batch's source ids already stored. Returns the rows to store as
    ``(position, stream_version, event)`` and the result list of :meth:`EventLog.append`.
    Raises :class:`StreamConflict` for a failed ``expected_version``.
    """
    heads = dict(stream_head)
    seen = set(known_sources)
    rows: list[tuple[int, int, NewEvent]] = []
    out: list[int | None] = []
    for ev in batch:
        if ev.source_id is not None:
            if ev.source_id in seen:
                out.append(None)
                continue
            seen.add(ev.source_id)
        h = heads.get(ev.stream_id, 0)
        if ev.expected_version is not None and ev.expected_version != h:
            raise StreamConflict(ev.stream_id, ev.expected_version, h)
        heads[ev.stream_id] = h + 1
        head += 1
        rows.append((head, h + 1, ev))
        out.append(head)
    return rows, out


@runtime_checkable
class EventLog(Protocol):
    """The append-only log of ledger events (see module docstring for the guarantees)."""

    async def append(self, batch: Sequence[NewEvent], leader_epoch: int) -> list[int | None]:
        """Store ``batch`` in one transaction; position per event, ``None`` for a duplicate source."""
        ...

    async def read(self, from_position: int = 1, limit: int = 1000) -> list[StoredEvent]:
        """Events with ``position >= from_position`` in position order, at most ``limit``."""
        ...

    async def read_payloads(self, from_position: int = 1, limit: int = 1000) -> Sequence[tuple[int, str | bytes]]:
        """``(position, payload)`` of the events with ``position >= from_position``, in position
        order, at most ``limit``: the part of each event a replay folds (and only that)."""
        ...

    async def read_stream(self, stream_id: str, from_version: int = 1, limit: int = 10_000) -> list[StoredEvent]:
        """One stream's events with ``stream_version >= from_version`` in version order."""
        ...

    async def read_streams(self, stream_ids: Sequence[str], limit: int = 10_000) -> list[StoredEvent]:
        """The events of any of ``stream_ids``, in position order, at most ``limit``."""
        ...

    async def head(self) -> int:
        """Position of the last stored event (0 for an empty log)."""
        ...

    async def take_leadership(self, holder: str) -> int:
        """Bump the leader epoch (fencing every older writer) and record ``holder``; returns it."""
        ...

    async def leader(self) -> LeaderInfo:
        ...

    async def latest_snapshot(self) -> Snapshot | None:
        ...

    async def archived_upto(self) -> int:
        """The last archived position (0: nothing archived); cheap, unlike :meth:`archive_anchor`."""
        ...

    async def archive_anchor(self) -> tuple[int, Snapshot | None]:
        """``(position, snapshot)``: the log's events up to ``position`` are archived
        (:mod:`coordinator.log.archive`) and the snapshot there is where a replay from the
        beginning starts; ``(0, None)`` when nothing is archived. The snapshot is None if it
        cannot be read (it is never deleted; a replay then fails, naming it)."""
        ...

    async def save_snapshot(self, snapshot: Snapshot, leader_epoch: int) -> None:
        """Store a snapshot (fenced like ``append``) with the chain head at its position; a second
        one at the same position is ignored."""
        ...

    async def chain_anchor(self) -> tuple[int, bytes]:
        """``(position, chain hash)`` where the stored chain starts: the newest archive's head, or
        ``(0, GENESIS)`` when nothing is archived (:mod:`coordinator.log.chain`)."""
        ...

    async def close(self) -> None:
        ...
