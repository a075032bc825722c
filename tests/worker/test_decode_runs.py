"""Decode loops as data: a request's tokens after the first are sampled on the model thread
(``worker.generation.DecodeRun``, ``worker.stepper``), and every bit stays what the
step-by-step loop on the event loop gives — alone, batched, stopped or cancelled.

Runs are on where ``service.request_runs`` is (the default). The step-by-step loop is the
path otherwise and for a request with a grammar; here it is forced with ``runs_on_model_thread``
patched to False or ``service.request_runs`` off, and compared with ``torch.equal``.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

import worker.generation as generation
from tests.twin import InProcessCoordinator
from tests.worker.conftest import prompt
from worker.generation import SamplingParams, generate

RUNS = {"service.request_runs": True}
STEPS = {"service.request_runs": False}

SAMPLINGS = [
    SamplingParams(),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, logprobs=3),
    SamplingParams(temperature=1.1, min_p=0.05, seed=3, repetition_penalty=1.3, frequency_penalty=0.4,
                   logit_bias=((5, 2.0),)),
]


async def _many(e, prompts, sampling, max_tokens=12):
    return await asyncio.gather(*(e.generate(p, max_tokens=max_tokens, sampling=sampling, reuse=False)
                                  for p in prompts))


@pytest.mark.parametrize("k", range(len(SAMPLINGS)))
async def test_runs_give_the_step_by_step_bits_alone_and_batched(make_engine, monkeypatch, k) -> None:
    sampling = SAMPLINGS[k]
    prompts = [prompt(20 + 13 * i, seed=40 + i) for i in range(4)]
    async with make_engine(None, **RUNS) as e:
        ran = await _many(e, prompts, sampling)                          # four runs, fused forwards
        alone = [await e.generate(p, max_tokens=12, sampling=sampling, reuse=False) for p in prompts]
        assert e.stepper.segments > e.stepper.forwards          # forwards held several runs
        monkeypatch.setattr(generation, "runs_on_model_thread", lambda s, sampling: False)
        mixed = await _many(e, prompts, sampling)               # prompts as runs, decodes step by step
    async with make_engine(None, **STEPS) as e:                 # steps only
        assert not e.stepper.runs
        steps = await _many(e, prompts, sampling)
        assert e.stepper.segments > e.stepper.forwards
    for a, *others in zip(ran, alone, mixed, steps):
        for b in others:
            assert a.tokens == b.tokens and torch.equal(a.logits, b.logits)


async def test_a_stop_heard_on_the_event_loop_ends_the_run_and_the_state_holds_what_was_fed(make_engine) -> None:
    toks = prompt(40, seed=5)
    async with make_engine(InProcessCoordinator(), **RUNS) as e:
        full = await e.generate(toks, max_tokens=20, reuse=False)
        s = await e.open(toks, tenant="default", reuse=False, max_new_tokens=20)
        heard: list[int] = []
        try:
            g = await generate(s, SamplingParams(), max_tokens=20,
                               on_token=lambda tok, lp: heard.append(tok) or len(heard) == 4)
            # the run may have computed a token or two past the stop: fed, never delivered
            assert g.tokens == heard == full.tokens[:4] and g.finish_reason == "stop"
            assert s.fed[:3] == full.tokens[:3] and len(s.fed) >= 3
            assert s.state.pos == len(toks) + len(s.fed)
        finally:
            await e.close(s)


async def test_a_cancelled_run_lets_go_of_its_state_and_the_others_run_on(make_engine) -> None:
    a, b = prompt(30, seed=8), prompt(50, seed=9)
    async with make_engine(InProcessCoordinator(), **RUNS) as e:
        want = await e.generate(b, max_tokens=40, reuse=False)
        s = await e.open(a, tenant="default", reuse=False, max_new_tokens=200)
        started = asyncio.Event()
        victim = asyncio.create_task(generate(s, SamplingParams(), max_tokens=200,
                                              on_token=lambda tok, lp: started.set() or False))
        other = asyncio.create_task(e.generate(b, max_tokens=40, reuse=False))
        await started.wait()
        victim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await victim
        assert s._run.done.done() and s.state.pos == len(a) + len(s.fed)     # let go, consistent
        await e.close(s)
        got = await other
        assert got.tokens == want.tokens and torch.equal(got.logits, want.logits)
        assert not e.stepper._runs and not e.stepper._waiting


async def test_a_job_queued_on_the_model_thread_waits_one_forward_not_the_whole_run(make_engine) -> None:
    """The driver hands the model thread back to a queued job (a state to build, a fork) after the
    forward in flight: the job runs while a long decode run is still going."""
    toks = prompt(30, seed=12)
    async with make_engine(None, **RUNS) as e:
        s = await e.open(toks, tenant="default", reuse=False, max_new_tokens=300)
        started = asyncio.Event()
        task = asyncio.create_task(generate(s, SamplingParams(), max_tokens=300,
                                            on_token=lambda tok, lp: started.set() or False))
        try:
            await started.wait()
            assert await e.compute(lambda: 42) == 42
            assert not task.done() and len(s.fed) < 299
            g = await task
            assert len(g.tokens) == 300 and g.finish_reason == "length"
        finally:
            await e.close(s)
