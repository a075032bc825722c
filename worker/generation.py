"""Sampling and the generation loop: the one place a request turns logits into tokens.

Both callers — the serving scheduler (``worker.scheduler``, HTTP requests) and
:meth:`worker.engine.Engine.generate` (tests, benchmarks, the debug subject) — run
:func:`generate`, so greedy and sampled requests mean the same thing everywhere.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from worker.session import Session


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """``temperature`` 0 = greedy (deterministic); else softmax sampling, optionally truncated to
    ``top_k`` tokens and to the nucleus ``top_p``; ``seed`` makes a sampled request reproducible."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


class Sampler:
    """One request's sampler, with a generator of its own (never the global RNG: concurrent
    requests must not draw from each other's stream)."""

    def __init__(self, p: SamplingParams) -> None:
        self.p = p
        self.gen: torch.Generator | None = None
        if p.temperature > 0:
            self.gen = torch.Generator().manual_seed(p.seed if p.seed is not None else secrets.randbits(63))

    def pick(self, logits: torch.Tensor) -> int:
        x = logits.detach().reshape(-1).float().cpu()
        if self.p.temperature <= 0:
            return int(torch.argmax(x))
        x = x / self.p.temperature
        if 0 < self.p.top_k < x.numel():
            kth = torch.topk(x, self.p.top_k).values[-1]
            x = torch.where(x < kth, torch.full_like(x, float("-inf")), x)
        probs = torch.softmax(x, -1)
        if self.p.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True, stable=True)
            # keep the smallest head whose mass reaches top_p (the first token always stays)
            keep = (torch.cumsum(sorted_p, 0) - sorted_p) < self.p.top_p
            probs = torch.zeros_like(probs).scatter(0, idx, sorted_p * keep)
        return int(torch.multinomial(probs, 1, generator=self.gen))


@dataclass(slots=True)
class Generated:
    tokens: list[int]
    #: ``length`` (max_tokens reached) or ``stop`` (a stop token, or the caller stopped it).
    finish_reason: str
    #: ``[len(tokens), vocab]``, the logits each token was sampled from (when kept).
    logits: torch.Tensor | None
    #: ``time.perf_counter()`` when the first token was sampled.
    first_token_at: float


async def generate(s: Session, sampling: SamplingParams, *, max_tokens: int,
                   stop_token_ids: Collection[int] = (), keep_logits: bool = False,
                   on_token: Callable[[int], bool] | None = None) -> Generated:
    """Prefill the session's prompt, then sample and decode until ``max_tokens``, a stop token,
    or ``on_token(token)`` (called once per token, as it is sampled) returning True."""
    sampler = Sampler(sampling)
    logits = await s.prefill_rest()
    out: list[int] = []
    kept: list[torch.Tensor] = []
    first_at = 0.0
    while True:
        if keep_logits:
            kept.append(logits.detach().cpu().clone())
        tok = sampler.pick(logits)
        out.append(tok)
        first_at = first_at or time.perf_counter()
        stopped = on_token(tok) if on_token is not None else False
        if tok in stop_token_ids or stopped:
            finish = "stop"
            break
        if len(out) >= max_tokens:
            finish = "length"
            break
        logits = await s.decode(tok)
    return Generated(out, finish, torch.stack(kept) if kept else None, first_at)


__all__ = ["Generated", "Sampler", "SamplingParams", "generate"]
