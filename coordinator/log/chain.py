"""The event log's hash chain: each event's ``chain_hash`` covers its content and the previous one's.

``chain_hash(n) = sha256(chain_hash(n-1) ‖ position ‖ leader_epoch ‖ stream_id ‖ type ‖ source_id ‖ payload)``
with fixed-width big-endian integers and length-prefixed strings (a NULL ``source_id`` has
length -1), so that no two different events hash the same bytes. ``chain_hash(0)`` is
:data:`GENESIS`. The same bytes are built in SQL by migration 0006 (which chained the rows that
were there before it); an operator can recompute a link with PostgreSQL's ``sha256()``.

The writer computes it: the adapter (:meth:`PostgresEventLog.append`, the in-memory twin) chains
each batch the group committer hands it, from the head it knows, and PostgreSQL checks that the
batch links to the head it finds under the leader lock. The audit re-derives the chain from an
anchor — position 0, the newest archive's last position, or a snapshot — and reports the first
position where it breaks: a payload edited, an event deleted, inserted or moved.

What it proves, and what it cannot (docs/operations.md, "The log's hash chain"): any change to
stored history breaks every link after it, unless the attacker rewrites the whole tail from the
change to the head. Recomputing the tail needs no secret, so only an anchor kept *outside* the
database catches that: the head the coordinator publishes (``kvl_log_chain_head_position`` and
the hash prefix in ``kvl_log_chain_head_info``), a snapshot's or an archive file's recorded head.

``stream_version`` and ``recorded_at`` are not covered: the first is derived from the stream's
order (the audit's replay checks it), the second is the server's clock.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

#: The ``chain_hash`` before the first event (and the head of an archive made before migration 0006).
GENESIS = bytes(32)

_HEAD = struct.Struct(">qqi")
_LEN = struct.Struct(">i")
_NULL = _LEN.pack(-1)
_sha256 = hashlib.sha256


def link(prev: bytes, position: int, leader_epoch: int, stream_id: str, type_: str, source_id: str | None,
         payload: bytes) -> bytes:
    """The chain hash of one event, given the previous event's."""
    s = stream_id.encode()
    t = type_.encode()
    src = _NULL if source_id is None else _LEN.pack(len(b := source_id.encode())) + b
    return _sha256(b"".join((prev, _HEAD.pack(position, leader_epoch, len(s)), s, _LEN.pack(len(t)), t, src,
                             payload))).digest()


def chain_batch(prev: bytes, first_position: int, leader_epoch: int,
                events: Sequence[tuple[str, str, str | None, bytes] | None]) -> list[bytes | None]:
    """Chain hashes for a batch of ``(stream_id, type, source_id, payload)`` stored at consecutive
    positions from ``first_position``; a ``None`` entry is not stored (a duplicate source) and
    takes no position. Returns one hash per entry (``None`` for the skipped)."""
    # NOTE: link() inlined with its names bound locally: this runs for every appended event on the
    # coordinator's event loop (about a third less time than calling link()).
    out: list[bytes | None] = []
    pos = first_position
    h = prev
    head, length, join, sha = _HEAD.pack, _LEN.pack, b"".join, _sha256
    for e in events:
        if e is None:
            out.append(None)
            continue
        stream, type_, source, payload = e
        s = stream.encode()
        t = type_.encode()
        if source is None:
            src = _NULL
        else:
            b = source.encode()
            src = length(len(b)) + b
        h = sha(join((h, head(pos, leader_epoch, len(s)), s, length(len(t)), t, src, payload))).digest()
        out.append(h)
        pos += 1
    return out


@dataclass(frozen=True, slots=True)
class ChainBreak:
    """The first position where the stored chain does not hold, and what is wrong there."""

    position: int
    what: str


@dataclass(slots=True)
class ChainCheck:
    """A running verification from an anchor (``position``, ``head``): feed it the stored events
    in position order (:meth:`feed`); it stops at the first break."""

    position: int
    head: bytes
    anchor: int = 0
    events: int = 0
    broken: ChainBreak | None = None

    def __post_init__(self) -> None:
        self.anchor = self.position

    def feed(self, rows: Iterable[tuple[int, str, str, str | None, bytes, int, bytes | None]]) -> bool:
        """``rows``: ``(position, stream_id, type, source_id, payload, leader_epoch, chain_hash)``.
        False once the chain is broken (later rows are not looked at)."""
        if self.broken is not None:
            return False
        for pos, stream, type_, source, payload, epoch, stored in rows:
            expected_pos = self.position + 1
            if pos != expected_pos:
                what = (f"position {expected_pos} is missing (the next stored event is at {pos})"
                        if pos > expected_pos else f"position {pos} appears out of order after {self.position}")
                self.broken = ChainBreak(expected_pos, what)
                return False
            h = link(self.head, pos, epoch, stream, type_, source, payload)
            if stored is None:
                self.broken = ChainBreak(pos, "the event has no chain hash (inserted around the writer)")
                return False
            if bytes(stored) != h:
                prev_ok = "its content or its link to the previous event changed"
                self.broken = ChainBreak(pos, f"chain hash mismatch: {prev_ok} (stored {bytes(stored).hex()[:16]}…, "
                                              f"recomputed {h.hex()[:16]}…)")
                return False
            self.head = h
            self.position = pos
            self.events += 1
        return True

    def report(self, upto: int) -> dict[str, object]:
        """The audit's ``chain`` entry; a break, or a log that ends before ``upto``, is not ok."""
        broken = self.broken
        if broken is None and self.position < upto:
            broken = ChainBreak(self.position + 1, f"position {self.position + 1} is missing (the log ends at "
                                                   f"{self.position}, the live state is at {upto})")
        out: dict[str, object] = {"ok": broken is None, "anchor_position": self.anchor, "verified_events": self.events,
                                  "head_position": self.position, "head_hash": self.head.hex()}
        if broken is not None:
            out["first_break"] = {"position": broken.position, "what": broken.what}
        return out
