"""The ledger state and the fold that builds it: ``state = fold(apply, events)``.

``apply`` mutates in place and does O(1) work per event (O(k) for an event that names k
replicas or leases): replay must fold a million events in seconds. It takes no decisions
and reads no clock — every decision is already in the event (see :mod:`.events`). It does
assert, cheaply, that the log asks for legal moves: a log that does not is corrupt, and
:class:`ReplayError` (or :class:`.lifecycle.IllegalTransition`) says where.

Besides the facts, the state keeps a few *derived* indexes (pool membership, per-tenant
counts, each worker's live replicas and leases, replica keys per block). They are
maintained by ``apply``, rebuilt from the facts by :func:`from_snapshot`, and checked
against a recomputation by :func:`.invariants.check_invariants`.

:func:`state_hash` is canonical: it sorts everything, so two states built in different
orders (live, by replay, from a snapshot) hash equal exactly when they hold the same facts.

Retention: the state is bounded by the cache, not by history. A replica that ends
(EVICTED, INVALID, LOST) stays as a *tombstone* only while it is among the most recent
terminal replicas of its owner worker — at most as many as that worker has pool slots —
then leaves the state (:func:`_bury`). A tombstone is what lets an offload copy an LRU
victim the worker heard of only from the grant that evicted it (the copy must carry the
checksum the victim was committed with), and what shows an operator why a recent replica
is gone; the whole history stays in the log, where the audit verifies it.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from coordinator.core import events as ev
from coordinator.core.lifecycle import (
    ALLOCATED, EVICTED, LIVE, READY, TERMINAL, TRANSITIONS, IllegalTransition, step,
)
from shared.forms import FormCatalogue
from shared.ids import ROOT_HASH
from shared.messages import ReplicaState
from shared.shards import ShardMap

#: ``(block_hash, form, location)``.
ReplicaKey = tuple[str, str, str]
#: ``(worker_id, form)``: one pool of one worker.
PoolKey = tuple[str, str]

SNAPSHOT_VERSION: Final = 3
#: An LRU heap's bound (see :func:`lru_push`) is checked every this many pushes.
LRU_CHECK_EVERY: Final = 64


class ReplayError(RuntimeError):
    """The log asks the fold for something impossible (unknown lease, duplicate source id…)."""


@dataclass(frozen=True, slots=True)
class CoreParams:
    """Limits the core decides with; the shell builds it from the coordinator config."""

    lease_ttl_ms: int = 30_000
    heartbeat_interval_ms: int = 1_000
    #: Heartbeats missed before a worker's epoch is suspended.
    missed_heartbeats: int = 5
    #: How long a suspended epoch waits for its worker to resume before it is fenced.
    resume_grace_ms: int = 60_000
    #: Cap on ALLOCATED+READY GPU replicas per tenant across all workers (0 = unlimited).
    tenant_quota_replicas: int = 0
    #: Longest list of rejected boundaries a grant reports (the rest are summarised).
    max_rejected_reasons: int = 16
    #: The shard this ledger is, and the map it owns its chains by (``shared.shards``); ``None``:
    #: unsharded, every chain its own. A lease on a chain the map gives elsewhere is refused.
    shard: int = 0
    shard_map: ShardMap | None = None

    @property
    def heartbeat_timeout_ms(self) -> int:
        return self.missed_heartbeats * self.heartbeat_interval_ms

    @classmethod
    def from_config(cls, coordinator: Any) -> CoreParams:
        """From a ``shared.config.CoordinatorConfig`` (duck-typed: the core imports no config loader)."""
        return cls(lease_ttl_ms=coordinator.lease_ttl_ms,
                   heartbeat_interval_ms=coordinator.heartbeat_interval_ms,
                   missed_heartbeats=coordinator.missed_heartbeats,
                   resume_grace_ms=coordinator.resume_grace_ms,
                   tenant_quota_replicas=coordinator.tenant_quota_replicas,
                   shard=coordinator.shard,
                   shard_map=(ShardMap.uniform(coordinator.shards, coordinator.shard_partitions)
                              if coordinator.shards > 1 else None))


class Replica(msgspec.Struct, gc=False, eq=False):
    """One form of one block at one location (the current incarnation of that key).

    NOTE: a struct the cyclic garbage collector does not track (``gc=False``: it refers only to
    strings, numbers and tuples, so it can be in no reference cycle). The state holds tens of
    thousands of these; as tracked objects every full collection walked all of them, a pause of
    ~100 ms in the middle of serving leases (the p99 of a lease went from ~90 to ~20 ms).
    """

    block_hash: str
    form: str
    location: str
    state: ReplicaState
    generation: int = 0
    checksum: str = ""
    tenant: str = ""
    namespace: str = ""
    parent_hash: str = ""
    token_start: int = 0
    token_end: int = 0
    #: Live leases pinning it for reading.
    pins: int = 0
    last_used_ms: int = 0
    #: The worker epoch that created this incarnation (lease holder or offloader).
    owner: str = ""
    owner_epoch: int = 0
    #: The lease whose write grant allocated it ("" for offload copies).
    lease_id: str = ""
    #: ``(worker, form)`` for a ``gpu:<worker>`` replica (it takes a pool slot), else None.
    pool: PoolKey | None = None

    @property
    def key(self) -> ReplicaKey:
        return (self.block_hash, self.form, self.location)


class Lease(msgspec.Struct, gc=False, eq=False):
    """A live lease.

    NOTE: untracked by the cyclic garbage collector (``gc=False``), its sequences tuples (which
    the collector untracks once it has seen them): a coordinator holds thousands of live leases,
    and as tracked objects each full collection walked all of them (a 20k-lease run's p99).
    """

    lease_id: str
    worker_id: str
    epoch: int
    tenant: str
    namespace: str
    request_id: str
    block_hashes: tuple[str, ...]
    usable_blocks: int
    #: Replicas pinned for reading (an ordered set).
    pins: dict[ReplicaKey, None]
    #: Block indices the holder may fill, per form.
    write: dict[str, tuple[int, ...]]
    expires_at_ms: int
    granted_at_ms: int

    def write_keys(self, location: str) -> list[ReplicaKey]:
        hs = self.block_hashes
        return [(hs[i], form, location) for form, idx in self.write.items() for i in idx]


@dataclass(slots=True, eq=False)
class WorkerRecord:
    worker_id: str
    epoch: int
    namespace: str
    catalogue: FormCatalogue
    pool_slots: dict[str, int]
    endpoint: str
    node: str
    registered_at_ms: int
    last_heartbeat_ms: int
    #: False once the current epoch is lost (fenced: superseded, or suspended past the grace).
    alive: bool = True
    draining: bool = False
    #: Every epoch ≤ this one is fenced.
    fenced_through: int = 0
    #: When the current (alive) epoch was suspended; 0 = not suspended. A suspended epoch
    #: keeps its replicas but gets no lease until its worker resumes with an inventory.
    suspended_at_ms: int = 0
    # derived:
    #: ALLOCATED/READY host/disk replicas the current epoch created (its GPU ones are in
    #: ``LedgerState.pools``).
    offloaded: dict[ReplicaKey, None] = field(default_factory=dict)
    #: Leases of the current epoch.
    leases: dict[str, None] = field(default_factory=dict)
    #: Its pool slots, all forms together: the tombstones it keeps (see "Retention").
    slots_total: int = field(init=False)
    #: The names of its catalogue's forms.
    form_names: frozenset[str] = field(init=False)
    #: Its GPU's location, ``gpu:<worker_id>``.
    gpu: str = field(init=False)
    #: The host tier it shares with its node (``host:<worker_id>`` until registration carries a
    #: node name).
    host: str = field(init=False)

    def __post_init__(self) -> None:
        self.slots_total = sum(self.pool_slots.values())
        self.form_names = frozenset(self.catalogue.names)
        # NOTE: fields, not properties: a decision read them several times (an f-string each)
        self.gpu = f"gpu:{self.worker_id}"
        self.host = f"host:{self.node or self.worker_id}"

    def is_fenced(self, epoch: int) -> bool:
        return epoch <= self.fenced_through

    @property
    def suspended(self) -> bool:
        return self.suspended_at_ms > 0


@dataclass(slots=True, eq=False)
class Watermark:
    """Seqs of one worker epoch recorded in the log: ``1..contiguous`` plus ``pending``."""

    contiguous: int = 0
    #: Seqs above ``contiguous + 1`` that arrived early (a gap below them is still open).
    pending: set[int] = field(default_factory=set)

    def has(self, seq: int) -> bool:
        return seq <= self.contiguous or seq in self.pending


@dataclass(slots=True, eq=False)
class LedgerState:
    params: CoreParams
    workers: dict[str, WorkerRecord] = field(default_factory=dict)
    replicas: dict[ReplicaKey, Replica] = field(default_factory=dict)
    leases: dict[str, Lease] = field(default_factory=dict)
    #: Commit watermark per (worker, epoch).
    watermarks: dict[tuple[str, int], Watermark] = field(default_factory=dict)
    #: Time of the last coordinator takeover (liveness clocks restart there).
    resumed_at_ms: int = 0
    #: Terminal replicas kept, per owner worker, oldest first (see "Retention" above).
    #: NOTE: an OrderedDict, not a dict: a ring drops its oldest key on every eviction once full,
    #: and ``next(iter(dict))`` walks the holes those deletions leave at the front of a dict's
    #: entries (~24 µs per eviction at 100k slots; ``popitem(last=False)`` is O(1)).
    tombstones: dict[str, OrderedDict[ReplicaKey, None]] = field(default_factory=dict)
    #: Namespaces whose reuse an operator turned off ("" = every namespace) → the reason.
    reuse_off: dict[str, str] = field(default_factory=dict)
    #: Events folded so far (not part of the state hash).
    applied: int = 0
    # derived:
    #: Live (ALLOCATED/READY) GPU replicas per (worker, form): membership and count.
    pools: dict[PoolKey, dict[ReplicaKey, None]] = field(default_factory=dict)
    #: Live GPU replicas per tenant.
    tenant_used: dict[str, int] = field(default_factory=dict)
    #: Per GPU pool, its READY unpinned replicas as a heap of ``(last_used_ms, block_hash, key)``:
    #: the LRU victims of a grant, least recently used first (see :func:`lru_push`). Entries go
    #: stale when a replica is pinned, used again or leaves; they are skipped when popped.
    lru: dict[PoolKey, list[tuple[int, str, ReplicaKey]]] = field(default_factory=dict)
    #: Live leases by when they may expire: a heap of ``(due_ms, lease_id, expires_at_ms)``
    #: (entries of ended or renewed leases are stale: skipped when popped; see :func:`due_push`).
    lease_due: list[tuple[int, str, int]] = field(default_factory=list)
    #: The two indexes above are not kept while a whole log is folded (:func:`indexes_deferred`).
    indexes_deferred: bool = False

    @classmethod
    def empty(cls, params: CoreParams | None = None) -> LedgerState:
        return cls(params=params or CoreParams())

    def reuse_enabled(self, namespace: str) -> bool:
        """Whether leases of ``namespace`` may pin and reserve (no operator switch says off)."""
        return not self.reuse_off or ("" not in self.reuse_off and namespace not in self.reuse_off)

    def pool_used(self, worker_id: str, form: str) -> int:
        p = self.pools.get((worker_id, form))
        return len(p) if p else 0

    def committed_seq(self, worker_id: str, epoch: int) -> int:
        wm = self.watermarks.get((worker_id, epoch))
        return wm.contiguous if wm else 0

    def replica_state(self, key: ReplicaKey) -> ReplicaState | None:
        r = self.replicas.get(key)
        return r.state if r else None

    def live_keys(self, w: WorkerRecord) -> list[ReplicaKey]:
        """ALLOCATED/READY replicas of ``w``'s current epoch: its GPU pools and its offloads."""
        out = [k for f in w.catalogue.names for k in self.pools.get((w.worker_id, f), ())]
        out.extend(w.offloaded)
        return out


def pool_of(location: str, form: str) -> PoolKey | None:
    """The pool a replica at ``location`` occupies (only ``gpu:<worker>`` locations have one)."""
    if location.startswith("gpu:"):
        return (location[4:], form)
    return None


# --- the fold ----------------------------------------------------------------------------

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


def _unpin_everywhere(s: LedgerState, r: Replica, key: ReplicaKey) -> None:
    # NOTE: rare (a pinned replica found invalid or lost); O(live leases).
    for lease in s.leases.values():
        if key in lease.pins:
            del lease.pins[key]
            r.pins -= 1
    assert r.pins == 0, (key, r.pins)


def _move(s: LedgerState, key: ReplicaKey, kind: str) -> Replica:
    """An existing replica's move of ``kind`` with its index bookkeeping."""
    r = s.replicas.get(key)
    if r is None:
        raise IllegalTransition(None, kind, key)
    old = r.state
    new = step(old, kind, key)
    if old in LIVE and new not in LIVE:
        _leave_live(s, r, key)
    if r.pins and new is not READY:
        _unpin_everywhere(s, r, key)
    r.state = new
    if new in TERMINAL:
        _bury(s, r.owner, key)
    return r


def tombstone_capacity(s: LedgerState, owner: str) -> int:
    """How many terminal replicas of ``owner`` the state keeps: its pool slots (0 if unknown)."""
    w = s.workers.get(owner)
    return w.slots_total if w is not None else 0


def _bury(s: LedgerState, owner: str, key: ReplicaKey) -> None:
    """``key`` just ended: keep it as ``owner``'s newest tombstone, dropping the oldest past capacity."""
    ring = s.tombstones.get(owner)
    if ring is None:
        ring = s.tombstones[owner] = OrderedDict()
    ring[key] = None
    _trim(s, owner, ring)


def _trim(s: LedgerState, owner: str, ring: OrderedDict[ReplicaKey, None]) -> None:
    cap = tombstone_capacity(s, owner)
    replicas = s.replicas
    pop = ring.popitem
    while len(ring) > cap:
        del replicas[pop(last=False)[0]]
    if not ring:
        del s.tombstones[owner]


def _unbury(s: LedgerState, owner: str, key: ReplicaKey) -> None:
    """``key``, a tombstone of ``owner``, lives again (a new incarnation)."""
    ring = s.tombstones[owner]
    del ring[key]
    if not ring:
        del s.tombstones[owner]


def _create(s: LedgerState, key: ReplicaKey, kind: str, owner: str, epoch: int) -> Replica:
    """A new incarnation of ``key`` (a grant or an offload copy); a tombstone of it is reused."""
    r = s.replicas.get(key)
    old = r.state if r is not None else None
    new = step(old, kind, key)
    if r is None:
        b, f, loc = key
        r = Replica(b, f, loc, new, 0, "", "", "", "", 0, 0, 0, 0, owner, epoch, "",
                    (loc[4:], f) if loc.startswith("gpu:") else None)
        s.replicas[key] = r
    else:
        _unbury(s, r.owner, key)
        r.state = new
        r.owner, r.owner_epoch = owner, epoch
        r.pins = 0
    return r


def _new_seq(s: LedgerState, t: ev.TransitionRecord) -> Watermark | None:
    """The epoch's watermark (None if it has none yet); raises if ``t``'s source id is recorded."""
    wm = s.watermarks.get((t.worker_id, t.epoch))
    if wm is not None and (t.seq <= wm.contiguous or t.seq in wm.pending):
        raise ReplayError(f"transition {t.source_id} is already in the ledger (duplicate source id)")
    return wm


def _record_seq(s: LedgerState, wm: Watermark | None, t: ev.TransitionRecord) -> None:
    # NOTE: called only after the replica move succeeded, so an illegal event changes nothing.
    if wm is None:
        wm = s.watermarks[(t.worker_id, t.epoch)] = Watermark()
    seq = t.seq
    c = wm.contiguous
    if seq == c + 1:
        pending = wm.pending
        if pending:
            while seq + 1 in pending:
                seq += 1
                pending.remove(seq)
        wm.contiguous = seq
    else:
        wm.pending.add(seq)


def _worker(s: LedgerState, worker_id: str, epoch: int) -> WorkerRecord:
    w = s.workers.get(worker_id)
    if w is None or w.epoch != epoch:
        raise ReplayError(f"no worker {worker_id} at epoch {epoch} in the ledger")
    return w


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


def _end_lease(s: LedgerState, lease_id: str, abort: bool) -> None:
    """End a lease: ``abort`` its writes still ALLOCATED under it (a release or an expiry; a
    worker loss makes them LOST instead), drop its pins."""
    lease = s.leases.pop(lease_id, None)
    if lease is None:
        raise ReplayError(f"lease {lease_id} is not live in the ledger")
    replicas = s.replicas
    if abort and lease.write:
        for key in sorted(lease.write_keys(f"gpu:{lease.worker_id}")):  # sorted: the tombstones' order
            r = replicas.get(key)
            if r is not None and r.state is ALLOCATED and r.lease_id == lease_id:
                _move(s, key, "abort")
    for key in lease.pins:
        r = replicas[key]
        r.pins -= 1
        if not r.pins and r.pool is not None:  # pinned replicas are READY: evictable again
            lru_push(s, r, key)
    w = s.workers.get(lease.worker_id)
    if w is not None:
        w.leases.pop(lease_id, None)


def _apply_worker_registered(s: LedgerState, e: ev.WorkerRegistered) -> None:
    old = s.workers.get(e.worker_id)
    if old is not None:
        if e.epoch <= old.epoch:
            raise ReplayError(f"worker {e.worker_id}: epoch {e.epoch} does not follow {old.epoch}")
        if old.alive:
            raise ReplayError(f"worker {e.worker_id}: epoch {old.epoch} re-registered without being fenced")
    s.workers[e.worker_id] = WorkerRecord(
        worker_id=e.worker_id, epoch=e.epoch, namespace=e.namespace, catalogue=e.catalogue,
        pool_slots=dict(e.pool_slots), endpoint=e.endpoint, node=e.node,
        registered_at_ms=e.at_ms, last_heartbeat_ms=e.at_ms, fenced_through=e.epoch - 1)
    ring = s.tombstones.get(e.worker_id)
    if ring is not None:  # the pool slots, hence the tombstones kept, may have changed
        _trim(s, e.worker_id, ring)


def _apply_heartbeat(s: LedgerState, e: ev.WorkerHeartbeat) -> None:
    # NOTE: heartbeats are soft state now; logs written before that still hold them.
    _worker(s, e.worker_id, e.epoch).last_heartbeat_ms = e.at_ms


def _alive_worker(s: LedgerState, worker_id: str, epoch: int) -> WorkerRecord:
    w = _worker(s, worker_id, epoch)
    if not w.alive:
        raise ReplayError(f"worker {worker_id} epoch {epoch} is fenced; it cannot be suspended or resumed")
    return w


def _apply_suspended(s: LedgerState, e: ev.WorkerSuspended) -> None:
    w = _alive_worker(s, e.worker_id, e.epoch)
    if w.suspended:
        raise ReplayError(f"worker {e.worker_id} epoch {e.epoch} suspended twice")
    w.suspended_at_ms = max(e.at_ms, 1)


def _apply_resumed(s: LedgerState, e: ev.WorkerResumed) -> None:
    w = _alive_worker(s, e.worker_id, e.epoch)
    for key in e.invalidated:
        _move(s, tuple(key), "invalidate")  # type: ignore[arg-type]
    w.suspended_at_ms = 0
    w.last_heartbeat_ms = e.at_ms


def _apply_draining(s: LedgerState, e: ev.WorkerDraining) -> None:
    _worker(s, e.worker_id, e.epoch).draining = True


def _apply_worker_lost(s: LedgerState, e: ev.WorkerLost) -> None:
    w = _worker(s, e.worker_id, e.epoch)
    for lid in e.released:
        _end_lease(s, lid, abort=False)
    for key in e.lost:
        _move(s, tuple(key), "lose")  # type: ignore[arg-type]
    # NOTE: disk READY replicas of this epoch survive; they simply stop being tracked as
    # the worker's own (the next epoch does not own them).
    w.offloaded.clear()
    w.alive = False
    w.draining = False
    w.suspended_at_ms = 0
    w.fenced_through = e.epoch
    if w.leases:
        raise ReplayError(f"worker {e.worker_id} lost with leases not released: {sorted(w.leases)}")


def _apply_lease_granted(s: LedgerState, e: ev.LeaseGranted) -> None:
    w = _worker(s, e.worker_id, e.epoch)
    if e.lease_id in s.leases:
        raise ReplayError(f"lease {e.lease_id} granted twice")
    if e.evicted:
        _evict_victims(s, w, e)
    pins: dict[ReplicaKey, None] = {}
    replicas = s.replicas
    at = e.at_ms
    for ref in e.read:
        key = (ref.block_hash, ref.form, ref.location)
        r = replicas.get(key)
        if r is None or r.state is not READY or key in pins:
            raise ReplayError(f"lease {e.lease_id} pins {key}, which is not a READY replica")
        r.pins += 1
        r.last_used_ms = at
        pins[key] = None
    s.leases[e.lease_id] = Lease(
        lease_id=e.lease_id, worker_id=e.worker_id, epoch=e.epoch, tenant=e.tenant, namespace=e.namespace,
        request_id=e.request_id, block_hashes=tuple(e.block_hashes), usable_blocks=e.usable_blocks, pins=pins,
        write={f: tuple(ix) for f, ix in e.write.items()}, expires_at_ms=e.expires_at_ms, granted_at_ms=at)
    w.leases[e.lease_id] = None
    due_push(s, s.leases[e.lease_id])
    if e.allocated:
        _allocate_writes(s, w, e)


# NOTE: the two loops below are a grant's bulk (in steady state every block it writes evicts
# one): _move/_create/_bury inlined for the one case each handles, which is most of a replay.

def _evict_victims(s: LedgerState, w: WorkerRecord, e: ev.LeaseGranted) -> None:
    """The grant's LRU victims: READY, unpinned replicas at the holder's GPU → EVICTED (tombstones)."""
    replicas, pools, tenant_used = s.replicas, s.pools, s.tenant_used
    gpu, cap, wid = w.gpu, w.slots_total, w.worker_id
    ring = s.tombstones.get(wid)
    # NOTE: a grant's victims are of one pool and one tenant as a rule: both looked up once per run
    pool: PoolKey | None = None
    members: dict[ReplicaKey, None] = {}
    tenant, freed = "", 0
    for block_hash, form, _generation in e.evicted:
        key = (block_hash, form, gpu)
        r = replicas.get(key)
        if r is None or r.state is not READY:
            raise IllegalTransition(r.state if r is not None else None, "evict", key)
        if r.pins:
            raise ReplayError(f"lease {e.lease_id} evicts {key}, which is pinned by {r.pins} lease(s)")
        if r.pool != pool:
            pool = r.pool
            members = pools[pool]  # type: ignore[index]
        del members[key]
        if r.tenant != tenant:
            if freed:
                _free(tenant_used, tenant, freed)
            tenant, freed = r.tenant, 0
        freed += 1
        r.state = EVICTED
        owner = r.owner
        if owner == wid:
            if ring is None:
                ring = s.tombstones[wid] = OrderedDict()
            ring[key] = None
            if len(ring) > cap:
                if cap:   # the ring held at most cap (registration trims it): drop the oldest
                    del replicas[ring.popitem(last=False)[0]]
                else:
                    _trim(s, owner, ring)
                    ring = None
        else:
            _bury(s, owner, key)
    if freed:
        _free(tenant_used, tenant, freed)


def _free(tenant_used: dict[str, int], tenant: str, n: int) -> None:
    """``n`` of ``tenant``'s GPU replicas left the pools."""
    left = tenant_used[tenant] - n
    if left:
        tenant_used[tenant] = left
    else:
        del tenant_used[tenant]


def _allocate_writes(s: LedgerState, w: WorkerRecord, e: ev.LeaseGranted) -> None:
    """The grant's write reservations: one ALLOCATED replica per (form, block index) at its GPU."""
    replicas, pools = s.replicas, s.pools
    hashes, wid, epoch, lid, at = e.block_hashes, w.worker_id, e.epoch, e.lease_id, e.at_ms
    tenant, namespace = e.tenant, e.namespace
    gpu, bs = w.gpu, w.catalogue.block_size
    n = 0
    for form, idx in e.write.items():
        pool_key = (wid, form)
        pool = pools.get(pool_key)
        if pool is None:
            pool = pools[pool_key] = {}
        for i in idx:
            block_hash = hashes[i]
            key = (block_hash, form, gpu)
            r = replicas.get(key)
            parent = hashes[i - 1] if i else ROOT_HASH
            if r is None:
                replicas[key] = Replica(block_hash, form, gpu, ALLOCATED, 0, "", tenant, namespace, parent, i * bs,
                                        (i + 1) * bs, 0, at, wid, epoch, lid, pool_key)
            else:
                if r.state in LIVE:
                    raise IllegalTransition(r.state, "grant", key)
                _unbury(s, r.owner, key)  # a tombstone of this key: it lives again
                r.state, r.owner, r.owner_epoch, r.pins = ALLOCATED, wid, epoch, 0
                r.generation, r.checksum, r.tenant, r.namespace = 0, "", tenant, namespace
                r.parent_hash, r.token_start, r.token_end, r.lease_id, r.last_used_ms = (
                    parent, i * bs, (i + 1) * bs, lid, at)
            pool[key] = None
            n += 1
    if n:
        s.tenant_used[tenant] = s.tenant_used.get(tenant, 0) + n


def _allocate(s: LedgerState, key: ReplicaKey, lease_id: str, worker_id: str, epoch: int, tenant: str,
              namespace: str, parent_hash: str, token_start: int, token_end: int, at_ms: int) -> None:
    r = _create(s, key, "grant", worker_id, epoch)
    r.generation = 0
    r.checksum = ""
    r.tenant = tenant
    r.namespace = namespace
    r.parent_hash = parent_hash
    r.token_start = token_start
    r.token_end = token_end
    r.lease_id = lease_id
    r.last_used_ms = at_ms
    _enter_live(s, r, key)


def _apply_lease_renewed(s: LedgerState, e: ev.LeaseRenewed) -> None:
    lease = s.leases.get(e.lease_id)
    if lease is None:
        raise ReplayError(f"lease {e.lease_id} renewed but not live")
    lease.expires_at_ms = e.expires_at_ms
    due_push(s, lease)


def _apply_lease_ended(s: LedgerState, e: ev.LeaseReleased | ev.LeaseExpired) -> None:
    _end_lease(s, e.lease_id, abort=True)


def _apply_replica_allocated(s: LedgerState, e: ev.ReplicaAllocated) -> None:
    if e.lease_id not in s.leases:
        raise ReplayError(f"replica {e.block_hash}/{e.form} allocated for lease {e.lease_id}, which is not live")
    _allocate(s, (e.block_hash, e.form, e.location), e.lease_id, e.worker_id, e.epoch, e.tenant, e.namespace,
              e.parent_hash, e.token_start, e.token_end, e.at_ms)


def _apply_replica_evicted(s: LedgerState, e: ev.ReplicaEvicted) -> None:
    key = (e.block_hash, e.form, e.location)
    r = s.replicas.get(key)
    kind = "abort" if r is not None and r.state is ReplicaState.ALLOCATED else "evict"
    _move(s, key, kind)


def _apply_transition_applied(s: LedgerState, e: ev.TransitionApplied) -> None:
    t = e.transition
    wm = s.watermarks.get((t.worker_id, t.epoch))
    if wm is not None and (t.seq <= wm.contiguous or t.seq in wm.pending):
        raise ReplayError(f"transition {t.source_id} is already in the ledger (duplicate source id)")
    key = (t.block_hash, t.form, t.location)
    kind = e.kind
    if kind == "commit":
        r = s.replicas.get(key)
        if r is None or r.state is not ALLOCATED:
            raise IllegalTransition(r.state if r is not None else None, kind, key)
        r.state = READY
        r.generation = t.generation
        r.checksum = t.checksum
        r.last_used_ms = e.at_ms
        if r.pool is not None and not s.indexes_deferred:  # a commit makes a GPU replica READY, unpinned
            lru_push(s, r, key)
        if wm is not None and t.seq == wm.contiguous + 1 and not wm.pending:   # _record_seq's common case
            wm.contiguous = t.seq
            return
    elif kind == "offload":
        r = _create(s, key, kind, t.worker_id, t.epoch)
        r.generation = t.generation
        r.checksum = t.checksum
        r.tenant = t.tenant
        r.namespace = t.namespace
        r.parent_hash = t.parent_hash
        r.token_start = t.token_start
        r.token_end = t.token_end
        r.lease_id = ""
        r.last_used_ms = e.at_ms
        _enter_live(s, r, key)
    else:
        _move(s, key, kind)
    _record_seq(s, wm, t)


def _apply_transition_rejected(s: LedgerState, e: ev.TransitionRejected) -> None:
    t = e.transition
    _record_seq(s, _new_seq(s, t), t)
    if e.more:   # the other refusals this row stands for (core.rejections)
        wm = s.watermarks[(t.worker_id, t.epoch)]
        for lo, hi in e.more:
            for seq in range(lo, hi + 1):
                if wm.has(seq):
                    raise ReplayError(f"transition {t.worker_id}.{t.epoch}.{seq} is already in the ledger "
                                      "(duplicate source id)")
                if seq == wm.contiguous + 1:
                    while seq + 1 in wm.pending:
                        seq += 1
                        wm.pending.remove(seq)
                    wm.contiguous = seq
                else:
                    wm.pending.add(seq)


def _apply_invalidated(s: LedgerState, e: ev.Invalidated) -> None:
    for key in e.affected:
        _move(s, tuple(key), "invalidate")  # type: ignore[arg-type]
    replicas = s.replicas
    for key in e.retired:
        # NOTE: one still remembered: a loss in the same decision may have pushed it out of its
        # owner's tombstone ring, and then no offload can name it as a source anyway.
        r = replicas.get(tuple(key))  # type: ignore[arg-type]
        if r is not None and r.state is EVICTED:
            _move(s, tuple(key), "invalidate")  # type: ignore[arg-type]


def _apply_cache_switched(s: LedgerState, e: ev.CacheSwitched) -> None:
    if e.enabled:
        s.reuse_off.pop(e.namespace, None)
    else:
        s.reuse_off[e.namespace] = e.reason


def _apply_coordinator_resumed(s: LedgerState, e: ev.CoordinatorResumed) -> None:
    s.resumed_at_ms = e.at_ms


_APPLY: Final[dict[type, Callable[[LedgerState, Any], None]]] = {
    ev.WorkerRegistered: _apply_worker_registered,
    ev.WorkerHeartbeat: _apply_heartbeat,
    ev.WorkerSuspended: _apply_suspended,
    ev.WorkerResumed: _apply_resumed,
    ev.WorkerDraining: _apply_draining,
    ev.WorkerLost: _apply_worker_lost,
    ev.LeaseGranted: _apply_lease_granted,
    ev.LeaseRenewed: _apply_lease_renewed,
    ev.LeaseReleased: _apply_lease_ended,
    ev.LeaseExpired: _apply_lease_ended,
    ev.ReplicaAllocated: _apply_replica_allocated,
    ev.ReplicaEvicted: _apply_replica_evicted,
    ev.TransitionApplied: _apply_transition_applied,
    ev.TransitionRejected: _apply_transition_rejected,
    ev.Invalidated: _apply_invalidated,
    ev.CacheSwitched: _apply_cache_switched,
    ev.CoordinatorResumed: _apply_coordinator_resumed,
}
assert set(_APPLY) == set(ev.EVENT_TYPES.values()), "every ledger event needs a fold"


def apply(state: LedgerState, event: Any) -> None:
    """Fold one event into ``state`` (in place).

    NOTE: an illegal move raises before the replica is touched, but an event that names
    several replicas may have applied part of itself when a later one fails. Either means
    the log is corrupt, and the caller must not keep using this state.
    """
    _APPLY[type(event)](state, event)
    state.applied += 1


def replay(events: Iterable[Any], params: CoreParams | None = None, *,
           start: LedgerState | None = None) -> LedgerState:
    """Fold ``events`` from empty (or onto ``start``, e.g. a state loaded from a snapshot)."""
    s = start if start is not None else LedgerState.empty(params)
    fold = _APPLY
    n = 0
    with no_gc(), indexes_deferred(s):
        try:
            for e in events:
                fold[type(e)](s, e)
                n += 1
        finally:
            s.applied += n
    return s


class FoldFailed(Exception):
    """The event at ``position`` could not be decoded or folded (the cause is chained)."""

    def __init__(self, position: int) -> None:
        super().__init__(f"event at position {position} cannot be folded")
        self.position = position


def fold_rows(state: LedgerState, rows: Iterable[tuple[int, bytes | str]]) -> None:
    """Decode and fold stored ``(position, payload)`` rows onto ``state``, in order.

    :class:`FoldFailed` names the row whose payload is not a ledger event this build reads
    (:class:`.events.EventDecodeError`) or asks for an illegal move (:class:`ReplayError`,
    :class:`IllegalTransition`); rows before it are folded, and the state must be dropped.

    NOTE: a replay's inner loop: :func:`.events.decode_event` and :func:`apply` inlined (a call
    and a counter per event were a tenth of a replay); a failure is re-decoded to explain it.
    """
    decode, fold, version = ev.DECODER.decode, _APPLY, ev.EVENT_SCHEMA_VERSION
    n = 0
    position = 0
    try:
        for position, payload in rows:
            try:
                e = decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError):
                e = ev.decode_event(payload)   # raises EventDecodeError, explained
            if e.v != version:
                ev.decode_event(payload)       # raises EventDecodeError, explained
            fold[type(e)](state, e)
            n += 1
    except (ev.EventDecodeError, ReplayError, IllegalTransition) as err:
        raise FoldFailed(position) from err
    finally:
        state.applied += n


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """The cyclic GC paused for a bulk build.

    NOTE: replay, snapshots and hashing allocate up to millions of long-lived objects, none
    in reference cycles; the collector would rescan them again and again (a 1M-replica
    snapshot took 6.5 s with it, 1.1 s without). The previous setting is restored.
    """
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


