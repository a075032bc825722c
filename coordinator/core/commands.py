"""Decisions: ``(state, message, now_ms) → (reply, events)``, never mutating the state.

The shell's loop around every command is::

    reply, events = command(state, msg, now_ms, ...)
    append(events)            # durably, in order (group commit)
    for e in events: apply(state, e)
    send(reply)               # NOTE: only after the append: a reply never precedes its event

A command validates what the caller asked and answers with a typed reply: the request
messages of :mod:`shared.messages` get a reply message (``ErrorReply`` with a code for what
cannot be granted); worker transitions get no reply, only events (rejections are recorded,
never raised); operator commands (invalidate, drain, evict) raise a :class:`CoreError`
subclass for impossible requests. Time is the ``now_ms`` argument; ids are the caller's.

Between a command and the ``apply`` of its events the shell must not run another command
on the same state (events are decided against the state they were computed from).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import msgspec

from coordinator.core import events as ev
from coordinator.core.lifecycle import (
    ALLOCATED, EVICTED, KIND_OF_PAIR, LIVE, READY, TRANSITIONS, WORKER_KINDS, IllegalTransition,
)
from coordinator.core.prefix import longest_usable_prefix
from coordinator.core.rejections import rejection_kind
from coordinator.core.state import Lease, LedgerState, Replica, ReplicaKey, WorkerRecord
from shared import messages as m
from shared.hashing import replica_digests, split_digests
from shared.shards import ShardMap

Events = list[Any]

#: How long a worker refused for capacity should wait before asking again.
RETRY_AFTER_MS = 100


class CoreError(ValueError):
    """An operator command asked for something impossible; the message says what and why."""


class UnknownWorker(CoreError):
    pass


class UnknownReplica(CoreError):
    pass


class ReplicaPinned(CoreError):
    pass


class UnknownScope(CoreError):
    pass



#: States a replica may be in to serve as the source of an offload copy.
OFFLOAD_SOURCES = (READY, EVICTED)

def _error(code: m.ErrorCode, message: str, retry_after_ms: int = 0) -> m.ErrorReply:
    return m.ErrorReply(code=code, message=message, retry_after_ms=retry_after_ms)


def _not_this_shard(shard_map: ShardMap, shard: int, namespace: str, root: str) -> m.ErrorReply | None:
    """``WRONG_SHARD`` when the map does not let this shard decide the chain rooted at ``root``:
    another shard owns it, or it is frozen on its way between shards (docs/architecture.md,
    "The ledger sharded"). A lease never spans shards, so its first hash decides for all."""
    part = shard_map.partition(namespace, root)
    owner = shard_map.owners[part]
    if shard_map.frozen(part):
        return _error(m.ErrorCode.WRONG_SHARD, f"partition {part} is moving between shards (shard map version "
                      f"{shard_map.version})", retry_after_ms=1000)
    if owner != shard:
        return _error(m.ErrorCode.WRONG_SHARD, f"partition {part} belongs to shard {owner}, not {shard} "
                      f"(shard map version {shard_map.version})")
    return None


def readable_locations(w: WorkerRecord) -> tuple[str, ...]:
    """Where ``w`` can read replicas from, fastest first: its GPU, its node's host tier, disk."""
    return (w.gpu, w.host, "disk")


def _ref(r: Replica) -> m.ReplicaRefFields:
    """A grant's ref to ``r``: the unchecked base, from the ledger's own state (as the grant's
    event stores it; the worker decodes it as a checked ``ReplicaRef``)."""
    return m.ReplicaRefFields(block_hash=r.block_hash, form=r.form, location=r.location,
                              generation=r.generation, checksum=r.checksum)


