"""Issue 20 through the real openai client: log probabilities (completions and chat, streamed
and not, with and without reuse), the sampling controls, and the routes vLLM serves beside the
OpenAI ones."""

from __future__ import annotations

import math

import torch

from tests.serving.conftest import MODEL
from shared.text.tokenizer import ByteTokenizer
from worker.generation import SamplingParams

PROMPT = "The ledger records every block: "          # 32 bytes = 2 blocks
TOK = ByteTokenizer()


def name(t: int) -> str:
    """How logprobs name a byte token: its character, or OpenAI's bytes:\\xNN for part of one."""
    text = TOK.decode([t])
    return f"bytes:\\x{t:02x}" if text == "\ufffd" else text


async def test_completion_logprobs_are_the_models_own_with_and_without_reuse(serve, reference) -> None:
    cold = await reference.generate(list(PROMPT.encode()), max_tokens=4)
    want = torch.log_softmax(cold.logits.float(), -1)
    async with serve() as s:
        c = s.client()
        runs = [await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3)
                for _ in range(2)]
        assert runs[1].usage.prompt_tokens_details.cached_tokens > 0          # the second one reused
        for r in runs:
            lp = r.choices[0].logprobs
            assert lp.tokens == [name(t) for t in cold.tokens]
            assert lp.token_logprobs == [float(want[i, t]) for i, t in enumerate(cold.tokens)]
            for i, top in enumerate(lp.top_logprobs):
                best = torch.topk(want[i], 3)
                assert top == {name(t): v for t, v in zip(best.indices.tolist(), best.values.tolist())}
            assert lp.text_offset == [0, 1, 2, 3]
        assert runs[0].choices[0].logprobs == runs[1].choices[0].logprobs
        # streamed: the chunks' entries, concatenated, are the same
        stream = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3,
                                            stream=True)
        got: list[float] = []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].logprobs:
                got += chunk.choices[0].logprobs.token_logprobs
        assert got == runs[0].choices[0].logprobs.token_logprobs


async def test_chat_logprobs_and_top_logprobs(serve) -> None:
    async with serve() as s:
        c = s.client()
        msgs = [{"role": "user", "content": "Which block is cached?"}]
        r = await c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, temperature=0, logprobs=True,
                                            top_logprobs=2)
        content = r.choices[0].logprobs.content
        assert len(content) == r.usage.completion_tokens == 3
        for e in content:
            assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
            assert e.logprob == e.top_logprobs[0].logprob           # greedy picks the most likely token
            assert len(e.bytes) == 1 and e.logprob <= 0                  # one byte per token here
        assert bytes(b for e in content for b in e.bytes).decode(errors="replace") == r.choices[0].message.content
        plain = await c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, temperature=0)
        assert plain.choices[0].logprobs is None and plain.choices[0].message.content == r.choices[0].message.content
        stream = await c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, temperature=0,
                                                 logprobs=True, stream=True)
        streamed = [e.logprob async for ch in stream if ch.choices and ch.choices[0].logprobs
                    for e in ch.choices[0].logprobs.content]
        assert streamed == [e.logprob for e in content]


async def test_logit_bias_steers_greedy_decoding(serve, reference) -> None:
    first = (await reference.generate(list(PROMPT.encode()), max_tokens=1)).tokens[0]
    async with serve() as s:
        c = s.client()
        r = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                       logit_bias={str(ord("Z")): 100})
        assert r.choices[0].text == "ZZZZ"
        banned = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                            logit_bias={str(first): -100})
        assert banned.choices[0].text.encode()[0] != first


async def test_penalties_and_min_p_reach_the_sampler(serve, reference) -> None:
    """What the HTTP fields become is what the engine's own generate computes with them."""
    cases = [({"frequency_penalty": 1.5, "presence_penalty": 0.5}, SamplingParams(frequency_penalty=1.5,
                                                                                   presence_penalty=0.5)),
             ({"extra_body": {"repetition_penalty": 1.8}}, SamplingParams(repetition_penalty=1.8))]
    async with serve() as s:
        c = s.client()
        for kw, params in cases:
            r = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, **kw)
            want = await reference.generate(list(PROMPT.encode()), max_tokens=12, sampling=params)
            assert r.choices[0].text == TOK.decode(want.tokens), kw
        plain = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
        penal = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                           frequency_penalty=2.0)
        assert len(set(penal.choices[0].text)) >= len(set(plain.choices[0].text))
        # min_p 1: only the most likely token survives, whatever the seed
        greedy5 = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
        for seed in range(3):
            r = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=seed,
                                           extra_body={"min_p": 1.0})
            assert r.choices[0].text == greedy5.choices[0].text


async def test_stop_token_ids_and_min_tokens(serve, reference) -> None:
    greedy = (await reference.generate(list(PROMPT.encode()), max_tokens=6)).tokens
    second = greedy[1]
    assert greedy[0] != second
    async with serve() as s:
        c = s.client()
        r = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                       extra_body={"stop_token_ids": [second]})
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 2   # the stop token is kept
        held = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                          extra_body={"stop_token_ids": [second], "min_tokens": 4})
        assert held.usage.completion_tokens >= 4