# --- canonical hash ------------------------------------------------------------------------

def _canon(s: LedgerState) -> list[Any]:
    workers = [[w.worker_id, w.epoch, w.namespace, w.catalogue.model_id, w.catalogue.block_size,
                [f.spec_digest for f in w.catalogue.forms], sorted(w.pool_slots.items()), w.endpoint, w.node,
                w.registered_at_ms, w.last_heartbeat_ms, w.alive, w.draining, w.fenced_through,
                w.suspended_at_ms]
               for _, w in sorted(s.workers.items())]
    replicas = [[*k, r.state.value, r.generation, r.checksum, r.tenant, r.namespace, r.parent_hash,
                 r.token_start, r.token_end, r.pins, r.last_used_ms, r.owner, r.owner_epoch, r.lease_id]
                for k, r in sorted(s.replicas.items())]
    leases = [[l.lease_id, l.worker_id, l.epoch, l.tenant, l.namespace, l.request_id, l.block_hashes,
               l.usable_blocks, sorted(l.pins), sorted(l.write.items()), l.expires_at_ms, l.granted_at_ms]
              for _, l in sorted(s.leases.items())]
    marks = [[w, e, m.contiguous, sorted(m.pending)] for (w, e), m in sorted(s.watermarks.items())]
    pools = sorted([w, f, len(p)] for (w, f), p in s.pools.items() if p)
    tenants = sorted(s.tenant_used.items())
    # NOTE: in order: which tombstone leaves next is a fact of the state.
    tombstones = [[owner, list(ring)] for owner, ring in sorted(s.tombstones.items())]
    out = [SNAPSHOT_VERSION, workers, replicas, leases, marks, pools, tenants, s.resumed_at_ms, tombstones]
    if s.reuse_off:     # NOTE: only when set, so the digests of states without a switch stay as they were
        out.append(sorted(s.reuse_off.items()))
    return out