def _live_worker(state: LedgerState, worker_id: str, epoch: int, *,
                 suspended_ok: bool = False) -> WorkerRecord | m.ErrorReply:
    """The worker if ``epoch`` is its live epoch (and not suspended, unless ``suspended_ok``),
    else the ErrorReply to send."""
    w = state.workers.get(worker_id)
    if w is None:
        return _error(m.ErrorCode.NOT_FOUND, f"worker {worker_id} is not registered; register first")
    if epoch != w.epoch or not w.alive:
        state_word = "current" if w.alive else "lost"
        return _error(m.ErrorCode.FENCED, f"worker {worker_id} epoch {epoch} is fenced "
                      f"(latest epoch {w.epoch}, {state_word}); re-register for a new epoch")
    if w.suspended and not suspended_ok:
        return _error(m.ErrorCode.SUSPENDED, f"worker {worker_id} epoch {epoch} is suspended since "
                      f"{w.suspended_at_ms} ms; resume it with an inventory")
    return w


# --- workers -----------------------------------------------------------------------------

def _lose(state: LedgerState, w: WorkerRecord, reason: str, now_ms: int) -> ev.WorkerLost:
    """Fence ``w``'s current epoch: its leases end, its GPU/host replicas (and any ALLOCATED) are LOST."""
    lost = sorted(k for k in state.live_keys(w)
                  if state.replicas[k].state is ALLOCATED or k[2] != "disk")
    return ev.WorkerLost(worker_id=w.worker_id, epoch=w.epoch, reason=reason, lost=lost,
                         released=sorted(w.leases), at_ms=now_ms)


def register_worker(state: LedgerState, msg: m.WorkerRegister,
                    now_ms: int) -> tuple[m.RegisterReply | m.ErrorReply, Events]:
    """A new epoch for ``msg.worker_id`` (previous + 1); the previous epoch, if live, is fenced."""
    declared = msg.catalogue.names
    for form in msg.pool_slots:
        if form not in declared:
            return _error(m.ErrorCode.INVALID, f"pool_slots names form {form!r}, which the catalogue does not "
                          f"declare; declared: {list(declared)}"), []
    events: Events = []
    old = state.workers.get(msg.worker_id)
    epoch = 1
    lost: set[ReplicaKey] = set()
    if old is not None:
        epoch = old.epoch + 1
        if old.alive:
            loss = _lose(state, old, f"superseded by epoch {epoch}", now_ms)
            lost.update(tuple(k) for k in loss.lost)  # type: ignore[misc]
            events.append(loss)
    disowned = _disown(state, msg.worker_id, lost, now_ms) if msg.disown_replicas else None
    if disowned is not None:
        events.append(disowned)
    events.append(ev.WorkerRegistered(
        worker_id=msg.worker_id, epoch=epoch, namespace=msg.namespace, catalogue=msg.catalogue,
        pool_slots=dict(msg.pool_slots), endpoint=msg.endpoint, at_ms=now_ms))
    p = state.params
    return m.RegisterReply(worker_id=msg.worker_id, epoch=epoch, heartbeat_interval_ms=p.heartbeat_interval_ms,
                           lease_ttl_ms=p.lease_ttl_ms, resume_grace_ms=p.resume_grace_ms,
                           disowned=len(disowned.affected) if disowned is not None else 0), events


def _disown(state: LedgerState, worker_id: str, lost: set[ReplicaKey], now_ms: int) -> ev.Invalidated | None:
    """Every live replica ``worker_id`` created (any epoch; its GPU and host ones are in ``lost``
    already), and every READY copy elsewhere of the same bytes, becomes INVALID: the worker says
    its bits may differ from a cold run's.

    NOTE: a disk copy outlives its epoch (another worker may reload it), so the epoch's loss
    alone would leave those bytes READY; a reader holding a pin on one loses it here, and its
    hit was validated against a checksum that says nothing about how the bytes were computed.
    A reload of such a copy is another worker's replica with the same (block, form, checksum):
    selected by content (of every replica the worker made that the state still remembers),
    with every other live replica of that block at that worker's GPU and host tier, which is
    what the ``invalidate_blocks`` control it is sent drops there (:func:`drop_controls`).
    EVICTED incarnations of that content, and of those blocks at those tiers, are retired: an
    offload copy from one may be in flight (see :class:`~coordinator.core.events.Invalidated`).
    O(replicas the state holds): a rare event (a failed run-time batch-invariance check)."""
    replicas = state.replicas
    content = {(k[0], k[1], r.checksum) for k, r in replicas.items() if r.owner == worker_id and r.checksum}
    own = {k for k, r in replicas.items() if r.owner == worker_id and r.state in LIVE}
    copies: set[ReplicaKey] = set()
    retired: set[ReplicaKey] = set()
    for k, r in replicas.items():
        if r.checksum and (k[0], k[1], r.checksum) in content:
            if r.state is READY and k not in own:
                copies.add(k)
            elif r.state is EVICTED:
                retired.add(k)
    held = {(k[0], loc) for k in copies | retired if k[2] != "disk" for loc in _tiers_of(state, k[2])}
    if held:
        for k, r in replicas.items():
            if (k[0], k[2]) in held:
                if r.state in LIVE:
                    copies.add(k)
                elif r.state is EVICTED:
                    retired.add(k)
    affected = sorted((own | copies) - lost)
    if not affected and not retired:
        return None
    return ev.Invalidated(scope="worker", value=worker_id, affected=affected,  # type: ignore[arg-type]
                          retired=sorted(retired), at_ms=now_ms,  # type: ignore[arg-type]
                          reason="the worker disowned what it computed (a fused forward differed from "
                                 "the same request alone)")