async def test_the_routes_vllm_serves_beside_the_openai_ones(serve) -> None:
    async with serve() as s:
        assert (await s.get("/health"))[0] == 200
        status, doc = await s.get("/version")
        assert status == 200 and doc["version"]
        status, doc, _ = await s.post("/tokenize", {"prompt": PROMPT})
        assert status == 200 and doc["tokens"] == list(PROMPT.encode()) and doc["count"] == 32
        assert doc["max_model_len"] == 4096
        status, chat, _ = await s.post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
        assert status == 200 and chat["count"] > 2
        status, back, _ = await s.post("/detokenize", {"tokens": doc["tokens"]})
        assert status == 200 and back["prompt"] == PROMPT
        for path, body, param in (("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "a", "messages": []}, "prompt"),
                                  ("/detokenize", {"tokens": [1, 999]}, "tokens"),
                                  ("/detokenize", {"tokens": "x"}, "tokens")):
            status, err, _ = await s.post(path, body)
            assert status == 400 and err["error"]["param"] == param, (path, body, err)


def test_logprob_values_are_finite_numbers() -> None:
    assert math.isfinite(float(torch.log_softmax(torch.tensor([0.0, 1.0]), -1)[0]))


async def test_n_samples_share_the_prompt_and_are_reproducible_by_seed(serve, reference) -> None:
    async with serve() as s:
        c = s.client()
        r = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=11, n=8)
        texts = [ch.text for ch in r.choices]
        assert [ch.index for ch in r.choices] == list(range(8)) and len(set(texts)) == 8
        assert r.usage.prompt_tokens == 32 and r.usage.completion_tokens == 48
        # one prefill: the later samples decoded copies of the state the first one's prompt left
        assert r.model_extra["kvl"]["samples_forked"] == [False] + [True] * 7
        assert r.model_extra["kvl"]["samples_cached_tokens"] == [0] * 8
        assert 'kvl_worker_forked_samples_total 7.0' in (await s.get("/metrics"))[1]
        again = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=11, n=8)
        assert [ch.text for ch in again.choices] == texts
        # sample i is the request with seed + i on its own
        one = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=14)
        assert one.choices[0].text == texts[3]
        # best_of: the n samples of highest total log probability among best_of
        best = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=11, n=2,
                                          best_of=8, logprobs=0)
        totals = sorted((sum(ch.logprobs.token_logprobs) for ch in best.choices), reverse=True)
        assert {ch.text for ch in best.choices} <= set(texts) and len(best.choices) == 2
        assert totals == sorted(totals, reverse=True) and best.usage.completion_tokens == 48
        # chat, streamed: each sample's chunks carry its index
        stream = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, temperature=1.0, seed=5, n=3, stream=True,
                                                 stream_options={"include_usage": True})
        got: dict[int, str] = {}
        finished = set()
        async for ch in stream:
            for choice in ch.choices:
                got[choice.index] = got.get(choice.index, "") + (choice.delta.content or "")
                if choice.finish_reason:
                    finished.add(choice.index)
            if ch.usage:
                assert ch.usage.completion_tokens == 12
        assert set(got) == finished == {0, 1, 2}
        plain = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4, temperature=1.0, seed=5, n=3)
        assert [got[i] for i in range(3)] == [ch.message.content for ch in plain.choices]


async def test_echo_returns_the_prompt_and_its_token_logprobs_with_and_without_reuse(serve, model) -> None:
    ids = list(PROMPT.encode())
    with torch.inference_mode():
        state = model.new_state(16, 64)
        logits = model.extend(ids, state, logits="all")           # one unit: another cut than the server's
    want = torch.log_softmax(logits.float(), -1)
    async with serve() as s:
        c = s.client()
        runs = [await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                           logprobs=2) for _ in range(2)]
        assert runs[1].usage.prompt_tokens_details.cached_tokens > 0
        for r in runs:
            ch = r.choices[0]
            assert ch.text.startswith(PROMPT) and len(ch.logprobs.tokens) == len(ids) + 3
            assert ch.logprobs.token_logprobs[0] is None and ch.logprobs.top_logprobs[0] is None
            assert ch.logprobs.token_logprobs[1:len(ids)] == [float(want[j - 1, t]) for j, t in enumerate(ids)][1:]
            assert ch.logprobs.text_offset[:3] == [0, 1, 2] and ch.logprobs.text_offset[len(ids)] == len(PROMPT)
        assert runs[0].choices[0].logprobs == runs[1].choices[0].logprobs
        plain = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
        assert runs[0].choices[0].text == PROMPT + plain.choices[0].text
        # echo without logprobs, streamed: the prompt comes first
        stream = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                            stream=True)
        text = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
        assert text == PROMPT + plain.choices[0].text
