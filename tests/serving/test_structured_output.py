"""Structured output through the real openai client: every ``json_schema`` output parses and
validates, over many seeds; ``json_object`` gives an object; reuse changes no byte of it."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from tests.serving.conftest import MODEL

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["a", "b", "c"]}}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


async def test_json_schema_outputs_parse_and_validate_for_every_seed(serve) -> None:
    """16 seeds at once (the scheduler fuses their decode steps; each keeps its own bits)."""
    async with serve() as s:
        c = s.client()

        def ask(seed: int):
            return c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=120, temperature=1.0,
                                             seed=seed, response_format=FORMAT)
        rs = await asyncio.gather(*(ask(seed) for seed in range(16)))
        for r in rs:
            assert r.choices[0].finish_reason == "stop", r.choices[0]
            jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
        # a seed reproduces its document, alone as in company
        again = await ask(15)
        assert again.choices[0].message.content == rs[15].choices[0].message.content


async def test_json_object_streamed_and_on_completions_and_reuse_is_invisible(serve) -> None:
    async with serve() as s:
        c = s.client()
        stream = await c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, temperature=0,
                                                 response_format={"type": "json_object"}, stream=True)
        text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
        # greedy decoding of a random model may run long inside a string: a complete answer parses
        if text.endswith("}"):
            assert isinstance(json.loads(text), dict)
        else:
            assert text.startswith("{")
        prompt = "A person, as JSON: "
        runs = [await c.completions.create(model=MODEL, prompt=prompt, max_tokens=120, temperature=0,
                                           extra_body={"response_format": FORMAT}) for _ in range(2)]
        assert runs[1].usage.prompt_tokens_details.cached_tokens > 0
        assert runs[0].choices[0].text == runs[1].choices[0].text
        jsonschema.validate(json.loads(runs[0].choices[0].text), PERSON)


@pytest.mark.parametrize("fmt, words", [
    ({"type": "yaml"}, "not supported"),
    ({"type": "json_schema"}, "needs"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}, "cannot be compiled"),
])
async def test_bad_response_formats_are_a_400(serve, fmt, words) -> None:
    async with serve() as s:
        status, doc, _ = await s.post("/v1/chat/completions", {"messages": ASK, "response_format": fmt})
        assert status == 400 and doc["error"]["param"] == "response_format" and words in doc["error"]["message"], doc


async def test_structured_outputs_regex_choice_grammar_and_json(serve) -> None:
    """vLLM's ``structured_outputs`` extension: every output matches, over many seeds."""
    import re

    grammar = 'start: num (OP num)*\nnum: /[1-9][0-9]?/\nOP: "+" | "*"'
    async with serve() as s:
        c = s.client()

        async def one_seed(seed: int) -> None:
            def ask(spec: dict, max_tokens: int = 24):
                return c.completions.create(model=MODEL, prompt="Answer: ", max_tokens=max_tokens, temperature=1.0,
                                            seed=seed, extra_body={"structured_outputs": spec})
            r = await ask({"regex": r"[0-9]{3}-[a-z]{2,4}"})
            assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", r.choices[0].text), r.choices[0].text
            assert r.choices[0].finish_reason == "stop"
            r = await ask({"choice": ["yes", "no", "maybe so"]})
            assert r.choices[0].text in ("yes", "no", "maybe so") and r.choices[0].finish_reason == "stop"
            r = await ask({"grammar": grammar})
            whole = r"[1-9][0-9]?(?:[+*][1-9][0-9]?)*"
            prefix = r"(?:[1-9][0-9]?[+*])*(?:[1-9][0-9]?)?"       # cut by max_tokens
            assert re.fullmatch(whole if r.choices[0].finish_reason == "stop" else prefix, r.choices[0].text), \
                r.choices[0]
            r = await ask({"json": PERSON}, 120)
            jsonschema.validate(json.loads(r.choices[0].text), PERSON)
        await asyncio.gather(*(one_seed(seed) for seed in range(8)))       # seeds side by side, fused
        chat = await c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, seed=1, temperature=1.0,
                                               extra_body={"structured_outputs": {"choice": ["red", "blue"]}})
        assert chat.choices[0].message.content in ("red", "blue")


@pytest.mark.parametrize("body, words", [
    ({"structured_outputs": {"regex": "[0-9"}}, "cannot be compiled"),
    ({"structured_outputs": {"grammar": "start: ??? bad"}}, "cannot be compiled"),
    ({"structured_outputs": {"choice": []}}, "non-empty list"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ({"structured_outputs": {"xml": "<a/>"}}, "unknown key"),
    ({"structured_outputs": {"json": "{not json"}}, "not a JSON schema"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "not both"),
])
async def test_bad_structured_outputs_are_a_400(serve, body, words) -> None:
    async with serve() as s:
        status, doc, _ = await s.post("/v1/completions", {"prompt": "x", **body})
        assert status == 400 and doc["error"]["param"] == "structured_outputs" and words in doc["error"]["message"], doc
