"""Log probabilities in OpenAI's two response shapes.

What they are: the log-softmax of the logits the token was chosen from *after* the request's
logit processing (``logit_bias``, the penalties, the ``min_tokens`` mask) and *before*
temperature and top-k / top-p / min-p truncation (:class:`worker.generation.SamplingParams`) —
so a greedy and a sampled request over the same prefix report the same numbers, and a warm run
the same as a cold one (the logits are bit-identical under reuse).

* completions (``logprobs: k``): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``,
  ``top_logprobs`` a list of ``{token text: logprob}`` per position (k entries; the sampled token
  is always among them, as in OpenAI's legacy API), ``text_offset`` each token's character
  offset in the choice's text. A token that is only part of a character (a byte of a multi-byte
  UTF-8 sequence) is named ``bytes:\\xNN`` (OpenAI's spelling) when its bytes are known;
* chat (``logprobs: true``, ``top_logprobs: k``): ``{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}, ...]}]}``.

A streamed response carries, in each chunk, the entries of the tokens whose text that chunk
completes (a token whose text is held back — part of a UTF-8 character, or maybe a stop
string — goes with the next chunk).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shared.text.tokenizer import Tokenizer
from worker.generation import TokenLogprobs


class LogprobsShape:
    def __init__(self, tokenizer: Tokenizer, *, chat: bool, top: int) -> None:
        self.tok = tokenizer
        self.chat = chat
        self.top = top
        self.offset = 0            # completions: text offset of the next token
        self._text: dict[int, str] = {}

    def _token(self, tid: int) -> str:
        """The token as logprobs name it: its text, or — a token that is part of a character (its
        text alone is U+FFFD) with known bytes — ``bytes:\\xNN…``, OpenAI's spelling."""
        s = self._text.get(tid)
        if s is None:
            s = self.tok.decode([tid]) if 0 <= tid < self.tok.vocab_size else ""
            raw = self.tok.token_bytes(tid) if "\ufffd" in s else None
            if raw is not None:
                s = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self._text[tid] = s
        return s

    def _bytes(self, tid: int) -> list[int]:
        raw = self.tok.token_bytes(tid)
        return list(raw) if raw is not None else list(self._token(tid).encode("utf-8"))

    def entries(self, lps: Sequence[TokenLogprobs]) -> dict[str, Any]:
        """The logprobs object of these tokens (the next part of the choice's output)."""
        if self.chat:
            return {"content": [self._chat_entry(lp) for lp in lps]}
        tokens, values, tops, offsets = [], [], [], []
        for lp in lps:
            text = self._token(lp.token)
            tokens.append(text)
            values.append(lp.logprob)
            top = {self._token(t): v for t, v in lp.top[:self.top]}
            top.setdefault(text, lp.logprob)
            tops.append(top)
            offsets.append(self.offset)
            # NOTE: a token that is part of a character counts as one (its U+FFFD): offsets are
            # approximate after a character spread over several tokens
            self.offset += 1 if text.startswith("bytes:") else len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def prompt_entries(self, tokens: Sequence[int], logits: Any) -> dict[str, Any]:
        """Completions with ``echo``: the prompt's tokens, each with the log-softmax of the model's
        logits at the position before it (the first has none: ``null``), no processing applied."""
        import torch

        lp = torch.log_softmax(logits.float(), -1)
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for j, t in enumerate(tokens):
            text = self._token(t)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += 1 if text.startswith("bytes:") else len(text)
            if j == 0:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            row = lp[j - 1]
            top = torch.topk(row, min(self.top, row.numel())) if self.top else None
            entry = {self._token(i): v for i, v in zip(top.indices.tolist(), top.values.tolist())} if top else {}
            entry.setdefault(text, float(row[t]))
            out["token_logprobs"].append(float(row[t]))
            out["top_logprobs"].append(entry)
        return out

    def _chat_entry(self, lp: TokenLogprobs) -> dict[str, Any]:
        text = self._token(lp.token)
        return {"token": text, "logprob": lp.logprob, "bytes": self._bytes(lp.token),
                "top_logprobs": [{"token": self._token(i), "logprob": v, "bytes": self._bytes(i)}
                                 for i, v in lp.top[:self.top]]}


__all__ = ["LogprobsShape"]
