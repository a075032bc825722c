"""The worker's transition outbox: nothing is forgotten until the ledger says it is durable.

A JetStream publish acknowledgement is not durability (the broker may acknowledge before it
writes to disk), so a transition stays here until the coordinator's *commit watermark* for
this worker epoch covers its sequence number. Entries not covered within ``resend_ms`` of
their last publish are due again; redelivery is harmless (``Nats-Msg-Id`` and the log's
unique source id). A full outbox refuses new entries: the caller switches to degraded mode
(serve by recomputation, publish nothing new) rather than drop an event.

Pure data structure: the publisher task owns the clock and the connection.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from shared.messages import TransitionEvent


class OutboxFull(Exception):
    """The outbox holds ``capacity`` unacknowledged transitions."""


@dataclass
class _Entry:
    event: TransitionEvent
    last_sent_ms: int = -1


@dataclass
class Outbox:
    worker_id: str
    epoch: int
    capacity: int
    resend_ms: int
    next_seq: int = 1
    watermark: int = 0
    _pending: OrderedDict[int, _Entry] = field(default_factory=OrderedDict)

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def full(self) -> bool:
        return len(self._pending) >= self.capacity

    def add(self, make: "callable[[int], TransitionEvent]") -> TransitionEvent:  # type: ignore[valid-type]
        """Assign the next seq, build the event with it, keep it. Raises OutboxFull."""
        if self.full:
            raise OutboxFull(f"{len(self._pending)} transitions await the commit watermark")
        seq = self.next_seq
        ev = make(seq)
        if ev.seq != seq or ev.worker_id != self.worker_id or ev.epoch != self.epoch:
            raise ValueError("event does not carry this outbox's worker, epoch and seq")
        self.next_seq += 1
        self._pending[seq] = _Entry(ev)
        return ev

    def due(self, now_ms: int) -> list[TransitionEvent]:
        """Events never sent, or sent more than ``resend_ms`` ago and still uncovered."""
        out = []
        for e in self._pending.values():
            if e.last_sent_ms < 0 or now_ms - e.last_sent_ms >= self.resend_ms:
                out.append(e.event)
        return out

    def mark_sent(self, seq: int, now_ms: int) -> None:
        e = self._pending.get(seq)
        if e is not None:
            e.last_sent_ms = now_ms

    def ack(self, epoch: int, seq: int) -> int:
        """Apply a commit watermark; returns how many entries it released."""
        if epoch != self.epoch or seq <= self.watermark:
            return 0
        self.watermark = seq
        released = 0
        while self._pending:
            first = next(iter(self._pending))
            if first > seq:
                break
            del self._pending[first]
            released += 1
        return released

    def pending_seqs(self) -> list[int]:
        return list(self._pending)
