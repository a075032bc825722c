"""A checkpoint's text side as ``save_pretrained`` writes it: tokenizer, chat template, special
tokens and generation defaults, held equal to transformers itself.

Each checkpoint directory is written by transformers (``PreTrainedTokenizerFast.save_pretrained``,
``GenerationConfig.save_pretrained``) around a small character-level BPE (the tiny model's
vocabulary is 256 ids): Llama 3 (template in ``chat_template.jinja``, BOS added by the
tokenizer's post-processor), Qwen2 / ChatML (template in ``tokenizer_config.json``, no BOS),
Mistral (named templates in ``tokenizer_config.json``, ``raise_exception`` on bad role order).
The oracle is ``AutoTokenizer.from_pretrained(dir)``; the server is driven over HTTP.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import jinja2
import pytest
from structlog.testing import capture_logs

from tests.checkpoints import save_tokenizer as _save
from tests.checkpoints import token_id as _id
from tests.checkpoints import trained_tokenizer
from tests.serving.conftest import config
from shared.text.chat_template import (
    TEMPLATE_ID,
    ChatMessage,
    ChatTemplateError,
    JinjaChatTemplate,
    load_chat_template,
)
from shared.text.checkpoint_files import CheckpointFileError
from tests.twin import InProcessCoordinator
from worker.engine import Engine
from shared.text.generation_config import SamplingDefaults, load_generation_config
from worker.http_server import start_http
from shared.text.tokenizer import load_tokenizer, special_tokens

# --- real-world templates (as published, trimmed of their tool-call branches) --------------------

LLAMA3 = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
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

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
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

CHATML = """{%- if tools %}
    {{- '<|im_start|>system\\n# Tools\\n<tools>' }}
    {%- for tool in tools %}
        {{- "\\n" }}{{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
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

MISTRAL = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
           "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
           "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
           "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")

ZEPHYR = """{% for message in messages %}
{% if message['role'] == 'user' %}
{{ '<|user|>\n' + message['content'] + eos_token }}
{% elif message['role'] == 'system' %}
{{ '<|system|>\n' + message['content'] + eos_token }}
{% elif message['role'] == 'assistant' %}
{{ '<|assistant|>\n'  + message['content'] + eos_token }}
{% endif %}
{% if loop.last and add_generation_prompt %}
{{ '<|assistant|>' }}
{% endif %}
{% endfor %}"""

#: What else templates use, each against transformers' own rendering of the same text.
FEATURES = {
    "indented_blocks": "{% for m in messages %}\n    {% if m.role == 'user' %}\n  > {{ m.content }}\n    {% endif %}\n"
                       "{% endfor %}",
    "loopcontrols": "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
                    "{% if m.role == 'system' %}{% continue %}{% endif %}{{ m.content }}|{% endfor %}",
    "tojson": "{{ messages | tojson(indent=2) }}{{ {'b': 'é', 'a': '<&>'} | tojson(sort_keys=true) }}"
              "{{ messages[0] | tojson(separators=(',', ':')) }}",
    "generation_tag": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
                      "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}",
    "namespace_dict": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
                      "{{ ns.n }}{{ dict(a=1, b=2) | tojson }}{{ dict.fromkeys(['x']) | tojson }}",
    "tokens_and_vars": "{{ bos_token }}{{ pad_token }}{{ eos_token }}{{ tools is none }}{{ documents is none }}"
                       "{{ add_generation_prompt }}{{ strftime_now('%Y') }}{{ messages | length }}",
}

@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        "llama": _save(root / "llama", bos="<|begin_of_text|>", eos="<|eot_id|>", template=LLAMA3,
                       gen={"do_sample": True, "temperature": 0.6, "top_p": 0.9,
                            "bos_token_id": _id("<|begin_of_text|>"),
                            "eos_token_id": [_id("<|end_of_text|>"), _id("<|eot_id|>")]}),
        "qwen": _save(root / "qwen", bos=None, eos="<|im_end|>", pad_token="<|endoftext|>", template=CHATML,
                      jinja_files=False,
                      gen={"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
                           "eos_token_id": [_id("<|im_end|>"), _id("<|endoftext|>")]}),
        "mistral": _save(root / "mistral", bos="<s>", eos="</s>", template={"default": MISTRAL, "tool_use": CHATML},
                         jinja_files=False),
        "zephyr": _save(root / "zephyr", bos="<s>", eos="</s>", pad_token="</s>", template=ZEPHYR),
        "plain": _save(root / "plain", bos="<s>", eos="</s>"),
    }


