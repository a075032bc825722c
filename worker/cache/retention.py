"""The disk tier's bound and age: how much of the offload directory a worker may keep, and for how long.

* **Bound** (:func:`offload_bound`): ``cache.offload_dir_bytes`` when set; 0 (the default) means
  ``cache.offload_dir_share`` of the file system's free space at the worker's start plus what its
  segments there already take — a directory on a shared disk no longer grows until the disk is
  full. The engine's garbage collector keeps the worker's segments within it.
* **Age** (:class:`DiskRetention`): every ``cache.offload_age_check_s``, this worker's closed
  segments last written more than ``cache.offload_max_age_s`` ago are deleted, each only once
  the ledger has evicted every replica it holds (``DiskGc``, all or none, as the bound's GC
  asks): a segment holding a replica a live lease pins waits for the next look.

Deleting is the engine's I/O thread's work (one file operation at a time), so this and the
bound's GC never delete under each other; a segment one of them deleted is skipped by the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from shared.config import Config
from shared.messages import MAX_DISK_GC_BLOCKS, DiskBlock, DiskGc
from worker.cache import offload_key as of
from worker.cache.segment_writer import SegmentWriter
from worker.client import CoordinatorRefused, CoordinatorUnavailable
from worker.settings import size


def free_bytes(root: Path, statvfs: Callable[[str], Any] = os.statvfs) -> int:
    """Bytes an unprivileged writer may still use on ``root``'s file system (its nearest existing
    ancestor, when the directory is not made yet)."""
    p = root.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    st = statvfs(str(p))
    return int(st.f_bavail * st.f_frsize)


def offload_bound(cfg: Config, writer: str, statvfs: Callable[[str], Any] = os.statvfs) -> tuple[int, str]:
    """``(bytes, how)``: the most this worker's segments may take (0 without a disk tier)."""
    c = cfg.cache
    if not c.offload_dir:
        return 0, "no disk tier (cache.offload_dir empty)"
    if c.offload_dir_bytes:
        return c.offload_dir_bytes, f"cache.offload_dir_bytes {c.offload_dir_bytes:,}"
    root = Path(c.offload_dir)
    own = sum(n for _, n in SegmentWriter(root, writer, c.offload_segment_bytes).segments()) if writer else 0
    free = free_bytes(root, statvfs)
    bound = int((free + own) * c.offload_dir_share)
    return bound, (f"cache.offload_dir_share {c.offload_dir_share:g} × ({size(free)} free on {root}'s file system"
                   f" + {size(own)} of this worker's segments)")


def room_for(cfg: Config, writer: str, statvfs: Callable[[str], Any] = os.statvfs) -> int:
    """Bytes this worker's segments could take in ``cache.offload_dir``: the file system's free
    space plus what its segments there take already."""
    root = Path(cfg.cache.offload_dir)
    own = sum(n for _, n in SegmentWriter(root, writer, cfg.cache.offload_segment_bytes).segments()) if writer else 0
    return free_bytes(root, statvfs) + own


def with_offload_bound(cfg: Config, writer: str, statvfs: Callable[[str], Any] = os.statvfs) -> tuple[Config, str]:
    """``cfg`` with ``cache.offload_dir_bytes`` resolved to the bound (unchanged without a disk
    tier or with an explicit bound), and how it was reached."""
    bound, how = offload_bound(cfg, writer, statvfs)
    if not cfg.cache.offload_dir or cfg.cache.offload_dir_bytes:
        return cfg, how
    # NOTE: at least one byte: 0 would read as "unbounded" to the engine's GC
    cache = msgspec.structs.replace(cfg.cache, offload_dir_bytes=max(1, bound))
    return msgspec.structs.replace(cfg, cache=cache), how