def state_hash(state: LedgerState) -> str:
    """32-hex canonical digest of the state's facts (independent of insertion order)."""
    with no_gc():
        return hashlib.blake2b(msgspec.json.encode(_canon(state)), digest_size=16).hexdigest()


# --- snapshots -------------------------------------------------------------------------------

class _SnapParams(msgspec.Struct, array_like=True):
    lease_ttl_ms: int
    heartbeat_interval_ms: int
    missed_heartbeats: int
    tenant_quota_replicas: int
    max_rejected_reasons: int
    resume_grace_ms: int


class _SnapWorker(msgspec.Struct, array_like=True):
    worker_id: str
    epoch: int
    namespace: str
    catalogue: FormCatalogue
    pool_slots: dict[str, int]
    endpoint: str
    node: str
    registered_at_ms: int
    last_heartbeat_ms: int
    alive: bool
    draining: bool
    fenced_through: int
    suspended_at_ms: int


class _SnapReplica(msgspec.Struct, array_like=True):
    block_hash: str
    form: str
    location: str
    state: ReplicaState
    generation: int
    checksum: str
    tenant: str
    namespace: str
    parent_hash: str
    token_start: int
    token_end: int
    pins: int
    last_used_ms: int
    owner: str
    owner_epoch: int
    lease_id: str


