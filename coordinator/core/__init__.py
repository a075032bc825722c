"""The coordinator's pure core: ledger events, the fold, the replica life cycle, decisions.

Nothing here does I/O or reads a clock (time is the ``now_ms`` argument): the shell
(``coordinator/`` outside ``core/``) loads, decides with :mod:`.commands`, appends the
events durably, folds them with :func:`.state.apply`, then replies.

Map:

* :mod:`.events`     — the ledger's facts (``LedgerEvent``), encode/decode, ``stream_of``;
* :mod:`.lifecycle`  — the replica state machine as a table, ``IllegalTransition``;
* :mod:`.state`      — ``LedgerState``, ``apply``/``replay``, ``state_hash``, snapshots;
  it re-exports :mod:`.records` (the state's records), :mod:`.indexes` (its derived
  indexes) and :mod:`.snapshot` (the canonical hash, snapshots);
* :mod:`.prefix`     — the longest usable prefix over a form catalogue;
* :mod:`.commands`   — ``(state, msg, now_ms) → (reply, events)``; the lease commands in
  :mod:`.leases`, a worker's transition judged in :mod:`.transitions`, what they share
  (error replies, the live-worker check) in :mod:`.replies`;
* :mod:`.invariants` — ``check_invariants(state)`` by recomputation.
"""

from coordinator.core.commands import (
    CoreError, ReplicaPinned, UnknownReplica, UnknownScope, UnknownWorker, collect_disk,
    drop_controls, drain_worker, evict_host, evict_replica, switch_cache, expire, heartbeat, invalidate,
    register_worker, resume, resume_worker,
)
from coordinator.core.events import (
    EVENT_SCHEMA_VERSION, EVENT_TYPES, CacheSwitched, CoordinatorResumed, EventDecodeError, Invalidated, LeaseExpired,
    LeaseGranted, LeaseReleased, LeaseRenewed, LedgerEvent, ReplicaAllocated, ReplicaEvicted,
    TransitionApplied, TransitionRejected, WorkerDraining, WorkerHeartbeat, WorkerLost, WorkerRegistered,
    WorkerResumed, WorkerSuspended, decode_event, encode_event, stream_of,
)
from coordinator.core.invariants import check_invariants
from coordinator.core.leases import acquire_lease, lease_deadline, release_lease, renew_lease
from coordinator.core.lifecycle import TRANSITIONS, IllegalTransition, kind_of, step
from coordinator.core.prefix import PrefixResult, longest_usable_prefix
from coordinator.core.replies import readable_locations
from coordinator.core.state import (
    CoreParams, Lease, LedgerState, Replica, ReplicaKey, ReplayError, SnapshotError, Watermark, WorkerRecord,
    apply, from_snapshot, replay, state_hash, to_snapshot,
)
from coordinator.core.transitions import ingest_transition

__all__ = [
    # events
    "EVENT_SCHEMA_VERSION", "EVENT_TYPES", "CacheSwitched", "CoordinatorResumed", "EventDecodeError", "Invalidated", "LeaseExpired",
    "LeaseGranted", "LeaseReleased", "LeaseRenewed", "LedgerEvent", "ReplicaAllocated", "ReplicaEvicted",
    "TransitionApplied", "TransitionRejected", "WorkerDraining", "WorkerHeartbeat", "WorkerLost",
    "WorkerRegistered", "WorkerResumed", "WorkerSuspended", "decode_event", "encode_event", "stream_of",
    # state
    "CoreParams", "Lease", "LedgerState", "Replica", "ReplicaKey", "ReplayError", "SnapshotError", "Watermark",
    "WorkerRecord", "apply", "from_snapshot", "replay", "state_hash", "to_snapshot",
    # lifecycle
    "TRANSITIONS", "IllegalTransition", "kind_of", "step",
    # prefix
    "PrefixResult", "longest_usable_prefix",
    # commands
    "CoreError", "ReplicaPinned", "UnknownReplica", "UnknownScope", "UnknownWorker", "acquire_lease",
    "collect_disk", "drop_controls", "drain_worker", "switch_cache", "evict_host", "evict_replica", "expire", "heartbeat", "ingest_transition", "invalidate", "lease_deadline",
    "readable_locations", "register_worker", "release_lease", "renew_lease", "resume", "resume_worker",
    # invariants
    "check_invariants",
]
