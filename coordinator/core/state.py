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

The records live in :mod:`.records`, the derived indexes in :mod:`.indexes`, the hash and the
snapshots in :mod:`.snapshot`; this module holds the fold and re-exports them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, Final

import msgspec

from coordinator.core import events as ev
from coordinator.core.indexes import (
    LRU_CHECK_EVERY, _enter_live, _leave_live, due_push, due_rebuild, indexes_deferred, lru_push, lru_rebuild,
    rebuild_indexes,
)
from coordinator.core.lifecycle import (
    ALLOCATED, EVICTED, LIVE, READY, TERMINAL, TRANSITIONS, IllegalTransition, step,
)
from coordinator.core.records import (
    CoreParams, Lease, LedgerState, PoolKey, Replica, ReplicaKey, Watermark, WorkerRecord, pool_of,
)
from coordinator.core.snapshot import SNAPSHOT_VERSION, SnapshotError, from_snapshot, no_gc, state_hash, to_snapshot
from shared.ids import ROOT_HASH
from shared.messages import ReplicaState


class ReplayError(RuntimeError):
    """The log asks the fold for something impossible (unknown lease, duplicate source id…)."""


# --- the fold ----------------------------------------------------------------------------

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


__all__ = [
    "CoreParams", "FoldFailed", "LedgerState", "Lease", "PoolKey", "Replica", "ReplicaKey", "ReplayError", "SnapshotError",
    "Watermark", "WorkerRecord", "apply", "fold_rows", "from_snapshot", "no_gc", "pool_of", "replay", "state_hash", "to_snapshot",
    "due_push", "due_rebuild", "indexes_deferred", "lru_push", "lru_rebuild", "rebuild_indexes", "tombstone_capacity",
    "TRANSITIONS", "LRU_CHECK_EVERY", "SNAPSHOT_VERSION",
]