class _SnapLease(msgspec.Struct, array_like=True):
    lease_id: str
    worker_id: str
    epoch: int
    tenant: str
    namespace: str
    request_id: str
    block_hashes: list[str]
    usable_blocks: int
    pins: list[ReplicaKey]
    write: dict[str, list[int]]
    expires_at_ms: int
    granted_at_ms: int


class _Snapshot(msgspec.Struct):
    v: int
    params: _SnapParams
    applied: int
    resumed_at_ms: int
    workers: list[_SnapWorker]
    replicas: list[_SnapReplica]
    leases: list[_SnapLease]
    watermarks: list[tuple[str, int, int, list[int]]]
    #: ``(owner, keys oldest first)`` per owner with tombstones.
    tombstones: list[tuple[str, list[ReplicaKey]]] = []
    #: ``(namespace, reason)`` of every reuse switch that is off.
    reuse_off: list[tuple[str, str]] = []


class SnapshotError(ValueError):
    """Bytes that are not a snapshot this build can read."""


def to_snapshot(state: LedgerState) -> bytes:
    """msgpack bytes of the state's facts (derived indexes are rebuilt on load)."""
    with no_gc():
        return _to_snapshot(state)


def _to_snapshot(state: LedgerState) -> bytes:
    p = state.params
    snap = _Snapshot(
        v=SNAPSHOT_VERSION,
        params=_SnapParams(p.lease_ttl_ms, p.heartbeat_interval_ms, p.missed_heartbeats,
                           p.tenant_quota_replicas, p.max_rejected_reasons, p.resume_grace_ms),
        applied=state.applied, resumed_at_ms=state.resumed_at_ms,
        workers=[_SnapWorker(w.worker_id, w.epoch, w.namespace, w.catalogue, w.pool_slots, w.endpoint, w.node,
                             w.registered_at_ms, w.last_heartbeat_ms, w.alive, w.draining, w.fenced_through,
                             w.suspended_at_ms)
                 for w in state.workers.values()],
        replicas=[_SnapReplica(r.block_hash, r.form, r.location, r.state, r.generation, r.checksum, r.tenant,
                               r.namespace, r.parent_hash, r.token_start, r.token_end, r.pins, r.last_used_ms,
                               r.owner, r.owner_epoch, r.lease_id)
                  for r in state.replicas.values()],
        leases=[_SnapLease(l.lease_id, l.worker_id, l.epoch, l.tenant, l.namespace, l.request_id, l.block_hashes,
                           l.usable_blocks, list(l.pins), l.write, l.expires_at_ms, l.granted_at_ms)
                for l in state.leases.values()],
        watermarks=[(w, e, m.contiguous, sorted(m.pending)) for (w, e), m in state.watermarks.items()],
        tombstones=[(owner, list(ring)) for owner, ring in state.tombstones.items()],
        reuse_off=sorted(state.reuse_off.items()),
    )
    return msgspec.msgpack.encode(snap)


