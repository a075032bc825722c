"""Agent tool turns on the chat endpoint, through the real openai client against a running worker:
forced calls (``tool_choice`` required / named) valid for every seed, streamed as they are returned
whole, an agent loop whose later turns reuse the earlier ones' cache, calls read from ``auto``
output, and every bad input a 400 naming its parameter. Checkpoint templates with tools render
exactly as transformers' ``apply_chat_template(..., tools=...)``, on the worker and the gateway."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from gateway.prompt import prompt_tokens
from shared.text.chat_template import BUILTIN, load_chat_template, message
from shared.text.tokenizer import ByteTokenizer, load_tokenizer
from shared.text.tool_calls import render_calls
from tests.checkpoints import save_tokenizer
from tests.serving.conftest import MODEL
from tests.serving.test_checkpoint_text import LLAMA3, hf, spy

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 5},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["tz"],
        "properties": {"tz": {"enum": ["UTC", "CET"]}}}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Forecast for a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "clock", "parameters": TIME}}]
SCHEMAS = {"weather": WEATHER, "clock": TIME}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]
NAMED = {"type": "function", "function": {"name": "weather"}}


def check_calls(choice, allowed=("weather", "clock")) -> list:
    """The choice's calls, each of an allowed tool with arguments valid for its parameters."""
    calls = choice.message.tool_calls or []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return calls


# --- forced calls -----------------------------------------------------------------------------------

async def test_a_named_tool_choice_returns_a_valid_call_for_every_seed(serve) -> None:
    async with serve() as s:
        c = s.client()
        for seed in (1, 3):      # NOTE: two seeds; the grammar's property test samples many more paths
            r = await c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                                max_tokens=120, temperature=1.0, seed=seed)
            choice = r.choices[0]
            assert choice.finish_reason == "tool_calls", choice
            assert choice.message.content is None and len(check_calls(choice, ("weather",))) == 1
        # a seed reproduces its call
        again = await c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                                max_tokens=120, temperature=1.0, seed=3)
        assert again.choices[0].message.tool_calls[0].function == choice.message.tool_calls[0].function


async def test_required_with_two_tools_one_call_or_several(serve) -> None:
    async with serve() as s:
        c = s.client()
        for seed in range(2):
            r = await c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                                parallel_tool_calls=False, max_tokens=120, temperature=1.0,
                                                seed=seed)
            assert r.choices[0].finish_reason == "tool_calls"
            calls = check_calls(r.choices[0])
            assert len(calls) == 1
        # parallel calls allowed: every call the output holds is valid; a cut-short list stays text
        r = await c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                            max_tokens=160, temperature=1.0, seed=7)
        if r.choices[0].finish_reason == "tool_calls":
            assert check_calls(r.choices[0]) and r.choices[0].message.content is None
        else:
            assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith("<|tool_calls|>[")


async def test_a_streamed_call_is_the_non_streamed_one(serve) -> None:
    async with serve() as s:
        c = s.client()
        whole = await c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                                max_tokens=120, temperature=1.0, seed=11)
        stream = await c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                                 max_tokens=120, temperature=1.0, seed=11, stream=True,
                                                 stream_options={"include_usage": True})
        chunks = [ch async for ch in stream]
        deltas = [d for ch in chunks if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
        content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        assert content == "" and finish == ["tool_calls"]
        assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
            (0, "weather", whole.choices[0].message.tool_calls[0].function.arguments)]
        assert deltas[0].id.startswith("call_") and deltas[0].type == "function"
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


async def test_n_samples_each_get_their_calls(serve) -> None:
    async with serve() as s:
        r = await s.client().chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, n=2,
                                                     max_tokens=120, temperature=1.0, seed=5)
        assert [ch.finish_reason for ch in r.choices] == ["tool_calls"] * 2
        assert all(len(check_calls(ch, ("weather",))) == 1 for ch in r.choices)
        # streamed: each choice's call under its own index, the same as above
        stream = await s.client().chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                                          n=2, max_tokens=120, temperature=1.0, seed=5, stream=True)
        chunks = [ch async for ch in stream]
        got = {ch.choices[0].index: (d.function.name, d.function.arguments) for ch in chunks if ch.choices
               for d in ch.choices[0].delta.tool_calls or []}
        assert got == {i: (c.message.tool_calls[0].function.name, c.message.tool_calls[0].function.arguments)
                       for i, c in enumerate(r.choices)}