def _tiers_of(state: LedgerState, location: str) -> tuple[str, ...]:
    """The GPU and host locations of the worker(s) holding ``location`` (a GPU or host tier)."""
    holders = [w for w in state.workers.values() if w.alive and location in (w.gpu, w.host)]
    return tuple({loc for w in holders for loc in (w.gpu, w.host)}) or (location,)


def drop_controls(state: LedgerState, event: ev.Invalidated, *, but: str = "") -> dict[str, list[m.Control]]:
    """``{worker: [control, …]}``: for each live worker (other than ``but``) whose GPU or host
    tier held a replica ``event`` invalidates or retires, ``invalidate_blocks`` controls naming
    each such block, up to ``MAX_CONTROL_BLOCKS`` a control (the ledger already records the
    invalidation; a control makes the worker drop the bytes, and with them any copy of them it
    is about to make). Each block comes with the generations of the worker's GPU replicas the
    event covers, so a new incarnation the worker writes before the control arrives (listed
    READY by then) is kept."""
    by_loc: dict[str, tuple[str, bool]] = {}
    for w in state.workers.values():
        if w.alive and w.worker_id != but:
            by_loc[w.gpu], by_loc[w.host] = (w.worker_id, True), (w.worker_id, False)
    out: dict[str, dict[str, dict[str, int]]] = {}
    replicas = state.replicas
    for k in (*event.affected, *event.retired):
        held = by_loc.get(k[2])
        if held is None:
            continue
        gens = out.setdefault(held[0], {}).setdefault(k[0], {})
        r = replicas.get(tuple(k))  # type: ignore[arg-type]
        if held[1] and r is not None:
            gens[k[1]] = r.generation
    return {w: block_controls(sorted(blocks.items()), event.reason) for w, blocks in sorted(out.items())}


def block_controls(blocks: list[tuple[str, dict[str, int]]], reason: str) -> list[m.Control]:
    """``invalidate_blocks`` controls naming ``(block, generations)`` in order, up to
    ``MAX_CONTROL_BLOCKS`` a control."""
    drops = [m.BlockDrop(block_hash=b, generations=g) for b, g in blocks]
    return [m.Control(action="invalidate_blocks", blocks=drops[i:i + m.MAX_CONTROL_BLOCKS], reason=reason)
            for i in range(0, len(drops), m.MAX_CONTROL_BLOCKS)]


def heartbeat(state: LedgerState, msg: m.Heartbeat,
              now_ms: int) -> tuple[m.HeartbeatReply | m.ErrorReply, Events]:
    """Liveness, answered with the epoch's commit watermark (what the worker may drop from its outbox).

    Never an event: liveness is soft state the shell keeps (see :func:`expire`); the log
    records only what it decides. A suspended epoch is told to resume.
    """
    w = _live_worker(state, msg.worker_id, msg.epoch)
    if isinstance(w, m.ErrorReply):
        return w, []
    return m.HeartbeatReply(committed_seq=state.committed_seq(w.worker_id, w.epoch)), []


