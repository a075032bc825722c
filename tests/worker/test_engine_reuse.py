"""The engine on the in-process coordinator twin: reuse is exact, bounded and never stale.

Every warm result is compared with a cache-disabled engine's cold run with ``torch.equal``
(logits and tokens), never a tolerance.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from tests.worker.conftest import BS, prompt
from tests.twin import InProcessCoordinator


def same(a, b) -> bool:
    return a.tokens == b.tokens and torch.equal(a.logits, b.logits)


#: ``service.state_thread``: states built and restored on the model thread, or on one of their own.
STATE_THREAD = pytest.mark.parametrize("own", [False, True], ids=["model-thread", "state-thread"])


@STATE_THREAD
async def test_second_request_reuses_and_is_bit_identical(make_engine, reference, own) -> None:
    toks = prompt(100, seed=1)
    cold = await reference().generate(toks, max_tokens=3)
    twin = InProcessCoordinator()
    async with make_engine(twin, **{"service.state_thread": own}) as e:
        addresses = e.pool_addresses()
        first = await e.generate(toks, max_tokens=3)
        assert first.cached_tokens == 0 and first.fallbacks == []
        second = await e.generate(toks, max_tokens=3)
        assert second.cached_tokens == 96 and second.hit_tokens == 96 and second.invalid == []
        assert same(cold, first) and same(cold, second)
        m = e.metrics
        assert m.value("kvl_worker_prefix_cache_queries_total") == 200
        assert m.value("kvl_worker_prefix_cache_validated_hits_total") == 96
        assert m.value("kvl_worker_hit_validation_total", {"layer": "integrity", "outcome": "pass"}) == second.validated
        assert e.pool_addresses() == addresses          # static topology
        assert e.health().pool_used["compressed"] == 6
    assert not twin.rejected


async def test_shared_prefix_different_suffixes(make_engine, reference) -> None:
    base = prompt(64, seed=2)
    a, b = base + prompt(40, seed=3), base + prompt(23, seed=4)
    ref = reference()
    async with make_engine(InProcessCoordinator()) as e:
        ra = await e.generate(a, max_tokens=2)
        rb = await e.generate(b, max_tokens=2)
        assert rb.cached_tokens == 64
        assert same(ra, await ref.generate(a, max_tokens=2))
        assert same(rb, await ref.generate(b, max_tokens=2))


async def test_prefix_ending_mid_block_reuses_the_largest_whole_block_boundary(make_engine, reference) -> None:
    base = prompt(70, seed=5)             # 4 whole blocks + 6 tokens
    a, b = base + prompt(30, seed=6), base + prompt(30, seed=7)
    async with make_engine(InProcessCoordinator()) as e:
        await e.generate(a, max_tokens=1)
        rb = await e.generate(b, max_tokens=2)
        assert rb.cached_tokens == 64
        assert same(rb, await reference().generate(b, max_tokens=2))


async def test_minimum_reuse_is_one_block(make_engine, reference) -> None:
    one = prompt(BS, seed=8)
    a, b = one + prompt(1, seed=9), one + prompt(5, seed=10)   # share exactly one block
    async with make_engine(InProcessCoordinator()) as e:
        await e.generate(a, max_tokens=1)
        rb = await e.generate(b, max_tokens=2)
        assert rb.cached_tokens == BS
        assert same(rb, await reference().generate(b, max_tokens=2))
        # a prompt of exactly one block: its last token must be computed, so nothing is reused
        r1 = await e.generate(one, max_tokens=1)
        assert r1.cached_tokens == 0 and r1.hit_tokens == BS


async def test_whole_cached_prompt_resumes_at_any_block_whatever_the_unit(make_engine, reference) -> None:
    """chunk_blocks=4 with batch-invariant ops: a resume may sit on any block (every cut of the
    prompt gives the same bits); the last token is always recomputed."""
    toks = prompt(128, seed=11)           # 8 whole blocks
    ref = reference(**{"cache.chunk_blocks": 4})
    async with make_engine(InProcessCoordinator(), **{"cache.chunk_blocks": 4}) as e:
        assert e.resume_grid == 1
        await e.generate(toks, max_tokens=1)
        again = await e.generate(toks, max_tokens=2)
        # 8 cached, the last token needs computing: resume at 7 blocks, off the 4-block grid
        assert again.hit_tokens == 128 and again.cached_tokens == 112 and "grid" not in again.fallbacks
        assert same(again, await ref.generate(toks, max_tokens=2))
        longer = toks + prompt(40, seed=12)
        r = await e.generate(longer, max_tokens=2)
        assert r.cached_tokens == 128
        assert same(r, await ref.generate(longer, max_tokens=2))


async def test_without_invariant_ops_a_resume_keeps_to_the_prefill_grid(make_engine, reference, model) -> None:
    toks = prompt(128, seed=11)
    model.batch_invariant = False
    try:
        ref = reference(**{"cache.chunk_blocks": 4})
        async with make_engine(InProcessCoordinator(), **{"cache.chunk_blocks": 4}) as e:
            e.model.batch_invariant = False      # the engine's start-up probe set it again
            assert e.resume_grid == 4 and not e.stepper.fused
            await e.generate(toks, max_tokens=1)
            again = await e.generate(toks, max_tokens=2)
            assert again.cached_tokens == 64 and "grid" in again.fallbacks
            ref.model.batch_invariant = False
            assert same(again, await ref.generate(toks, max_tokens=2))
    finally:
        model.batch_invariant = True


async def test_long_prefix_after_everything_else_was_overwritten(make_engine, reference, model) -> None:
    """A prefix 4× the sliding window, asked again after other long prompts recycled every
    window slot: no stale window state, bit-identical."""
    assert model.cfg.sliding_window * 4 <= 128
    long = prompt(136, seed=13)
    # small pools: swa and tail hold only a handful of blocks, so later requests recycle them
    over = {"worker.pool_bytes": 2 * 2**20, "cache.host_tier_bytes": 0, "cache.offload_dir": ""}
    ref = reference()
    async with make_engine(InProcessCoordinator(), **over) as e:
        assert e.slots["swa"] <= 12, e.slots
        await e.generate(long, max_tokens=1)
        for seed in range(20, 23):
            await e.generate(prompt(136, seed=seed), max_tokens=1)
        again = await e.generate(long, max_tokens=3)
        assert again.invalid == []
        assert same(again, await ref.generate(long, max_tokens=3))
        # the window slots were really recycled (new generations) in between
        assert max(e.store.pools["swa"].generations) > 1


async def test_reuse_off_and_tenants_do_not_share(make_engine, reference) -> None:
    toks = prompt(64, seed=14)
    async with make_engine(InProcessCoordinator()) as e:
        await e.generate(toks, max_tokens=1, tenant="alice")
        r = await e.generate(toks, max_tokens=1, tenant="alice", reuse=False)
        assert r.cached_tokens == 0 and r.hit_tokens == 0
        other = await e.generate(toks, max_tokens=1, tenant="bob")
        assert other.cached_tokens == 0 and other.hit_tokens == 0   # another tenant's salt: no hash hit
        mine = await e.generate(toks, max_tokens=2, tenant="alice")
        assert mine.cached_tokens == 48
        assert same(mine, await reference().generate(toks, max_tokens=2))


async def test_step_api_matches_generate(make_engine) -> None:
    toks = prompt(80, seed=15)
    async with make_engine(InProcessCoordinator()) as e:
        full = await e.generate(toks, max_tokens=2)
        s = await e.open(toks, max_new_tokens=2)
        steps = 0
        while not await s.prefill_step():
            steps += 1
        assert steps == 0 and s.resume_blocks == 4      # one unit left: the last block
        logits = [s.logits]
        logits.append(await s.decode(int(torch.argmax(s.logits))))
        await e.close(s)
        assert torch.equal(torch.stack(logits), full.logits)
        assert e.health().active_sessions == 0


@STATE_THREAD
async def test_speculative_restore_is_confirmed_by_the_grant(make_engine, reference, own) -> None:
    """Validation and restore from the worker's own pools run while the lease is in flight;
    the result is the same as the grant-driven path, and the same as a cold run."""
    toks = prompt(90, seed=16)
    cold = await reference().generate(toks, max_tokens=2)
    async with make_engine(InProcessCoordinator(), **{"service.state_thread": own}) as e:
        await e.generate(toks, max_tokens=1)
        fast = await e.generate(toks, max_tokens=2)
        assert "speculate" in fast.timings and fast.cached_tokens == 80
        e.speculate = False
        slow = await e.generate(toks, max_tokens=2)
        assert "speculate" not in slow.timings and slow.cached_tokens == 80
        assert same(cold, fast) and same(cold, slow)
        assert e.metrics.value("kvl_worker_hit_validation_total", {"layer": "presence", "outcome": "pass"}) == \
            fast.validated + slow.validated


@STATE_THREAD
async def test_a_slot_recycled_while_the_speculative_restore_reads_it_is_not_trusted(make_engine, reference,
                                                                                       own) -> None:
    """The speculation validates the worker's own slots in place and the model restores from
    them. Freed meanwhile (here: the pools cleared, as a new epoch does, while the model reads),
    the slots' bytes are no longer known to be the ones validated: the speculation is dropped,
    the grant's refs are validated again (gone now: presence fails) and the prompt recomputed."""
    toks = prompt(90, seed=16)
    cold = await reference().generate(toks, max_tokens=2)
    async with make_engine(InProcessCoordinator(), **{"service.state_thread": own}) as e:
        await e.generate(toks, max_tokens=1)
        loop = asyncio.get_running_loop()
        new_state = e.model.new_state

        def new_state_recycling_its_slots(*a, **k):
            st = new_state(*a, **k)
            restore = st.restore

            def restore_while_recycled(blocks, n_blocks, **kw):
                if n_blocks:
                    e.model.new_state = new_state                   # once
                    cleared = threading.Event()
                    loop.call_soon_threadsafe(lambda: (e.store.clear(), cleared.set()))
                    assert cleared.wait(5)
                return restore(blocks, n_blocks, **kw)
            st.restore = restore_while_recycled
            return st

        e.model.new_state = new_state_recycling_its_slots
        r = await e.generate(toks, max_tokens=2)
        assert e.model.new_state is new_state                       # the speculative restore ran
        assert "speculate" in r.timings and r.cached_tokens == 0 and "validation" in r.fallbacks
        assert same(cold, r)


