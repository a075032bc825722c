"""The scheduler: concurrency never changes an output, steps and admission follow their policy,
and a client that goes away releases everything it held."""

from __future__ import annotations

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import torch

from tests.serving.conftest import MODEL
from worker.model import build_model
from worker.model.config import ModelConfig
from worker.scheduler import GenRequest, SamplingParams
from worker.stepper import Stepper
from shared.tenants import Tenant


def _prompts(n: int) -> list[str]:
    rng = random.Random(5)
    stems = ["One shared stem: ", "Another one, 16:"]       # a block each (17 and 16 bytes)
    out = []
    for i in range(n):
        tail = "".join(rng.choice("abcdefghij ") for _ in range(rng.randint(1, 6)))
        out.append((stems[i % 2] if i % 3 else "") + tail + str(i))
    return out


async def test_64_concurrent_requests_equal_the_same_requests_one_at_a_time(serve) -> None:
    prompts = _prompts(64)

    def kwargs(i: int, reuse: bool) -> dict:
        kw: dict = {"model": MODEL, "max_tokens": 2, "extra_body": {"cache_reuse": reuse}}
        if i % 4 == 3:
            kw.update(temperature=0.9, top_p=0.9, seed=i)           # seeded sampling is per request too
        else:
            kw.update(temperature=0)
        return kw

    async with serve() as s:
        c = s.client()

        async def one(i: int, reuse: bool):
            if i % 5 == 4:
                r = await c.chat.completions.create(messages=[{"role": "user", "content": prompts[i]}],
                                                    **kwargs(i, reuse))
                return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens
            r = await c.completions.create(prompt=prompts[i], **kwargs(i, reuse))
            return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens

        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, s.scheduler.running)
                await asyncio.sleep(0.01)

        w = asyncio.create_task(watch())
        together = await asyncio.gather(*(one(i, True) for i in range(64)))   # raises on any error status
        w.cancel()
        alone = [await one(i, False) for i in range(64)]
        assert [t for t, _ in together] == [t for t, _ in alone]
        assert all(cached == 0 for _, cached in alone)
        assert sum(cached > 0 for _, cached in together) > 0, together   # shared stems were reused meanwhile
        assert peak == 32                                               # service.max_concurrency, the rest queued
        text = (await s.get("/metrics"))[1]
        assert 'kvl_worker_http_requests_total{route="/v1/completions",status="200"}' in text
        assert 'status="5' not in text


async def test_interleaved_requests_are_bit_identical_to_cold_runs(serve, reference) -> None:
    prompts = [list(p.encode()) for p in _prompts(8)]
    async with serve() as s:
        jobs = [s.scheduler.submit(GenRequest(tokens=p, max_tokens=3, tenant=Tenant("default"), keep_logits=True))
                for p in prompts]
        outs = await asyncio.gather(*(j.wait() for j in jobs))
        st = s.engine.stepper
        assert st.fused and st.segments > st.forwards      # requests really shared forwards
        for p, out in zip(prompts, outs):
            cold = await reference.generate(p, max_tokens=3)
            assert out.tokens == cold.tokens and torch.equal(out.logits.view(torch.int32), cold.logits.view(torch.int32))


async def test_forked_samples_are_bit_identical_to_their_own_cold_runs(serve, reference) -> None:
    """n > 1: samples forked from one prefill compute what each would alone, logits and all,
    fused or not; a fork whose source is past its prompt opens its own session instead."""
    prompt = list(_prompts(3)[1].encode()) * 3
    for over in ({}, {"service": {"max_batch_tokens": 16}}):
        async with serve(**over) as s:
            def req(seed: int) -> GenRequest:
                return GenRequest(tokens=prompt, max_tokens=5, tenant=Tenant("default"), keep_logits=True,
                                  sampling=SamplingParams(temperature=1.0, seed=seed))
            first = s.scheduler.submit(req(0))
            forks = [s.scheduler.submit(req(i), fork_of=first) for i in range(1, 4)]
            outs = await asyncio.gather(*(j.wait() for j in [first, *forks]))
            assert [j.forked for j in [first, *forks]] == [False, True, True, True]
            late = s.scheduler.submit(req(9), fork_of=first)         # first is done: its own session
            outs.append(await late.wait())
            assert not late.forked and late.cached_tokens > 0
            for seed, out in zip([0, 1, 2, 3, 9], outs):
                cold = await reference.generate(prompt, max_tokens=5, sampling=SamplingParams(temperature=1.0, seed=seed))
                assert out.tokens == cold.tokens
                assert torch.equal(out.logits.view(torch.int32), cold.logits.view(torch.int32))
            assert len({tuple(o.tokens) for o in outs}) > 1
            assert not s.engine.sessions


