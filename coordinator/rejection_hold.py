"""At most one log row per worker epoch and kind of refusal per interval (issue 51, item 4).

A transition the ledger refuses is still recorded (``transition.rejected``: its seq enters the
epoch's commit watermark, so the worker's outbox can drop it). A worker that publishes junk —
compromised, or broken — turned every refused transition into a permanent row: three messages of
1,000 transitions became 3,000 rows. :func:`coordinator.core.rejections.coalesce_rejections`
folds a commit's refusals of one ``(worker, epoch, kind)`` into one row; this holds the
refusals that arrive after such a row, within ``coordinator.rejection_interval_ms``, and logs
them as one more row (with their ``count`` and seqs) when the interval ends.

NOTE: a held refusal is neither applied to the live state nor logged until then, so the live
state equals the log at every moment (snapshots and audits see no difference), and the commit
watermark does not cover it early: the transition consumer acks its NATS message only after
the row is durable. The first refusal of a quiet key is logged at once, so an honest worker's
occasional refusal costs no latency; only a burst waits (at most one interval). Held refusals
whose row cannot be written (the ledger stopped leading, an append failed) fail with the error,
and their messages are redelivered.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from coordinator.core.rejections import rejection_kind

#: ``(worker, epoch, kind)``.
Key = tuple[str, int, str]


class RejectionHold:
    def __init__(self, interval_ms: int, flush: Callable[[Key], None]) -> None:
        self.interval_s = interval_ms / 1000
        self._flush = flush
        #: When each key's last row was logged (monotonic seconds); entries older than the interval go.
        self._last: dict[Key, float] = {}
        #: Refusals held per key, and the future their waiters await (the row's commit).
        self.held: dict[Key, list[Any]] = {}
        self._waiters: dict[Key, asyncio.Future[None]] = {}
        self._timers: dict[Key, asyncio.TimerHandle] = {}

    @staticmethod
    def key(e: Any) -> Key:
        t = e.transition
        return (t.worker_id, t.epoch, e.kind or rejection_kind(e.reason))

    def hold(self, e: Any) -> asyncio.Future[None] | None:
        """``None``: log ``e`` now (its key had no row in the last interval). Otherwise ``e`` is
        held, and the future resolves once the row holding it is durable (or fails)."""
        if self.interval_s <= 0:
            return None
        key = self.key(e)
        now = time.monotonic()
        last = self._last.get(key)
        if key not in self.held and (last is None or now - last >= self.interval_s):
            self._last[key] = now
            if len(self._last) > 1024:
                self._last = {k: t for k, t in self._last.items() if now - t < self.interval_s}
            return None
        self.held.setdefault(key, []).append(e)
        fut = self._waiters.get(key)
        if fut is None:
            loop = asyncio.get_running_loop()
            fut = self._waiters[key] = loop.create_future()
            delay = max(0.0, (last if last is not None else now) + self.interval_s - now)
            self._timers[key] = loop.call_later(delay, self._flush, key)
        return fut

    def rearm(self, key: Key, delay_s: float) -> None:
        """Try ``key``'s flush again in ``delay_s`` (the ledger could not write its row just now)."""
        if key in self.held:
            self._timers[key] = asyncio.get_running_loop().call_later(delay_s, self._flush, key)

    def take(self, key: Key) -> tuple[list[Any], asyncio.Future[None] | None]:
        """The refusals held for ``key`` and their future; the key's interval restarts now."""
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        self._last[key] = time.monotonic()
        return self.held.pop(key, []), self._waiters.pop(key, None)

    def fail_all(self, exc: BaseException) -> int:
        """Fail every held refusal (their messages are redelivered); returns how many there were."""
        n = 0
        for key in list(self.held):
            events, fut = self.take(key)
            n += len(events)
            if fut is not None and not fut.done():
                fut.set_exception(exc)
        self._last.clear()
        return n
