"""The lease commands (acquire, with its write plan and LRU victims; renew; release): one life cycle, kept apart."""

from __future__ import annotations

import heapq

import msgspec

from coordinator.core import events as ev
from coordinator.core.lifecycle import LIVE, READY
from coordinator.core.prefix import longest_usable_prefix
from coordinator.core.replies import (
    RETRY_AFTER_MS, Events, _error, _live_worker, _not_this_shard, _ref, readable_locations,
)
from coordinator.core.state import Lease, LedgerState, Replica, ReplicaKey, WorkerRecord
from shared import messages as m


def _plan_writes(state: LedgerState, w: WorkerRecord, msg: m.LeaseAcquire, usable: int,
                 pin_keys: list[ReplicaKey], mine: set[str]) -> tuple[dict[str, list[int]], list[Replica], int]:
    """``(write, victims, wanted)``: which blocks to fill per form, whom to evict for them.

    Writes are granted block by block, every needed form of a block together, stopping at
    the first block that does not fit: a block is reusable only with all its forms, and a
    prefix only without gaps, so a partial grant keeps the earliest blocks whole.

    A block needs a form when it has no live replica of that form on the worker's GPU and
    either lies past the usable prefix (it will be computed) or is read from host/disk for
    the resume (it will be reloaded). A block fits when each such form has a free slot or an
    LRU victim (READY, unpinned, not a block of this request) in its pool, and the tenant's
    quota has room for all of them.
    """
    gpu = w.gpu
    hashes = msg.block_hashes
    n = len(hashes)
    get = state.replicas.get
    # Blocks of the usable prefix read from host or disk (reloaded into GPU slots); the rest of
    # the prefix is read from the GPU or not needed for the resume: nothing to fill there.
    reloaded = {(k[0], k[1]) for k in pin_keys if k[2] != gpu}
    # NOTE: the request's own blocks (``mine``) are never victims: READY ones past the prefix are
    # kept (nothing would rewrite them), and the pinned ones must not move.
    need: dict[str, set[int]] = {}
    for form in msg.write_forms:
        idx = {i for i in range(usable, n)
               if (r := get((hashes[i], form, gpu))) is None or r.state not in LIVE}
        if reloaded:
            idx.update(i for i in range(usable) if (hashes[i], form) in reloaded
                       and ((r := get((hashes[i], form, gpu))) is None or r.state not in LIVE))
        if idx:
            need[form] = idx
    wanted = sum(map(len, need.values()))
    if not wanted:
        return {}, [], 0
    free: dict[str, int] = {}
    for form in need:
        free[form] = max(0, w.pool_slots.get(form, 0) - len(state.pools.get((w.worker_id, form), ())))
    quota = state.params.tenant_quota_replicas
    if not quota and all(len(idx) <= free[f] for f, idx in need.items()):
        return {f: sorted(idx) for f, idx in need.items()}, [], wanted   # room for everything
    # NOTE: victims come from each pool's LRU index, popped only when its free slots run out
    # (a scan of the pool was O(pool size) per grant); see :class:`_Victims`.
    victims: dict[str, _Victims] = {}
    chosen: dict[str, list[Replica]] = {f: [] for f in need}
    # NOTE: evicting the tenant's own replicas would free quota too; not counted (conservative).
    room = quota - state.tenant_used.get(msg.tenant, 0) if quota else wanted
    granted = dict.fromkeys(need, 0)
    blocks: list[int] = []
    try:
        for i in sorted(set().union(*need.values())):
            forms = [f for f in need if i in need[f]]
            if len(forms) > room:
                break
            picked: list[tuple[str, Replica]] = []
            for f in forms:
                if granted[f] < free[f]:
                    continue
                cursor = victims.get(f)
                if cursor is None:
                    cursor = victims[f] = _Victims(state, (w.worker_id, f), mine)
                v = cursor.next()
                if v is None:
                    break
                picked.append((f, v))
            else:
                for f in forms:
                    granted[f] += 1
                for f, v in picked:
                    chosen[f].append(v)
                room -= len(forms)
                blocks.append(i)
                continue
            break   # a form of block i has neither a free slot nor a victim: the earlier blocks stay
    finally:
        for cursor in victims.values():
            cursor.restore()
    write = {f: idx for f in need if (idx := [i for i in blocks if i in need[f]])}
    return write, [v for f in granted for v in chosen[f]], wanted


