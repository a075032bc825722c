"""The worker's offload segments kept within their bound and their age (the disk tier's GC).

* :meth:`SegmentGc.to_bound` — after each spill, delete this worker's oldest segments while they
  exceed ``cache.offload_dir_bytes`` (the bound ``worker.cache.retention`` resolves at start);
* :class:`DiskRetention` — every ``cache.offload_age_check_s``, delete its closed segments last
  written more than ``cache.offload_max_age_s`` ago (:meth:`SegmentGc.expired`).

Either deletes a segment only once the ledger has evicted every replica it holds (``DiskGc``,
asked of the shard deciding each block, all or none): a segment holding a replica a live lease
pins is kept for now, and without the coordinator nothing is deleted (no READY replica loses its
bytes). Deleting is the I/O thread's work (one file operation at a time), so the two never delete
under each other; a segment one of them deleted is skipped by the other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from shared.messages import DiskBlock
from worker.cache import offload_key as of
from worker.cache.planner import BlockMeta
from worker.cache.tiers import Tiers
from worker.client import CoordinatorRefused, CoordinatorUnavailable
from worker.metrics import WorkerMetrics
from worker.shard_links import ShardLinks


class SegmentGc:
    """Deletes this worker's segments the ledger no longer needs (see the module's docstring).

    ``links`` is None without a coordinator: then nothing is ever deleted."""

    def __init__(self, *, tiers: Tiers, links: ShardLinks | None, io: Callable[[Callable[[], Any]], Any],
                 metrics: WorkerMetrics, log: Any, worker_id: str) -> None:
        self.tiers = tiers
        self.links = links
        self.io = io
        self.metrics = metrics
        self.log = log
        self.worker_id = worker_id

    async def _pinned(self, metas: list[BlockMeta]) -> bool:
        """Whether a live lease pins one of a segment's replicas (raises as ``Contact.call`` does)."""
        assert self.links is not None
        blocks = list(dict.fromkeys(DiskBlock(block_hash=m.block_hash, form=m.form) for m in metas))
        return await self.links.disk_pinned(self.worker_id, blocks)

    async def _delete(self, path: Any, metas: list[BlockMeta], deferred: str) -> bool | None:
        """Delete one segment unless a live lease pins a replica in it: True deleted, False kept
        (pinned), None when this pass must stop (the coordinator did not decide, logged as
        ``deferred``; or the disk went down)."""
        try:
            pinned = await self._pinned(metas)
        except (CoordinatorRefused, CoordinatorUnavailable) as e:
            self.metrics.disk_gc.labels(outcome="no_coordinator").inc()
            self.log.warning(deferred, error=type(e).__name__)
            return None
        if pinned:
            self.metrics.disk_gc.labels(outcome="pinned").inc()
            return False
        try:
            await self.io(lambda: self.tiers.disk_delete(path))
        except of.OffloadUnavailable as e:
            self.tiers.mark_disk_down(str(e))
            return None
        return True

    async def to_bound(self, bound: int) -> None:
        """Delete the oldest segments while this worker's exceed ``bound`` bytes (0: unbounded)."""
        if not bound or self.links is None or not self.tiers.disk_available():
            return
        try:
            usage = await self.io(self.tiers.disk_usage)
            if usage <= bound:
                return
            candidates = await self.io(self.tiers.disk_collectable)
        except of.OffloadUnavailable as e:
            self.tiers.mark_disk_down(str(e))
            return
        for path, size, metas in candidates:
            if usage <= bound:
                break
            done = await self._delete(path, metas, "disk gc deferred: the coordinator did not decide")
            if done is None:
                return
            if not done:
                continue
            usage -= size
            self.metrics.disk_gc.labels(outcome="deleted").inc()
            self.metrics.disk_gc_bytes.inc(size)
        self.metrics.disk_bytes.set(usage)

    async def expired(self, max_age_s: float, now: float | None = None) -> int:
        """Delete the closed segments older than ``max_age_s`` (0: no age limit); how many went."""
        if not max_age_s or self.links is None or self.tiers.disk_root is None or not self.tiers.disk_available():
            return 0
        try:
            old = await self.io(lambda: self.tiers.disk_expired(max_age_s, now))
        except of.OffloadUnavailable as e:
            self.tiers.mark_disk_down(str(e))
            return 0
        deleted = 0
        for path, size, metas in old:
            done = await self._delete(path, metas, "disk age cleanup deferred: the coordinator did not decide")
            if done is None:
                return deleted
            if not done:
                continue
            deleted += 1
            self.metrics.disk_gc.labels(outcome="expired").inc()
            self.metrics.disk_gc_bytes.inc(size)
        if deleted:
            self.metrics.disk_bytes.set(await self.io(self.tiers.disk_usage))
            self.log.info("disk_segments_expired", segments=deleted, max_age_s=max_age_s)
        return deleted


class DiskRetention:
    """Every ``check_s``, deletes the segments past ``max_age_s`` (:meth:`SegmentGc.expired`)."""

    def __init__(self, gc: SegmentGc, max_age_s: float, check_s: float, log: Any) -> None:
        self.gc, self.max_age_s, self.check_s, self.log = gc, max_age_s, check_s, log

    @property
    def wanted(self) -> bool:
        """Whether there is anything to look after: an age limit and a disk tier."""
        return bool(self.max_age_s) and self.gc.tiers.disk_root is not None

    async def collect_once(self, now: float | None = None) -> int:
        """One look: delete what is past its age and evicted in the ledger; how many segments."""
        return await self.gc.expired(self.max_age_s, now)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.check_s)
            try:
                await self.collect_once()
            except Exception as err:  # noqa: BLE001 - one failed look must not end the cleanup for good
                self.log.error("disk_age_cleanup_failed", error=type(err).__name__)


__all__ = ["DiskRetention", "SegmentGc"]
