"""An in-process twin of the coordinator, built on :mod:`coordinator.core` commands.

For fast unit tests of the engine only: it decides with the same pure commands as the
real coordinator and folds their events into a :class:`coordinator.core.LedgerState`, but
keeps nothing durable and has no broker. Integration and end-to-end tests run the real
coordinator process.

Test hooks: ``down`` makes every call fail as if the coordinator were unreachable;
``drop_publishes`` makes the broker lose publishes (the outbox must resend them);
``hold_watermark`` ingests transitions but announces no new watermark (neither on the
watermark subject nor in heartbeat replies), like a coordinator whose log stalls.
"""

from __future__ import annotations

import itertools
import time
import uuid

from coordinator.core import (
    CoreParams, Invalidated, LedgerState, acquire_lease, apply, collect_disk, drop_controls, evict_host, expire,
    heartbeat, ingest_transition, register_worker, release_lease, renew_lease, resume, resume_worker,
)
from coordinator.core.rejections import strands_bytes
from shared import messages as m
from worker.client import (
    CoordinatorRefused, CoordinatorUnavailable, OnControl, OnInventory, OnWatermark, PublishFailed,
)


def _now() -> int:
    return time.time_ns() // 1_000_000


class InProcessCoordinator:
    def __init__(self, params: CoreParams | None = None) -> None:
        self.state = LedgerState.empty(params or CoreParams())
        self.down = False
        self.drop_publishes = 0
        self.hold_watermark = False
        self.published: list[m.TransitionEvent] = []
        #: Batch messages published (their transitions are in ``published`` too).
        self.batches = 0
        self.rejected: list[tuple[m.TransitionEvent, str]] = []
        self._ids = itertools.count(1)
        self._listeners: dict[str, tuple[OnWatermark, OnInventory, OnControl]] = {}
        self._announced: dict[tuple[str, int], int] = {}
        self._refused: dict[tuple[str, int], list[int]] = {}   # refusals that strand bytes, not yet told
        #: Soft liveness, as the real coordinator keeps it (heartbeats are not events).
        self.seen: dict[tuple[str, int], int] = {}

    # --- the port -----------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return not self.down

    async def connect(self) -> None:
        self._check()

    async def close(self) -> None:
        self._listeners.clear()

    def _check(self) -> None:
        if self.down:
            raise CoordinatorUnavailable("twin coordinator is down")

    def _run(self, reply_events: tuple) -> object:
        reply, events = reply_events
        for e in events:
            apply(self.state, e)
        if isinstance(reply, m.ErrorReply):
            raise CoordinatorRefused(reply.code, reply.message, reply.retry_after_ms)
        # NOTE: as the worker gets it from the real coordinator, through the wire format: the
        # core builds some of a reply's parts as unchecked base types (a grant's refs), which a
        # decoded reply never holds
        return m.decode(m.encode(reply))

    async def register(self, msg: m.WorkerRegister) -> m.RegisterReply:
        self._check()
        reply, events = register_worker(self.state, msg, _now())
        # as the coordinator's shell does: holders of copies of what a worker disowned are told
        held = {w: b for e in events if isinstance(e, Invalidated)
                for w, b in drop_controls(self.state, e, but=msg.worker_id).items()}
        out = self._run((reply, events))
        for wid, controls in held.items():
            if wid in self._listeners:
                for c in controls:
                    await self.control(wid, c)
        return out  # type: ignore[return-value]

    async def resume(self, msg: m.WorkerResume) -> m.ResumeReply:
        self._check()
        return self._run(resume_worker(self.state, msg, _now()))  # type: ignore[return-value]

    async def heartbeat(self, msg: m.Heartbeat) -> m.HeartbeatReply:
        self._check()
        reply = self._run(heartbeat(self.state, msg, _now()))
        self.seen[(msg.worker_id, msg.epoch)] = _now()
        if self.hold_watermark:  # a stalled log: the reply reports only what was announced before
            return m.HeartbeatReply(committed_seq=self._announced.get((msg.worker_id, msg.epoch), 0))
        return reply  # type: ignore[return-value]

    async def acquire(self, msg: m.LeaseAcquire) -> m.LeaseGrant:
        self._check()
        return self._run(acquire_lease(self.state, msg, _now(), f"L{next(self._ids)}-{uuid.uuid4().hex[:6]}"))  # type: ignore[return-value]

    async def renew(self, msg: m.LeaseRenew) -> m.LeaseRenewed:
        self._check()
        return self._run(renew_lease(self.state, msg, _now()))  # type: ignore[return-value]

    async def release(self, msg: m.LeaseRelease) -> m.LeaseReleased:
        self._check()
        return self._run(release_lease(self.state, msg, _now()))  # type: ignore[return-value]

    async def disk_gc(self, msg: m.DiskGc) -> m.DiskGcReply:
        self._check()
        return self._run(collect_disk(self.state, msg, _now()))  # type: ignore[return-value]

    async def host_evict(self, msg: m.HostEvict) -> m.HostEvictReply:
        self._check()
        return self._run(evict_host(self.state, msg, _now()))  # type: ignore[return-value]

    async def publish(self, event: m.TransitionEvent) -> None:
        await self._store(event.worker_id, event.epoch, [event])

    async def publish_batch(self, batch: m.TransitionBatch) -> None:
        await self._store(batch.worker_id, batch.epoch, batch.events)
        self.batches += 1

    async def _store(self, worker_id: str, epoch: int, events: list[m.TransitionEvent]) -> None:
        """One broker message: stored whole (each transition judged in order) or not at all."""
        if self.down:
            raise PublishFailed("twin broker is down")
        if self.drop_publishes:
            self.drop_publishes -= 1
            return  # "acknowledged" by the broker, then lost
        for event in events:
            self.published.append(event)
            for e in ingest_transition(self.state, event, _now()):
                reason = getattr(e, "reason", None)
                if reason is not None and type(e).__name__ == "TransitionRejected":
                    self.rejected.append((event, reason))
                    if strands_bytes(event):
                        self._refused.setdefault((worker_id, epoch), []).append(event.seq)
                apply(self.state, e)
        if not self.hold_watermark:
            self.send_watermark(worker_id, epoch)

    async def listen(self, worker_id: str, on_watermark: OnWatermark, on_inventory: OnInventory,
                     on_control: OnControl) -> None:
        self._listeners[worker_id] = (on_watermark, on_inventory, on_control)

    # --- test helpers -------------------------------------------------------------------------

    def take_over(self) -> None:
        """As a new leader does after replay: every live epoch is suspended until it resumes."""
        for e in resume(self.state, _now()):
            apply(self.state, e)

    def expire(self, now_ms: int | None = None) -> list[object]:
        """Run the liveness and lease decisions now (or at ``now_ms``)."""
        events = expire(self.state, _now() if now_ms is None else now_ms, self.seen)
        for e in events:
            apply(self.state, e)
        return events

    def send_watermark(self, worker_id: str, epoch: int) -> None:
        seq = self.state.committed_seq(worker_id, epoch)
        self._announced[(worker_id, epoch)] = seq
        cbs = self._listeners.get(worker_id)
        refused = self._refused.pop((worker_id, epoch), [])   # as the coordinator's publisher does
        if cbs is not None:
            cbs[0](m.CommitWatermark(worker_id=worker_id, epoch=epoch, seq=seq, refused=refused))

    async def control(self, worker_id: str, msg: m.Control) -> m.ControlAck:
        return await self._listeners[worker_id][2](msg)

    async def inventory(self, worker_id: str, timeout_s: float | None = None, *,
                        request: m.InventoryRequest | None = None) -> m.InventoryReply:
        """Ask a worker what it holds (``request``: items by default; the whole reply, unpaged)."""
        return await self._listeners[worker_id][1](request or m.InventoryRequest())

    async def audit_inventory(self, worker_id: str, timeout_s: float | None = None, *, digests: bool = False,
                              disk: list[m.DiskRef] | None = None) -> m.InventoryReply | str:
        """The audit's ``inventory`` callable (see :func:`coordinator.audit.run_audit`) on this twin."""
        if worker_id not in self._listeners:
            return "no responders"
        req = m.InventoryRequest(disk=disk) if disk else m.InventoryRequest(digests=digests)
        return await self._listeners[worker_id][1](req)
