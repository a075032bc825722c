"""Phase of ``bench.coordinator``: a write grant on a full pool, the core alone in this process."""

from __future__ import annotations

import statistics
import time
from typing import Any

from bench.coordinator.harness import LEASE_TTL_MS, NS, PROMPT_BLOCKS, catalogue, h
from bench.coordinator.synthetic_worker import commit_transition


#: Slots of the full pool and write grants timed on it (the scan baseline costs O(slots) each):
#: full run, quick run.
FULL_POOL = {False: (100_000, 300), True: (10_000, 500)}


def full_pool_phase(slots: int, grants: int) -> dict[str, Any]:
    """The decision cost of a 16-block write grant on a worker whose pool is full of READY
    replicas (every written block evicts one, least recently used first), in this process:
    ``coordinator.core.acquire_lease`` + apply, with the pool's LRU index. Baseline: the same
    victims found by scanning the pool (what the core did before the index: every READY
    unpinned replica, then the k least recently used), timed on the same state."""
    import heapq

    from coordinator import core
    from coordinator.core.lifecycle import READY
    from shared import messages as m

    s = core.LedgerState.empty(core.CoreParams(lease_ttl_ms=LEASE_TTL_MS))
    now = m.now_ms()
    reply, evs = core.register_worker(s, m.WorkerRegister(worker_id="w", namespace=NS, catalogue=catalogue(),
                                                          pool_slots={"compressed": slots}), now)
    for e in evs:
        core.apply(s, e)
    hashes = [h(i + 1) for i in range(slots)]
    _, evs = core.acquire_lease(s, m.LeaseAcquire(worker_id="w", epoch=reply.epoch, request_id="fill", namespace=NS,
                                                  block_hashes=hashes, write_forms=["compressed"], reuse=False,
                                                  ttl_ms=LEASE_TTL_MS), now, "fill")
    for e in evs:
        core.apply(s, e)
    for i in range(slots):
        for e in core.ingest_transition(s, commit_transition(reply.epoch, i + 1, hashes, i, "fill", now, "w"), now + i):
            core.apply(s, e)
    for e in core.release_lease(s, m.LeaseRelease(worker_id="w", epoch=reply.epoch, lease_id="fill"), now)[1]:
        core.apply(s, e)
    pool = s.pools[("w", "compressed")]
    t_index = t_scan = 0.0
    with core.state.no_gc():
        for k in range(grants):
            hs = [h(slots + 10 + PROMPT_BLOCKS * k + j) for j in range(PROMPT_BLOCKS)]
            msg = m.LeaseAcquire(worker_id="w", epoch=reply.epoch, request_id=f"g{k}", namespace=NS, block_hashes=hs,
                                 write_forms=["compressed"], ttl_ms=LEASE_TTL_MS)
            t0 = time.perf_counter()
            mine = set(hs)
            scan = heapq.nsmallest(PROMPT_BLOCKS, [r for key in pool if (r := s.replicas[key]).state is READY
                                                   and not r.pins and key[0] not in mine],
                                   key=lambda r: (r.last_used_ms, r.block_hash))
            t1 = time.perf_counter()
            grant, evs = core.acquire_lease(s, msg, now + slots + k, f"l{k}")
            for e in evs:
                core.apply(s, e)
            t2 = time.perf_counter()
            if [v.block_hash for v in grant.evict] != [r.block_hash for r in scan]:
                raise RuntimeError("the LRU index chose other victims than a scan of the pool")
            t_scan += t1 - t0
            t_index += t2 - t1
    if core.check_invariants(s):
        raise RuntimeError(f"full-pool phase: invariants broken: {core.check_invariants(s)[:3]}")
    # A resume of that worker, holding all of it (what every worker sends after a takeover): the
    # decision alone, on the coordinator's thread, with the inventory the worker would send.
    from shared.hashing import replica_digests
    held = [(key, r) for key in pool if (r := s.replicas[key]).state is READY]
    inventory = b"".join(replica_digests((k[0], k[1], k[2], r.generation, r.checksum) for k, r in held))
    resume = m.WorkerResume(worker_id="w", epoch=reply.epoch, namespace=NS, catalogue=catalogue(),
                            pool_slots={"compressed": slots}, held=inventory)
    t_resume = []
    with core.state.no_gc():
        for _ in range(3):
            t0 = time.perf_counter()
            answer, _ = core.resume_worker(s, resume, now + slots + grants)
            t_resume.append(time.perf_counter() - t0)
    if not isinstance(answer, m.ResumeReply) or answer.kept != len(held):
        raise RuntimeError(f"full-pool phase: the resume kept {getattr(answer, 'kept', answer)} of {len(held)}")
    resume_s = statistics.median(t_resume)
    return {"full_pool_slots": slots, "full_pool_grants": grants,
            "grant_full_pool_us": round(1e6 * t_index / grants, 1),
            "grant_full_pool_scan_us": round(1e6 * t_scan / grants, 1),
            "grant_full_pool_speedup_vs_scan": round(t_scan / t_index, 1),
            "resume_full_pool_replicas": len(held), "resume_full_pool_ms": round(1e3 * resume_s, 1),
            "resume_full_pool_us_per_replica": round(1e6 * resume_s / len(held), 2)}
