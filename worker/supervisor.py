"""The worker's background duties towards the coordinator and its lower tiers.

:class:`Supervisor` is what the engine builds, starts and stops; it composes four parts, each in
its own module:

* **contact** (``worker.membership``) — per shard, register (an epoch), heartbeat, resume; keep
  the worker *degraded* (recomputing, its cache kept) while the coordinator is away; a fenced
  epoch or an outage past the resume grace period registers a new one and drops that shard's copies;
* **spill** (``worker.spill``) — write the blocks queued for the disk tier in batches (one fsync
  each), ask the coordinator to evict host-tier victims once their disk copies are in the ledger;
* **disk GC** (``worker.disk_gc``) — keep this worker's offload segments within
  ``cache.offload_dir_bytes`` after each spill, and delete those past ``cache.offload_max_age_s``
  (``DiskRetention``, its own task), each once the ledger has evicted what it holds;
* **answers** (``worker.answers``) — what the coordinator asks of the worker: its inventory and
  control decisions (:meth:`on_inventory`, :meth:`on_control`).

Transitions these cause go through the replica writer (``worker.cache.replicas``); none touches
a request. With a sharded ledger (``worker.shard_links``) the contact task runs once per shard,
each with its own epoch, outbox and standing: a takeover on one shard suspends and resumes that
shard's epoch only, a fence there drops only that shard's blocks, and what the worker tells or asks
a shard (its inventory, an eviction, a disk GC) is of that shard's chains.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from shared.config import Config
from shared.forms import FormCatalogue
from shared.messages import Control, ControlAck, InventoryReply, InventoryRequest
from worker.answers import Answers
from worker.cache.replicas import ReplicaWriter
from worker.cache.store import CacheStore
from worker.cache.tiers import Tiers
from worker.client import CoordinatorClient
from worker.contact import Contact
from worker.disk_gc import DiskRetention, SegmentGc
from worker.membership import Membership
from worker.metrics import WorkerMetrics
from worker.publisher import TransitionPublisher
from worker.shard_links import ShardLink, ShardLinks
from worker.spill import SPILL_BATCH, SpillWriter


class Supervisor:
    """Registration, heartbeats, resume, spill, disk GC, inventory and control (see the module's docstring)."""

    def __init__(self, *, cfg: Config, contact: Contact, replicas: ReplicaWriter,
                 client: CoordinatorClient | None, publisher: TransitionPublisher | None,
                 store: CacheStore | None, tiers: Tiers, metrics: WorkerMetrics, log, worker_id: str,
                 namespace: str, catalogue: FormCatalogue, slots: dict[str, int], spec_digests: dict[str, str],
                 device: str, dtype: str, cache_dtype: str, io: Callable[[Callable[[], Any]], Any],
                 active_sessions: Callable[[], int], links: ShardLinks | None = None) -> None:
        self.cfg = cfg
        self.client = client
        self.tiers = tiers
        self.metrics = metrics
        self.log = log
        #: Every shard's link (one: this coordinator's client, outbox and contact).
        self.links = links if links is not None else (
            ShardLinks([ShardLink(0, client, publisher, contact)], namespace) if client is not None
            and publisher is not None else None)
        self.answers = Answers(contact=contact, publisher=publisher, links=self.links, replicas=replicas, store=store,
                               tiers=tiers, log=log, worker_id=worker_id, namespace=namespace,
                               spec_digests=spec_digests, io=io, active_sessions=active_sessions)
        self.membership = Membership(links=self.links, replicas=replicas, store=store, tiers=tiers,
                                     answers=self.answers, metrics=metrics, log=log, worker_id=worker_id,
                                     namespace=namespace, catalogue=catalogue, slots=slots, device=device,
                                     dtype=dtype, cache_dtype=cache_dtype, state_dir=cfg.state_dir)
        self.disk = SegmentGc(tiers=tiers, links=self.links, io=io, metrics=metrics, log=log, worker_id=worker_id)
        self.retention = DiskRetention(self.disk, cfg.cache.offload_max_age_s, cfg.cache.offload_age_check_s, log)
        self.spill = SpillWriter(replicas=replicas, tiers=tiers, links=self.links, disk=self.disk, metrics=metrics,
                                 log=log, io=io, host_location=f"host:{worker_id}",
                                 bound=cfg.cache.offload_dir_bytes,
                                 request_timeout_s=cfg.nats.request_timeout_ms / 1000)
        self.registered_once = self.membership.registered_once
        self.tasks: list[asyncio.Task] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        assert self.links is not None
        self.tasks = [loop.create_task(self.membership.run(link), name=f"kvl-supervisor-s{link.shard}"
                                       if link.shard else "kvl-supervisor") for link in self.links]
        self.tasks.append(loop.create_task(self.spill.run(), name="kvl-spill"))
        if self.tiers.disk_root is not None:
            self.metrics.disk_bound.set(self.cfg.cache.offload_dir_bytes)
        if self.retention.wanted:
            self.tasks.append(loop.create_task(self.retention.run(), name="disk-retention"))
        if self.links.sharded:
            self.tasks.append(loop.create_task(self.links.follow(self.client, self.cfg, self.log), name="kvl-shard-map"))

    def take_tasks(self) -> list[asyncio.Task]:
        """The running tasks, for the engine to cancel at stop (the supervisor no longer runs)."""
        tasks, self.tasks = self.tasks, []
        return tasks

    def fused_mismatch(self, reason: str) -> None:
        """A fused forward differed from a request alone: the cache goes with the epoch, and the
        next registrations disown what this worker computed (:meth:`Membership.fused_mismatch`)."""
        self.membership.fused_mismatch(reason)

    # What the membership sends the coordinator: where gateways reach us, and our load.
    endpoint = property(lambda self: self.membership.endpoint,
                        lambda self, v: setattr(self.membership, "endpoint", v))
    load_probe = property(lambda self: self.membership.load_probe,
                          lambda self, v: setattr(self.membership, "load_probe", v))

    async def on_inventory(self, req: InventoryRequest, shard: int = 0) -> InventoryReply:
        return await self.answers.on_inventory(req, shard)

    async def on_control(self, msg: Control, shard: int = 0) -> ControlAck:
        return await self.answers.on_control(msg, shard)


__all__ = ["SPILL_BATCH", "Supervisor"]