def _same_worker(w: WorkerRecord, msg: m.WorkerResume) -> str:
    """Why ``msg`` cannot continue ``w``'s epoch ("" if it can)."""
    if msg.namespace != w.namespace:
        return f"namespace {msg.namespace} differs from the epoch's {w.namespace} (another model)"
    if [f.spec_digest for f in msg.catalogue.forms] != [f.spec_digest for f in w.catalogue.forms]:
        return "its form catalogue differs from the one it registered"
    if dict(msg.pool_slots) != w.pool_slots:
        return "its pool sizes differ from the ones it registered"
    return ""


def resume_worker(state: LedgerState, msg: m.WorkerResume, now_ms: int,
                  max_drop: int | None = None) -> tuple[m.ResumeReply | m.ErrorReply, Events]:
    """A worker that kept its memory keeps its epoch: its inventory is reconciled with the ledger.

    Refused (``FENCED``/``NOT_FOUND``: register anew, dropping the cache) for an unknown or
    fenced epoch, a changed model or pool layout, or an epoch suspended past the grace period
    (fenced now). ``UNAVAILABLE`` until the log holds every transition the worker emitted
    before its inventory. Otherwise each of the epoch's READY replicas on its GPU and host
    tier is kept if the worker holds it with the same generation and checksum (its digest is
    in ``held``) and becomes INVALID if not; held digests that match no live replica of the
    epoch are sent back to drop. Nothing the worker claims is ever added to the ledger.
    ALLOCATED replicas (writes of live leases) are left to their leases. Disk replicas are
    shared and verified on every reload, so they are not part of a worker's inventory.
    More than ``max_drop`` copies to drop (a reply that would not fit one message, and a worker
    the ledger mostly disowns) is refused with ``FENCED`` and changes nothing: register anew.
    """
    w = _live_worker(state, msg.worker_id, msg.epoch, suspended_ok=True)
    if isinstance(w, m.ErrorReply):
        return w, []
    p = state.params
    why = _same_worker(w, msg)
    if why:
        return _error(m.ErrorCode.FENCED, f"worker {w.worker_id} cannot resume epoch {w.epoch}: {why}; "
                      "register for a new epoch"), []
    try:
        held = set(split_digests(msg.held))
    except ValueError as e:
        return _error(m.ErrorCode.INVALID, f"held: {e}"), []
    if w.suspended and now_ms - w.suspended_at_ms > p.resume_grace_ms:
        lost = _lose(state, w, f"resumed {now_ms - w.suspended_at_ms} ms after its suspension "
                               f"(grace {p.resume_grace_ms} ms)", now_ms)
        return _error(m.ErrorCode.FENCED, f"worker {w.worker_id} epoch {w.epoch} stayed suspended past the "
                      f"grace period ({p.resume_grace_ms} ms) and is fenced; register for a new epoch"), [lost]
    committed = state.committed_seq(w.worker_id, w.epoch)
    if msg.emitted_seq > committed:
        return _error(m.ErrorCode.UNAVAILABLE, f"the log holds this epoch's transitions up to seq {committed}, "
                      f"the worker emitted up to {msg.emitted_seq}; resume once they are in",
                      RETRY_AFTER_MS), []
    own = (w.gpu, w.host)
    replicas = state.replicas
    keys: list[ReplicaKey] = []

    def listed() -> Iterator[tuple[str, str, str, int, str]]:
        # NOTE: a generator, not a list of rows: a worker holds 100k replicas, and 100k tuples
        # built and kept alive cost the resume (one pass on the coordinator's thread) a third more
        for key in state.live_keys(w):
            r = replicas[key]
            if key[2] in own and r.state is not ALLOCATED:
                keys.append(key)
                yield key[0], key[1], key[2], r.generation, r.checksum

    digests = replica_digests(listed())
    matched = held.intersection(digests)
    invalidated = [] if len(matched) == len(digests) else sorted(k for k, d in zip(keys, digests) if d not in held)
    drop = sorted(held - matched)
    if max_drop is not None and len(drop) > max_drop:
        return _error(m.ErrorCode.FENCED, f"worker {w.worker_id} holds {len(drop)} copies the ledger does not list "
                      f"live (at most {max_drop} can be dropped by a resume); register for a new epoch"), []
    event = ev.WorkerResumed(worker_id=w.worker_id, epoch=w.epoch, kept=len(matched),
                             invalidated=invalidated, dropped=len(drop), at_ms=now_ms)  # type: ignore[arg-type]
    return m.ResumeReply(worker_id=w.worker_id, epoch=w.epoch, kept=len(matched), drop=b"".join(drop),
                         committed_seq=committed, heartbeat_interval_ms=p.heartbeat_interval_ms,
                         lease_ttl_ms=p.lease_ttl_ms, resume_grace_ms=p.resume_grace_ms), [event]


