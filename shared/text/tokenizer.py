"""Text ↔ token ids for the serving layer.

Two tokenizers behind one small interface (:class:`Tokenizer`):

* :class:`ByteTokenizer` — the default: a token is one byte of the UTF-8 encoding (ids
  0–255), nothing to download, no special tokens. It matches the tiny seeded model, whose
  vocabulary is exactly 256.
* :class:`HFTokenizer` — ``tokenizer.json`` (Hugging Face ``tokenizers`` library) from the
  configured model directory (``worker.model_dir``), used whenever that file exists.

Special tokens, as transformers and vLLM handle them: a ``/v1/completions`` prompt is encoded
with them (``add_special_tokens=True``: ``tokenizer.json``'s post-processor adds what the model
expects, e.g. Llama's BOS); a chat prompt is encoded without (the chat template writes them
itself, as ``apply_chat_template`` does). Decoding skips them. Generation ends at any of the
EOS ids: ``generation_config.json``'s ``eos_token_id`` (an id or a list), ``config.json``'s,
and the tokenizer's ``eos_token`` (:func:`special_tokens`).

Generated text is detokenized incrementally (:class:`Detokenizer`): a stream emits text as
soon as it is final and holds back only an incomplete UTF-8 sequence (bytes) or a trailing
replacement character (BPE pieces that complete a character later), so the concatenated
stream equals the text of the whole output.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Any, Protocol

from shared.text.checkpoint_files import CheckpointFileError, read_json_object
from shared.text.generation_config import eos_ids_of, load_generation_config


class TokenizerError(CheckpointFileError):
    """The configured tokenizer cannot be used with this model (names the file and why)."""


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    #: Token ids that end generation (finish_reason "stop"); empty for the byte tokenizer.
    eos_token_ids: frozenset[int]

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the tokenizer adds around a
        sequence (the module docstring says when)."""

    def decode(self, ids: list[int]) -> str: ...

    def token_bytes(self, token: int) -> bytes | None:
        """The token's own bytes when the tokenizer knows them exactly (None: use ``decode``)."""

    def added_token(self, token: int) -> str | None:
        """The text of ``token`` when it is an added (special) token, e.g. a model's image token;
        None otherwise."""

    def detokenizer(self) -> Detokenizer: ...


class Detokenizer(Protocol):
    def push(self, token: int) -> str:
        """Feed one generated token; returns the text that became final."""

    def flush(self) -> str:
        """End of output: whatever is still held back (incomplete sequences as U+FFFD)."""


class ByteTokenizer:
    """One token per UTF-8 byte. Invalid byte sequences decode to U+FFFD (``errors="replace"``)."""

    name = "byte-level"
    vocab_size = 256
    eos_token_ids: frozenset[int] = frozenset()

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))       # no special tokens to add

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes | None:
        return bytes((token,)) if 0 <= token < 256 else None

    def added_token(self, token: int) -> str | None:
        return None                             # no added tokens

    def detokenizer(self) -> _ByteDetokenizer:
        return _ByteDetokenizer()


class _ByteDetokenizer:
    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._dec.decode(bytes((token,)))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


