"""The fleet's request mix, pure (no I/O): namespaces, shared system prompts and multi-turn
conversations, as chains of block hashes.

* A *namespace* is one model: the workers serving it are its only members (a lease names the
  worker's own namespace).
* Each namespace has a few *system prompts* (``PROMPT_BLOCKS`` blocks each), picked with Zipf
  weights, so a few are hot: every conversation under one shares its blocks, hence its root, hence
  its partition and shard (docs/architecture.md, "The ledger sharded": a hot root is one shard's).
  A share of conversations (``1 − shared``) has no system prompt: its root is its own.
* A *conversation* is one worker's (the gateway routes a conversation where its prefix is), and
  each turn extends its chain by a few blocks: the turn's lease reads the chain so far (cached on
  that worker unless evicted) and writes the new blocks. A conversation ends after ``max_blocks``.

Block hashes are chained (each commits to its parent), 32 lowercase hex characters, as the
ledger's keys are; the tokens behind them are never made: the ledger never sees them.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field

#: Blocks of a system prompt, and of the user's part of a turn (first turn and later ones).
PROMPT_BLOCKS = 4
TURN_BLOCKS = (2, 6)


def chained(parent: str, label: str) -> str:
    """The block after ``parent`` (``""`` for a chain's first) whose content is ``label``."""
    return hashlib.blake2b(f"{parent}\0{label}".encode(), digest_size=16).hexdigest()


def namespace(i: int) -> str:
    """The ``i``-th model's namespace (32 hex characters, as a real one)."""
    return hashlib.blake2b(f"bench.fleet model {i}".encode(), digest_size=16).hexdigest()


def system_prompt(ns: str, k: int) -> list[str]:
    out: list[str] = []
    for b in range(PROMPT_BLOCKS):
        out.append(chained(out[-1] if out else "", f"{ns} system {k} block {b}"))
    return out


@dataclass(slots=True)
class Conversation:
    cid: str
    #: The chain so far (hashes of every block of every earlier turn).
    chain: list[str] = field(default_factory=list)
    turns: int = 0


@dataclass(slots=True)
class MixParams:
    #: System prompts per namespace, and the Zipf exponent of their popularity.
    prompts: int = 8
    zipf: float = 1.0
    #: Share of new conversations that start with a shared system prompt.
    shared: float = 0.8
    #: Conversations a worker keeps going at once, and the chain length that ends one.
    active: int = 6
    max_blocks: int = 48


class WorkerMix:
    """One worker's stream of requests: :meth:`next_turn` returns the conversation and the whole
    chain of its next turn (the lease's ``block_hashes``); :meth:`done` records that it was served."""

    def __init__(self, ns: str, worker_id: str, params: MixParams, seed: int) -> None:
        self.ns, self.worker_id, self.p = ns, worker_id, params
        self.rng = random.Random(seed)
        self.prompts = [system_prompt(ns, k) for k in range(params.prompts)]
        self.weights = [1 / (k + 1) ** params.zipf for k in range(params.prompts)]
        self.active: list[Conversation] = []
        self.started = 0

    def _new(self) -> Conversation:
        self.started += 1
        c = Conversation(cid=f"{self.worker_id}.c{self.started}")
        if self.prompts and self.rng.random() < self.p.shared:
            c.chain = list(self.rng.choices(self.prompts, self.weights)[0])
        return c

    def next_turn(self) -> tuple[Conversation, list[str]]:
        if len(self.active) < self.p.active:
            self.active.append(self._new())
        c = self.rng.choice(self.active)
        new: list[str] = []
        last = c.chain[-1] if c.chain else ""
        for b in range(self.rng.randint(*TURN_BLOCKS)):
            last = chained(last, f"{c.cid} turn {c.turns} block {b}")
            new.append(last)
        return c, c.chain + new

    def done(self, c: Conversation, hashes: list[str]) -> None:
        """The turn on ``hashes`` was served: the chain grows, and ends when long enough."""
        c.chain, c.turns = hashes, c.turns + 1
        if len(c.chain) >= self.p.max_blocks:
            self.active.remove(c)


__all__ = ["PROMPT_BLOCKS", "TURN_BLOCKS", "Conversation", "MixParams", "WorkerMix", "chained", "namespace",
           "system_prompt"]
