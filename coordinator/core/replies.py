"""What the command modules share: error replies, a grant's refs, the live-worker and shard checks, readable tiers."""

from __future__ import annotations

from typing import Any

from coordinator.core.state import LedgerState, Replica, WorkerRecord
from shared import messages as m
from shared.shards import ShardMap

Events = list[Any]

#: How long a worker refused for capacity should wait before asking again.
RETRY_AFTER_MS = 100


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