def drain_worker(state: LedgerState, worker_id: str, now_ms: int = 0, reason: str = "") -> Events:
    """Stop granting writes to ``worker_id`` (reads still allowed). No-op if lost or already draining."""
    w = state.workers.get(worker_id)
    if w is None:
        raise UnknownWorker(f"worker {worker_id} is not registered; known: {sorted(state.workers)}")
    if not w.alive or w.draining:
        return []
    return [ev.WorkerDraining(worker_id=worker_id, epoch=w.epoch, reason=reason, at_ms=now_ms)]


def resume(state: LedgerState, now_ms: int) -> Events:
    """A coordinator took over: liveness clocks restart now (see ``CoordinatorResumed``), and
    every live epoch is suspended until its worker resumes with an inventory (it may have
    changed its cache while no coordinator listened; nothing is fenced for that)."""
    events: Events = [ev.CoordinatorResumed(at_ms=now_ms)]
    for wid in sorted(state.workers):
        w = state.workers[wid]
        if w.alive and not w.suspended:
            events.append(ev.WorkerSuspended(worker_id=wid, epoch=w.epoch, reason="coordinator takeover",
                                             at_ms=now_ms))
    return events


# --- leases ------------------------------------------------------------------------------

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


def switch_cache(state: LedgerState, namespace: str, enabled: bool, reason: str = "", now_ms: int = 0) -> Events:
    """Turn reuse of ``namespace`` ("" = every namespace) off or back on, for the whole fleet.

    Durable (the event is in the log before the answer), idempotent, and effective at the next
    lease: leases already granted keep what they pinned until they end. Turning "" on does not
    turn on a namespace switched off on its own (each switch is undone by its own ``on``).
    """
    return [ev.CacheSwitched(namespace=namespace, enabled=enabled, reason=reason, at_ms=now_ms)]


def collect_disk(state: LedgerState, msg: m.DiskGc, now_ms: int) -> tuple[m.DiskGcReply | m.ErrorReply, Events]:
    """A worker's disk GC: evict every named live ``disk`` replica *it wrote*, or none if a
    lease pins any named one.

    All or nothing, so a segment is deleted only when nothing it holds is pinned; the worker
    deletes the bytes after this answer, and a pinned replica keeps both its bytes and its
    READY state. A worker collects only its own segments, so a replica another worker's offload
    created (its record lies in that worker's segments, which stay) is not this worker's to
    evict: it is left READY, as is a name that is not live (already evicted, never offloaded).
    Pins count whoever wrote the replica: a reader may be reading this worker's copy of it.
    """
    w = _live_worker(state, msg.worker_id, msg.epoch)
    if isinstance(w, m.ErrorReply):
        return w, []
    live, pinned = [], []
    for b in msg.blocks:
        r = state.replicas.get((b.block_hash, b.form, "disk"))
        if r is None or r.state not in LIVE:
            continue
        if r.pins:
            pinned.append((b, r))
        elif r.owner == w.worker_id:
            live.append((b, r))
    if pinned:
        return m.DiskGcReply(pinned=[b for b, _ in pinned]), []
    return m.DiskGcReply(evicted=len(live)), [
        ev.ReplicaEvicted(block_hash=b.block_hash, form=b.form, location="disk", generation=r.generation,
                          reason="disk_gc", at_ms=now_ms) for b, r in live]