def hf(d: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(d)


def ours(messages: list[dict[str, str]]) -> list[ChatMessage]:
    return [ChatMessage(m["role"], m["content"], m.get("name")) for m in messages]


CHATS = {
    "one": [{"role": "user", "content": "Hello!"}],
    "turns": [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello! How are you?"},
              {"role": "user", "content": "The ledger?", "name": "ann"}],
    "tool": [{"role": "user", "content": "Look it up"}, {"role": "tool", "content": 'café ☃ <b>"x"</b>'}],
    "two_users": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
}


# --- rendering and token ids == transformers ----------------------------------------------------

@pytest.mark.parametrize("kind", ["llama", "qwen", "mistral", "zephyr"])
@pytest.mark.parametrize("chat", sorted(CHATS))
def test_rendering_and_ids_equal_transformers(dirs, kind: str, chat: str) -> None:
    d, messages = dirs[kind], CHATS[chat]
    ref_tok, template, tok = hf(d), load_chat_template(str(d)), load_tokenizer(str(d), 256)
    try:
        want = ref_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except jinja2.TemplateError as e:       # the template's raise_exception: ours refuses the same way
        with pytest.raises(ChatTemplateError, match=str(e)) as info:
            template.render(ours(messages))
        assert info.value.code == "chat_template_error" and info.value.param == "messages"
        return
    got = template.render(ours(messages))
    assert got == want
    ids = ref_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert tok.encode(got, add_special_tokens=False) == ids
    text = "The ledger records every block."
    assert tok.encode(text, add_special_tokens=True) == ref_tok(text).input_ids
    assert tok.decode(ids) == ref_tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_template_features_render_as_in_transformers(dirs, feature: str) -> None:
    d, source = dirs["zephyr"], FEATURES[feature]
    template = JinjaChatTemplate(source, feature, special_tokens(d))
    for messages in CHATS.values():
        want = hf(d).apply_chat_template(messages, chat_template=source, tokenize=False, add_generation_prompt=True)
        assert template.render(ours(messages)) == want


def test_where_the_template_and_its_tokens_come_from(dirs, tmp_path: Path) -> None:
    llama, qwen, mistral = (load_chat_template(str(dirs[k])) for k in ("llama", "qwen", "mistral"))
    assert (dirs["llama"] / "chat_template.jinja").is_file()            # transformers 5's own file
    assert llama.origin == str(dirs["llama"] / "chat_template.jinja")
    assert llama.id == "jinja-" + hashlib.sha256(LLAMA3.encode()).hexdigest()[:16]
    assert json.loads((dirs["qwen"] / "tokenizer_config.json").read_text())["chat_template"] == CHATML
    assert qwen.origin.endswith("tokenizer_config.json: field chat_template")
    assert mistral.origin.endswith("(default)") and mistral.id != qwen.id
    assert load_chat_template("").id == TEMPLATE_ID and load_chat_template("").origin == "builtin"
    missing = load_chat_template(str(dirs["plain"]))
    assert not missing.available and "no chat_template.jinja" in missing.origin
    for kind in ("llama", "qwen", "mistral", "zephyr"):
        assert special_tokens(dirs[kind]) == hf(dirs[kind]).special_tokens_map
    # The legacy special_tokens_map.json (no added_tokens_decoder in tokenizer_config.json): its
    # AddedToken dicts win, as transformers reads them.
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "tokenizer.json").write_text(trained_tokenizer())
    (legacy / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                              "chat_template": MISTRAL}))
    (legacy / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": {"content": "<|begin_of_text|>", "lstrip": False, "normalized": False, "rstrip": False,
                       "single_word": False}, "eos_token": "<|eot_id|>"}))
    assert special_tokens(legacy) == hf(legacy).special_tokens_map == {"bos_token": "<|begin_of_text|>",
                                                                        "eos_token": "<|eot_id|>"}
    messages = CHATS["one"] + [{"role": "assistant", "content": "Hi"}]
    assert (load_chat_template(str(legacy)).render(ours(messages))
            == hf(legacy).apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    assert load_tokenizer(str(legacy), 256).eos_token_ids == {_id("<|eot_id|>")}


def test_eos_ids_are_the_union_of_the_files(dirs) -> None:
    assert load_tokenizer(str(dirs["llama"]), 256).eos_token_ids == {_id("<|end_of_text|>"), _id("<|eot_id|>")}
    assert load_tokenizer(str(dirs["qwen"]), 256).eos_token_ids == {_id("<|im_end|>"), _id("<|endoftext|>")}
    assert load_tokenizer(str(dirs["mistral"]), 256).eos_token_ids == {_id("</s>")}


def test_generation_config_defaults_follow_do_sample(dirs, tmp_path: Path) -> None:
    assert load_generation_config(dirs["llama"]).sampling_defaults() == SamplingDefaults(
        0.6, 0.9, 0, source=str(dirs["llama"] / "generation_config.json"))
    qwen = load_generation_config(dirs["qwen"]).sampling_defaults()
    assert (qwen.temperature, qwen.top_p, qwen.top_k) == (0.7, 0.8, 20)
    assert load_generation_config(dirs["mistral"]).sampling_defaults() == SamplingDefaults()   # no file
    assert load_generation_config("").sampling_defaults() == SamplingDefaults()
    # do_sample absent (base Llama 3's file) or false: transformers decodes greedily and ignores
    # the sampling fields, so they are not request defaults.
    for doc in ({"temperature": 0.6, "top_p": 0.9}, {"do_sample": False, "temperature": 0.6, "top_k": 5}):
        (tmp_path / "generation_config.json").write_text(json.dumps(doc))
        assert load_generation_config(tmp_path).sampling_defaults() == SamplingDefaults()
    assert SamplingDefaults(0.6, 0.9, 20).resolve(None, None, None) == (0.6, 0.9, 20)
    assert SamplingDefaults(0.6, 0.9, 20).resolve(0.0, 1.0, 0) == (0.0, 1.0, 0)


@pytest.mark.parametrize("doc, words", [
    ("{not json", "generation_config.json: not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"do_sample": "yes"}', "field do_sample: expected true, false or null"),
    ('{"do_sample": true, "temperature": "hot"}', "field temperature: expected a number"),
    ('{"do_sample": true, "top_k": 2.5}', "field top_k: expected an integer >= 0"),
    ('{"do_sample": true, "top_p": 0}', "field top_p: 0.0 is outside the API's range"),
    ('{"do_sample": true, "temperature": 5}', "field temperature: 5.0 is outside the API's range"),
    ('{"eos_token_id": "</s>"}', "field eos_token_id: expected a token id"),
    ('{"eos_token_id": [1, true]}', "field eos_token_id"),
])
def test_a_bad_generation_config_is_refused_naming_file_and_field(tmp_path: Path, doc: str, words: str) -> None:
    (tmp_path / "generation_config.json").write_text(doc)
    with pytest.raises(CheckpointFileError, match=words.replace("(", r"\(")):
        load_generation_config(tmp_path)


def test_a_bad_template_is_refused_at_load_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}\n{% endfo %}")
    with pytest.raises(CheckpointFileError, match=r"chat_template\.jinja: the chat template does not compile: line 2"):
        load_chat_template(str(tmp_path))
    (tmp_path / "chat_template.jinja").unlink()
    for value in (5, [{"name": "default"}], ["x"]):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": value}))
        with pytest.raises(CheckpointFileError, match="tokenizer_config.json: field chat_template: expected"):
            load_chat_template(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "rag", "template": "x"}]}))
    assert "none is named 'default'" in load_chat_template(str(tmp_path)).origin
    (tmp_path / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(CheckpointFileError, match="tokenizer_config.json: not valid JSON"):
        load_chat_template(str(tmp_path))


def test_a_template_error_at_render_time_is_a_chat_template_error(tmp_path: Path) -> None:
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content + 1 }}")
    with pytest.raises(ChatTemplateError, match="failed on them: TypeError") as info:
        load_chat_template(str(tmp_path)).render([ChatMessage("user", "x")])
    assert info.value.code == "chat_template_error"
    # the sandbox holds (transformers' namespace refuses underscore names)
    (tmp_path / "chat_template.jinja").write_text("{% set ns = namespace(_x=1) %}{{ ''.__class__ }}")
    with pytest.raises(ChatTemplateError, match="underscore-prefixed"):
        load_chat_template(str(tmp_path)).render([ChatMessage("user", "x")])


