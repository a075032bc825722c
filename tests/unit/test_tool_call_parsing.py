"""Tool calls read from model output (``shared.text.tool_calls``): each format's syntax, what stays
content, a stream cut anywhere giving exactly the whole output's result, and the forcing grammar
admitting only valid calls (random walks through llguidance's masks)."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.text import tool_calls as tc
from shared.text.chat_template import BUILTIN, message
from tests.fuzz import examples

NAMES = frozenset({"get_weather", "noop"})


def calls(p: tc.Parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in p.calls]


# --- each format ----------------------------------------------------------------------------------

def test_hermes_several_calls_with_text_around_them() -> None:
    out = ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
           '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>\nDone.')
    p = tc.parse("hermes", out, NAMES)
    assert calls(p) == [("get_weather", {"city": "Paris"}), ("noop", {})]
    assert p.content == "Let me check both.\nDone."
    # arguments come back as the model wrote them (spacing, escapes), not re-encoded
    p = tc.parse("hermes", '<tool_call>{"name":"get_weather","arguments":{"city" : "\\u00e9"}}</tool_call>', NAMES)
    assert p.calls == (tc.Call("get_weather", '{"city" : "\\u00e9"}'),) and p.content is None
    # arguments written as a JSON string are decoded (and spaced as tojson writes them)
    p = tc.parse("hermes", '<tool_call>\n{"name": "noop", "arguments": "{\\"a\\":1}"}\n</tool_call>', NAMES)
    assert p.calls == (tc.Call("noop", '{"a": 1}'),)


@pytest.mark.parametrize("out", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>',      # bad JSON
    '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',                      # not a declared tool
    '<tool_call>\n{"name": "noop", "arguments": [1, 2]}\n</tool_call>',                   # arguments not an object
    '<tool_call>\n{"name": "noop", "arguments": {}, "extra": 1}\n</tool_call>',           # not a call object
    '<tool_call>\n{"name": "noop", "arguments": {}}',                                     # cut short
    'Plain text, no call at all.\n',
])
def test_what_is_not_a_valid_call_stays_content_as_written(out: str) -> None:
    assert tc.parse("hermes", out, NAMES) == tc.Parsed(out, ())


def test_a_bad_call_beside_a_good_one_stays_text_and_the_good_one_counts() -> None:
    bad = '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    out = f'{bad}\n<tool_call>\n{{"name": "noop", "arguments": {{}}}}\n</tool_call>'
    p = tc.parse("hermes", out, NAMES)
    assert calls(p) == [("noop", {})] and p.content == bad


def test_llama3_json() -> None:
    p = tc.parse("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', NAMES)
    assert calls(p) == [("get_weather", {"city": "Paris"})] and p.content is None
    p = tc.parse("llama3_json", '<|python_tag|>{"name": "noop", "arguments": {}}; {"name": "get_weather", '
                                '"parameters": {"city": "Oslo"}} thanks', NAMES)
    assert calls(p) == [("noop", {}), ("get_weather", {"city": "Oslo"})] and p.content == "thanks"
    for text in ('I think {"name": "noop", "parameters": {}}',      # only at the start of the output
                 '{"answer": 42}', '{"name": "noop", "parameters": {'):
        assert tc.parse("llama3_json", text, NAMES) == tc.Parsed(text, ())


def test_mistral_with_and_without_its_control_token() -> None:
    body = '[{"name": "noop", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]'
    for out in ("[TOOL_CALLS]" + body, " " + body, "Sure. [TOOL_CALLS] " + body):
        p = tc.parse("mistral", out, NAMES)
        assert calls(p) == [("noop", {}), ("get_weather", {"city": "Rome"})], out
        assert p.content == ("Sure." if out.startswith("Sure") else None)
    for out in ("[1, 2] are numbers", "[TOOL_CALLS] [{\"name\": \"noop\"", "Sure: " + body):
        assert tc.parse("mistral", out, NAMES) == tc.Parsed(out, ())


def test_builtin_calls_rendered_by_the_template_parse_back_and_keep_the_prompt_a_prefix() -> None:
    """What the built-in template renders for a turn's calls is what the model writes for them."""
    written = [("get_weather", '{"city":"Paris"}'), ("noop", "{}")]
    out = "On it." + tc.render_calls("builtin", written)
    assert out == 'On it.<|tool_calls|>[{"name":"get_weather","arguments":{"city":"Paris"}},{"name":"noop",' \
                  '"arguments":{}}]'
    p = tc.parse("builtin", out, NAMES)
    assert [(c.name, c.arguments) for c in p.calls] == written and p.content == "On it."
    tools = [{"type": "function", "function": {"name": n}} for n in sorted(NAMES)]
    turn = [message("user", "Weather in Paris?")]
    prompt = BUILTIN.render(turn, tools)
    ids = [f"call_{k}" for k in range(len(p.calls))]
    replied = turn + [message("assistant", p.content, tool_calls=[
        {"id": i, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for i, c in zip(ids, p.calls)])] + [message("tool", "21 C", tool_call_id=ids[0]),
                                            message("tool", "ok", tool_call_id=ids[1])]
    assert BUILTIN.render(replied, tools).startswith(prompt + out + "\n<|tool|>\n21 C\n")


def test_detect_reads_the_template_text() -> None:
    assert tc.detect("{{- '<tool_call>\\n' }}") == "hermes"
    assert tc.detect("", "{{ '[TOOL_CALLS] [' }}") == "mistral"
    llama = """{%- set tool_call = message.tool_calls[0].function %}{{- '"parameters": ' }}"""
    assert tc.detect(llama) == "llama3_json"
    assert tc.detect("{{ messages[0].content }}") == "none"


# --- streaming: any cut gives the whole output's answer ----------------------------------------------

FRAGMENTS = ["Hi", " ", "\n", "Let me see.", "<tool", "_call>", "<tool_call>", "</tool_call>", "{", "}", "[", "]",
             '{"name": "noop", "arguments": {}}', '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
             '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>', "[TOOL_CALLS]", ";", "<|python_tag|>",
             '<|tool_calls|>[{"name":"noop","arguments":{}}]', "<|tool_", '[{"name": "noop", "arguments": {}}]']


@settings(max_examples=examples(300), deadline=None)
@given(fmt=st.sampled_from(["hermes", "llama3_json", "mistral", "builtin"]),
       pieces=st.lists(st.sampled_from(FRAGMENTS), max_size=8), cuts=st.randoms(use_true_random=False))
def test_a_stream_cut_anywhere_gives_the_whole_outputs_content_and_calls(fmt, pieces, cuts) -> None:
    text = "".join(pieces)
    whole = tc.parse(fmt, text, NAMES)
    sp, streamed, i = tc.StreamParser(fmt, NAMES), "", 0
    while i < len(text):
        n = cuts.randint(1, 5)
        streamed += sp.push(text[i:i + n])
        i += n
    rest, parsed = sp.finish()
    assert parsed == whole
    assert streamed + rest == (whole.content or "")


def test_a_stream_sends_text_before_a_call_at_once_and_holds_what_may_begin_one() -> None:
    sp = tc.StreamParser("hermes", NAMES)
    assert sp.push("Checking") == "Checking"
    assert sp.push(" the weather <tool") == " the weather"          # trailing space and '<tool' held
    assert sp.push("_call>\n{") == ""                                 # a call began: held to the end
    sp.push('"name": "noop", "arguments": {}}\n</tool_call>')
    rest, parsed = sp.finish()
    assert rest == "" and parsed.content == "Checking the weather" and calls(parsed) == [("noop", {})]


# --- forcing ---------------------------------------------------------------------------------------

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 5}, "days": {"type": "integer", "minimum": 1,
                                                                               "maximum": 7}}}


