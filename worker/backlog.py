"""The prompt tokens a request will compute: what the admission's prefill backlog counts.

A multi-turn conversation or a burst sharing a system prompt computes a fraction of its prompt:
the rest is a cached prefix this worker holds, or one another request here is computing right
now (its claims, :mod:`worker.inflight`: the request will wait for it and read it). Counting
whole prompts made the backlog several times the real work under such a load (c = 32 of
bench.peers' chat workload: ~700-token prompts of which ~190 are new), so the admission refused
half the requests it could have served in time. The estimate here is the prompt less its leading
whole blocks that are held, claimed, or will be computed by a request admitted ahead of it in
the same round.

It is only an estimate — the lease and the validation decide what a request reads, and a prompt
that finds less than estimated computes more (the measured prefill rate and the deadline margin
absorb it; a request that cannot finish still ends as a timeout, never with other bits). A
session that has opened counts exactly what it has left.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from shared.hashing import chain_hashes


class _Engine(Protocol):
    """The worker's ports the estimate reads (``worker.engine.Engine`` has them)."""

    cache_enabled: bool
    block_size: int
    namespace: str

    def salt(self, tenant: str) -> bytes: ...

    def holds_block(self, block_hash: str) -> bool: ...


def leading_known(hashes: Sequence[str], known: Callable[[str], bool]) -> int:
    """How many of ``hashes``, from the first, are ``known`` (a chain is only usable from its start)."""
    n = 0
    for h in hashes:
        if not known(h):
            break
        n += 1
    return n


class PromptWork:
    """Estimates prompt tokens to compute for queued requests (see the module docstring)."""

    def __init__(self, engine: _Engine, claimed: Callable[[str], bool]) -> None:
        self.engine = engine
        self.claimed = claimed
        # a prompt's block hashes, by request (hashing ~700 tokens costs ~0.1 ms: once per request)
        self._hashes: dict[int, list[str]] = {}

    def hashes(self, key: int, tokens: Sequence[int], tenant: str) -> list[str]:
        hs = self._hashes.get(key)
        if hs is None:
            e = self.engine
            hs = self._hashes[key] = chain_hashes(tokens, e.block_size, e.namespace, e.salt(tenant))
        return hs

    def forget(self, key: int) -> None:
        self._hashes.pop(key, None)

    def estimate(self, key: int, tokens: Sequence[int], tenant: str, *, reuse: bool, has_images: bool,
                 ahead: set[str] | None = None, claims: bool = True) -> int:
        """Tokens of ``tokens`` to compute: all of them without reuse, with images (their blocks'
        keys are not known here) or with the cache off; otherwise less the leading blocks held,
        claimed by another request here (``claims``), or in ``ahead`` (the hashes of requests to
        run before this one; this one's are added to it)."""
        n = len(tokens)
        e = self.engine
        if not (reuse and e.cache_enabled) or has_images or n < e.block_size:
            return n
        hs = self.hashes(key, tokens, tenant)
        extra = ahead if ahead is not None else ()
        k = leading_known(hs, lambda h: h in extra or (claims and self.claimed(h)) or e.holds_block(h))
        if ahead is not None:
            ahead.update(hs)
        return n - k * e.block_size


__all__ = ["PromptWork", "leading_known"]