# --- over HTTP ----------------------------------------------------------------------------------

def spy(server, monkeypatch) -> list:
    """The GenRequests the handlers submit (token ids and sampling as the engine gets them)."""
    seen: list = []
    submit = server.scheduler.submit

    def record(req):
        seen.append(req)
        return submit(req)

    monkeypatch.setattr(server.scheduler, "submit", record)
    return seen


async def test_a_llama_checkpoint_serves_chat_and_completions(serve, dirs, monkeypatch) -> None:
    d, ref = dirs["llama"], hf(dirs["llama"])
    messages = CHATS["turns"]
    async with serve(**{"worker.model_dir": str(d)}) as s:
        seen = spy(s, monkeypatch)
        status, doc, _ = await s.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2})
        assert status == 200, doc
        want = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        assert seen[-1].tokens == want and doc["usage"]["prompt_tokens"] == len(want)
        assert (seen[-1].sampling.temperature, seen[-1].sampling.top_p, seen[-1].sampling.top_k) == (0.6, 0.9, 0)
        assert seen[-1].stop_token_ids == {_id("<|end_of_text|>"), _id("<|eot_id|>")}
        # a completion's text gets the tokenizer's BOS; explicit sampling values win
        status, doc, _ = await s.post("/v1/completions", {"prompt": "Hello!", "max_tokens": 2, "temperature": 0,
                                                          "top_k": 3})
        assert status == 200 and seen[-1].tokens == ref("Hello!").input_ids
        assert seen[-1].tokens[0] == _id("<|begin_of_text|>")
        assert (seen[-1].sampling.temperature, seen[-1].sampling.top_p, seen[-1].sampling.top_k) == (0.0, 0.9, 3)
        assert (await s.get("/v1/models"))[1]["data"][0]["chat_template"] == load_chat_template(str(d)).id


