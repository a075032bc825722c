"""Group commit: many requests' events, one transaction.

Callers :meth:`~GroupCommitter.submit` their events (synchronously, so the log order is the
order in which the caller applied them to its live state) and await the returned future,
which resolves only after the transaction holding them has committed. A background task
takes everything queued (up to ``batch_max`` events) and appends it as one batch. One batch
is in flight at a time (there is one writer), so while a commit is in progress the next batch
fills up by itself: the busier the coordinator, the larger its batches, and a lone request
is committed at once. ``batch_ms`` > 0 makes a submission that finds the writer idle wait that
long for company first (fewer, larger transactions for a slow disk, at that latency cost).

A submission is never split across transactions: a request's events commit together.

If a batch fails, its submissions *and every submission queued behind it* fail too: the
caller applied those events on top of the failed ones, so none of them may be reported
durable. The owner then rebuilds its state from the log (``on_failure``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from coordinator.log.port import EventLog, LogUnavailable, NewEvent


@dataclass(slots=True)
class Submission:
    events: list[NewEvent]
    future: asyncio.Future[list[int | None]]
    #: Opaque to the committer; handed back to ``on_commit`` (e.g. the decoded ledger events).
    context: Any = None
    positions: list[int | None] = field(default_factory=list)


#: ``on_commit(submissions)`` runs after a commit, before any waiter is woken.
CommitHook = Callable[[Sequence[Submission]], None]
FailureHook = Callable[[BaseException], None]
#: ``on_batch(events, seconds, ok)``, for metrics.
BatchHook = Callable[[int, float, bool], None]


class GroupCommitter:
    def __init__(self, log: EventLog, *, batch_ms: float, batch_max: int, leader_epoch: int = 0,
                 on_commit: CommitHook | None = None, on_failure: FailureHook | None = None,
                 on_batch: BatchHook | None = None) -> None:
        self.log = log
        self.batch_s = batch_ms / 1000
        self.batch_max = batch_max
        self.leader_epoch = leader_epoch
        self.on_commit = on_commit
        self.on_failure = on_failure
        self.on_batch = on_batch
        self._queue: deque[Submission] = deque()
        self._queued_events = 0
        self._first_at = 0.0
        self._nonempty = asyncio.Event()
        self._full = asyncio.Event()
        self._last: asyncio.Future[list[int | None]] | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        #: Transactions committed and events stored, since start.
        self.batches = 0
        self.events = 0

    # --- caller side -----------------------------------------------------------------------

    def submit(self, events: list[NewEvent], context: Any = None) -> asyncio.Future[list[int | None]]:
        """Queue ``events`` for the next batch; the future resolves to their positions after commit."""
        if self._closed:
            raise LogUnavailable("the commit queue is closed (shutting down or stepping down)")
        fut: asyncio.Future[list[int | None]] = asyncio.get_running_loop().create_future()
        if not self._queue:
            self._first_at = time.monotonic()
        self._queue.append(Submission(events, fut, context))
        self._queued_events += len(events)
        self._last = fut
        self._nonempty.set()
        if self._queued_events >= self.batch_max:
            self._full.set()
        return fut

    def barrier(self) -> asyncio.Future[list[int | None]] | None:
        """The future of the latest submission, or None when everything submitted has settled.

        Awaiting it means every event submitted so far is durable (batches commit in order).
        """
        return self._last if self._last is not None and not self._last.done() else None

    async def flush(self) -> None:
        """Wait until everything submitted so far has committed or failed."""
        if (b := self.barrier()) is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(b)

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        self._closed = False
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self.run(), name="group-commit")

    async def close(self, *, flush: bool = True) -> None:
        """Stop taking submissions; commit what is queued (``flush``) or fail it; stop the task."""
        self._closed = True
        if flush:
            await self.flush()
        self.fail_pending(LogUnavailable("the coordinator is stopping"))
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def fail_pending(self, exc: BaseException) -> None:
        while self._queue:
            sub = self._queue.popleft()
            if not sub.future.done():
                sub.future.set_exception(exc)
        self._queued_events = 0
        self._nonempty.clear()
        self._full.clear()

    # --- the batching loop ----------------------------------------------------------------

    async def run(self) -> None:
        while True:
            await self._nonempty.wait()
            delay = self._first_at + self.batch_s - time.monotonic()
            if delay > 0 and self._queued_events < self.batch_max:
                self._full.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._full.wait(), delay)
            batch = self._take()
            if batch:
                await self._commit(batch)

    def _take(self) -> list[Submission]:
        batch: list[Submission] = []
        n = 0
        while self._queue and (not batch or n + len(self._queue[0].events) <= self.batch_max):
            sub = self._queue.popleft()
            batch.append(sub)
            n += len(sub.events)
        self._queued_events -= n
        if self._queue:
            self._first_at = time.monotonic()
            if self._queued_events >= self.batch_max:
                self._full.set()
        else:
            self._nonempty.clear()
            self._full.clear()
        return batch

    async def _commit(self, batch: list[Submission]) -> None:
        flat = [e for sub in batch for e in sub.events]
        t0 = time.perf_counter()
        try:
            positions = await self.log.append(flat, self.leader_epoch) if flat else []
        except asyncio.CancelledError:
            err = LogUnavailable("the coordinator stopped while a commit was in flight", committed_unknown=True)
            self._fail(batch, err)
            raise
        except Exception as e:  # noqa: BLE001 - every failure fails the waiters, then the owner decides
            if self.on_batch:
                self.on_batch(len(flat), time.perf_counter() - t0, False)
            self._fail(batch, e)
            if self.on_failure:
                self.on_failure(e)
            return
        if self.on_batch:
            self.on_batch(len(flat), time.perf_counter() - t0, True)
        self.batches += 1
        self.events += sum(p is not None for p in positions)
        i = 0
        for sub in batch:
            sub.positions = positions[i:i + len(sub.events)]
            i += len(sub.events)
        if self.on_commit:
            self.on_commit(batch)
        for sub in batch:
            if not sub.future.done():
                sub.future.set_result(sub.positions)

    def _fail(self, batch: list[Submission], exc: BaseException) -> None:
        for sub in batch:
            if not sub.future.done():
                sub.future.set_exception(exc)
        self.fail_pending(exc)