def _walk(grammar: str, seed: int, limit: int = 400) -> str:
    """A random path through the grammar over a byte vocabulary (what a random model could write)."""
    import llguidance

    from worker.structured import _ByteVocab

    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocab(257)), n_vocab=257)
    g = llguidance.LLMatcher.grammar_from_lark(grammar)
    assert not llguidance.LLMatcher.validate_grammar_with_warnings(g, tok)[0]
    m, rng, out = llguidance.LLMatcher(tok, g, log_level=0), random.Random(seed), []
    while not m.is_stopped() and len(out) < limit:
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")[:256]
        t = rng.choice(np.nonzero(bits)[0].tolist())
        assert m.consume_token(t)
        out.append(t)
    return bytes(out).decode("utf-8")


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral", "builtin"])
def test_a_forced_call_is_always_a_valid_call_of_the_allowed_tools(fmt: str) -> None:
    functions = [("get_weather", WEATHER), ("noop", None)]
    for seed in range(12):
        for allowed, parallel in ((functions, False), (functions[:1], False), (functions, True)):
            out = _walk(tc.grammar(fmt, allowed, parallel=parallel), seed)
            p = tc.parse(fmt, out, NAMES)
            if parallel and fmt == "hermes":       # no end token here: calls follow calls to the limit
                assert p.calls, out
            else:
                assert p.content is None and p.calls, out
            if not parallel or fmt == "llama3_json":
                assert len(p.calls) == 1, out
            for c in p.calls:
                assert c.name in {n for n, _ in allowed}
                jsonschema.validate(json.loads(c.arguments), dict(allowed)[c.name] or tc.NO_PARAMETERS)
                assert c.arguments in out                     # as written
