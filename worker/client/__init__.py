"""The worker's port to the coordinator, and its two adapters.

:class:`CoordinatorClient` is everything the engine needs from the coordinator: the
request/reply calls (register, heartbeat, leases), publishing transitions (one or a batch), and the
coordinator-to-worker subjects (commit watermark, inventory, control). Two adapters:

* :class:`worker.client.nats_adapter.NatsCoordinatorClient` — the real one (NATS
  request/reply + JetStream);
* ``tests.twin.InProcessCoordinator`` (under tests/) — a twin that runs
  :mod:`coordinator.core` commands in process, for fast unit tests only. Integration tests
  use the real coordinator process.

Errors are split by what the engine should do about them: :class:`CoordinatorUnavailable`
(timeout, no responders, connection lost, the coordinator's log unavailable) sends the
worker into degraded mode, cache kept; :class:`CoordinatorRefused` (fenced, suspended,
over capacity, invalid) is an answer, handled per code.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from shared.messages import (
    CommitWatermark, Control, ControlAck, DiskGc, DiskGcReply, ErrorCode, Heartbeat, HeartbeatReply, HostEvict,
    HostEvictReply, InventoryReply, InventoryRequest, LeaseAcquire, LeaseGrant, LeaseRelease, LeaseReleased, LeaseRenew,
    LeaseRenewed, RegisterReply, ResumeReply, TransitionBatch, TransitionEvent, WorkerRegister, WorkerResume,
)


class CoordinatorUnavailable(Exception):
    """The coordinator cannot be reached or cannot answer now (transient)."""


class CoordinatorRefused(Exception):
    """The coordinator answered with an error (``code`` says which)."""

    def __init__(self, code: ErrorCode, message: str, retry_after_ms: int = 0) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms


class PublishFailed(Exception):
    """A transition could not be handed to JetStream (it stays in the outbox)."""


OnWatermark = Callable[[CommitWatermark], None]
OnInventory = Callable[[InventoryRequest], Awaitable[InventoryReply]]
OnControl = Callable[[Control], Awaitable[ControlAck]]


class CoordinatorClient(Protocol):
    @property
    def connected(self) -> bool: ...

    async def connect(self) -> None:
        """Open the connection (raises CoordinatorUnavailable); a no-op when connected."""

    async def close(self) -> None: ...

    async def register(self, msg: WorkerRegister) -> RegisterReply: ...

    async def resume(self, msg: WorkerResume) -> ResumeReply: ...

    async def heartbeat(self, msg: Heartbeat) -> HeartbeatReply: ...

    async def acquire(self, msg: LeaseAcquire) -> LeaseGrant: ...

    async def renew(self, msg: LeaseRenew) -> LeaseRenewed: ...

    async def release(self, msg: LeaseRelease) -> LeaseReleased: ...

    async def disk_gc(self, msg: DiskGc) -> DiskGcReply: ...

    async def host_evict(self, msg: HostEvict) -> HostEvictReply: ...

    async def publish(self, event: TransitionEvent) -> None:
        """Hand one transition to the broker (raises PublishFailed). Not durability: see the outbox."""

    async def publish_batch(self, batch: TransitionBatch) -> None:
        """Hand several transitions of one epoch to the broker as one message, stored whole or not
        at all (raises PublishFailed)."""

    async def listen(self, worker_id: str, on_watermark: OnWatermark, on_inventory: OnInventory,
                     on_control: OnControl) -> None:
        """Subscribe to this worker's coordinator-to-worker subjects (idempotent)."""


__all__ = ["CoordinatorClient", "CoordinatorRefused", "CoordinatorUnavailable", "OnControl", "OnInventory",
           "OnWatermark", "PublishFailed"]