class HFTokenizer:
    """A ``tokenizers`` tokenizer loaded from ``tokenizer.json``."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Tok

        try:
            self._tok = _Tok.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - the library raises plain Exceptions for bad files
            raise TokenizerError(f"cannot load {path}: {e}") from e
        self.name = f"tokenizers:{path}"
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        eos = special_tokens(path.parent).get("eos_token")
        self.eos_token_ids = frozenset(_eos_ids(self._tok, path.parent, eos))

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def to_json(self) -> str:
        """The tokenizer.json document (what structured output's llguidance loads)."""
        return str(self._tok.to_str())

    def token_bytes(self, token: int) -> bytes | None:
        # NOTE: the vocabulary's own spelling (byte-level "Ġ", sentencepiece "<0xE2>") needs the
        # decoder to become bytes; the decoded text is what is known for sure
        return None

    def added_token(self, token: int) -> str | None:
        added = self._tok.get_added_tokens_decoder().get(token)
        return added.content if added is not None else None

    def detokenizer(self) -> _DiffDetokenizer:
        return _DiffDetokenizer(self)


class _DiffDetokenizer:
    """Decode the whole output each step and emit the new suffix once it is stable.

    O(n²) in the output length, which is fine for the short outputs served here; the text
    is held back while it ends in U+FFFD (a character whose bytes span several tokens).
    """

    def __init__(self, tok: HFTokenizer) -> None:
        self._tok = tok
        self._ids: list[int] = []
        self._sent = 0

    def push(self, token: int) -> str:
        self._ids.append(token)
        text = self._tok.decode(self._ids)
        if text.endswith("\ufffd"):
            return ""
        return self._take(text)

    def flush(self) -> str:
        return self._take(self._tok.decode(self._ids))

    def _take(self, text: str) -> str:
        # NOTE: a later token may rewrite earlier text (a merge with a space prefix); what was
        # sent stays sent, so only the part beyond it is emitted.
        out = text[self._sent:]
        self._sent = max(self._sent, len(text))
        return out


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer files write it: a string or an AddedToken ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def special_tokens(directory: Path) -> dict[str, str]:
    """The special tokens a chat template sees (``bos_token``, ``eos_token``, ...), resolved as
    transformers resolves them from ``tokenizer_config.json`` and ``special_tokens_map.json``.

    Every key ending in ``_token`` with a token for value: the named ones (``bos_token``,
    ``eos_token``, ``unk_token``, ``sep_token``, ``pad_token``, ``cls_token``, ``mask_token``) and
    model-specific ones, plus the ``extra_special_tokens`` mapping. ``special_tokens_map.json``
    is the legacy file, read only when ``tokenizer_config.json`` has no ``added_tokens_decoder``,
    and then its values win. A token that is null is left out.
    """
    doc = dict(read_json_object(directory / "tokenizer_config.json") or {})
    if "added_tokens_decoder" not in doc:
        doc.update(read_json_object(directory / "special_tokens_map.json") or {})
    out: dict[str, str] = {}
    for key, value in doc.items():
        if key.endswith("_token") and (text := _token_text(value)) is not None:
            out[key] = text
    extra = doc.get("extra_special_tokens")
    if isinstance(extra, dict):
        out.update((k, t) for k, v in extra.items() if (t := _token_text(v)) is not None)
    return out


def _eos_ids(tok: Any, directory: Path, eos_token: str | None) -> list[int]:
    """EOS ids: ``generation_config.json`` (validated), ``config.json``, the tokenizer's ``eos_token``."""
    ids = list(load_generation_config(directory).eos_token_ids)
    try:
        # NOTE: config.json is the model's file (loaded and validated with the weights); an
        # unusable eos_token_id there only costs an id here.
        doc = json.loads((directory / "config.json").read_text())
        ids += eos_ids_of(directory / "config.json", doc) if isinstance(doc, dict) else []
    except (OSError, ValueError):
        pass
    if eos_token is not None and (tid := tok.token_to_id(eos_token)) is not None:
        ids.append(tid)
    return ids


def load_tokenizer(model_dir: str, model_vocab_size: int) -> Tokenizer:
    """``<model_dir>/tokenizer.json`` if it exists, else the byte-level tokenizer.

    Raises :class:`TokenizerError` when the tokenizer's ids do not fit the model's vocabulary.
    """
    tok: Tokenizer
    path = Path(model_dir) / "tokenizer.json" if model_dir else None
    tok = HFTokenizer(path) if path is not None and path.is_file() else ByteTokenizer()
    if tok.vocab_size > model_vocab_size:
        raise TokenizerError(f"tokenizer {tok.name} has {tok.vocab_size} ids but the model's vocabulary is "
                             f"{model_vocab_size}; put a matching tokenizer.json in worker.model_dir")
    return tok


__all__ = ["ByteTokenizer", "Detokenizer", "HFTokenizer", "Tokenizer", "TokenizerError", "load_tokenizer",
           "special_tokens"]
