"""The disk tier's bound and age: how much of the offload directory a worker may keep, and for how long.

* **Bound** (:func:`offload_bound`): ``cache.offload_dir_bytes`` when set; 0 (the default) means
  ``cache.offload_dir_share`` of the file system's free space at the worker's start plus what its
  segments there already take — a directory on a shared disk no longer grows until the disk is
  full.
* **Age** (``cache.offload_max_age_s``): how long a closed segment is kept.

Both are enforced by the supervisor's disk GC (``worker.disk_gc``: ``SegmentGc`` after each
spill, ``DiskRetention`` every ``cache.offload_age_check_s``), which deletes a segment only once
the ledger has evicted every replica it holds.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from shared.config import Config
from worker.cache.segment_writer import SegmentWriter
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
