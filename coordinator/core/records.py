"""The ledger state's records (LedgerState, Replica, Lease, WorkerRecord, ...): plain data, apart from the fold."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgspec

from shared.forms import FormCatalogue
from shared.messages import ReplicaState
from shared.shards import ShardMap

#: ``(block_hash, form, location)``.
ReplicaKey = tuple[str, str, str]
#: ``(worker_id, form)``: one pool of one worker.
PoolKey = tuple[str, str]


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
