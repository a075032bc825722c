"""What must hold of every ledger state, checked by recomputation (audit and property tests).

``check_invariants(state)`` returns one line per violation (empty = OK). It recomputes
every derived index from the facts instead of trusting them, so it is O(state): for the
audit and for tests, never for the hot path.
"""

from __future__ import annotations

from collections import Counter

from coordinator.core.lifecycle import ALLOCATED, LIVE, READY
from coordinator.core.state import LedgerState, ReplicaKey, pool_of, tombstone_capacity


def check_invariants(state: LedgerState) -> list[str]:
    out: list[str] = []
    q = state.params.tenant_quota_replicas

    # Recompute derived counts from the replicas.
    pools: dict[tuple[str, str], set[ReplicaKey]] = {}
    tenants: Counter[str] = Counter()
    owned: dict[str, set[ReplicaKey]] = {}
    writes: dict[str, set[ReplicaKey]] = {}
    for key, r in state.replicas.items():
        if r.key != key:
            out.append(f"replica stored under {key} says it is {r.key}")
        if r.pool != pool_of(r.location, r.form):
            out.append(f"replica {key}: pool {r.pool} does not match its location")
        if r.pins < 0:
            out.append(f"replica {key}: negative pin count {r.pins}")
        if r.state not in LIVE:
            continue
        if r.pool is not None:
            pools.setdefault(r.pool, set()).add(key)
            tenants[r.tenant] += 1
        w = state.workers.get(r.owner)
        if w is None:
            out.append(f"replica {key}: owner {r.owner} is not a registered worker")
            continue
        fenced = w.is_fenced(r.owner_epoch) or r.owner_epoch != w.epoch or not w.alive
        if fenced and (r.state is ALLOCATED or r.location.startswith(("gpu:", "host:"))):
            out.append(f"replica {key}: {r.state.value} but its epoch {r.owner}.{r.owner_epoch} is fenced")
        if not fenced and r.pool is None:
            owned.setdefault(r.owner, set()).add(key)
        if r.state is ALLOCATED:
            lease = state.leases.get(r.lease_id)
            if lease is not None and r.lease_id not in writes:
                writes[r.lease_id] = set(lease.write_keys(f"gpu:{lease.worker_id}"))
            if lease is None or key not in writes[r.lease_id]:
                out.append(f"replica {key}: ALLOCATED for lease {r.lease_id!r}, which is not live or did not grant it")

    # 1. admission cap per (worker, form) and per tenant.
    for (wid, form), keys in sorted(pools.items()):
        w = state.workers.get(wid)
        cap = w.pool_slots.get(form, 0) if w is not None else 0
        if len(keys) > cap:
            out.append(f"pool {wid}/{form}: {len(keys)} ALLOCATED+READY > {cap} slots")
    if q:
        for tenant, n in sorted(tenants.items()):
            if n > q:
                out.append(f"tenant {tenant}: {n} ALLOCATED+READY GPU replicas > quota {q}")

    # Counters equal their recomputation.
    stored_pools = {pk: set(keys) for pk, keys in state.pools.items() if keys}
    if stored_pools != pools:
        diff = sorted(set(stored_pools) ^ set(pools) | {pk for pk in pools if stored_pools.get(pk) != pools[pk]})
        out.append(f"pool membership differs from recomputation for {diff}")
    if dict(tenants) != state.tenant_used:
        out.append(f"tenant counts {dict(sorted(state.tenant_used.items()))} != recomputed "
                   f"{dict(sorted(tenants.items()))}")
    for wid, w in sorted(state.workers.items()):
        if set(w.offloaded) != owned.get(wid, set()):
            out.append(f"worker {wid}: offloaded-replica index differs from recomputation")
        if not w.alive and state.live_keys(w):
            out.append(f"worker {wid}: lost, yet holds live replicas")
        if w.suspended and not w.alive:
            out.append(f"worker {wid}: suspended at {w.suspended_at_ms} ms, yet its epoch is fenced")
        lease_ids = {lid for lid, l in state.leases.items() if l.worker_id == wid and l.epoch == w.epoch}
        if set(w.leases) != lease_ids:
            out.append(f"worker {wid}: lease index {sorted(w.leases)} != {sorted(lease_ids)}")

    # Pins: refcount = number of live leases pinning; pinned replicas are READY.
    pins: Counter[ReplicaKey] = Counter()
    for lid, lease in sorted(state.leases.items()):
        w = state.workers.get(lease.worker_id)
        if w is None or not w.alive or lease.epoch != w.epoch:
            out.append(f"lease {lid}: its epoch {lease.worker_id}.{lease.epoch} is fenced or unknown")
        for key in lease.pins:
            pins[key] += 1
            r = state.replicas.get(key)
            if r is None or r.state is not READY:
                out.append(f"lease {lid} pins {key}, which is {r.state.value if r else 'absent'}, not READY")
    for key, r in state.replicas.items():
        if r.pins != pins.get(key, 0):
            out.append(f"replica {key}: pin count {r.pins} != {pins.get(key, 0)} pinning leases")

    # The LRU index: every READY unpinned replica of a GPU pool can be found there, as last used.
    for pk, keys in state.pools.items():
        heap = state.lru.get(pk, [])
        indexed = {k for t, _, k in heap if (r := state.replicas.get(k)) is not None and r.last_used_ms == t}
        missing = [k for k in keys if (r := state.replicas[k]).state is READY and not r.pins and k not in indexed]
        if missing:
            out.append(f"pool {pk[0]}/{pk[1]}: {len(missing)} evictable replicas missing from the LRU index, "
                       f"e.g. {missing[0]}")

    # The deadline index: every live lease can be found there, at its current expiry.
    indexed_leases = {(lid, exp) for _, lid, exp in state.lease_due}
    unindexed = [lid for lid, lease in state.leases.items() if (lid, lease.expires_at_ms) not in indexed_leases]
    if unindexed:
        out.append(f"{len(unindexed)} live leases missing from the deadline index, e.g. {unindexed[0]}")

    # Retention: every ended replica is a tombstone of its owner, within the owner's capacity.
    buried: dict[ReplicaKey, str] = {}
    for owner, ring in state.tombstones.items():
        if not ring:
            out.append(f"tombstones of {owner}: an empty ring is kept")
        if len(ring) > tombstone_capacity(state, owner):
            out.append(f"tombstones of {owner}: {len(ring)} > capacity {tombstone_capacity(state, owner)}")
        for key in ring:
            buried[key] = owner
            r = state.replicas.get(key)
            if r is None or r.state in LIVE or r.owner != owner:
                out.append(f"tombstone {key} of {owner} is {'absent' if r is None else r.state.value} "
                           f"(owner {r.owner if r else '-'}), not an ended replica of its owner")
    for key, r in state.replicas.items():
        if r.state not in LIVE and buried.get(key) != r.owner:
            out.append(f"replica {key} is {r.state.value} but not among {r.owner}'s tombstones")

    # Watermarks: pending seqs lie above the contiguous prefix.
    for (wid, epoch), wm in state.watermarks.items():
        if wm.contiguous < 0 or any(s <= wm.contiguous + 1 for s in wm.pending):
            out.append(f"watermark {wid}.{epoch}: contiguous {wm.contiguous}, pending {sorted(wm.pending)[:5]}")
    return out
