"""Generated tokens → the text a client sees: incremental detokenization and ``stop`` strings.

Streaming and non-streaming responses run the same :class:`TextStream`, so the text of a
stream's chunks, concatenated, is exactly the non-streaming text.

A stop string ends the output and is not part of it (OpenAI's semantics). While generated
text could still be the beginning of a stop string, that tail is held back; it is released
as soon as it cannot be, or at the end of the output.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.text.tokenizer import Detokenizer


class TextStream:
    def __init__(self, detok: Detokenizer, stop: Sequence[str] = ()) -> None:
        self._detok = detok
        self._stops = [s for s in stop if s]
        self._held = ""
        self.stopped = False
        #: Tokens pushed until the output ended (the one completing a stop string included).
        self.tokens = 0

    def push(self, token: int) -> str:
        """Feed one token; returns the text that is final now (may be empty)."""
        if self.stopped:
            return ""
        self.tokens += 1
        return self._feed(self._detok.push(token))

    def finish(self) -> str:
        """End of output: the held-back text (unless a stop string ended it)."""
        if self.stopped:
            return ""
        out = self._feed(self._detok.flush())
        out += self._held
        self._held = ""
        return out

    def _feed(self, new: str) -> str:
        if not self._stops:
            return new
        buf = self._held + new
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return buf[:min(hits)]
        keep = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]