# --- an agent loop --------------------------------------------------------------------------------

async def test_an_agent_loop_reuses_the_cache_of_its_earlier_turns(serve, monkeypatch) -> None:
    """call → result → call → result → answer: each turn's prompt extends the previous prompt and
    reply byte for byte (the built-in template renders a call as the model wrote it), so each later
    turn finds every whole block of them cached (replies' blocks are cached too)."""
    async with serve() as s:
        seen = spy(s, monkeypatch)
        c = s.client()
        messages: list = [{"role": "system", "content": "Use the tools."}, *ASK]
        previous = None
        for turn, choice in enumerate(("required", NAMED, "none")):
            r = await c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice=choice,
                                                parallel_tool_calls=False, max_tokens=120 if turn < 2 else 4,
                                                temperature=1.0, seed=turn)
            tokens = seen[-1].tokens
            if previous is not None:
                before, reply = previous
                assert tokens[:len(before) + len(reply)] == before + reply       # a prefix: prompt, then reply
                cached = r.usage.prompt_tokens_details.cached_tokens
                assert cached == (len(before) + len(reply)) // 16 * 16 > 0, (cached, turn)   # every whole block
            choice0 = r.choices[0]
            if turn < 2:
                (call,) = check_calls(choice0)
                messages.append(choice0.message)                      # as agent loops do: the reply object
                messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'})
                # what the model wrote: the call in the built-in syntax, its arguments as returned
                previous = tokens, ByteTokenizer().encode(render_calls("builtin", [(call.function.name,
                                                                                    call.function.arguments)]))
            else:
                assert choice0.finish_reason == "length" and not choice0.message.tool_calls   # none: plain text


# --- auto: calls read from free output ---------------------------------------------------------------

CALL = '<|tool_calls|>[{"name":"clock","arguments":{"tz":"CET"}}]'


def regex(text: str) -> dict:
    """Make the model write exactly ``text`` (vLLM's structured_outputs), to drive ``auto`` parsing."""
    import re

    return {"structured_outputs": {"regex": re.escape(text)}}


@pytest.mark.parametrize("stream", [False, True])
async def test_auto_reads_calls_out_of_the_output_and_leaves_the_rest(serve, stream) -> None:
    async with serve() as s:
        c = s.client()

        async def ask(text: str, **kw):
            r = await c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=100,
                                                temperature=0, extra_body=regex(text), stream=stream, **kw)
            if not stream:
                m = r.choices[0].message
                return m.content, [(t.function.name, t.function.arguments) for t in m.tool_calls or []], \
                    r.choices[0].finish_reason
            chunks = [ch async for ch in r]
            content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            calls = [(d.function.name, d.function.arguments) for ch in chunks if ch.choices
                     for d in ch.choices[0].delta.tool_calls or []]
            finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
            return content or None, calls, finish[0]

        assert await ask("Sure. " + CALL) == ("Sure.", [("clock", '{"tz":"CET"}')], "tool_calls")
        # an undeclared tool and arguments that are not JSON stay content, as written
        for text in (CALL.replace("clock", "clack"), CALL.replace('"CET"', "CET")):
            assert await ask(text) == (text, [], "stop")
        # tool_choice none: the tools are in the prompt, the output is text
        assert await ask(CALL, tool_choice="none") == (CALL, [], "stop")


async def test_tools_change_the_prompt_only_when_given(serve, monkeypatch) -> None:
    async with serve() as s:
        seen = spy(s, monkeypatch)
        c = s.client()
        for extra in ({}, {"tools": []}, {"tool_choice": "none"}, {"tools": TOOLS}):
            await c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, **extra)
        plain = ByteTokenizer().encode(BUILTIN.render([message("user", ASK[0]["content"])]))
        assert seen[0].tokens == seen[1].tokens == seen[2].tokens == plain            # exactly as before
        with_tools = BUILTIN.render([message("user", ASK[0]["content"])], TOOLS)
        assert seen[3].tokens == ByteTokenizer().encode(with_tools)
        assert with_tools.startswith('<|tools|>\n{"type":"function","function":{"name":"weather",')


# --- bad input -------------------------------------------------------------------------------------

def tool(**fn) -> dict:
    return {"type": "function", "function": {"name": "f", **fn}}


