"""Tokenizers, detokenizing, stop strings and the chat template (no model)."""

from __future__ import annotations

import json

import pytest

from worker.api.text import TextStream
from shared.text.chat_template import ChatMessage, ChatTemplateError, render
from shared.text.tokenizer import ByteTokenizer, HFTokenizer, TokenizerError, load_tokenizer


def run(text: str, stop: list[str]) -> tuple[list[str], str, bool]:
    tok = ByteTokenizer()
    ts = TextStream(tok.detokenizer(), stop)
    pieces = [ts.push(t) for t in tok.encode(text)]
    pieces.append(ts.finish())
    return pieces, "".join(pieces), ts.stopped


def test_stop_strings() -> None:
    assert run("hello world", [])[1:] == ("hello world", False)
    assert run("hello world", ["o w"])[1:] == ("hell", True)
    assert run("hello world", ["xyz", "wor", "llo"])[1:] == ("he", True)     # the earliest match wins
    assert run("hello world", ["ld!"])[1:] == ("hello world", False)         # a held tail is released at the end
    pieces, _, _ = run("abcabd", ["abd"])
    assert pieces == ["", "", "abc", "", "", "", ""]                         # "ab" held until it cannot be "abd"
    ts = TextStream(ByteTokenizer().detokenizer(), ["b"])
    ts.push(ord("a")), ts.push(ord("b")), ts.push(ord("c"))
    assert ts.stopped and ts.tokens == 2 and ts.finish() == ""


def test_byte_detokenizer_holds_incomplete_utf8() -> None:
    tok = ByteTokenizer()
    d = tok.detokenizer()
    snow = "☃".encode()
    assert [d.push(b) for b in snow] == ["", "", "☃"]
    assert d.push(0xE2) == "" and d.flush() == "\ufffd"
    assert tok.decode(list(b"ok\xff")) == "ok\ufffd"
    assert run("naïve ☃", ["☃"])[1] == "naïve "


def test_chat_template_is_documented_and_extends_by_prefix() -> None:
    msgs = [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi")]
    assert render(msgs) == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    turn2 = [*msgs, ChatMessage("assistant", "Hello"), ChatMessage("user", "More")]
    assert render(turn2).startswith(render(msgs))
    assert render([ChatMessage("developer", "x")]) == render([ChatMessage("system", "x")])
    with pytest.raises(ChatTemplateError, match=r"messages\[1\].role"):
        render([ChatMessage("user", "a"), ChatMessage("function", "b")])   # "tool" is a role: tool results
    with pytest.raises(ChatTemplateError, match="at least one"):
        render([])


def _word_level(tmp_path, words: list[str]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[UNK]", "</s>", *words])}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.save(str(tmp_path / "tokenizer.json"))


def test_tokenizer_json_from_the_model_dir(tmp_path) -> None:
    assert isinstance(load_tokenizer("", 256), ByteTokenizer)
    assert isinstance(load_tokenizer(str(tmp_path), 256), ByteTokenizer)       # no tokenizer.json there
    _word_level(tmp_path, ["the", "ledger", "block"])
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 1}))
    tok = load_tokenizer(str(tmp_path), 256)
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 5 and tok.eos_token_ids == {1}
    ids = tok.encode("the ledger block")
    assert ids == [2, 3, 4] and tok.decode(ids) == "the ledger block"
    d = tok.detokenizer()
    assert "".join(d.push(i) for i in ids) + d.flush() == tok.decode(ids)
    _word_level(tmp_path, [f"w{i}" for i in range(300)])
    with pytest.raises(TokenizerError, match="302 ids but the model's vocabulary is 256"):
        load_tokenizer(str(tmp_path), 256)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot load"):
        load_tokenizer(str(tmp_path), 256)


async def test_a_tokenizer_json_serves(serve, tmp_path) -> None:
    _word_level(tmp_path, [chr(c) for c in range(ord("a"), ord("z") + 1)])
    async with serve(tokenizer=HFTokenizer(tmp_path / "tokenizer.json")) as s:
        status, doc, _ = await s.post("/v1/completions", {"prompt": "a b c d e f g h i j k l m n o p q",
                                                          "max_tokens": 3, "temperature": 0})
        assert status == 200 and doc["usage"]["prompt_tokens"] == 17
        status, doc = await s.get("/v1/models")
        assert doc["data"][0]["tokenizer"].startswith("tokenizers:")