class _Victims:
    """A pool's LRU victims for one grant, least recently used first (ties by block hash).

    Pops the pool's LRU heap (``LedgerState.lru``) as victims are needed, skipping stale
    entries (dropped: the replica was pinned, used again or has left) and the request's own
    blocks; :meth:`restore` pushes back every valid entry it popped, so the index is as it was
    (less its stale entries) whatever the grant decides: the decision does not change the state.
    """

    def __init__(self, state: LedgerState, pool: tuple[str, str], mine: set[str]) -> None:
        self.heap = state.lru.get(pool, [])
        self.replicas = state.replicas
        self.mine = mine
        self.popped: list[tuple[int, str, ReplicaKey]] = []
        self.seen: set[ReplicaKey] = set()

    def next(self) -> Replica | None:
        heap, replicas = self.heap, self.replicas
        while heap:
            entry = heapq.heappop(heap)
            key = entry[2]
            r = replicas.get(key)
            if r is None or r.state is not READY or r.pins or r.last_used_ms != entry[0] or key in self.seen:
                continue
            self.seen.add(key)
            self.popped.append(entry)
            if key[0] in self.mine:
                continue
            return r
        return None

    def restore(self) -> None:
        for entry in self.popped:
            heapq.heappush(self.heap, entry)
        self.popped.clear()


def acquire_lease(state: LedgerState, msg: m.LeaseAcquire, now_ms: int,
                  lease_id: str) -> tuple[m.LeaseGrant | m.ErrorReply, Events]:
    """Read pins for the longest usable prefix plus write reservations for what must be filled.

    Writes go to the worker's GPU pools (see :func:`_plan_writes`); a full pool gives up its
    least recently used unpinned READY replicas (``evict`` in the grant, already EVICTED in
    the log); when even that is not enough, or the tenant quota is reached, fewer blocks are
    granted — the earliest first. Nothing at all to read or write → ``OVER_CAPACITY``.
    A draining worker gets reads only.
    """
    w = _live_worker(state, msg.worker_id, msg.epoch)
    if isinstance(w, m.ErrorReply):
        return w, []
    if msg.namespace != w.namespace:
        return _error(m.ErrorCode.INVALID, f"namespace {msg.namespace} is not worker {w.worker_id}'s "
                      f"namespace {w.namespace}"), []
    for form in msg.write_forms:
        if form not in w.form_names:
            return _error(m.ErrorCode.INVALID, f"write form {form!r} is not declared by worker "
                          f"{w.worker_id}'s catalogue; declared: {list(w.catalogue.names)}"), []
    mine = set(msg.block_hashes)
    if len(mine) != len(msg.block_hashes):
        seen: dict[str, int] = {}
        for i, bh in enumerate(msg.block_hashes):
            if bh in seen:
                return _error(m.ErrorCode.INVALID, f"block_hashes repeats {bh} (indices {seen[bh]} and {i}); "
                              "the chained hashes of one prompt are all distinct"), []
            seen[bh] = i
    if len(set(msg.write_forms)) != len(msg.write_forms):
        return _error(m.ErrorCode.INVALID, f"write_forms lists a form twice: {msg.write_forms}"), []
    if lease_id in state.leases:
        return _error(m.ErrorCode.INVALID, f"lease id {lease_id} is already live"), []
    if not state.reuse_enabled(msg.namespace):
        # an operator turned reuse off: pin nothing, reserve nothing (the request recomputes)
        msg = msgspec.structs.replace(msg, reuse=False, write_forms=[])
    p = state.params
    hashes = msg.block_hashes
    n = len(hashes)
    if p.shard_map is not None and n:
        wrong = _not_this_shard(p.shard_map, p.shard, msg.namespace, hashes[0])
        if wrong is not None:
            return wrong, []

    usable, pin_keys, rejected = 0, [], []
    if msg.reuse and n:
        res = longest_usable_prefix(state, w.catalogue, hashes, readable_locations(w), p.max_rejected_reasons)
        usable, pin_keys, rejected = res.usable_blocks, res.replicas_to_pin, res.rejected

    replicas = state.replicas
    write, victims, wanted = ({}, [], n * len(msg.write_forms)) if w.draining else _plan_writes(
        state, w, msg, usable, pin_keys, mine)

    if wanted and not write and not usable:
        why = "worker is draining" if w.draining else "pool full of pinned replicas or tenant quota reached"
        return _error(m.ErrorCode.OVER_CAPACITY, f"no cache capacity for this request ({why}); "
                      "serve it by recomputation", RETRY_AFTER_MS), []

    expires = now_ms + min(msg.ttl_ms, p.lease_ttl_ms)
    reads = [_ref(replicas[k]) for k in pin_keys]
    evict = [_ref(v) for v in victims]
    # One event holds the whole decision: the victims, the pins and the write reservations.
    event = ev.LeaseGranted(
        lease_id=lease_id, worker_id=w.worker_id, epoch=w.epoch, tenant=msg.tenant, namespace=msg.namespace,
        request_id=msg.request_id, block_hashes=list(hashes), usable_blocks=usable,
        read=reads, write=write, expires_at_ms=expires,
        evicted=[(v.block_hash, v.form, v.generation) for v in victims], allocated=True, at_ms=now_ms)
    grant = m.LeaseGrant(lease_id=lease_id, expires_at_ms=expires, usable_blocks=usable, read=reads,
                         write=write, evict=evict, rejected=rejected)
    return grant, [event]


