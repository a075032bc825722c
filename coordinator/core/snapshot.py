"""The state's canonical hash and its snapshots (bytes to and from a state), apart from the fold that builds it."""

from __future__ import annotations

import contextlib
import gc
import hashlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, Final

import msgspec

from coordinator.core.indexes import _enter_live, rebuild_indexes
from coordinator.core.lifecycle import LIVE
from coordinator.core.records import CoreParams, Lease, LedgerState, Replica, ReplicaKey, Watermark, WorkerRecord
from shared.forms import FormCatalogue
from shared.messages import ReplicaState

SNAPSHOT_VERSION: Final = 3


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
