"""Text ↔ token ids for the serving layer.

Two tokenizers behind one small interface (:class:`Tokenizer`):

* :class:`ByteTokenizer` — the default: a token is one byte of the UTF-8 encoding (ids
  0–255), nothing to download, no special tokens. It matches the tiny seeded model, whose
  vocabulary is exactly 256.
* :class:`HFTokenizer` — ``tokenizer.json`` (Hugging Face ``tokenizers`` library) from the
  configured model directory (``worker.model_dir``), used whenever that file exists.

Generated text is detokenized incrementally (:class:`Detokenizer`): a stream emits text as
soon as it is final and holds back only an incomplete UTF-8 sequence (bytes) or a trailing
replacement character (BPE pieces that complete a character later), so the concatenated
stream equals the text of the whole output.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Protocol


class TokenizerError(ValueError):
    """The configured tokenizer cannot be used with this model (names the file and why)."""


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    #: Token ids that end generation (finish_reason "stop"); empty for the byte tokenizer.
    eos_token_ids: frozenset[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

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

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

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
        self.eos_token_ids = frozenset(_eos_ids(self._tok, path.parent))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

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


def _eos_ids(tok: object, directory: Path) -> list[int]:
    """EOS ids from ``config.json`` / ``generation_config.json`` / ``tokenizer_config.json`` beside it."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        try:
            doc = json.loads((directory / name).read_text())
        except (OSError, ValueError):
            continue
        v = doc.get("eos_token_id")
        if isinstance(v, int):
            ids.append(v)
        elif isinstance(v, list):
            ids += [i for i in v if isinstance(i, int)]
    try:
        doc = json.loads((directory / "tokenizer_config.json").read_text())
        eos = doc.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            tid = tok.token_to_id(eos)  # type: ignore[attr-defined]
            if tid is not None:
                ids.append(tid)
    except (OSError, ValueError):
        pass
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


__all__ = ["ByteTokenizer", "Detokenizer", "HFTokenizer", "Tokenizer", "TokenizerError", "load_tokenizer"]
