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

import torch

from shared.config import parse_config
from shared.messages import ReplicaState
from tests.twin import InProcessCoordinator
from worker.engine import Engine
from worker.model import build_model

torch.set_num_threads(1)
SWA_BLOCK = 24576          # bytes of one block's window form in the tiny model


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def test_a_host_replica_pinned_by_a_lease_is_not_dropped_behind_the_ledgers_back(tmp_path) -> None:
    # two window slots on the GPU, room for two window blocks in the host tier, no disk tier
    cfg = parse_config({
        "cache": {"chunk_blocks": 1, "host_tier_bytes": 2 * SWA_BLOCK + 1000, "offload_dir": "", "offload_threshold": 1.0,
                  "compressed_pool_limit": 0.5, "tail_pool_limit": 0.2, "swa_pool_limit": 0.07},
        "worker": {"worker_id": "w1", "pool_bytes": 2**20, "outbox_resend_ms": 200},
        "coordinator": {"heartbeat_interval_ms": 100},
        "state_dir": str(tmp_path / "state")})
    twin = InProcessCoordinator()
    engine = Engine(build_model(seed=0), cfg, twin)
    assert engine.slots["swa"] == 2
    await engine.start()
    try:
        a, b = prompt(48, seed=1), prompt(48, seed=2)
        await engine.generate(a, max_tokens=1)      # A's window blocks 0, 1 on the GPU
        await engine.generate(b, max_tokens=1)      # B's push them out: copied to the host tier
        assert await engine.flush()
        host = f"host:{engine.worker_id}"
        assert {(r.block_hash, r.form) for r in engine.tiers.host_items()} == \
            {k[:2] for k, r in twin.state.replicas.items() if k[2] == host and r.state is ReplicaState.READY}

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
        ledger_has = {k[:2] for k, r in twin.state.replicas.items() if k[2] == host and r.state is ReplicaState.READY}
        assert ledger_has == worker_has, (f"ledger lists {len(ledger_has - worker_has)} READY host replica(s) the "
                                          f"worker dropped; evictions refused: {refused}")
    finally:
        await engine.stop()
