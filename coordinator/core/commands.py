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

from coordinator.core import events as ev
from coordinator.core.leases import lease_deadline
from coordinator.core.lifecycle import ALLOCATED, EVICTED, LIVE, READY, IllegalTransition
from coordinator.core.replies import RETRY_AFTER_MS, Events, _error, _live_worker
from coordinator.core.state import LedgerState, ReplicaKey, WorkerRecord
from shared import messages as m
from shared.hashing import replica_digests, split_digests


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


# --- leases (acquire, renew and release are in .leases, ingest_transition in .transitions)

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
