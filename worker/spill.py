"""The disk writer: blocks queued for the disk tier written in batches, host-tier victims evicted.

:class:`SpillWriter` waits for the replica writer's ``spill_due``, writes the queue in batches (one
fsync each), marks each written block's disk replica READY, asks the coordinator to evict the
host-tier victims once their disk copies are in the ledger, and then keeps this worker's segments
within their bound (:meth:`worker.disk_gc.SegmentGc.to_bound`). A task of the
:class:`worker.supervisor.Supervisor`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import torch

from shared.messages import MAX_HOST_EVICT_BLOCKS, DiskBlock, ReplicaState
from worker.cache import offload_key as of
from worker.cache.planner import BlockMeta
from worker.cache.replicas import ReplicaWriter
from worker.cache.tiers import Tiers
from worker.client import CoordinatorRefused, CoordinatorUnavailable
from worker.disk_gc import SegmentGc
from worker.metrics import WorkerMetrics
from worker.shard_links import ShardLinks

R = ReplicaState
#: Blocks written to the disk tier per batch (one fsync each).
SPILL_BATCH = 256


class SpillWriter:
    """Writes the spill queue to disk and settles host-tier victims (see the module's docstring).

    ``links`` is None without a coordinator: host-tier victims are then reported evicted after
    the fact, and the segments' bound waits."""

    def __init__(self, *, replicas: ReplicaWriter, tiers: Tiers, links: ShardLinks | None, disk: SegmentGc,
                 metrics: WorkerMetrics, log: Any, io: Callable[[Callable[[], Any]], Any], host_location: str,
                 bound: int, request_timeout_s: float) -> None:
        self.replicas = replicas
        self.tiers = tiers
        self.links = links
        self.disk = disk
        self.metrics = metrics
        self.log = log
        self.io = io
        self.host_location = host_location
        #: ``cache.offload_dir_bytes``: the most this worker's segments may take (0: unbounded).
        self.bound = bound
        self.request_timeout_s = request_timeout_s

    async def run(self) -> None:
        due = self.replicas.spill_due
        while True:
            await due.wait()
            due.clear()
            try:
                await self.spill_once()
            except Exception as e:  # noqa: BLE001 - the task must survive a bad block
                self.log.error("spill failed", error=repr(e))

    async def spill_once(self) -> None:
        """Write the spill queue to the disk tier in batches (one fsync each), then keep this
        worker's segments within ``cache.offload_dir_bytes``. A block that fails on its own (an
        unsafe key: anything but the tier being unavailable) is logged without content, counted
        in ``offload_failures{reason="error"}`` and dropped from the queue; the others go on."""
        queue = self.tiers.take_spills()
        for i in range(0, len(queue), SPILL_BATCH):
            await self._spill_batch(queue[i:i + SPILL_BATCH])
        if queue:
            await self.disk.to_bound(self.bound)

    async def _spill_batch(self, batch: list[tuple[BlockMeta, torch.Tensor, bool]]) -> None:
        good: list[tuple[BlockMeta, torch.Tensor, bool]] = []
        victims: list[BlockMeta] = []   # host-tier victims: their eviction is the coordinator's to decide
        for meta, data, from_host in batch:
            if not self.tiers.needs_disk(meta):
                victims.append(meta)   # written by an earlier pass; still waiting for its eviction
                continue
            try:
                of.BlockKey(meta.namespace, meta.tenant, meta.block_hash, meta.form, meta.spec_digest)
                good.append((meta, data, from_host))
            except ValueError as e:
                self.metrics.offload_failures.labels(tier="disk", reason="error").inc()
                self.log.error("spill_item_failed", block=meta.block_hash[:12], form=meta.form, error=type(e).__name__)
                self._spill_done(meta, from_host, written=False)
                if from_host:
                    victims.append(meta)
        digests: list[str] = []
        if good and self.tiers.disk_available():
            t0 = time.perf_counter()
            try:
                digests = await self.io(lambda: self.tiers.disk_write_many([(m, d) for m, d, _ in good]))
            except of.OffloadUnavailable as e:
                self.tiers.mark_disk_down(str(e))
                self.metrics.offload_failures.labels(tier="disk", reason="unavailable").inc()
                self.metrics.tier_unavailable.labels(tier="disk").inc()
                self.log.warning("disk tier unavailable; serving without it", error=str(e),
                                 retry_s=self.tiers.retry_s)
            else:
                self.metrics.offload_seconds.labels(tier="disk").observe(time.perf_counter() - t0)
                self.metrics.offloaded_bytes.labels(tier="disk").inc(sum(d.numel() for _, d, _ in good))
        elif good and self.tiers.disk_root is not None:
            self.metrics.tier_unavailable.labels(tier="disk").inc()
        for j, (meta, _, from_host) in enumerate(good):
            written = j < len(digests) and digests[j] == meta.checksum
            if j < len(digests) and not written:
                self.metrics.offload_failures.labels(tier="disk", reason="checksum").inc()
            try:
                self._spill_done(meta, from_host, written=written)
            except Exception as e:  # noqa: BLE001 - one bad block must not stop the writer for good
                self.metrics.offload_failures.labels(tier="disk", reason="error").inc()
                self.log.error("spill_item_failed", block=meta.block_hash[:12], form=meta.form,
                               error=type(e).__name__)
            if from_host:
                victims.append(meta)
        if victims:
            await self._evict_host(victims)

    def _spill_done(self, meta: BlockMeta, from_host: bool, *, written: bool) -> None:
        """One queued block's disk copy handled: its disk replica is READY if written. A
        host-tier victim stays queued (and readable) until :meth:`_evict_host` settles it."""
        if not self.tiers.is_spilling(meta):
            return  # put back into the host tier meanwhile: it stays there
        if written:
            self.replicas.emit(meta, "disk", None, R.READY, 0, kind="offload")
        if from_host:
            self.tiers.disk_done(meta)
        else:
            self.tiers.spilled(meta)

    async def _evict_host(self, victims: list[BlockMeta]) -> None:
        """Drop host-tier LRU victims' bytes once the coordinator has evicted their replicas
        (``HostEvict``); a victim a live lease pins stays a host replica.

        NOTE: the coordinator decides, in the ledger's order, as it does a grant's GPU victims.
        Dropping first and reporting the eviction after the fact left a window (the transition's
        way to the ledger) in which a grant could pin bytes that were already gone; the ledger
        then refused the eviction and listed a READY replica that existed nowhere. Without an
        answer (coordinator unreachable, epoch suspended) the victims stay queued and readable,
        and are asked about again after ``retry_s``."""
        todo = [m for m in victims if self.tiers.is_spilling(m) and not self.tiers.keep_pinned(m)]
        if todo and self.links is None:
            # no ledger to ask (an engine without a coordinator): report after the fact
            for meta in todo:
                self.tiers.spilled(meta)
                self.replicas.emit(meta, self.host_location, R.READY, R.EVICTED, 0, kind="evict", reason="host lru")
            todo = []
        by_key = {(m.block_hash, m.form): m for m in todo}
        blocks = [DiskBlock(block_hash=h, form=f) for h, f in by_key]
        # NOTE: the victims' disk copies must be in the ledger first: an offload is accepted only
        # while a copy it can come from is known (here, the host replica), and until the disk
        # replica is READY the host one is what a reader has.
        if blocks and not await self.links.outboxes_empty(self.request_timeout_s):
            self._defer_host_evictions(len(blocks), "the victims' offloads are not committed yet")
            blocks = []
        for i in range(0, len(blocks), MAX_HOST_EVICT_BLOCKS):
            chunk = blocks[i:i + MAX_HOST_EVICT_BLOCKS]
            try:
                pinned = await self.replicas.ask_evict(chunk)
            except (CoordinatorRefused, CoordinatorUnavailable) as e:
                self._defer_host_evictions(len(blocks) - i, type(e).__name__)
                break
            for b in chunk:
                meta = by_key[(b.block_hash, b.form)]
                if (b.block_hash, b.form) in pinned:
                    # still queued and readable, asked about again once the lease may have ended
                    # (not put back into the host tier: that would push out another entry)
                    self.metrics.host_evictions.labels(outcome="pinned").inc()
                elif self.tiers.is_spilling(meta):   # (else: dropped meanwhile, an invalidation)
                    self.tiers.spilled(meta)   # evicted in the log (or not a live replica): the bytes go
                    self.metrics.host_evictions.labels(outcome="evicted").inc()
            if pinned:
                self._spill_again_later()

    def _defer_host_evictions(self, n: int, why: str) -> None:
        """Host-tier victims stay (queued, readable) without a decision; ask again after ``retry_s``."""
        self.metrics.host_evictions.labels(outcome="deferred").inc(n)
        self.log.warning("host-tier evictions deferred: the coordinator did not decide", victims=n, error=why,
                         retry_s=self.tiers.retry_s)
        self._spill_again_later()

    def _spill_again_later(self) -> None:
        asyncio.get_running_loop().call_later(self.tiers.retry_s, self.replicas.spill_due.set)


__all__ = ["SPILL_BATCH", "SpillWriter"]