def evict_host(state: LedgerState, msg: m.HostEvict, now_ms: int) -> tuple[m.HostEvictReply | m.ErrorReply, Events]:
    """A worker's LRU victims on its host tier (or, ``tier`` ``gpu``, in a GPU pool the ledger
    thought had room): evict each named READY replica at that location of the worker's unless a
    live lease pins it (those stay READY and the reply lists them).

    Decided here, in the ledger's order, rather than reported after the fact: the worker drops
    the bytes only after this answer, so a lease granted before it keeps both the pin and the
    bytes, and one granted after it finds the replica EVICTED. Reported after the fact, a grant
    decided between the worker's drop and the ledger's ingest pinned bytes that were gone.
    Per block, not all or nothing (each is its own entry in host memory); a name that is not a
    READY replica (never offloaded, already evicted) needs nothing.
    """
    w = _live_worker(state, msg.worker_id, msg.epoch)
    if isinstance(w, m.ErrorReply):
        return w, []
    loc = w.gpu if msg.tier == "gpu" else w.host
    pinned: list[m.DiskBlock] = []
    events: Events = []
    for b in dict.fromkeys(msg.blocks):
        r = state.replicas.get((b.block_hash, b.form, loc))
        if r is None or r.state is not READY:
            continue
        if r.pins:
            pinned.append(b)
        else:
            # reason "lru": the worker's LRU chose it (a reason older coordinators can read)
            events.append(ev.ReplicaEvicted(block_hash=b.block_hash, form=b.form, location=loc,
                                            generation=r.generation, reason="lru", at_ms=now_ms))
    return m.HostEvictReply(evicted=len(events), pinned=pinned), events


def expire(state: LedgerState, now_ms: int, last_seen: Mapping[tuple[str, int], int] | None = None,
           floor_ms: int = 0) -> Events:
    """Liveness and lease decisions at ``now_ms``.

    A worker epoch silent past ``missed_heartbeats × interval`` is suspended; one suspended
    for longer than ``resume_grace_ms`` is lost (fenced). Leases past their TTL end.
    ``last_seen`` is the shell's soft state: when each ``(worker, epoch)`` was last heard
    from; ``floor_ms`` a time before which silence is not the worker's fault (the
    coordinator's own stall). Registration, resume and takeover times count as heard.
    """
    p = state.params
    floor = max(state.resumed_at_ms, floor_ms)
    seen = last_seen or {}
    events: Events = []
    lost: set[str] = set()
    for wid in sorted(state.workers):
        w = state.workers[wid]
        if not w.alive:
            continue
        if w.suspended:
            if now_ms - w.suspended_at_ms > p.resume_grace_ms:
                events.append(_lose(state, w, f"suspended for {now_ms - w.suspended_at_ms} ms without resuming "
                                              f"(grace {p.resume_grace_ms} ms)", now_ms))
                lost.add(wid)
            continue
        heard = max(w.last_heartbeat_ms, seen.get((wid, w.epoch), 0))
        if now_ms - max(heard, floor) > p.heartbeat_timeout_ms:
            events.append(ev.WorkerSuspended(worker_id=wid, epoch=w.epoch, at_ms=now_ms,
                                             reason=f"no heartbeat for {now_ms - heard} ms "
                                                    f"(limit {p.heartbeat_timeout_ms} ms)"))
    # Leases come from their deadline index (state.lease_due): only those due by now are looked
    # at. NOTE: what is popped is pushed back (a lease extended by a takeover with its new due
    # time), so the index holds what it held, less its stale entries: the decision changes no state.
    due, leases = state.lease_due, state.leases
    popped: list[tuple[int, str, int]] = []
    expired: set[str] = set()
    while due and due[0][0] <= now_ms:
        entry = heapq.heappop(due)
        lease = leases.get(entry[1])
        if lease is None or lease.expires_at_ms != entry[2]:
            continue   # ended or renewed since
        deadline = lease_deadline(state, lease)
        if now_ms < deadline:
            popped.append((deadline, entry[1], entry[2]))   # granted before a takeover: due later
            continue
        popped.append(entry)
        if lease.worker_id not in lost:   # (a lost worker's leases end with its loss)
            expired.add(entry[1])
    for entry in popped:
        heapq.heappush(due, entry)
    events.extend(ev.LeaseExpired(lease_id=lid, at_ms=now_ms) for lid in sorted(expired))
    return events


