"""A GPU pool whose view diverged from the ledger's: a granted write finds the pool full.

The ledger counts a slot free that the worker still holds (e.g. a commit it rejected after the
write's lease ended). The worker used to evict its own coldest unpinned block and report the
eviction after the fact — the host tier's old race on the GPU: a grant already on its way,
pinning that block, was invisible to the worker's pin check, the ledger refused the eviction and
kept listing a READY replica whose bytes were gone. Now the write is aborted and the coordinator
decides which of the worker's coldest replicas go (``HostEvict``, tier ``gpu``); a name the
ledger does not list READY (the slot it does not count) goes too, which heals the divergence.
"""

from __future__ import annotations

import asyncio

from coordinator.core import apply
from coordinator.core.commands import evict_replica
from shared.messages import ReplicaState
from tests.faults.test_host_tier_pins import prompt, small_tiers_engine
from worker.client import CoordinatorUnavailable
from worker.engine import Engine


def gpu_ready(engine: Engine, twin, form: str) -> tuple[set[str], set[str]]:
    """(blocks of ``form`` the worker holds READY on its GPU, those the ledger lists READY there)."""
    worker = {m.block_hash for f, _, m in engine.store.items() if f == form}
    ledger = {k[0] for k, r in twin.state.replicas.items()
              if k[1] == form and k[2] == engine.gpu and r.state is ReplicaState.READY}
    return worker, ledger


async def until(cond, tries: int = 200) -> bool:
    for _ in range(tries):
        if cond():
            return True
        await asyncio.sleep(0.02)
    return cond()


def forget(twin, engine: Engine, block_hash: str, form: str) -> None:
    """The ledger evicts a GPU replica the worker is never told about: a slot it no longer counts."""
    for e in evict_replica(twin.state, (block_hash, form, engine.gpu), 0):
        apply(twin.state, e)


async def test_a_slot_the_ledger_does_not_count_is_found_and_freed(tmp_path) -> None:
    engine, twin = small_tiers_engine(tmp_path)
    assert engine.slots["swa"] == 2
    await engine.start()
    try:
        await engine.generate(prompt(48, seed=1), max_tokens=1)     # A's two window blocks fill the pool
        assert await engine.flush()
        held, listed = gpu_ready(engine, twin, "swa")
        assert len(held) == 2 and held == listed
        phantom = engine.store.coldest_metas("swa", 1, lambda m: True)[0].block_hash
        forget(twin, engine, phantom, "swa")
        await engine.generate(prompt(48, seed=2), max_tokens=1)     # B's writes: one finds the pool full
        assert engine.metrics.value("kvl_worker_pool_divergences_total", {"form": "swa"}) >= 1
        assert await until(lambda: phantom not in gpu_ready(engine, twin, "swa")[0])
        assert engine.metrics.value("kvl_worker_pool_room_evictions_total", {"outcome": "evicted"}) >= 1
        assert await engine.flush()
        held, listed = gpu_ready(engine, twin, "swa")
        assert held == listed, (held, listed)
        assert not [r for t, r in twin.rejected if t.location == engine.gpu], twin.rejected
        # healed: the next prompt's writes all fit
        before = engine.metrics.value("kvl_worker_pool_divergences_total", {"form": "swa"})
        await engine.generate(prompt(48, seed=3), max_tokens=1)
        assert await engine.flush()
        assert engine.metrics.value("kvl_worker_pool_divergences_total", {"form": "swa"}) == before
        assert gpu_ready(engine, twin, "swa")[0] == gpu_ready(engine, twin, "swa")[1]
    finally:
        await engine.stop()


async def test_a_gpu_block_pinned_by_a_grant_the_worker_has_not_heard_of_keeps_its_bytes(tmp_path) -> None:
    """The coldest block, the one the worker's own pin check would give up, is pinned by a grant
    whose reply has not reached the worker: the coordinator keeps it, bytes and READY replica;
    the next refused write asks about the next coldest, the slot the ledger does not count."""
    engine, twin = small_tiers_engine(tmp_path)
    await engine.start()
    try:
        await engine.generate(prompt(48, seed=1), max_tokens=1)
        assert await engine.flush()
        cold, phantom = (m.block_hash for m in engine.store.coldest_metas("swa", 2, lambda m: True))
        twin.state.replicas[(cold, "swa", engine.gpu)].pins += 1   # the ledger's side of the unseen grant
        forget(twin, engine, phantom, "swa")
        seed = 2
        while engine.metrics.value("kvl_worker_pool_divergences_total", {"form": "swa"}) < 1 and seed < 6:
            await engine.generate(prompt(48, seed=seed), max_tokens=1)
            seed += 1
            await until(lambda: not engine.replicas.making_room)
        assert engine.metrics.value("kvl_worker_pool_divergences_total", {"form": "swa"}) >= 1
        assert cold in gpu_ready(engine, twin, "swa")[0], "a block the ledger pins lost its bytes"
        assert engine.store.lookup("swa", cold) is not None
        assert engine.metrics.value("kvl_worker_pool_room_evictions_total", {"outcome": "pinned"}) >= 1
        while phantom in gpu_ready(engine, twin, "swa")[0] and seed < 10:
            await engine.generate(prompt(48, seed=seed), max_tokens=1)
            seed += 1
            await until(lambda: not engine.replicas.making_room)
        assert phantom not in gpu_ready(engine, twin, "swa")[0], "the slot the ledger does not count was never freed"
        assert cold in gpu_ready(engine, twin, "swa")[0]
        assert await engine.flush()
        held, listed = gpu_ready(engine, twin, "swa")
        assert held == listed, (held, listed)
        assert not [r for t, r in twin.rejected if t.location == engine.gpu], twin.rejected
    finally:
        await engine.stop()


async def test_an_unanswered_request_for_room_is_asked_again(tmp_path) -> None:
    """No answer (the coordinator did not decide, or its answer was lost after it evicted): the
    victims keep their bytes, counted as deferred, and the worker asks again after
    ``cache.tier_retry_ms`` without waiting for another refused write."""
    engine, twin = small_tiers_engine(tmp_path)
    host_evict, calls = twin.host_evict, []

    async def first_unanswered(msg):
        calls.append(msg.tier)
        if len(calls) == 1:
            raise CoordinatorUnavailable("host_evict: coordinator did not answer within 5.0 s")
        return await host_evict(msg)
    twin.host_evict = first_unanswered
    await engine.start()
    try:
        await engine.generate(prompt(48, seed=1), max_tokens=1)
        assert await engine.flush()
        phantom = engine.store.coldest_metas("swa", 1, lambda m: True)[0].block_hash
        forget(twin, engine, phantom, "swa")
        await engine.generate(prompt(48, seed=2), max_tokens=1)
        assert await until(lambda: engine.metrics.value("kvl_worker_pool_room_evictions_total",
                                                        {"outcome": "deferred"}) >= 1)
        assert phantom in gpu_ready(engine, twin, "swa")[0]            # kept without a decision
        assert await until(lambda: phantom not in gpu_ready(engine, twin, "swa")[0])   # asked again: freed
        assert calls == ["gpu", "gpu"]
        assert await engine.flush()
        held, listed = gpu_ready(engine, twin, "swa")
        assert held == listed, (held, listed)
    finally:
        await engine.stop()
