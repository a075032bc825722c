"""A finding of the fault soak, reduced to one engine on the in-process coordinator twin.

In the soak, leases pinned ``host:wb`` replicas the worker no longer held (hit validation
failed at its *presence* layer, 8 times in one 3-cycle run, always at ``host:wb``), and at the
end the ledger listed a READY host replica that wb's inventory did not have. The mechanism:

1. a request's read lease pins a replica in the worker's host tier;
2. while the lease lives, the host tier's LRU pushes that replica out (another GPU eviction
   copied into the host tier) — the worker drops the bytes and publishes READY → EVICTED;
3. the ledger rejects the eviction ("pinned by a live lease") and keeps the replica READY;
4. the lease ends: the ledger now lists a READY host replica that exists nowhere, and offers
   it to the next request, whose presence check fails (it recomputes: correct, but a lost hit).

docs/architecture.md's invariant 4 says a READY replica under a read lease is never evicted; the GPU
pools honour it (the engine never picks a pinned block as a local LRU victim), the host tier
did not. No wrong answer comes of it (validation catches it), and the audit does not see it
(it compared GPU replicas only then). Fixed: the host tier's LRU skips entries live leases pin
(``worker.cache.host_tier``), and when only pinned ones could make room the new block goes to
the disk tier instead.
"""

from __future__ import annotations

import asyncio

import torch

from shared.config import parse_config
from shared.messages import ReplicaState
from tests.twin import InProcessCoordinator
from worker.client import CoordinatorUnavailable
from worker.engine import Engine
from worker.model import build_model

torch.set_num_threads(1)
SWA_BLOCK = 24576          # bytes of one block's window form in the tiny model


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def small_tiers_engine(tmp_path) -> tuple[Engine, InProcessCoordinator]:
    """Two window slots on the GPU, room for two window blocks in the host tier, no disk tier."""
    cfg = parse_config({
        "cache": {"chunk_blocks": 1, "host_tier_bytes": 2 * SWA_BLOCK + 1000, "offload_dir": "", "offload_threshold": 1.0,
                  "compressed_pool_limit": 0.5, "tail_pool_limit": 0.2, "swa_pool_limit": 0.07, "tier_retry_ms": 50},
        "worker": {"worker_id": "w1", "pool_bytes": 2**20, "outbox_resend_ms": 200},
        "coordinator": {"heartbeat_interval_ms": 100},
        "state_dir": str(tmp_path / "state")})
    twin = InProcessCoordinator()
    return Engine(build_model(seed=0), cfg, twin), twin


def ledger_host_ready(twin: InProcessCoordinator, host: str) -> set[tuple[str, str]]:
    return {k[:2] for k, r in twin.state.replicas.items() if k[2] == host and r.state is ReplicaState.READY}


async def settled(engine: Engine) -> None:
    """Until the spill queue holds nothing but victims whose eviction is still undecided."""
    for _ in range(100):
        if all(not engine.tiers.needs_disk(m) for m, _, _ in engine.tiers.take_spills()):
            return
        await asyncio.sleep(0.02)


async def test_a_host_replica_pinned_by_a_lease_is_not_dropped_behind_the_ledgers_back(tmp_path) -> None:
    engine, twin = small_tiers_engine(tmp_path)
    assert engine.slots["swa"] == 2
    await engine.start()
    try:
        a, b = prompt(48, seed=1), prompt(48, seed=2)
        await engine.generate(a, max_tokens=1)      # A's window blocks 0, 1 on the GPU
        await engine.generate(b, max_tokens=1)      # B's push them out: copied to the host tier
        assert await engine.flush()
        host = f"host:{engine.worker_id}"
        assert {(r.block_hash, r.form) for r in engine.tiers.host_items()} == ledger_host_ready(twin, host)

        # A again: its lease pins A's host replicas; its write grant evicts B's window blocks,
        # whose copies push A's out of the host tier while the lease still pins them
        s = await engine.open(a, max_new_tokens=1)
        pinned = {(r.block_hash, r.form) for lease in s.leases for r in lease.grant.read if r.location == host}
        assert pinned, "the lease pinned no host replica: the scenario did not happen"
        assert await engine.flush()
        await engine.close(s)
        assert await engine.flush()

        refused = [reason for t, reason in twin.rejected if t.location == host and "pinned" in reason]
        worker_has = {(r.block_hash, r.form) for r in engine.tiers.host_items()}
        ledger_has = ledger_host_ready(twin, host)
        assert ledger_has == worker_has, (f"ledger lists {len(ledger_has - worker_has)} READY host replica(s) the "
                                          f"worker dropped; evictions refused: {refused}")
    finally:
        await engine.stop()