# --- transitions -------------------------------------------------------------------------

def _judge(state: LedgerState, t: m.TransitionEvent) -> tuple[str, str]:
    """``(kind, "")`` if the transition is legal now, else ``("", reason)``."""
    w = state.workers.get(t.worker_id)
    if w is None:
        return "", f"worker {t.worker_id} is not registered"
    if w.is_fenced(t.epoch):
        return "", f"epoch {t.epoch} of worker {t.worker_id} is fenced (latest epoch {w.epoch})"
    if t.epoch > w.epoch:
        return "", f"epoch {t.epoch} of worker {t.worker_id} was never registered (latest {w.epoch})"
    if t.namespace != w.namespace:
        return "", f"namespace {t.namespace} is not the worker's namespace {w.namespace}"
    # NOTE: a loop, not ``catalogue.names`` (a tuple built per call): this runs per transition.
    for spec in w.catalogue.forms:
        if spec.name == t.form:
            break
    else:
        return "", f"form {t.form!r} is not declared; declared: {list(w.catalogue.names)}"
    loc = t.location
    if loc.startswith("gpu:"):
        if loc != w.gpu:
            return "", f"worker {t.worker_id} cannot change replicas at {loc}"
    elif loc.startswith("host:"):
        # a host tier is the memory of its worker's process: no one else holds (or may drop) its bytes
        if loc != w.host:
            return "", f"worker {t.worker_id} cannot change replicas at {loc} (its host tier is {w.host})"
    elif loc != "disk":
        return "", f"location {loc!r}: expected gpu:<worker>, host:<node> or disk"
    kind = KIND_OF_PAIR.get((t.from_state, t.to_state))   # kind_of() and step() inlined: per transition
    if kind is None or kind not in WORKER_KINDS:
        frm = t.from_state.value if t.from_state else "absent"
        return "", f"a worker cannot move a replica from {frm} to {t.to_state.value}"
    key = (t.block_hash, t.form, loc)
    r = state.replicas.get(key)
    cur = r.state if r is not None else None
    if kind == "offload":
        if cur in LIVE:
            return "", f"replica {key} already exists ({cur})"
    elif cur != t.from_state:
        return "", f"stale: replica {key} is {cur.value if cur else 'absent'}, not {t.from_state}"
    moves = TRANSITIONS.get(cur)
    if moves is None or kind not in moves:
        return "", str(IllegalTransition(cur, kind, key))
    holder = r is not None and r.owner == t.worker_id and r.owner_epoch == t.epoch
    if kind in ("commit", "abort") or (kind == "invalidate" and cur is ALLOCATED):
        assert r is not None
        if not holder:
            return "", f"only the lease holder {r.owner}.{r.owner_epoch} may {kind} replica {key}"
        if t.lease_id and t.lease_id != r.lease_id:
            return "", f"replica {key} was allocated to lease {r.lease_id}, not {t.lease_id}"
        if kind == "commit":
            if not t.checksum:
                return "", f"commit of {key} carries no checksum"
            if t.tenant != r.tenant:
                return "", f"replica {key} belongs to tenant {r.tenant}, not {t.tenant}"
    elif kind in ("evict", "invalidate"):
        assert r is not None
        if t.generation != r.generation:
            return "", f"stale generation {t.generation} for {key} (current {r.generation})"
        if kind == "evict" and r.pins:
            return "", f"replica {key} is pinned by {r.pins} live lease(s); it cannot be evicted"
        if kind == "evict" and loc == "disk" and r.owner != t.worker_id:
            # (an invalidate stays open to every reader: whoever finds the bytes bad says so)
            return "", f"disk replica {key} was written by {r.owner}; only its writer may evict it"
    elif kind == "offload":
        if loc.startswith("gpu:"):
            return "", "an offload copies to host:<node> or disk; a GPU copy needs a write lease"
        if not t.checksum:
            return "", f"offload of {key} carries no checksum"
        # NOTE: a worker copies from where it can read: its GPU, its node's host tier, disk.
        # The source may already be EVICTED: a worker learns of an LRU eviction from the
        # grant that made it, and copies the victim to a lower tier before reusing the slot.
        # Bytes whose checksum equals the one committed are the committed bytes, and every
        # reload re-verifies that checksum, so an evicted source is as good as a READY one.
        for src_loc in readable_locations(w):
            src = state.replicas.get((t.block_hash, t.form, src_loc))
            if (src_loc != loc and src is not None and src.state in OFFLOAD_SOURCES and src.checksum
                    and src.checksum == t.checksum):
                break
        else:
            return "", (f"no READY or EVICTED replica of block {t.block_hash} form {t.form} with checksum "
                        f"{t.checksum} at {list(readable_locations(w))} to copy")
    return kind, ""


