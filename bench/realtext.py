"""Real text for the benchmarks run on a real checkpoint (``--model-dir``).

Random token ids, or random letters, are what the tiny random-weight model is fed: the cost of a
forward does not depend on them, and its replies are noise either way. A pretrained model reads
and answers them as the gibberish they are, and some measurements then lose their meaning (reply
reuse over text needs replies that are text). So on a real checkpoint the benchmarks take their
prompts from this repository's own documentation — English prose, tables and code, ~300 KB —
in consecutive passages that never overlap, so two prompts share no prefix unless a benchmark
builds them to.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
#: The corpus, in this order (the documentation a user reads first).
SOURCES = ("README.md", "docs/architecture.md", "docs/operations.md")


def corpus() -> str:
    return "\n\n".join((REPO / p).read_text(encoding="utf-8") for p in SOURCES)


class Passages:
    """Consecutive passages of whole words from a seeded starting point (wrapping at the end)."""

    def __init__(self, seed: int) -> None:
        self.words = corpus().split()
        self.pos = random.Random(seed).randrange(len(self.words))

    def text(self, chars: int) -> str:
        """The next passage: whole words, at least ``chars`` characters (one word at least)."""
        out: list[str] = []
        n = 0
        while n < chars or not out:
            w = self.words[self.pos]
            self.pos = (self.pos + 1) % len(self.words)
            out.append(w)
            n += len(w) + 1
        return " ".join(out)


class TokenStream:
    """The corpus through a model's tokenizer, handed out in consecutive runs of token ids."""

    def __init__(self, tokenizer: Any, seed: int) -> None:
        self.ids: list[int] = tokenizer.encode(corpus())
        self.pos = random.Random(seed).randrange(len(self.ids))

    def take(self, n: int) -> list[int]:
        if n > len(self.ids):
            raise ValueError(f"{n} tokens asked of a {len(self.ids)}-token corpus")
        out = [self.ids[(self.pos + i) % len(self.ids)] for i in range(n)]
        self.pos = (self.pos + n) % len(self.ids)
        return out
