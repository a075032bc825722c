"""Eviction to host memory and to the shared offload directory, and reloads from both — on the
coordinator twin, two engines sharing one ledger and one directory."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter

import torch

from shared.hashing import chain_hashes
from shared.messages import ReplicaState
from tests.worker.conftest import core_accepts_lru_offload, prompt
from tests.twin import InProcessCoordinator
from tests.segment_files import flip_header, flip_payload, records


def same(a, b) -> bool:
    return a.tokens == b.tokens and torch.equal(a.logits, b.logits)


#: Pools of ~7 blocks per form, so a few 6-block prompts push each other out.
SMALL = {"worker.pool_bytes": 400_000, "cache.compressed_pool_limit": 0.1, "cache.swa_pool_limit": 0.7,
         "cache.tail_pool_limit": 0.18}
ONE_PROMPT = 6 * (2560 + 1024 + 6144 + 24576)


async def test_evicted_to_host_then_reloaded_bit_identical(make_engine, reference) -> None:
    p = prompt(100, seed=50)
    twin = InProcessCoordinator()
    async with make_engine(twin, **SMALL, **{"cache.host_tier_bytes": 4 * ONE_PROMPT,
                                              "cache.offload_dir": ""}) as e:
        await e.generate(p, max_tokens=1)
        await e.generate(prompt(100, seed=51), max_tokens=1)     # pushes p's blocks to the host tier
        await e.flush()
        assert e.metrics.value("kvl_worker_offload_bytes_total", {"tier": "host"}) > 0
        r = await e.generate(p, max_tokens=2)
        assert r.reloaded.get("host", 0) > 0 and r.cached_tokens == 96 and r.invalid == []
        assert same(r, await reference().generate(p, max_tokens=2))
    assert not [x for x in twin.rejected if x[0].location.startswith("host:")], twin.rejected[:3]


async def _fill_disk(make_engine, twin, prompts) -> None:
    """Worker ``wa`` caches ``prompts``, then pushes them out: GPU → host tier → offload files."""
    async with make_engine(twin, worker_id="wa", **SMALL, **{"cache.host_tier_bytes": ONE_PROMPT}) as a:
        for p in prompts:
            await a.generate(p, max_tokens=1)
        for seed in (52, 53, 54):
            await a.generate(prompt(100, seed=seed), max_tokens=1)
        assert await a.flush(timeout=10)
        assert a.metrics.value("kvl_worker_offload_bytes_total", {"tier": "host"}) > 0
        assert a.metrics.value("kvl_worker_offload_bytes_total", {"tier": "disk"}) > 0


async def test_host_then_disk_then_reload_in_another_worker(make_engine, reference, tmp_path) -> None:
    """Clean records reload bit-identically in another worker (it reads wa's segments); a
    record with a damaged header is skipped (that block alone is missing: recomputed) and one
    with a flipped payload byte is detected (integrity), marked INVALID, recomputed — same
    output, counted."""
    p1, p2, p3 = prompt(100, seed=50), prompt(100, seed=58), prompt(100, seed=59)
    twin = InProcessCoordinator()
    await _fill_disk(make_engine, twin, [p1, p2, p3])
    async with make_engine(twin, worker_id="wb", **SMALL) as b:
        salt_ns = (b.namespace, b.salt("default"))
        damaged = {}
        for p, how in ((p2, "header"), (p3, "payload")):
            recs = records(tmp_path / "offload", chain_hashes(p, 16, *salt_ns))
            assert recs
            for r in recs:
                (flip_header if how == "header" else flip_payload)(r)
            damaged[how] = p
        in_place = []                   # reloads read straight into the slot their grant reserved
        install_reserved = b.store.install_reserved
        b.store.install_reserved = lambda m, res: in_place.append(m.form) or install_reserved(m, res)

        def reserved_left() -> int:     # slots taken but neither installed nor given back
            return sum(not i.ready for pool in b.store.pools.pools.values() for i in pool.table.values())

        r = await b.generate(p1, max_tokens=2)
        assert r.reloaded.get("disk", 0) > 0 and r.cached_tokens > 0 and r.invalid == []
        assert same(r, await reference().generate(p1, max_tokens=2))
        assert in_place and reserved_left() == 0
        for how, p in damaged.items():
            r = await b.generate(p, max_tokens=2)
            assert same(r, await reference().generate(p, max_tokens=2)), how
            layer = "integrity:" if how == "payload" else "presence:"
            assert r.invalid and all(x.startswith(layer) for x in r.invalid), (how, r.invalid)
            assert reserved_left() == 0, how   # a slot read into and found damaged is given back
        assert b.tiers.disk_index_skipped >= 1
        v = b.metrics.value
        assert v("kvl_worker_reload_failures_total", {"tier": "disk", "reason": "integrity"}) >= 2
        assert v("kvl_worker_hit_invalid_total", {"layer": "integrity", "form": "compressed"}) >= 1
        await b.flush()
        states = twin.state.replicas
        # reloaded replicas became wb's GPU replicas; the damaged files' replicas are INVALID
        assert any(k[2] == "gpu:wb" and rep.state is ReplicaState.READY for k, rep in states.items())
        assert any(k[2] == "disk" and rep.state is ReplicaState.INVALID for k, rep in states.items())


async def test_a_reload_slot_recycled_during_the_restore_means_recompute(make_engine, reference, tmp_path) -> None:
    """A disk reload lands in a slot its grant reserved and the model restores from that slot. If
    the slot is freed while the model reads it (a new epoch clears the pools), what the restore
    read may not be what was validated: the request recomputes its prompt instead."""
    p1 = prompt(100, seed=50)
    twin = InProcessCoordinator()
    await _fill_disk(make_engine, twin, [p1])
    async with make_engine(twin, worker_id="wb", **SMALL) as b:
        ports, cleared = b.ports, []

        def clear_first(fn):
            if not cleared and "_restore" in fn.__qualname__:     # the restore after the disk read
                cleared.append(True)
                b.store.clear()         # what a new epoch does to every slot, reserved ones too
            return ports.runner.states(fn)

        # the request's model port: its restore clears the pools first
        b.ports = dataclasses.replace(ports, runner=dataclasses.replace(ports.runner, states=clear_first))
        r = await b.generate(p1, max_tokens=2)
        assert "slot_recycled" in r.fallbacks and r.cached_tokens == 0
        assert same(r, await reference().generate(p1, max_tokens=2))
        assert all(i.ready for pool in b.store.pools.pools.values() for i in pool.table.values())


async def test_a_reservation_lost_before_its_commit_is_an_abort_not_a_replica(make_engine) -> None:
    """A granted reload read into a reserved slot commits it in place; if the slot was freed since
    (a new epoch clears the pools), the engine must not mark whatever the slot holds now READY:
    the write is aborted. With the outbox full the reservation is given back."""
    async with make_engine(InProcessCoordinator()) as e:
        await e.generate(prompt(40, seed=60), max_tokens=1)
        meta = next(m for f, _, m in e.store.items() if f == "compressed")
        e.store.drop("compressed", meta.block_hash)
        res = e.store.reserve("compressed", meta.block_hash)
        e.store.clear()
        aborts = e.metrics.value("kvl_worker_transitions_total", {"kind": "abort"}) or 0
        commits = e.metrics.value("kvl_worker_transitions_total", {"kind": "commit"}) or 0
        e.commit(meta, res, lease_id="l1")
        assert e.metrics.value("kvl_worker_transitions_total", {"kind": "abort"}) == aborts + 1
        assert (e.metrics.value("kvl_worker_transitions_total", {"kind": "commit"}) or 0) == commits
        assert e.store.lookup("compressed", meta.block_hash) is None
        held = e.store.reserve("compressed", meta.block_hash)
        e.publisher.outbox.capacity = 0                     # full: nothing may be committed now
        assert e.commit(meta, held, lease_id="l1") == 0 and not e.store.holds(held)


async def test_a_worker_whose_fused_forward_differed_disowns_its_disk_copies(
        make_engine, reference, monkeypatch, tmp_path) -> None:
    """A failed run-time batch-invariance check drops the worker's cache with its epoch; its
    copies on the shared disk outlive the epoch, so it disowns them when it registers again: the
    ledger marks them INVALID, and with them another worker's reload of one of them (the same
    bytes: found by content), which that worker is told to drop. It recomputes both prompts
    instead of reusing bytes that may differ from a cold run."""
    from worker.stepper import FusedMismatch
    p1, p2 = prompt(100, seed=50), prompt(100, seed=51)
    twin = InProcessCoordinator()
    async with make_engine(twin, worker_id="wa", **SMALL, **{"cache.host_tier_bytes": ONE_PROMPT,
                                                              "service.fused_check_every": 1}) as a:
        for p in (p1, p2):
            await a.generate(p, max_tokens=1)
        for seed in (52, 53, 54):                        # pushes p1 and p2 out: GPU → host → disk
            await a.generate(prompt(100, seed=seed), max_tokens=1)
        assert await a.flush(timeout=10)
        on_disk = {k for k, r in twin.state.replicas.items() if k[2] == "disk" and r.state is ReplicaState.READY}
        async with make_engine(twin, worker_id="wb", **SMALL) as b:
            p2_blocks = chain_hashes(p2, 16, b.namespace, b.salt("default"))
            assert {k[0] for k in on_disk} >= set(p2_blocks[:5])
            r = await b.generate(p2, max_tokens=1)       # wb reloads wa's copies of p2
            assert r.reloaded.get("disk", 0) > 0
            assert await b.flush(timeout=10)
            reloaded = {k for k, rep in twin.state.replicas.items()
                        if k[2] == "gpu:wb" and k[0] in p2_blocks and rep.state is ReplicaState.READY}
            assert reloaded
            hidden = a.model._hidden
            monkeypatch.setattr(a.model, "_hidden",
                                lambda ids, batch, need: hidden(ids, batch, need) * (1 + 1e-3 * ids.numel()))
            monkeypatch.setattr(a.model, "batch_invariant", True)      # restored afterwards
            got = await asyncio.gather(*(a.generate(prompt(20, seed=60 + k), max_tokens=4) for k in range(3)),
                                       return_exceptions=True)
            assert any(isinstance(r, FusedMismatch) for r in got), got
            deadline = time.monotonic() + 10
            while not (a.registered and a.epoch == 2) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert a.registered and a.epoch == 2
            monkeypatch.setattr(a.model, "_hidden", hidden)
            # INVALID (or already past the owner's tombstone ring): none is READY any more
            states = twin.state.replicas
            assert {states[k].state for k in on_disk | reloaded if k in states} <= {ReplicaState.INVALID}
            assert a.metrics.value("kvl_worker_disowned_replicas_total") >= len(on_disk) + len(reloaded)
            assert not (tmp_path / "state" / "disown-wa").exists()     # carried out: nothing left to do
            assert all(b.store.lookup(k[1], k[0]) is None for k in reloaded)   # wb was told to drop them
            for p in (p1, p2):
                r = await b.generate(p, max_tokens=2)
                assert not r.reloaded.get("disk") and r.cached_tokens == 0
                assert same(r, await reference().generate(p, max_tokens=2))


async def test_a_disown_not_yet_registered_survives_a_restart(make_engine, tmp_path) -> None:
    """The disown is kept on disk (``<state_dir>/disown-<worker>``) until a registration carried
    it: a worker process that stopped between a failed run-time check and its next registration
    disowns its disk copies when it starts again."""
    twin = InProcessCoordinator()
    await _fill_disk(make_engine, twin, [prompt(100, seed=50)])
    on_disk = {k for k, r in twin.state.replicas.items() if k[2] == "disk" and r.state is ReplicaState.READY}
    assert on_disk
    marker = tmp_path / "state" / "disown-wa"
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("a fused forward differed\n")
    async with make_engine(twin, worker_id="wa", **SMALL) as a:
        assert a.registered and not marker.exists()
        assert a.metrics.value("kvl_worker_disowned_replicas_total") >= len(on_disk)
    assert not {k for k in on_disk if k in twin.state.replicas and twin.state.replicas[k].state is ReplicaState.READY}


def test_core_accepts_offload_of_lru_victims() -> None:
    """The worker copies an LRU victim down a tier *after* the grant that evicted it; the
    coordinator must accept that offload (its source is EVICTED by then)."""
    assert core_accepts_lru_offload()


async def test_unwritable_offload_directory_keeps_serving(make_engine, reference, tmp_path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the directory should be")
    p = prompt(100, seed=55)
    async with make_engine(InProcessCoordinator(), **SMALL, **{"cache.host_tier_bytes": 0,
                                                                "cache.offload_dir": str(blocker / "x")}) as e:
        for seed in (55, 56, 57):
            r = await e.generate(prompt(100, seed=seed), max_tokens=1)
        await e.flush()
        assert e.checked is not None and e.checked.offload.startswith("failed: cannot create the directory")
        assert e.metrics.value("kvl_worker_tier_unavailable_total", {"tier": "disk"}) >= 1
        assert e.health().disk_tier == "down"
        r = await e.generate(p, max_tokens=2)
        assert same(r, await reference().generate(p, max_tokens=2))


async def test_the_disk_tier_stays_within_its_bound_and_never_drops_a_pinned_or_ready_replica(
        make_engine, reference, tmp_path) -> None:
    """cache.offload_dir_bytes: the worker deletes its oldest segments once the ledger evicted
    what they hold; a segment holding a replica a live lease pins stays; every replica the
    ledger lists READY on disk still has its record."""
    twin = InProcessCoordinator()
    seg = 64 * 1024
    bound = 12 * seg                                     # ~4 prompts' worth of every form
    over = {**SMALL, "cache.host_tier_bytes": 0, "cache.offload_dir_bytes": bound, "cache.offload_segment_bytes": seg}
    root = tmp_path / "offload"

    def ready_on_disk() -> set[tuple[str, str]]:
        return {k[:2] for k, r in twin.state.replicas.items() if k[2] == "disk" and r.state is ReplicaState.READY}

    async with make_engine(twin, worker_id="wa", **over) as a:
        first = prompt(100, seed=70)
        await a.generate(first, max_tokens=1)
        for seed in range(71, 73):                       # push `first` out to disk
            await a.generate(prompt(100, seed=seed), max_tokens=1)
        assert await a.flush(timeout=10)
        s = await a.open(first, max_new_tokens=1)        # a lease pins first's disk replicas
        pinned = {(r.block_hash, r.form) for lease in s.leases for r in lease.grant.read if r.location == "disk"}
        assert pinned
        for seed in range(76, 100):                      # far past the bound
            await a.generate(prompt(100, seed=seed), max_tokens=1)
        assert await a.flush(timeout=10)
        held = {(r.header.block_hash, r.header.form) for r in records(root)}
        assert pinned <= held                            # the pinned ones' segment was kept
        assert a.metrics.value("kvl_worker_disk_gc_segments_total", {"outcome": "pinned"}) >= 1
        await a.close(s)
        await a.generate(prompt(100, seed=100), max_tokens=1)
        assert await a.flush(timeout=10)
        assert a.metrics.value("kvl_worker_disk_gc_segments_total", {"outcome": "deleted"}) >= 3
        usage = a.tiers.disk_usage()
        assert usage <= bound + 2 * seg, usage           # the bound, give or take the open segment and a batch
        assert ready_on_disk() <= {(r.header.block_hash, r.header.form) for r in records(root)}
        evicted = [k for k, r in twin.state.replicas.items() if k[2] == "disk" and r.state is ReplicaState.EVICTED]
        assert evicted                                   # each deleted record's replica, in the ledger
        r = await a.generate(first, max_tokens=2)
        assert same(r, await reference().generate(first, max_tokens=2))


async def test_above_the_threshold_cold_replicas_are_copied_down_before_they_are_evicted(
        make_engine, reference, tmp_path) -> None:
    """cache.offload_threshold: past it, the coldest GPU replicas get a host copy while they
    stay READY on the GPU; the eviction that follows copies nothing again; reuse is exact."""
    twin = InProcessCoordinator()
    over = {**SMALL, "cache.host_tier_bytes": 8 * ONE_PROMPT, "cache.offload_dir": "", "cache.offload_threshold": 0.5}
    async with make_engine(twin, **over) as e:
        first = prompt(100, seed=80)
        await e.generate(first, max_tokens=1)
        await e.generate(prompt(100, seed=81), max_tokens=1)
        assert await e.flush(timeout=10)
        pre = sum(e.metrics.value("kvl_worker_pre_offloaded_blocks_total", {"form": f}) for f in e.slots)
        assert pre > 0
        both = [k[:2] for k, r in twin.state.replicas.items() if r.state is ReplicaState.READY
                and k[2] == "host:w1" and twin.state.replica_state((k[0], k[1], "gpu:w1")) is ReplicaState.READY]
        assert both                                      # copied down, still on the GPU
        for seed in range(82, 86):                       # now the pools run out: evictions
            await e.generate(prompt(100, seed=seed), max_tokens=1)
        assert await e.flush(timeout=10)
        evicted_backed = [k for k in both if twin.state.replica_state((*k, "gpu:w1")) is not ReplicaState.READY]
        assert evicted_backed                            # some of the copied ones were evicted since ...
        assert all(twin.state.replica_state((*k, "host:w1")) is ReplicaState.READY for k in evicted_backed)
        copies = Counter((t.block_hash, t.form) for t in twin.published
                         if t.location == "host:w1" and t.from_state is None and t.to_state is ReplicaState.READY)
        assert all(copies[k] == 1 for k in evicted_backed), copies   # their eviction copied nothing again
        r = await e.generate(first, max_tokens=2)
        assert r.reloaded.get("host", 0) > 0 and same(r, await reference().generate(first, max_tokens=2))
        assert not [x for x in twin.rejected if x[0].location.startswith("host:")], twin.rejected[:3]


async def test_an_invalidation_drops_a_block_queued_for_the_disk_writer(make_engine) -> None:
    """A GPU victim waiting for the disk writer (no host tier) is bytes the worker still holds:
    an ``invalidate_block`` control drops it there too, so no disk copy of the invalidated
    block is written and offered to the ledger afterwards; other queued blocks stay."""
    from shared.messages import Control
    twin = InProcessCoordinator()
    async with make_engine(twin, worker_id="wa", **SMALL) as a:
        await a.generate(prompt(40, seed=70), max_tokens=1)
        assert await a.flush(timeout=10)
        metas = [m for _, _, m in a.store.items()]
        first = metas[0]
        other = next(m for m in metas if m.block_hash != first.block_hash)
        for m in (first, other):
            a.tiers.spill_direct(m, torch.zeros(4))      # queued, the writer not woken
        ack = await a.on_control(Control(action="invalidate_block", block_hash=first.block_hash, reason="test"))
        assert ack.affected >= 2                          # its GPU forms and the queued copy
        assert {m.block_hash for m, _, _ in a.tiers.take_spills()} == {other.block_hash}
        a.tiers.spilled(other)


async def test_an_invalidation_control_drops_only_the_incarnations_it_names(make_engine) -> None:
    """A block's control names the generation of each GPU replica the decision covered: a slot
    holding another generation (a new incarnation written before the control arrived, which
    the ledger lists READY) is kept; the named one is dropped; forms not named are kept."""
    from shared.messages import Control
    twin = InProcessCoordinator()
    async with make_engine(twin, worker_id="wa", **SMALL) as a:
        await a.generate(prompt(40, seed=71), max_tokens=1)
        assert await a.flush(timeout=10)
        block = next(m.block_hash for _, _, m in a.store.items())
        held = {f: m.generation for f, _, m in a.store.items() if m.block_hash == block}
        assert len(held) >= 2
        named, *kept = sorted(held)
        stale = await a.on_control(Control(action="invalidate_block", block_hash=block, reason="test",
                                           generations={named: held[named] + 1}))
        assert stale.affected == 0
        ack = await a.on_control(Control(action="invalidate_block", block_hash=block, reason="test",
                                         generations={named: held[named]}))
        assert ack.affected == 1
        assert {f for f, _, m in a.store.items() if m.block_hash == block} == set(kept)


async def test_one_control_drops_every_block_it_names_at_its_generations(make_engine) -> None:
    """What the coordinator sends: ``invalidate_blocks`` names several blocks, each with its
    GPU generations; each goes as its own ``invalidate_block`` would have it (a block named at
    a generation it no longer has stays), and the blocks not named stay."""
    from shared.messages import BlockDrop, Control
    twin = InProcessCoordinator()
    async with make_engine(twin, worker_id="wa", **SMALL) as a:
        await a.generate(prompt(64, seed=73), max_tokens=1)
        assert await a.flush(timeout=10)
        held: dict[str, dict[str, int]] = {}
        for f, _, m in a.store.items():
            held.setdefault(m.block_hash, {})[f] = m.generation
        assert len(held) >= 3
        dropped, stale, untouched = list(held)[:3]
        ack = await a.on_control(Control(action="invalidate_blocks", reason="test", blocks=[
            BlockDrop(block_hash=dropped, generations=held[dropped]),
            BlockDrop(block_hash=stale, generations={f: g + 1 for f, g in held[stale].items()})]))
        assert ack.affected == len(held[dropped])
        left = {m.block_hash for _, _, m in a.store.items()}
        assert dropped not in left and {stale, untouched} <= left


async def test_a_host_copy_the_ledger_refuses_is_dropped(make_engine) -> None:
    """A copy to the host tier names its source by checksum; when the ledger refuses it (the
    source left its owner's tombstones meanwhile, or was invalidated) the worker would hold bytes
    the ledger does not list. The watermark names the refused seq and the copy goes; a copy the
    ledger accepted stays."""
    import msgspec
    twin = InProcessCoordinator()
    async with make_engine(twin, worker_id="wa", **SMALL, **{"cache.host_tier_bytes": ONE_PROMPT,
                                                              "cache.offload_dir": ""}) as a:
        await a.generate(prompt(40, seed=72), max_tokens=1)
        assert await a.flush(timeout=10)
        (_, _, good), (_, _, other) = list(a.store.items())[:2]
        unknown = msgspec.structs.replace(other, checksum="0" * len(other.checksum))   # no such source
        for meta in (good, unknown):
            a.replicas.offload_copy(meta, torch.zeros(8))
            assert a.tiers.holds(meta)
        assert await a.flush(timeout=10)
        assert [(e.block_hash, e.form) for e, _ in twin.rejected if e.location.startswith("host:")] == [
            (unknown.block_hash, unknown.form)]
        assert not a.tiers.holds(unknown) and a.tiers.holds(good)
        assert a.metrics.value("kvl_worker_refused_copies_total") == 1
        assert not a.replicas.offers                             # both settled
