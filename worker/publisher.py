"""The transition publisher: the outbox plus the task that drains it into JetStream.

Every transition the engine decides goes through :meth:`TransitionPublisher.emit`, which
numbers it (``seq`` per worker epoch) and keeps it in a bounded
:class:`worker.cache.outbox.Outbox`. The publisher task sends what is due, in seq order, up
to ``batch`` transitions per JetStream message (:class:`shared.messages.TransitionBatch`,
stored whole or not at all); it awaits each broker acknowledgement before the next message,
so the stream holds them in order, and drops an entry only when the coordinator's commit
watermark for this epoch covers it — from the watermark subject or a heartbeat reply. An
entry not covered within ``resend_ms`` is sent again; a publish that fails leaves it (and
everything after it) in place for the next round.

:meth:`emit` raises :class:`OutboxFull` when the outbox is full: the engine goes degraded
(serves by recomputation, emits nothing new) instead of dropping anything.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from shared.logging import get_logger
from shared.messages import CommitWatermark, TransitionBatch, TransitionEvent
from worker.cache.outbox import Outbox, OutboxFull
from worker.client import CoordinatorClient, PublishFailed
from worker.metrics import WorkerMetrics

log = get_logger("kvl.worker.publisher")


def _now_ms() -> int:
    return time.monotonic_ns() // 1_000_000


class TransitionPublisher:
    def __init__(self, client: CoordinatorClient, *, capacity: int, resend_ms: int,
                 metrics: WorkerMetrics, batch: int = 1) -> None:
        self.client = client
        self.capacity = capacity
        self.resend_ms = resend_ms
        #: Most transitions per message (``worker.publish_batch``); 1 = one message each.
        self.batch = batch
        self.metrics = metrics
        self.outbox: Outbox | None = None
        self.last_error = ""
        self._wake = asyncio.Event()
        self._advanced = asyncio.Condition()
        self._task: asyncio.Task | None = None

    # --- epochs -------------------------------------------------------------------------------

    def new_epoch(self, worker_id: str, epoch: int) -> int:
        """Start numbering for a new epoch; returns how many old-epoch entries were dropped.

        NOTE: a new epoch fences the old one, so the coordinator would reject what is left.
        """
        dropped = len(self.outbox) if self.outbox is not None else 0
        self.outbox = Outbox(worker_id, epoch, self.capacity, self.resend_ms)
        self.metrics.outbox_depth.set(0)
        return dropped

    @property
    def epoch(self) -> int:
        return self.outbox.epoch if self.outbox is not None else 0

    @property
    def depth(self) -> int:
        return len(self.outbox) if self.outbox is not None else 0

    @property
    def full(self) -> bool:
        return self.outbox is not None and self.outbox.full

    # --- producing ----------------------------------------------------------------------------

    def emit(self, make: Callable[[int], TransitionEvent]) -> TransitionEvent:
        """Number, keep and schedule one transition (``make(seq)`` builds it). Raises OutboxFull."""
        if self.outbox is None:
            raise OutboxFull("no epoch: the worker is not registered")
        ev = self.outbox.add(make)
        self.metrics.outbox_depth.set(len(self.outbox))
        self._wake.set()
        return ev

    # --- acknowledgement ----------------------------------------------------------------------

    def on_watermark(self, wm: CommitWatermark) -> None:
        self.ack(wm.epoch, wm.seq)

    def ack(self, epoch: int, seq: int) -> None:
        ob = self.outbox
        if ob is None or epoch != ob.epoch:
            return
        if ob.ack(epoch, seq):
            self.metrics.outbox_depth.set(len(ob))
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._advanced:
            self._advanced.notify_all()

    def committed(self, epoch: int, seq: int) -> bool:
        ob = self.outbox
        # NOTE: another epoch's entries are gone (fenced): waiting for them is pointless.
        return ob is None or ob.epoch != epoch or ob.watermark >= seq

    async def wait_committed(self, epoch: int, seq: int, timeout: float) -> bool:
        """Wait until the watermark covers ``seq`` of ``epoch``; False on timeout."""
        if self.committed(epoch, seq):
            return True
        self._wake.set()
        try:
            async with self._advanced:
                await asyncio.wait_for(self._advanced.wait_for(lambda: self.committed(epoch, seq)), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def wait_empty(self, timeout: float) -> bool:
        ob = self.outbox
        if ob is None:
            return True
        return await self.wait_committed(ob.epoch, ob.next_seq - 1, timeout)

    # --- the task -----------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kvl-publisher")

    async def stop(self) -> None:
        t, self._task = self._task, None
        if t is not None:
            t.cancel()
            try:
                await t
            except asyncio.CancelledError:
                pass

    def kick(self) -> None:
        self._wake.set()

    async def _run(self) -> None:
        tick = max(0.02, min(self.resend_ms / 4000, 0.25))
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), tick)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            await self.publish_due()

    async def publish_due(self) -> int:
        """Send every due entry in seq order; stop at the first failure. Returns how many were sent."""
        ob = self.outbox
        if ob is None:
            return 0
        sent = 0
        due = ob.due(_now_ms())
        for k in range(0, len(due), self.batch):
            if ob is not self.outbox:
                break  # a new epoch began meanwhile
            part = due[k:k + self.batch]
            try:
                if len(part) == 1:
                    await self.client.publish(part[0])
                else:
                    await self.client.publish_batch(TransitionBatch(worker_id=ob.worker_id, epoch=ob.epoch,
                                                                    events=part))
            except PublishFailed as e:
                self.metrics.publish_failures.inc()
                if self.last_error != str(e):
                    log.warning("publish failed; kept in the outbox", error=str(e), depth=len(ob))
                self.last_error = str(e)
                break
            now = _now_ms()
            for ev in part:
                ob.mark_sent(ev.seq, now)
            self.metrics.published_messages.inc()
            sent += len(part)
        else:
            self.last_error = ""
        return sent


__all__ = ["OutboxFull", "TransitionPublisher"]