def ingest_transition(state: LedgerState, t: m.TransitionEvent, now_ms: int | None = None) -> Events:
    """Judge one worker transition: ``[TransitionApplied]``, ``[TransitionRejected]``, or ``[]``.

    ``[]`` means the source id (``worker.epoch.seq``) is already in the ledger — a redelivery,
    harmless. Never raises for bad input: a rejection is recorded with its reason, so the
    worker's outbox can drop it (the watermark covers it) and an operator can see why.
    ``now_ms`` defaults to the worker's ``ts_ms``.
    """
    wm = state.watermarks.get((t.worker_id, t.epoch))
    if wm is not None and wm.has(t.seq):
        return []
    at = t.ts_ms if now_ms is None else now_ms
    kind, reason = _judge(state, t)
    if kind:
        return [ev.TransitionApplied(transition=t, kind=kind, at_ms=at)]
    return [ev.TransitionRejected(transition=t, reason=reason, kind=rejection_kind(reason), at_ms=at)]


# --- operator commands -------------------------------------------------------------------

def invalidate(state: LedgerState, scope: str, value: str, reason: str, now_ms: int = 0) -> Events:
    """Every live replica in ``scope`` (``namespace`` | ``worker`` | ``block``) becomes INVALID,
    and every EVICTED one of the namespace, block, or worker's GPU and host tier is retired (an
    offload copy from it may be in flight: see :class:`~coordinator.core.events.Invalidated`)."""
    if scope == "namespace":
        mine = [(k, r.state) for k, r in state.replicas.items() if r.namespace == value]
    elif scope == "worker":
        w = state.workers.get(value)
        if w is None:
            raise UnknownWorker(f"worker {value} is not registered; known: {sorted(state.workers)}")
        mine = [(k, state.replicas[k].state) for k in state.live_keys(w)]
        mine += [(k, EVICTED) for k, r in state.replicas.items() if r.state is EVICTED and k[2] in (w.gpu, w.host)]
    elif scope == "block":
        mine = [(k, r.state) for k, r in state.replicas.items() if k[0] == value]
    else:
        raise UnknownScope(f"invalidation scope {scope!r}; allowed: namespace, worker, block")
    affected = sorted(k for k, st in mine if st in LIVE)
    retired = sorted(k for k, st in mine if st is EVICTED)
    return [ev.Invalidated(scope=scope, value=value, reason=reason, affected=affected,  # type: ignore[arg-type]
                           retired=retired, at_ms=now_ms)]  # type: ignore[arg-type]


def evict_replica(state: LedgerState, key: Sequence[str], now_ms: int = 0) -> Events:
    """Operator eviction of one unpinned replica (READY, or an ALLOCATED write, which aborts)."""
    k = (key[0], key[1], key[2])
    r = state.replicas.get(k)
    if r is None:
        raise UnknownReplica(f"no replica {k}")
    if r.state not in LIVE:
        raise IllegalTransition(r.state, "evict", k)
    if r.pins:
        raise ReplicaPinned(f"replica {k} is pinned by {r.pins} live lease(s); release them first")
    return [ev.ReplicaEvicted(block_hash=k[0], form=k[1], location=k[2], generation=r.generation,
                              reason="control", at_ms=now_ms)]