async def test_a_chatml_checkpoint_adds_no_bos(serve, dirs, monkeypatch) -> None:
    d, ref = dirs["qwen"], hf(dirs["qwen"])
    async with serve(**{"worker.model_dir": str(d)}) as s:
        seen = spy(s, monkeypatch)
        c = s.client()
        # a tool result answers a call of an earlier assistant turn (the API checks it); the template
        # gets the call's arguments as an object, as transformers' own server passes them
        call = {"id": "call_1", "type": "function", "function": {"name": "look", "arguments": '{"q": "x"}'}}
        sent = [CHATS["tool"][0], {"role": "assistant", "content": None, "tool_calls": [call]},
                {**CHATS["tool"][1], "tool_call_id": "call_1"}]
        oracle = [sent[0], {"role": "assistant", "tool_calls": [{**call, "function": {"name": "look",
                                                                                      "arguments": {"q": "x"}}}]},
                  sent[2]]
        reply = await c.chat.completions.create(model="kvledger/dsv4-tiny", messages=sent, max_tokens=2,
                                                temperature=0)
        assert reply.choices[0].message.role == "assistant"
        assert seen[-1].tokens == ref.apply_chat_template(oracle, tokenize=True, add_generation_prompt=True,
                                                          return_dict=False)
        assert (seen[-1].sampling.temperature, seen[-1].sampling.top_p, seen[-1].sampling.top_k) == (0.0, 0.8, 20)
        await c.completions.create(model="kvledger/dsv4-tiny", prompt="Hello!", max_tokens=1)
        assert seen[-1].tokens == ref("Hello!").input_ids == ref("Hello!", add_special_tokens=False).input_ids


async def test_raise_exception_is_a_400_naming_the_reason(serve, dirs) -> None:
    async with serve(**{"worker.model_dir": str(dirs["mistral"])}) as s:
        status, doc, _ = await s.post("/v1/chat/completions", {"messages": CHATS["two_users"], "max_tokens": 1})
        assert status == 400
        assert doc["error"] == {"message": "messages: the model's chat template refused them: Conversation roles "
                                           "must alternate user/assistant/user/assistant/...",
                                "type": "invalid_request_error", "param": "messages", "code": "chat_template_error"}
        status, doc, _ = await s.post("/v1/chat/completions", {"messages": CHATS["one"], "max_tokens": 1})
        assert status == 200, doc


async def test_a_checkpoint_without_template_refuses_chat_and_says_so_once(serve, dirs) -> None:
    with capture_logs() as logs:
        async with serve(**{"worker.model_dir": str(dirs["plain"])}) as s:
            for _ in range(2):
                status, doc, _ = await s.post("/v1/chat/completions", {"messages": CHATS["one"], "max_tokens": 1})
                assert status == 400 and doc["error"]["code"] == "chat_template_missing"
                message = doc["error"]["message"]
                assert "has no chat template" in message and str(dirs["plain"]) not in message   # no server paths
            status, doc, _ = await s.post("/v1/completions", {"prompt": "Hello!", "max_tokens": 1})
            assert status == 200
            assert (await s.get("/v1/models"))[1]["data"][0]["chat_template"] is None
    missing = [e for e in logs if e["event"] == "chat_template_missing"]
    assert len(missing) == 1 and str(dirs["plain"]) in missing[0]["reason"]


async def test_the_builtin_template_without_a_model_dir(serve) -> None:
    async with serve() as s:
        assert (await s.get("/v1/models"))[1]["data"][0]["chat_template"] == TEMPLATE_ID


async def test_a_broken_checkpoint_file_refuses_the_start(model, tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "generation_config.json").write_text('{"do_sample": 1}')
    cfg = config(tmp_path, **{"worker.model_dir": str(d)})
    engine = Engine(model, cfg, InProcessCoordinator())
    try:
        with pytest.raises(ValueError, match=r"generation_config\.json: field do_sample"):
            await start_http(engine, cfg)
    finally:
        await engine.stop()