def _lease_of(state: LedgerState, worker_id: str, epoch: int, lease_id: str) -> Lease | m.ErrorReply:
    lease = state.leases.get(lease_id)
    if lease is None:
        return _error(m.ErrorCode.NOT_FOUND, f"lease {lease_id} is not live (released, expired or never granted)")
    if lease.worker_id != worker_id:
        return _error(m.ErrorCode.INVALID, f"lease {lease_id} belongs to worker {lease.worker_id}, not {worker_id}")
    if lease.epoch != epoch:
        return _error(m.ErrorCode.FENCED, f"lease {lease_id} belongs to epoch {lease.epoch}, not {epoch}")
    return lease


def lease_deadline(state: LedgerState, lease: Lease) -> int:
    """When ``lease`` expires; a lease granted before the last takeover gets a heartbeat
    timeout from the takeover to be renewed (the holder could not renew while no coordinator ran)."""
    if lease.granted_at_ms >= state.resumed_at_ms:
        return lease.expires_at_ms
    return max(lease.expires_at_ms, state.resumed_at_ms + state.params.heartbeat_timeout_ms)


def renew_lease(state: LedgerState, msg: m.LeaseRenew,
                now_ms: int) -> tuple[m.LeaseRenewed | m.ErrorReply, Events]:
    lease = _lease_of(state, msg.worker_id, msg.epoch, msg.lease_id)
    if isinstance(lease, m.ErrorReply):
        return lease, []
    w = state.workers.get(lease.worker_id)
    if w is not None and w.suspended:
        return _error(m.ErrorCode.SUSPENDED, f"worker {w.worker_id} epoch {w.epoch} is suspended; resume it "
                      "with an inventory before renewing its leases"), []
    deadline = lease_deadline(state, lease)
    if now_ms >= deadline:
        return _error(m.ErrorCode.NOT_FOUND, f"lease {msg.lease_id} expired at {deadline} ms"), []
    expires = now_ms + min(msg.ttl_ms, state.params.lease_ttl_ms)
    return (m.LeaseRenewed(lease_id=msg.lease_id, expires_at_ms=expires),
            [ev.LeaseRenewed(lease_id=msg.lease_id, expires_at_ms=expires, at_ms=now_ms)])


def release_lease(state: LedgerState, msg: m.LeaseRelease,
                  now_ms: int) -> tuple[m.LeaseReleased | m.ErrorReply, Events]:
    """Unpin the reads; writes never committed are aborted (EVICTED) by the release itself."""
    lease = _lease_of(state, msg.worker_id, msg.epoch, msg.lease_id)
    if isinstance(lease, m.ErrorReply):
        return lease, []
    return m.LeaseReleased(lease_id=lease.lease_id), [ev.LeaseReleased(lease_id=lease.lease_id, at_ms=now_ms)]
