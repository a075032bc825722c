"""The state's derived indexes (pools, tenant counts, LRU and deadline heaps), shared by the fold and the snapshot loader."""

from __future__ import annotations

import contextlib
import heapq
from collections.abc import Iterator
from typing import Final

from coordinator.core.lifecycle import READY
from coordinator.core.records import Lease, LedgerState, PoolKey, Replica, ReplicaKey

#: An LRU heap's bound (see :func:`lru_push`) is checked every this many pushes.
LRU_CHECK_EVERY: Final = 64


def _enter_live(s: LedgerState, r: Replica, key: ReplicaKey) -> None:
    pool = r.pool
    if pool is not None:
        p = s.pools.get(pool)
        if p is None:
            p = s.pools[pool] = {}
        p[key] = None
        tu = s.tenant_used
        tu[r.tenant] = tu.get(r.tenant, 0) + 1
    else:
        w = s.workers.get(r.owner)
        if w is not None and w.epoch == r.owner_epoch and w.alive:
            w.offloaded[key] = None


def _leave_live(s: LedgerState, r: Replica, key: ReplicaKey) -> None:
    if r.pool is not None:
        del s.pools[r.pool][key]
        n = s.tenant_used[r.tenant] - 1
        if n:
            s.tenant_used[r.tenant] = n
        else:
            del s.tenant_used[r.tenant]
    else:
        w = s.workers.get(r.owner)
        if w is not None and w.epoch == r.owner_epoch:
            w.offloaded.pop(key, None)


def lru_push(s: LedgerState, r: Replica, key: ReplicaKey) -> None:
    """``r`` (READY, unpinned, in a GPU pool) is evictable from now on, as used at ``r.last_used_ms``.

    NOTE: an index, not a scan: a write grant on a full pool needs its least recently used
    victims, and scanning the pool cost O(pool) per grant (50 ms at 100k slots). Stale entries
    are dropped when popped, and the heap is rebuilt from the pool once it holds more than
    twice the pool's slots (plus 64, checked every ``LRU_CHECK_EVERY`` pushes).
    """
    if s.indexes_deferred:
        return
    pool = r.pool
    heap = s.lru.get(pool)  # type: ignore[arg-type]
    if heap is None:
        heap = s.lru[pool] = []  # type: ignore[index]
    heapq.heappush(heap, (r.last_used_ms, r.block_hash, key))
    # NOTE: the bound is checked every LRU_CHECK_EVERY pushes, not on each: looking up the
    # pool's size was a third of a push (one per commit the ledger folds).
    if not len(heap) % LRU_CHECK_EVERY:
        w = s.workers.get(pool[0])  # type: ignore[index]
        if len(heap) > 2 * (w.pool_slots.get(pool[1], 0) if w is not None else 0) + 64:  # type: ignore[index]
            s.lru[pool] = lru_rebuild(s, pool)  # type: ignore[arg-type]


def lru_rebuild(s: LedgerState, pool: PoolKey) -> list[tuple[int, str, ReplicaKey]]:
    """The LRU heap of ``pool`` from its members (no stale entries)."""
    replicas = s.replicas
    heap = [(r.last_used_ms, r.block_hash, k) for k in s.pools.get(pool, ())
            if (r := replicas[k]).state is READY and not r.pins]
    heapq.heapify(heap)
    return heap


def due_push(s: LedgerState, lease: Lease) -> None:
    """``lease`` may expire at its ``expires_at_ms``: index it for :func:`.commands.expire`.

    NOTE: the expiry check runs every heartbeat interval; scanning every live lease took tens of
    milliseconds with 20k of them, a pause in the middle of serving. The heap is rebuilt once it
    holds more than twice the live leases.
    """
    if s.indexes_deferred:
        return
    due = s.lease_due
    heapq.heappush(due, (lease.expires_at_ms, lease.lease_id, lease.expires_at_ms))
    if len(due) > 2 * len(s.leases) + 64:
        s.lease_due = due_rebuild(s)


def due_rebuild(s: LedgerState) -> list[tuple[int, str, int]]:
    due = [(lease.expires_at_ms, lid, lease.expires_at_ms) for lid, lease in s.leases.items()]
    heapq.heapify(due)
    return due


def rebuild_indexes(s: LedgerState) -> None:
    """Every pool's LRU heap and the leases' deadline heap, from the state alone."""
    s.lru = {pool: lru_rebuild(s, pool) for pool in s.pools}
    s.lease_due = due_rebuild(s)


@contextlib.contextmanager
def indexes_deferred(s: LedgerState) -> Iterator[LedgerState]:
    """Fold a whole log onto ``s`` without keeping its LRU and deadline heaps; both are rebuilt
    from the state at the end (also when the fold fails).

    NOTE: folding never reads them (a grant's victims are in its event), so a replay that
    pushed an entry per commit and per unpin (~0.4 µs each, then the periodic rebuilds of a
    heap full of stale entries) paid for an index that only the next decision uses. A rebuilt
    heap holds exactly the entries that a kept one would not skip as stale, so the victims
    chosen afterwards are the same. A standby following the log folds short tails onto its live
    state and keeps the heaps as it goes (a rebuild is O(pool) per step).
    """
    was = s.indexes_deferred
    s.indexes_deferred = True
    try:
        yield s
    finally:
        s.indexes_deferred = was
        if not was:
            rebuild_indexes(s)
