"""The worker's standing with the coordinator: its epoch, and whether it may use its cache now.

:class:`Contact` holds what every part of the worker asks before it touches the ledger — the
epoch it registered, whether it is *degraded* (serving by full recomputation: no leases, no
reuse, no writes, the cache kept) and why, whether the coordinator asked it to drain — and
:meth:`Contact.call`, the one place a coordinator round trip is timed, counted and turned into
a change of that standing:

* *unreachable* (no answer to a register, heartbeat or resume): degraded, the cache and the
  epoch kept; the supervisor keeps asking (``worker.supervisor``);
* *suspect* (a request-path call got no answer): degraded until the next heartbeat says
  whether the coordinator is really gone or was only slow;
* *suspended* (the ledger suspended the epoch): degraded until a resume reconciles the
  inventory;
* *registration lost* (the epoch is fenced or unknown): a new epoch is registered, the cache
  goes with the old one;
* *outbox full*: nothing new is emitted (nothing it holds is dropped) until it drains.

It decides nothing about blocks and does no I/O of its own: the supervisor drives the
registration loop, the cache manager and the replica writer read it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

from shared.messages import ErrorCode, RegisterReply, ResumeReply
from worker.client import CoordinatorClient, CoordinatorRefused, CoordinatorUnavailable
from worker.metrics import WorkerMetrics
from worker.publisher import TransitionPublisher

T = TypeVar("T")


class Contact:
    """The epoch, degraded mode and accounted coordinator calls (see the module's docstring)."""

    def __init__(self, client: CoordinatorClient | None, publisher: TransitionPublisher | None,
                 metrics: WorkerMetrics, log, *, heartbeat_interval_ms: int, lease_ttl_ms: int,
                 resume_grace_ms: int) -> None:
        self.client = client
        self.publisher = publisher
        self.metrics = metrics
        self.log = log
        self.cache_enabled = client is not None
        self.epoch = 0
        self.registered = False
        self.draining = False
        self.reason = "not started" if self.cache_enabled else ""
        #: Degraded because the outbox is full (clears by itself once the watermark drains it).
        self.outbox_full = False
        #: A request-path call failed: degraded until a heartbeat says whether the coordinator is
        #: really unreachable or was only slow (then: carry on, same epoch).
        self.suspect = ""
        #: When (monotonic) the coordinator stopped answering (0 = it answers). The cache is kept.
        self.away_since = 0.0
        #: The ledger suspended our epoch: degraded until a resume reconciles our inventory.
        self.suspended = False
        #: Set while the coordinator answers for our epoch (requests told "suspended" wait on it).
        self.answering = asyncio.Event()
        #: Wakes the supervisor's loop (a lost contact, a suspension, a lost registration).
        self.wake = asyncio.Event()
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.lease_ttl_ms = lease_ttl_ms
        self.resume_grace_ms = resume_grace_ms

    @property
    def degraded(self) -> bool:
        return self.cache_enabled and (not self.registered or self.outbox_full or bool(self.suspect)
                                       or bool(self.away_since) or self.suspended)

    @property
    def state(self) -> str:
        """disabled | unregistered | unreachable | suspended | reachable (``Health.contact``)."""
        if not self.cache_enabled:
            return "disabled"
        if not self.registered:
            return "unregistered"
        if self.away_since or (self.client is not None and not self.client.connected):
            # NOTE: the bus itself says so at once: a disconnected client is unreachable before
            # any call has failed (readiness must not report "reachable" while NATS is down)
            return "unreachable"
        return "suspended" if self.suspended else "reachable"

    # --- entering degraded mode -----------------------------------------------------------

    def degrade(self, reason: str, *, wake: bool = True) -> None:
        if not self.degraded:
            self.log.warning("degraded: serving by recomputation", reason=reason)
            self.metrics.degraded_entries.labels(reason=reason.split(":", 1)[0][:40]).inc()
        self.reason = reason
        self.metrics.degraded.set(1)
        if wake:
            self.wake.set()

    def lose_contact(self, reason: str) -> None:
        """No answer from the coordinator: recompute everything, keep the cache and the epoch."""
        # NOTE: wake the supervisor on losing contact, not on each failed retry: its own failed
        # heartbeat would cut its backoff short, and it would spin (a "no responders" answer is
        # instant) at full CPU, starving the model thread, for as long as the coordinator is away.
        self.degrade(reason, wake=not self.away_since)
        if not self.away_since:
            self.away_since = time.monotonic()

    def suspend(self, reason: str) -> None:
        """The ledger suspended our epoch: resume (with our inventory) before reusing anything."""
        self.degrade(reason)
        self.suspended = True
        self.answering.clear()

    def registration_lost(self, reason: str) -> None:
        """Our epoch is fenced (or unknown): register a new one; the cache goes with the old."""
        self.degrade(reason)
        self.registered = False

    def suspect_contact(self, reason: str) -> None:
        if not self.degraded:
            self.log.warning("degraded: checking the coordinator", reason=reason)
            self.metrics.degraded_entries.labels(reason=reason.split(":", 1)[0][:40]).inc()
        self.suspect = reason
        self.reason = reason
        self.metrics.degraded.set(1)
        self.wake.set()

    def outbox_overflow(self) -> None:
        """The outbox is full: emit nothing new (never drop what it holds) until it drains."""
        if not self.degraded:
            self.log.warning("degraded: outbox full", depth=self.publisher.depth if self.publisher else 0)
            self.metrics.degraded_entries.labels(reason="outbox full").inc()
            self.reason = "outbox full: transitions await the commit watermark"
        self.outbox_full = True
        self.metrics.degraded.set(1)

    # --- leaving it -----------------------------------------------------------------------

    def in_contact(self) -> None:
        """The coordinator answers for our epoch: leave degraded mode (unless the outbox is full)."""
        self.suspect = ""
        self.suspended = False
        self.away_since = 0.0
        self.answering.set()
        if not self.outbox_full:
            self.reason = ""
            self.metrics.degraded.set(0)

    def outbox_drained(self) -> None:
        self.outbox_full = False
        self.reason = ""
        self.metrics.degraded.set(0)

    def timing(self, reply: RegisterReply | ResumeReply) -> None:
        """The coordinator's heartbeat interval, lease TTL and resume grace (from its reply)."""
        self.heartbeat_interval_ms = reply.heartbeat_interval_ms
        self.lease_ttl_ms = reply.lease_ttl_ms
        if reply.resume_grace_ms:
            self.resume_grace_ms = reply.resume_grace_ms

    def away_too_long(self) -> bool:
        # NOTE: the coordinator fences a silent epoch after the heartbeat timeout plus the grace;
        # past the grace alone a resume would race that decision, and losing it costs only the cache.
        return (time.monotonic() - self.away_since) * 1000 > self.resume_grace_ms

    async def wait_resumed(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until the coordinator answers for our epoch again; True if it does."""
        try:
            await asyncio.wait_for(self.answering.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return self.registered and not self.suspended

    # --- calls ----------------------------------------------------------------------------

    async def call(self, op: str, coro: Awaitable[T]) -> T:
        """A coordinator round trip with latency and error accounting."""
        t0 = time.perf_counter()
        try:
            out = await coro
        except CoordinatorUnavailable as e:
            self.metrics.lease_errors.labels(op=op, code="unavailable").inc()
            if op in ("register", "heartbeat", "resume"):
                self.lose_contact(f"coordinator unreachable: {e}")
            else:
                self.suspect_contact(f"coordinator unreachable: {e}")
            raise
        except CoordinatorRefused as e:
            self.metrics.lease_errors.labels(op=op, code=e.code.value).inc()
            if e.code is ErrorCode.SUSPENDED:
                self.suspend(f"epoch suspended: {e}")
            elif (e.code in (ErrorCode.FENCED, ErrorCode.NOT_FOUND) and op in ("acquire", "heartbeat", "resume")
                  or op == "resume" and e.code is ErrorCode.INVALID):
                self.registration_lost(f"registration lost: {e}")
            raise
        finally:
            self.metrics.lease_seconds.labels(op=op).observe(time.perf_counter() - t0)
        return out


__all__ = ["Contact"]
