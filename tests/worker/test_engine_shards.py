"""A worker that is a member of two coordinator shards (``worker.shard_links``), on two twins whose
cores are shards 0 and 1 of one map: each shard fences the chains the map gives the other, so a
lease sent to the wrong shard fails and the request recomputes.

The real coordinators, NATS and PostgreSQL are in tests/e2e/test_sharded_stack.py; these check
the worker's side quickly: one epoch and outbox per shard, each lease and transition on its
chain's shard, a takeover or fence on one shard handled there only, each shard's inventory its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import pytest

from coordinator.audit import compare_tiers
from coordinator.core import CoreParams
from shared.hashing import chain_hashes
from shared.messages import InventoryRequest, ReplicaState
from shared.shards import ShardMap
from tests.twin import InProcessCoordinator
from tests.worker.conftest import BS, config, prompt
from worker.engine import Engine

PARTITIONS = 16
MAP = ShardMap.uniform(2, PARTITIONS)


@pytest.fixture
def sharded(model, tmp_path):
    """``async with sharded() as (engine, twins)``: a started engine on two twin shards."""

    @contextlib.asynccontextmanager
    async def make(**over: Any) -> AsyncIterator[tuple[Engine, list[InProcessCoordinator]]]:
        twins = [InProcessCoordinator(CoreParams(heartbeat_interval_ms=100, missed_heartbeats=50, shard=k,
                                                 shard_map=MAP)) for k in (0, 1)]
        cfg = config(tmp_path, **{"worker.worker_id": "w1", "coordinator.shards": 2,
                                  "coordinator.shard_partitions": PARTITIONS, **over})
        engine = Engine(model, cfg, twins[0], shard_clients=[twins[1]])
        await engine.start()
        try:
            yield engine, twins
        finally:
            await engine.stop()

    return make


def prompts_by_shard(engine: Engine, per_shard: int = 2) -> dict[int, list[list[int]]]:
    """``per_shard`` three-block prompts whose chains each shard owns."""
    out: dict[int, list[list[int]]] = {0: [], 1: []}
    seed = 100
    while min(len(v) for v in out.values()) < per_shard:
        p = prompt(3 * BS + 5, seed=seed)
        seed += 1
        k = MAP.owner(engine.namespace, chain_hashes(p, BS, engine.namespace, engine.salt("default"))[0])
        if len(out[k]) < per_shard:
            out[k].append(p)
    return out


def ready_blocks(twin: InProcessCoordinator) -> set[str]:
    return {key[0] for key, r in twin.state.replicas.items() if r.state is ReplicaState.READY}


async def assert_clean(twin: InProcessCoordinator, worker_id: str = "w1") -> None:
    """The audit's comparison on one shard: the worker's inventory for it against its ledger."""
    reply = await twin.inventory(worker_id, request=InventoryRequest(digests=True))
    tiers = compare_tiers(twin.state, worker_id, reply)
    assert not any(t.worker_only or t.ledger_only for t in tiers.values()), {
        loc: (len(t.worker_only), len(t.ledger_only)) for loc, t in tiers.items()}


async def test_each_chain_is_leased_committed_and_reused_on_its_own_shard(sharded) -> None:
    async with sharded() as (e, twins):
        assert [link.contact.epoch for link in e.links] == [1, 1]      # registered with both
        by_shard = prompts_by_shard(e)
        first = {}
        for k, ps in by_shard.items():
            for p in ps:
                r = await e.generate(p, max_tokens=2)
                assert r.cached_tokens == 0 and not r.fallbacks, (k, r.fallbacks)
                first[tuple(p)] = r.tokens
        assert await e.flush(timeout=10)
        for k, twin in enumerate(twins):
            mine = {h for p in by_shard[k] for h in chain_hashes(p, BS, e.namespace, e.salt("default"))}
            assert ready_blocks(twin) and ready_blocks(twin) <= mine, f"shard {k} holds only its own chains"
            # each shard counts its share of the pool (half each here), together never more than the pool
            assert twin.state.workers["w1"].pool_slots == {f: n * 8 // 16 for f, n in e.slots.items()}
        for ps in by_shard.values():
            for p in ps:
                again = await e.generate(p, max_tokens=2)
                assert again.cached_tokens == 3 * BS and again.tokens == first[tuple(p)]
        assert await e.flush(timeout=10)
        for twin in twins:
            await assert_clean(twin)


async def test_a_takeover_on_one_shard_suspends_only_that_shards_epoch(sharded) -> None:
    async with sharded() as (e, twins):
        by_shard = prompts_by_shard(e, per_shard=1)
        for ps in by_shard.values():
            await e.generate(ps[0], max_tokens=1)
        assert await e.flush(timeout=10)
        twins[1].take_over()
        # the suspended shard's chain: the engine resumes that epoch (its inventory of that shard) and reuses
        r1 = await e.generate(by_shard[1][0], max_tokens=1)
        assert r1.cached_tokens == 3 * BS, r1.fallbacks
        assert e.metrics.value("kvl_worker_resumes_total") == 1
        assert [link.contact.epoch for link in e.links] == [1, 1]
        assert not e.links.links[0].contact.suspended
        r0 = await e.generate(by_shard[0][0], max_tokens=1)
        assert r0.cached_tokens == 3 * BS
        assert await e.flush(timeout=10)
        for twin in twins:
            await assert_clean(twin)


async def test_a_fence_on_one_shard_drops_only_that_shards_blocks(sharded) -> None:
    async with sharded() as (e, twins):
        by_shard = prompts_by_shard(e, per_shard=1)
        for ps in by_shard.values():
            await e.generate(ps[0], max_tokens=1)
        assert await e.flush(timeout=10)
        held_before = {m.block_hash for _, _, m in e.store.items()}
        shard0 = set(chain_hashes(by_shard[0][0], BS, e.namespace, e.salt("default")))
        shard1 = set(chain_hashes(by_shard[1][0], BS, e.namespace, e.salt("default")))
        assert shard0 <= held_before and shard1 <= held_before
        e.links.links[1].contact.registration_lost("test: shard 1 fenced this epoch")
        r = await e.generate(by_shard[1][0], max_tokens=1)      # shard 1: a new epoch, its cache gone
        assert [link.contact.epoch for link in e.links] == [1, 2]
        assert r.cached_tokens == 0
        r0 = await e.generate(by_shard[0][0], max_tokens=1)
        assert r0.cached_tokens == 3 * BS, "shard 0's blocks stay"
        assert await e.flush(timeout=10)
        for twin in twins:
            await assert_clean(twin)


class StoredMap:
    """The stored shard map as the worker reads it (``shared.shard_store.ShardMapReader.newer``)."""

    def __init__(self, stored: ShardMap) -> None:
        self.stored = stored

    async def newer(self, held: ShardMap) -> ShardMap:
        return self.stored if self.stored.version > held.version else held


async def test_a_lease_refused_wrong_shard_rereads_the_map_and_asks_the_new_owner(sharded) -> None:
    async with sharded() as (e, twins):
        for t in e.supervisor.tasks:        # the map is not followed meanwhile: only the refusal makes it read
            if t.get_name() == "kvl-shard-map":
                t.cancel()
        p = prompts_by_shard(e, per_shard=1)[1][0]
        hashes = chain_hashes(p, BS, e.namespace, e.salt("default"))
        part = MAP.partition(e.namespace, hashes[0])
        moved = MAP.freeze(part, 0).open(part)          # a cold move of its (empty) partition to shard 0
        for twin in twins:
            twin.state.params = dataclasses.replace(twin.state.params, shard_map=moved)
        e.links.reader = StoredMap(moved)
        r = await e.generate(p, max_tokens=1)
        assert not r.fallbacks and e.links.map.version == 3
        assert e.metrics.value("kvl_worker_lease_errors_total", {"op": "acquire", "code": "wrong_shard"}) == 1
        assert await e.flush(timeout=10)
        assert set(hashes) <= ready_blocks(twins[0]) and not ready_blocks(twins[1])
        again = await e.generate(p, max_tokens=1)
        assert again.cached_tokens == 3 * BS
        for twin in twins:
            await assert_clean(twin)


async def _until(check, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "not within the time allowed"
        await asyncio.sleep(0.02)


async def test_a_shard_out_of_reach_degrades_only_its_own_chains(sharded) -> None:
    async with sharded() as (e, twins):
        by_shard = prompts_by_shard(e, per_shard=1)
        for ps in by_shard.values():
            await e.generate(ps[0], max_tokens=1)
        assert await e.flush(timeout=10)
        twins[1].down = True
        await _until(lambda: e.health().degraded)          # its next heartbeat goes unanswered
        h = e.health()
        assert h.contact == "unreachable" and h.reason.startswith("shard 1: ") and h.epoch == 1
        assert e.metrics.value("kvl_worker_degraded") == 1
        r0 = await e.generate(by_shard[0][0], max_tokens=1)       # shard 0 answers: its cache serves
        assert r0.cached_tokens == 3 * BS and not r0.degraded
        r1 = await e.generate(by_shard[1][0], max_tokens=1)       # shard 1's chain: recomputed
        assert r1.cached_tokens == 0 and r1.degraded
        twins[1].down = False
        await _until(lambda: not e.health().degraded)
        assert e.health().contact == "reachable" and e.metrics.value("kvl_worker_degraded") == 0
        again = await e.generate(by_shard[1][0], max_tokens=1)    # same epoch, cache kept
        assert again.cached_tokens == 3 * BS and [link.contact.epoch for link in e.links] == [1, 1]