class _SnapVersion(msgspec.Struct):
    v: int = -1


def from_snapshot(data: bytes, params: CoreParams | None = None) -> LedgerState:
    """A state from :func:`to_snapshot` bytes; ``params`` overrides the stored limits."""
    with no_gc():
        return _from_snapshot(data, params)


def _from_snapshot(data: bytes, params: CoreParams | None) -> LedgerState:
    try:
        ver = msgspec.msgpack.decode(data, type=_SnapVersion).v
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise SnapshotError(f"not a ledger snapshot: {e}") from None
    if ver != SNAPSHOT_VERSION:
        raise SnapshotError(f"snapshot version {ver}; this build reads v{SNAPSHOT_VERSION} (replay the log instead)")
    try:
        snap = msgspec.msgpack.decode(data, type=_Snapshot)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise SnapshotError(f"invalid ledger snapshot: {e}") from None
    sp = snap.params
    s = LedgerState.empty(params or CoreParams(
        lease_ttl_ms=sp.lease_ttl_ms, heartbeat_interval_ms=sp.heartbeat_interval_ms,
        missed_heartbeats=sp.missed_heartbeats, resume_grace_ms=sp.resume_grace_ms,
        tenant_quota_replicas=sp.tenant_quota_replicas, max_rejected_reasons=sp.max_rejected_reasons))
    s.applied = snap.applied
    s.resumed_at_ms = snap.resumed_at_ms
    for sw in snap.workers:
        s.workers[sw.worker_id] = WorkerRecord(
            sw.worker_id, sw.epoch, sw.namespace, sw.catalogue, dict(sw.pool_slots), sw.endpoint, sw.node,
            sw.registered_at_ms, sw.last_heartbeat_ms, sw.alive, sw.draining, sw.fenced_through,
            sw.suspended_at_ms)
    replicas = s.replicas
    for sr in snap.replicas:
        b, f, loc = sr.block_hash, sr.form, sr.location
        key = (b, f, loc)
        r = Replica(b, f, loc, sr.state, sr.generation, sr.checksum, sr.tenant, sr.namespace, sr.parent_hash,
                    sr.token_start, sr.token_end, sr.pins, sr.last_used_ms, sr.owner, sr.owner_epoch, sr.lease_id,
                    (loc[4:], f) if loc.startswith("gpu:") else None)
        replicas[key] = r
        if r.state in LIVE:
            _enter_live(s, r, key)
    for sl in snap.leases:
        s.leases[sl.lease_id] = Lease(sl.lease_id, sl.worker_id, sl.epoch, sl.tenant, sl.namespace, sl.request_id,
                                      tuple(sl.block_hashes), sl.usable_blocks, {tuple(k): None for k in sl.pins},
                                      {f: tuple(ix) for f, ix in sl.write.items()}, sl.expires_at_ms,
                                      sl.granted_at_ms)
        w = s.workers.get(sl.worker_id)
        if w is not None and w.epoch == sl.epoch:
            w.leases[sl.lease_id] = None
    for wid, epoch, contiguous, pending in snap.watermarks:
        s.watermarks[(wid, epoch)] = Watermark(contiguous, set(pending))
    s.reuse_off = dict(snap.reuse_off)
    for owner, keys in snap.tombstones:
        s.tombstones[owner] = OrderedDict.fromkeys(tuple(k) for k in keys)  # type: ignore[misc]
    rebuild_indexes(s)
    return s


__all__ = [
    "CoreParams", "FoldFailed", "LedgerState", "Lease", "PoolKey", "Replica", "ReplicaKey", "ReplayError", "SnapshotError",
    "Watermark", "WorkerRecord", "apply", "fold_rows", "from_snapshot", "no_gc", "pool_of", "replay", "state_hash", "to_snapshot",
    "due_push", "due_rebuild", "indexes_deferred", "lru_push", "lru_rebuild", "rebuild_indexes", "tombstone_capacity",
    "TRANSITIONS",
]