def resolve_at_start(cfg: Config, writer: str, log: Any) -> Config:
    """The worker's start: ``cfg`` with the disk tier's bound resolved, said in the log
    (``offload_bounded``), with a warning when it holds fewer than two segments (the tier would
    delete what it just wrote). A file system that cannot be read leaves ``cfg`` as it is: the
    start-up self-check reports the tier down then."""
    if not cfg.cache.offload_dir:
        return cfg
    try:
        resolved, how = with_offload_bound(cfg, writer)
    except OSError as e:
        log.warning("offload_bound_unknown", error=e.strerror or str(e), offload_dir=cfg.cache.offload_dir)
        return cfg
    c = resolved.cache
    log.info("offload_bounded", bound_bytes=c.offload_dir_bytes, how=how, max_age_s=c.offload_max_age_s)
    room = None
    if cfg.cache.offload_dir_bytes:   # an explicit bound: does the file system have that much room?
        with contextlib.suppress(OSError):   # unreadable: the self-check reports the tier down
            room = room_for(cfg, writer)
    if room is not None and c.offload_dir_bytes > room:
        # NOTE: a warning, not a refusal: the tier runs until the disk is full, then its writes fail
        # (kvl_worker_offload_failures_total{tier="disk"}) and the blocks are recomputed instead
        log.warning("offload_disk_short", bound_bytes=c.offload_dir_bytes, room_bytes=room,
                    fix=f"cache.offload_dir_bytes {c.offload_dir_bytes:,} is more than {c.offload_dir}'s file system "
                        f"has room for ({size(room)} free + this worker's segments): lower cache.offload_dir_bytes "
                        f"to at most {room:,}, or free space there")
    if c.offload_dir_bytes < 2 * c.offload_segment_bytes:
        log.warning("offload_disk_small", bound_bytes=c.offload_dir_bytes, how=how,
                    fix=f"free space on {c.offload_dir}'s file system, raise cache.offload_dir_share, or set "
                        f"cache.offload_dir_bytes to at least 2 × cache.offload_segment_bytes "
                        f"({2 * c.offload_segment_bytes:,})")
    return resolved


class DiskRetention:
    """Deletes this worker's segments past ``cache.offload_max_age_s`` (see the module docstring)."""

    def __init__(self, engine: Any, max_age_s: float, check_s: float, log: Any) -> None:
        self.engine, self.max_age_s, self.check_s, self.log = engine, max_age_s, check_s, log
        self._task: asyncio.Task[None] | None = None

    async def collect_once(self, now: float | None = None) -> int:
        """One look: delete what is past its age and evicted in the ledger; how many segments."""
        e = self.engine
        if not self.max_age_s or e.client is None or e.tiers.disk_root is None or not e.tiers.disk_available():
            return 0
        try:
            expired = await e.io(lambda: e.tiers.disk_expired(self.max_age_s, now))
        except of.OffloadUnavailable as err:
            e.tiers.mark_disk_down(str(err))
            return 0
        deleted = 0
        for path, size_, metas in expired:
            blocks = list(dict.fromkeys(DiskBlock(block_hash=m.block_hash, form=m.form) for m in metas))
            try:
                pinned = False
                for i in range(0, len(blocks), MAX_DISK_GC_BLOCKS):
                    reply = await e.call("disk_gc", e.client.disk_gc(DiskGc(
                        worker_id=e.worker_id, epoch=max(1, e.epoch), blocks=blocks[i:i + MAX_DISK_GC_BLOCKS])))
                    if reply.pinned:
                        pinned = True
                        break
            except (CoordinatorRefused, CoordinatorUnavailable) as err:
                e.metrics.disk_gc.labels(outcome="no_coordinator").inc()
                self.log.warning("disk age cleanup deferred: the coordinator did not decide", error=type(err).__name__)
                return deleted
            if pinned:
                e.metrics.disk_gc.labels(outcome="pinned").inc()
                continue
            try:
                await e.io(lambda p=path: e.tiers.disk_delete(p))
            except of.OffloadUnavailable as err:
                e.tiers.mark_disk_down(str(err))
                return deleted
            deleted += 1
            e.metrics.disk_gc.labels(outcome="expired").inc()
            e.metrics.disk_gc_bytes.inc(size_)
        if deleted:
            e.metrics.disk_bytes.set(await e.io(e.tiers.disk_usage))
            self.log.info("disk_segments_expired", segments=deleted, max_age_s=self.max_age_s)
        return deleted

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.check_s)
            try:
                await self.collect_once()
            except Exception as err:  # noqa: BLE001 - one failed look must not end the cleanup for good
                self.log.error("disk_age_cleanup_failed", error=type(err).__name__)

    def start(self) -> None:
        if self.engine.tiers.disk_root is not None:
            self.engine.metrics.disk_bound.set(self.engine.cfg.cache.offload_dir_bytes)
        if self.max_age_s and self.engine.tiers.disk_root is not None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="disk-retention")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


def retention_ctx(engine: Any, cfg: Config, log: Any) -> Any:
    """An aiohttp ``cleanup_ctx`` running :class:`DiskRetention` while the worker's app runs."""
    async def ctx(_app: Any) -> Any:
        r = DiskRetention(engine, cfg.cache.offload_max_age_s, cfg.cache.offload_age_check_s, log)
        r.start()
        try:
            yield
        finally:
            await r.stop()
    return ctx