CALLED = {"role": "assistant", "content": None,
          "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "weather",
                                                                            "arguments": '{"city": "Oslo"}'}}]}


@pytest.mark.parametrize("extra, param, words", [
    ({"tools": "weather"}, "tools", "expected `array | null`"),
    ({"tools": [tool()] * 129}, "tools", "at most 128 tools"),
    ({"tools": [tool(description="x" * 300_000)]}, "tools", "bytes of tool definitions"),
    ({"tools": [5]}, "tools[0]", "expected"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "only 'function'"),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "expected"),
    ({"tools": [TOOLS[0], tool(name="a b")]}, "tools[1].function.name", "a-z"),
    ({"tools": [TOOLS[0], TOOLS[1], tool(name="x" * 65)]}, "tools[2].function.name", "1 to 64"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name", "already the name of tools[0]"),
    ({"tools": [tool(description=5)]}, "tools[0].function.description", "string"),
    ({"tools": [tool(parameters=[1])]}, "tools[0].function.parameters", "JSON Schema object"),
    ({"tools": [tool(parameters={"type": "string"})]}, "tools[0].function.parameters", "must be 'object'"),
    ({"tools": [tool(parameters={"type": "object", "properties": []})]}, "tools[0].function.parameters.properties",
     "expected an object"),
    ({"tools": [tool(parameters={"type": "object", "required": "a"})]}, "tools[0].function.parameters.required",
     "list of argument names"),
    ({"tools": [tool(parameters={"type": "object", "properties": {"a": {"type": "frobnicate"}}})],
      "tool_choice": "required"}, "tools[0].function.parameters", "cannot be compiled"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "is not one of"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "expected"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among tools (weather, clock)"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": NAMED}, "tool_choice", "not among tools (none given)"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "send one of them"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "expected `bool | null`"),
    ({"messages": [*ASK, {"role": "tool", "content": "21", "tool_call_id": "call_9"}]}, "messages[1].tool_call_id",
     "not the id of a tool call in an earlier assistant message"),
    ({"messages": [*ASK, {"role": "tool", "content": "21"}]}, "messages[1].tool_call_id", "names the call"),
    ({"messages": [*ASK, {"role": "tool", "content": "21", "tool_call_id": "call_1"}, CALLED]},
     "messages[1].tool_call_id", "earlier assistant message"),
    ({"messages": [*ASK, CALLED, {"role": "tool", "tool_call_id": "call_1"}]}, "messages[2].content", "result"),
    ({"messages": [{**ASK[0], "tool_calls": CALLED["tool_calls"]}]}, "messages[0].tool_calls", "only assistant"),
    ({"messages": [*ASK, {**CALLED, "tool_calls": [{"type": "function"}]}]}, "messages[1].tool_calls[0].id",
     "id"),
    ({"messages": [*ASK, {**CALLED, "tool_calls": [{**CALLED["tool_calls"][0], "type": "code"}]}]},
     "messages[1].tool_calls[0].type", "only 'function'"),
    ({"messages": [*ASK, {**CALLED, "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}]},
     "messages[1].tool_calls[0].function.name", "name"),
    ({"messages": [*ASK, {**CALLED, "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "not valid JSON"),
    ({"messages": [*ASK, {**CALLED, "tool_calls": "call"}]}, "messages[1].tool_calls", "expected `array | null`"),
    ({"messages": [*ASK, {"role": "tool", "content": "x", "tool_call_id": 7}]}, "messages[1].tool_call_id",
     "expected `str | null`"),
])
async def test_bad_tool_inputs_are_400_naming_the_parameter(serve, extra, param, words) -> None:
    async with serve() as s:
        for path in ("/v1/chat/completions", "/tokenize"):
            if path == "/tokenize" and any(k.startswith(("tool_choice", "parallel", "response")) for k in extra):
                continue                    # /tokenize takes messages and tools only
            status, doc, _ = await s.post(path, {"messages": ASK, "max_tokens": 1, **extra})
            e = doc["error"]
            assert status == 400 and e["type"] == "invalid_request_error", (path, doc)
            assert e["param"] == param and words in e["message"], (path, e)
        assert s.live_leases() == 0


async def test_a_template_without_a_call_syntax_refuses_forced_calls_but_renders_tools(serve, dirs) -> None:
    async with serve(**{"worker.model_dir": str(dirs["zephyr"])}) as s:
        status, doc, _ = await s.post("/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "max_tokens": 1,
                                                               "tool_choice": "required"})
        assert status == 400 and doc["error"]["param"] == "tool_choice"
        assert "service.tool_call_parser" in doc["error"]["message"]
        status, doc, _ = await s.post("/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "max_tokens": 1})
        assert status == 200 and "tool_calls" not in doc["choices"][0]["message"]
    # a syntax named by config, on a tokenizer llguidance cannot read: a 400 saying so, not a 500
    async with serve(**{"worker.model_dir": str(dirs["zephyr"]), "service.tool_call_parser": "hermes"}) as s:
        status, doc, _ = await s.post("/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "max_tokens": 1,
                                                               "tool_choice": NAMED})
        assert status == 400 and doc["error"]["param"] == "tool_choice", doc
        assert "not available with this model's tokenizer" in doc["error"]["message"]


# --- checkpoint templates == transformers ---------------------------------------------------------

#: Qwen2.5-Instruct's template as published (Hermes-style calls).
QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

#: Llama 3.1-Instruct's template as published (JSON calls with "parameters", custom tools in the
#: first user message, built-in tools as <|python_tag|> calls that iterate the arguments).
LLAMA31 = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\\n\\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""


def call(i: str, name: str, args: str) -> dict:
    return {"id": i, "type": "function", "function": {"name": name, "arguments": args}}


#: Conversations as the API gets them (arguments as JSON text, null content beside calls).
AGENT = {
    "ask": [{"role": "user", "content": "Weather in Oslo?"}],
    "one_call": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
                 {"role": "assistant", "content": None,
                  "tool_calls": [call("call_1", "weather", '{"city": "Oslo", "days": 2}')]},
                 {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "café ☃"}'}],
    "two_calls": [{"role": "user", "content": "Oslo and the time?"},
                  {"role": "assistant", "content": "Checking both.",
                   "tool_calls": [call("a", "weather", '{"city":"Oslo","days":1}'),
                                  call("b", "clock", '{"tz":"CET"}')]},
                  {"role": "tool", "tool_call_id": "a", "content": "21"},
                  {"role": "tool", "tool_call_id": "b", "content": "12:00"},
                  {"role": "assistant", "content": "21 C at noon."}, {"role": "user", "content": "Thanks"}],
}


def transformers_view(messages: list[dict]) -> list[dict]:
    """The same conversation as transformers documents it: arguments as objects (what its own
    server passes templates), None-valued keys dropped (as apply_chat_template does)."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        if "tool_calls" in m:
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


def ours(messages: list[dict]) -> list:
    return [message(m["role"], m.get("content"), m.get("name"), m.get("tool_calls"), m.get("tool_call_id"))
            for m in messages]


def llguidance_readable(d: Path) -> Path:
    """The test tokenizer with a decoder llguidance maps to bytes (sentencepiece-style, as Llama 2's
    and Mistral's; its Fuse alone llguidance refuses), so forced calls can run on it."""
    from tokenizers import Tokenizer, decoders

    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.save(str(d / "tokenizer.json"))
    return d


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    from tests.serving.test_checkpoint_text import ZEPHYR

    root = tmp_path_factory.mktemp("tool_checkpoints")
    return {
        "qwen25": llguidance_readable(save_tokenizer(root / "qwen25", bos=None, eos="<|im_end|>",
                                                     pad_token="<|endoftext|>", template=QWEN25, jinja_files=False)),
        "llama31": save_tokenizer(root / "llama31", bos="<|begin_of_text|>", eos="<|eot_id|>", template=LLAMA31),
        # a default template without tools and a tool_use one, in transformers 5's files
        # (additional_chat_templates/tool_use.jinja) and in tokenizer_config.json's list
        "named_files": save_tokenizer(root / "named_files", bos="<s>", eos="</s>",
                                      template={"default": LLAMA3, "tool_use": QWEN25}),
        "named_config": save_tokenizer(root / "named_config", bos="<s>", eos="</s>",
                                       template={"default": LLAMA3, "tool_use": QWEN25}, jinja_files=False),
        "zephyr": save_tokenizer(root / "zephyr", bos="<s>", eos="</s>", pad_token="</s>", template=ZEPHYR),
    }


@pytest.mark.parametrize("kind", ["qwen25", "llama31", "named_files", "named_config"])
@pytest.mark.parametrize("chat", sorted(AGENT))
@pytest.mark.parametrize("with_tools", [True, False])
def test_tool_conversations_render_as_transformers_renders_them(dirs, kind, chat, with_tools) -> None:
    d, messages = dirs[kind], AGENT[chat]
    tools = TOOLS if with_tools else None
    template, ref = load_chat_template(str(d)), hf(d)
    try:
        want = ref.apply_chat_template(transformers_view(messages), tools=tools, tokenize=False,
                                       add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - the template's raise_exception: ours refuses alike
        with pytest.raises(ValueError, match=str(e)[:40]):
            template.render(ours(messages), tools)
        assert kind == "llama31" and chat == "two_calls"        # Llama 3.1 renders one call per turn
        return
    assert template.render(ours(messages), tools) == want


def test_the_template_names_its_call_syntax(dirs) -> None:
    assert load_chat_template(str(dirs["qwen25"])).tool_format == "hermes"
    assert load_chat_template(str(dirs["llama31"])).tool_format == "llama3_json"
    assert load_chat_template(str(dirs["named_files"])).tool_format == "hermes"      # its tool_use template's
    assert (dirs["named_files"] / "additional_chat_templates" / "tool_use.jinja").is_file()
    assert load_chat_template(str(dirs["zephyr"])).tool_format == "none"
    assert load_chat_template("").tool_format == "builtin"
    # the tool_use template is part of the template's identity
    assert load_chat_template(str(dirs["named_files"])).id != load_chat_template(str(dirs["qwen25"])).id


@pytest.mark.parametrize("kind", ["qwen25", "llama31"])
async def test_the_worker_and_the_gateway_tokenize_a_tool_turn_as_transformers(serve, dirs, monkeypatch,
                                                                              kind) -> None:
    d, ref = dirs[kind], hf(dirs[kind])
    messages = AGENT["one_call"]
    body = {"messages": messages, "tools": TOOLS, "max_tokens": 2, "temperature": 0}
    want = ref.apply_chat_template(transformers_view(messages), tools=TOOLS, tokenize=True,
                                   add_generation_prompt=True, return_dict=False)
    async with serve(**{"worker.model_dir": str(d)}) as s:
        seen = spy(s, monkeypatch)
        status, doc, _ = await s.post("/v1/chat/completions", body)
        assert status == 200, doc
        assert seen[-1].tokens == want
        status, doc, _ = await s.post("/tokenize", {"messages": messages, "tools": TOOLS})
        assert status == 200 and doc["tokens"] == want
    # the gateway routes by the same tokens (its cache query hashes them)
    routed = prompt_tokens("/v1/chat/completions", json.loads(json.dumps(body)), load_tokenizer(str(d), 256),
                           load_chat_template(str(d)))
    assert routed is not None and routed.tokens == want


async def test_the_gateway_tokenizes_a_builtin_tool_turn_as_the_worker(serve, monkeypatch) -> None:
    messages = [*AGENT["one_call"], {"role": "assistant", "content": "21 C."}, {"role": "user", "content": "Bye"}]
    body = {"messages": messages, "tools": TOOLS, "max_tokens": 1}
    async with serve() as s:
        seen = spy(s, monkeypatch)
        assert (await s.post("/v1/chat/completions", body))[0] == 200
    routed = prompt_tokens("/v1/chat/completions", body, ByteTokenizer(), BUILTIN)
    assert routed is not None and routed.tokens == seen[-1].tokens
    assert b'<|tool_calls|>[{"name":"weather","arguments":{"city": "Oslo", "days": 2}}]\n<|tool|>\n' \
        in bytes(seen[-1].tokens)


async def test_a_hermes_checkpoint_forces_and_reads_calls(serve, dirs) -> None:
    """Qwen2.5's syntax end to end: a forced call in ``<tool_call>`` blocks, spaced as its template
    renders calls back, read into tool_calls."""
    async with serve(**{"worker.model_dir": str(dirs["qwen25"])}) as s:
        c = s.client()
        for seed in range(2):
            r = await c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                                parallel_tool_calls=False, max_tokens=150, temperature=1.0,
                                                seed=seed)
            assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
            (tc,) = check_calls(r.choices[0])
            assert tc.function.arguments.startswith('{"') and '": ' in tc.function.arguments   # tojson's spacing