async def test_a_host_victim_pinned_by_a_grant_the_worker_has_not_heard_of_keeps_its_bytes(tmp_path) -> None:
    """The race the local pin check leaves open: the coordinator grants a lease pinning a host
    replica after the worker's LRU chose it as a victim and before the ledger hears of the
    eviction (the grant's reply is still on its way: the worker's own pin check cannot see it).
    Reported after the fact, the eviction was refused and the ledger kept listing a READY host
    replica whose bytes were gone; decided by the coordinator (``HostEvict``), the pinned victim
    stays a host replica."""
    engine, twin = small_tiers_engine(tmp_path)
    await engine.start()
    host = f"host:{engine.worker_id}"
    granted: list[tuple[str, str, str]] = []
    on_evict = engine.tiers.host.on_evict

    def victim_chosen(key, data, digest) -> None:
        on_evict(key, data, digest)
        r = twin.state.replicas.get((*key, host))
        if r is not None and r.state is ReplicaState.READY:
            r.pins += 1          # the ledger's side of a grant the worker has not heard of yet
            granted.append((*key, host))
    engine.tiers.host.on_evict = victim_chosen
    try:
        for seed in (1, 2, 3):   # A's, then B's window blocks are pushed down to the host tier, and out of it
            await engine.generate(prompt(48, seed=seed), max_tokens=1)
            await settled(engine)
        assert granted, "no host replica became an LRU victim: the scenario did not happen"
        worker_has = {(r.block_hash, r.form) for r in engine.tiers.host_items()}
        assert {k[:2] for k in granted} <= worker_has, "a victim the ledger pins lost its bytes"
        assert ledger_host_ready(twin, host) == worker_has
        assert all(engine.tiers.host_read(*k[:2])[1] is not None for k in granted)
        assert engine.metrics.value("kvl_worker_host_evictions_total", {"outcome": "pinned"}) >= 1
        assert engine.tiers.evictions_waiting == len(set(granted))
        for key in set(granted):  # the grants end: the victims go at the next ask
            twin.state.replicas[key].pins -= granted.count(key)
        engine.tiers.host.on_evict = on_evict
        for _ in range(100):
            if not engine.tiers.evictions_waiting:
                break
            await asyncio.sleep(0.02)
        assert not engine.tiers.evictions_waiting
        assert ledger_host_ready(twin, host) == {(r.block_hash, r.form) for r in engine.tiers.host_items()}
        assert not {k[:2] for k in granted} & ledger_host_ready(twin, host)
        refused = [reason for t, reason in twin.rejected if t.location == host]
        assert not refused, refused
    finally:
        await engine.stop()


async def test_host_victims_wait_for_the_coordinators_decision(tmp_path) -> None:
    """With no answer to its ``HostEvict`` the worker keeps the victims (readable, in its
    inventory, counted as deferred) and asks again later; once the coordinator decides, they go."""
    engine, twin = small_tiers_engine(tmp_path)
    await engine.start()
    host = f"host:{engine.worker_id}"
    chosen: list[tuple[str, str]] = []
    on_evict, host_evict = engine.tiers.host.on_evict, twin.host_evict
    silent = True

    def victim_chosen(key, data, digest) -> None:
        on_evict(key, data, digest)
        chosen.append(key)

    async def no_answer(msg):
        if silent:               # the request times out: the coordinator did not decide
            raise CoordinatorUnavailable("host_evict: coordinator did not answer within 5.0 s")
        return await host_evict(msg)
    engine.tiers.host.on_evict = victim_chosen
    twin.host_evict = no_answer
    try:
        for seed in (1, 2, 3):
            await engine.generate(prompt(48, seed=seed), max_tokens=1)
            if chosen:
                break
            assert await engine.flush()
        assert chosen, "no host replica became an LRU victim: the scenario did not happen"
        for _ in range(100):
            if engine.metrics.value("kvl_worker_host_evictions_total", {"outcome": "deferred"}) >= 1:
                break
            await asyncio.sleep(0.02)
        assert engine.metrics.value("kvl_worker_host_evictions_total", {"outcome": "deferred"}) >= 1
        held = {(r.block_hash, r.form) for r in engine.tiers.host_items()}
        assert set(chosen) <= held and set(chosen) <= ledger_host_ready(twin, host)
        assert all(engine.tiers.host_read(*key)[1] is not None for key in chosen)
        assert engine.metrics.value("kvl_worker_host_evictions_waiting") == engine.tiers.evictions_waiting >= 1
        silent = False
        for _ in range(200):
            if not engine.tiers.evictions_waiting:
                break
            await asyncio.sleep(0.02)
        assert not engine.tiers.evictions_waiting
        assert engine.metrics.value("kvl_worker_host_evictions_waiting") == 0
        assert not set(chosen) & {(r.block_hash, r.form) for r in engine.tiers.host_items()}
        assert not set(chosen) & ledger_host_ready(twin, host)
        assert ledger_host_ready(twin, host) == {(r.block_hash, r.form) for r in engine.tiers.host_items()}
    finally:
        await engine.stop()