def _planner(prompts: dict[str, list[int]], done: dict[str, int]):
    """A stepper plan per prompt name: whole 16-token blocks up to what the step allows, at
    least one; ``done`` records how far each prompt has been handed out."""
    def plan(name: str):
        def f(max_tokens):
            start = done[name]
            end = min(len(prompts[name]), start + max(16, max_tokens // 16 * 16))
            done[name] = end
            return prompts[name][start:end], []
        return f
    return plan


async def _beside_a_decode(model, stepper: Stepper, g: torch.Generator, plan, left=None) -> list:
    """Prompts ``a`` and ``b`` queued, then one decode token; returns the prompts' futures once the
    first forward (all three in it) has answered the decode."""
    decoding = model.new_state(16, 128)
    model.extend(torch.randint(0, 256, (5,), generator=g), decoding)
    futs = [stepper.prefill(model.new_state(16, 128), plan(n), (0, k), left=left(n) if left else None)
            for k, n in enumerate("ab")]
    await stepper.decode(decoding, 7, (0, 9))
    return futs


async def test_a_step_runs_decodes_first_then_prompts_in_priority_order_within_the_budget() -> None:
    """One forward: every decode token, then the oldest (highest-priority) prompt takes whole
    blocks from what is left of service.max_batch_tokens; a prompt that no longer fits waits."""
    model = build_model(ModelConfig())
    pool = ThreadPoolExecutor(1)
    stepper = Stepper(model, pool, max_batch_tokens=48, block_size=16)
    g = torch.Generator().manual_seed(3)
    decoding = model.new_state(16, 128)
    model.extend(torch.randint(0, 256, (5,), generator=g), decoding)
    prompts = {name: torch.randint(0, 256, (64,), generator=g).tolist() for name in "ab"}
    states = {name: model.new_state(16, 128) for name in prompts}
    done = {name: 0 for name in prompts}

    plan = _planner(prompts, done)

    try:
        futs = [stepper.prefill(states["b"], plan("b"), (1, 2)), stepper.decode(decoding, 7, (5, 3)),
                stepper.prefill(states["a"], plan("a"), (0, 1))]
        first = await futs[1]
        assert stepper.forwards == 1 and stepper.segments == 2 and stepper.rows == 1 + 32
        assert done == {"a": 32, "b": 0} and first.tokens == 1
        await asyncio.gather(*futs)
        assert done["b"] > 0 and stepper.forwards >= 2
    finally:
        pool.shutdown()


async def test_prompts_beside_decode_tokens_take_at_most_the_cap_and_alone_the_whole_budget() -> None:
    """service.max_prompt_tokens_with_decodes: a forward that carries a decode token gives the
    prompts at most that many tokens (at least one block, so they advance), while a forward of
    prompts alone still takes the whole max_batch_tokens."""
    model = build_model(ModelConfig())
    pool = ThreadPoolExecutor(1)
    g = torch.Generator().manual_seed(4)
    prompts = {name: torch.randint(0, 256, (64,), generator=g).tolist() for name in "abc"}
    done = {name: 0 for name in prompts}

    plan = _planner(prompts, done)

    try:
        for cap, first_rows in ((32, 32), (4, 16)):
            stepper = Stepper(model, pool, max_batch_tokens=1024, block_size=16, max_prompt_tokens_with_decodes=cap)
            done.update(a=0, b=0)
            futs = await _beside_a_decode(model, stepper, g, plan)
            # one block for a (cap 4 rounds up to it) or 32 rows shared in arrival order; b waits
            assert stepper.forwards == 1 and stepper.rows == 1 + first_rows
            assert done == {"a": first_rows, "b": 0, "c": 0}
            await asyncio.gather(*futs)

        stepper = Stepper(model, pool, max_batch_tokens=1024, block_size=16, max_prompt_tokens_with_decodes=32)
        done.update(a=0, b=0)
        await asyncio.gather(*(stepper.prefill(model.new_state(16, 128), plan(n), (0, k)) for k, n in enumerate("abc")))
        assert stepper.forwards == 1 and stepper.rows == 3 * 64        # no decode: the budget alone
    finally:
        pool.shutdown()


async def test_the_cap_beside_decodes_rises_with_the_prompt_backlog() -> None:
    """service.prompt_cap_backlog_share: beside decodes, the prompts get the larger of the cap and
    that share of the prompt tokens waiting (here two 64-token prompts: a backlog of 128)."""
    model = build_model(ModelConfig())
    pool = ThreadPoolExecutor(1)
    g = torch.Generator().manual_seed(5)
    prompts = {name: torch.randint(0, 256, (64,), generator=g).tolist() for name in "ab"}
    done = {name: 0 for name in prompts}
    plan = _planner(prompts, done)

    def left(name: str):
        return lambda: len(prompts[name]) - done[name]

    try:
        for share, first_rows in ((0.25, 32), (0.5, 64), (1.0, 128)):
            stepper = Stepper(model, pool, max_batch_tokens=1024, block_size=16, max_prompt_tokens_with_decodes=32,
                              prompt_cap_backlog_share=share)
            done.update(a=0, b=0)
            futs = await _beside_a_decode(model, stepper, g, plan, left)
            assert stepper.forwards == 1 and stepper.rows == 1 + first_rows
            assert done["a"] + done["b"] == first_rows
            await asyncio.gather(*futs)
    finally:
        pool.shutdown()


async def test_admission_by_priority_then_arrival(serve) -> None:
    async with serve(**{"service.max_concurrency": 1, "service.batch_window_ms": 0}) as s:
        t = Tenant("default")
        first = s.scheduler.submit(GenRequest(tokens=[1] * 20, max_tokens=4, tenant=t))
        low = s.scheduler.submit(GenRequest(tokens=[2] * 20, max_tokens=1, tenant=t, priority=5))
        mid = s.scheduler.submit(GenRequest(tokens=[3] * 20, max_tokens=1, tenant=t))
        high = s.scheduler.submit(GenRequest(tokens=[4] * 20, max_tokens=1, tenant=t, priority=-5))
        await asyncio.gather(*(j.wait() for j in (first, low, mid, high)))
        order = sorted((first, low, mid, high), key=lambda j: j.admitted_at)
        assert order == [first, high, mid, low]


async def test_the_window_holds_arrivals_only_at_a_busy_worker(serve) -> None:
    """An idle worker starts a request at once (no window to wait out); at a busy one a request
    waits the window, and a higher priority arriving within it goes first."""
    async with serve(**{"service.max_concurrency": 2, "service.batch_window_ms": 300}) as s:
        t = Tenant("default")
        first = s.scheduler.submit(GenRequest(tokens=[1] * 20, max_tokens=8, tenant=t))
        assert first.admitted.done()               # two slots free, one request: no wait
        low = s.scheduler.submit(GenRequest(tokens=[2] * 20, max_tokens=1, tenant=t, priority=5))
        assert not low.admitted.done()             # a busy worker: the window decides
        high = s.scheduler.submit(GenRequest(tokens=[4] * 20, max_tokens=1, tenant=t, priority=-5))
        # NOTE: the order of admission, not admitted_at: when the first request ends within the
        # window, both are admitted in one pass and their clock readings can be equal
        order: list[str] = []
        low.admitted.add_done_callback(lambda _: order.append("low"))
        high.admitted.add_done_callback(lambda _: order.append("high"))
        await asyncio.gather(*(j.wait() for j in (first, low, high)))
        assert order == ["high", "low"]


async def _until_idle(s, what: str) -> None:
    for _ in range(200):
        if not s.engine.sessions and s.live_leases() == 0 and s.scheduler.running == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{what}: sessions {len(s.engine.sessions)}, leases {s.live_leases()}, "
                         f"running {s.scheduler.running}")


async def test_client_disconnect_cancels_the_work_and_releases_the_leases(serve) -> None:
    body = {"model": MODEL, "prompt": "A prompt of three whole blocks and a few more bytes.", "max_tokens": 300,
            "temperature": 0}
    async with serve() as s:
        cancelled = s.scheduler.metrics.finished.labels(reason="cancelled")
        # streaming: read one chunk, then hang up
        async with aiohttp.ClientSession() as http:
            async with http.post(s.url + "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status == 200
                await r.content.readline()
                assert s.live_leases() >= 1 and len(s.engine.sessions) == 1
        await _until_idle(s, "stream")
        assert cancelled._value.get() == 1
        # not streaming: the client gives up while the request runs
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as http:
            try:
                async with http.post(s.url + "/v1/completions", json=body) as r:
                    await r.read()
            except asyncio.TimeoutError:
                pass
        await _until_idle(s, "non-stream")
        assert cancelled._value.get() == 2
        # and the worker serves on
        r = await s.client().completions.create(model=MODEL, prompt=body["prompt"], max_tokens=1, temperature=0)
        assert r.usage.prompt_tokens_details.cached_tokens == 48


async def test_seeded_sampler_ignores_global_rng() -> None:
    from worker.scheduler import Sampler
    logits = torch.randn(256, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, seed=11)
    a = [Sampler(p).pick(logits) for _ in range(3)]
    torch.manual_seed(99)
    torch.rand(10)
    assert [Sampler(p).pick(logits) for _ in range(3)] == a
    nucleus = Sampler(SamplingParams(temperature=1.0, top_p=0.3, seed=1))
    probs = torch.softmax(logits, -1)
    top = torch.sort(probs, descending=True)
    allowed = set(top.indices[:int((torch.cumsum(top.values, 0) < 0.3).sum()) + 1].tolist())
    assert {nucleus.pick(logits) for _ in range(200)} <= allowed


async def test_a_step_that_cannot_run_fails_alone_and_the_others_are_exact() -> None:
    model = build_model(ModelConfig())
    pool = ThreadPoolExecutor(1)
    stepper = Stepper(model, pool, max_batch_tokens=64, block_size=16)
    good, bad, alone = model.new_state(16, 64), model.new_state(16, 64), model.new_state(16, 64)
    try:
        futs = [stepper.decode(good, 5, (0, 1)), stepper.decode(bad, 999, (0, 2))]   # 999: no such token
        ok, err = await asyncio.gather(*futs, return_exceptions=True)
        assert isinstance(err, ValueError) and "token ids must lie in" in str(err)
        assert bad.pos == 0 and good.pos == 1                    # the refused state was not touched
        want = model.forward_batch([([5], alone)])[0]
        assert torch.equal(ok.logits.view(torch.int32), want.view(torch.int32))
    finally:
        pool.shutdown()
