"""SmolLM2 served through the OpenAI API: a conversation's next turn reuses every whole block of
its prompt and reply, n > 1 samples, and tool calls through its chat template (which renders no
tools and names no call syntax: forced calls need ``service.tool_call_parser``)."""

from __future__ import annotations

import json

from tests.realmodel.conftest import BS, chat_ids, greedy, oracle

FIRST = [{"role": "system", "content": "You are a helpful assistant. Answer with a full sentence."},
         {"role": "user", "content": "Describe the planet Mars in two sentences."}]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


async def test_the_next_turn_reuses_prompt_and_reply(serve) -> None:
    tok = oracle()[1]
    async with serve() as s:
        c = s.client()
        one = await c.chat.completions.create(model=s.engine.model.cfg.model_id, messages=FIRST, max_tokens=20, temperature=0)
        reply = one.choices[0].message.content
        assert one.usage.prompt_tokens_details.cached_tokens == 0 and "Mars" in reply
        first_ids = chat_ids(FIRST)
        generated = greedy(first_ids, one.usage.completion_tokens)      # what the worker computed (parity)
        assert tok.decode(generated, skip_special_tokens=True) == reply
        second = [*FIRST, {"role": "assistant", "content": reply}, {"role": "user", "content": "And the largest?"}]
        second_ids = chat_ids(second)
        # the worker holds K/V of the prompt and of every generated token but the last (never fed back)
        shared = common_prefix(second_ids, first_ids + generated[:-1])
        want = min(shared, len(second_ids) - 1) // BS * BS
        assert want > len(first_ids) // BS * BS, "the reply must reach a whole block past the prompt's"
        two = await c.chat.completions.create(model=s.engine.model.cfg.model_id, messages=second, max_tokens=4, temperature=0)
        assert two.usage.prompt_tokens == len(second_ids)
        assert two.usage.prompt_tokens_details.cached_tokens == want
        # and the warm answer is the cold one
        assert tok.encode(two.choices[0].message.content, add_special_tokens=False) == \
            greedy(second_ids, two.usage.completion_tokens)[:len(tok.encode(two.choices[0].message.content,
                                                                                add_special_tokens=False))]


async def test_n_samples(serve) -> None:
    messages = [{"role": "user", "content": "Say a random word."}]
    async with serve() as s:
        c = s.client()
        r = await c.chat.completions.create(model=s.engine.model.cfg.model_id, messages=messages, max_tokens=6, n=3, temperature=1.0,
                                            seed=7)
        assert [ch.index for ch in r.choices] == [0, 1, 2] and all(ch.message.content for ch in r.choices)
        assert r.usage.completion_tokens == sum(len(oracle()[1].encode(ch.message.content, add_special_tokens=False))
                                                for ch in r.choices) or r.usage.completion_tokens > 0
        again = await c.chat.completions.create(model=s.engine.model.cfg.model_id, messages=messages, max_tokens=6, n=3, temperature=1.0,
                                                seed=7)
        assert [ch.message.content for ch in again.choices] == [ch.message.content for ch in r.choices]
        # greedy samples are all the greedy answer
        g = await c.chat.completions.create(model=s.engine.model.cfg.model_id, messages=messages, max_tokens=6, n=2, temperature=0)
        want = oracle()[1].decode(greedy(chat_ids(messages), 6), skip_special_tokens=True)
        assert [ch.message.content for ch in g.choices] == [want, want]


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


async def test_tool_calls_through_its_template(serve, monkeypatch) -> None:
    # its own template: tools rendered as transformers renders them (SmolLM2's ignores them), and
    # no call syntax to force a call in
    async with serve() as s:
        seen = []
        submit = s.scheduler.submit
        monkeypatch.setattr(s.scheduler, "submit", lambda req: seen.append(req) or submit(req))
        status, doc, _ = await s.post("/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "max_tokens": 3,
                                                               "temperature": 0})
        assert status == 200 and "tool_calls" not in doc["choices"][0]["message"], doc
        assert seen[-1].tokens == chat_ids(ASK, tools=TOOLS)
        status, doc, _ = await s.post("/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "max_tokens": 3,
                                                               "tool_choice": "required"})
        assert status == 400 and doc["error"]["param"] == "tool_choice"
        assert "service.tool_call_parser" in doc["error"]["message"]
    # Hermes syntax named by config: the grammar, over SmolLM2's real 49k-token vocabulary, makes the
    # model write a valid call, read back into tool_calls
    async with serve(**{"service.tool_call_parser": "hermes"}) as s:
        r = await s.client().chat.completions.create(model=s.engine.model.cfg.model_id, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                                     max_tokens=40, temperature=0)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch
        (call,) = ch.message.tool_calls
        assert call.function.name == "get_weather"
        args = json.loads(call.function.arguments)
        assert set(args) == {"city"} and isinstance(args["city"], str)


async def test_ignore_eos_generates_past_the_end_of_sequence(serve) -> None:
    """vLLM's ``ignore_eos`` (what benchmarks send for fixed-length replies): a reply that ends
    early ends at ``max_tokens`` instead, and its first tokens are the ones it had."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    async with serve() as s:
        c = s.client()
        model = s.engine.model.cfg.model_id
        short = await c.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0)
        assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 40
        n = short.usage.completion_tokens + 4
        long = await c.chat.completions.create(model=model, messages=messages, max_tokens=n, temperature=0,
                                               extra_body={"ignore_eos": True})
        assert long.choices[0].finish_reason == "length" and long.usage.completion_tokens == n
        assert long.choices[0].message.content.startswith(short.choices[0].message.content)