async def test_next_turn_reuses_the_previous_prompt_and_its_reply(make_engine, reference) -> None:
    """Blocks the reply completed by decode steps are cached at the end of the request, so the
    next turn (prompt + reply + more) resumes past the reply, bit-identical to a cold run."""
    bs = 16
    p1 = prompt(40, seed=31)
    ref = reference()
    async with make_engine(InProcessCoordinator()) as e:
        r1 = await e.generate(p1, max_tokens=30)
        assert await e.flush()
        assert e.metrics.value("kvl_worker_reply_blocks_total") == 2      # blocks 2 and 3: [32, 64)
        p2 = p1 + r1.tokens + prompt(10, seed=32)
        r2 = await e.generate(p2, max_tokens=3)
        fed = len(p1) + len(r1.tokens) - 1       # the last sampled token never went through the model
        assert r2.cached_tokens == fed // bs * bs == 64                    # the prompt alone: 32
        assert same(r2, await ref.generate(p2, max_tokens=3))
        assert same(r1, await ref.generate(p1, max_tokens=30))


async def test_a_reply_after_a_prompt_shorter_than_a_block_is_cached_too(make_engine, reference) -> None:
    p1 = prompt(5, seed=33)                   # no whole block: no lease when the request opened
    async with make_engine(InProcessCoordinator()) as e:
        r1 = await e.generate(p1, max_tokens=40)
        assert await e.flush()
        assert e.metrics.value("kvl_worker_reply_blocks_total") == 2      # [0, 32) of the 44 fed tokens
        p2 = p1 + r1.tokens + prompt(3, seed=34)
        r2 = await e.generate(p2, max_tokens=2)
        assert r2.cached_tokens == 32
        assert same(r2, await reference().generate(p2, max_tokens=2))
