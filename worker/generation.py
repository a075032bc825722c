"""Sampling and the generation loop: the one place a request turns logits into tokens.

Both callers — the serving scheduler (``worker.scheduler``, HTTP requests) and
:meth:`worker.engine.Engine.generate` (tests, benchmarks, the debug subject) — run
:func:`generate`, so greedy and sampled requests mean the same thing everywhere.

After its first token a request's decode loop is data, a :class:`DecodeRun` the stepper
advances on the model thread (sample, decide the end, feed the token to the next forward); the
event loop only hears each token (``on_token``), and a caller that wants no more sets
``stopped`` — where ``service.request_runs`` is on. Otherwise, and for a request with a grammar
(its masks come from the grammar workers on the event loop), the loop below samples on the
event loop and hands in one decode step per token.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from shared import tracing
from worker.runs import Run

if TYPE_CHECKING:
    from worker.cache.manager import Session


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request turns logits into tokens.

    The model's logits are first *processed* — ``logit_bias`` added, ``repetition_penalty``
    applied over the prompt and the output so far (positive logits divided by it, negative ones
    multiplied, as in transformers and vLLM), ``frequency_penalty`` × the token's count in the
    output and ``presence_penalty`` × whether it occurred there subtracted (OpenAI's
    definitions), and the stop tokens masked while fewer than ``min_tokens`` were generated.
    Log probabilities (``logprobs``) are the log-softmax of these processed logits, before
    temperature and truncation. Then: ``temperature`` 0 = greedy (argmax); else softmax of the
    processed logits / temperature, truncated to ``top_k`` tokens, to the nucleus ``top_p`` and
    to tokens of at least ``min_p`` × the top probability, sampled from a generator seeded by
    ``seed`` (reproducible) or at random.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    #: (token id, bias) pairs.
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    #: None = no log probabilities; k = the sampled token's and the k most likely (0 ≤ k ≤ 20).
    logprobs: int | None = None
    #: Structured output (``worker.structured.Grammar``): tokens it does not allow are masked
    #: (after the processing above), and a complete grammar ends the output.
    grammar: Any = None

    @property
    def processes(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.grammar is not None)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The sampled token's log probability and the ``k`` most likely tokens' (id, logprob)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class Sampler:
    """One request's sampler, with a generator of its own (never the global RNG: concurrent
    requests must not draw from each other's stream). ``prompt``: the request's prompt tokens
    (the repetition penalty counts them); ``stop_token_ids``: masked under ``min_tokens``."""

    def __init__(self, p: SamplingParams, prompt: Sequence[int] = (), stop_token_ids: Collection[int] = ()) -> None:
        self.p = p
        self.gen: torch.Generator | None = None
        if p.temperature > 0:
            self.gen = torch.Generator().manual_seed(p.seed if p.seed is not None else secrets.randbits(63))
        #: Tokens the repetition penalty applies to (the prompt's and the output's so far), and
        #: their ids as a tensor, rebuilt only when a token joins: a long prompt's ids were set,
        #: sorted and copied into a tensor again for every generated token.
        self._seen: set[int] = set(prompt) if p.repetition_penalty != 1.0 else set()
        self._seen_ids: torch.Tensor | None = None
        self._counts: dict[int, int] = {}
        self._stops = sorted(stop_token_ids)
        self.generated = 0
        self.last: TokenLogprobs | None = None
        self.constraint = p.grammar.start() if p.grammar is not None else None

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """The processed logits (float32, on the CPU) the next token is chosen from."""
        x = logits.detach().reshape(-1).float().cpu()
        p = self.p
        if not p.processes:
            return x
        x = x.clone()
        n = x.numel()
        for tok, bias in p.logit_bias:
            if tok < n:
                x[tok] += bias
        if p.repetition_penalty != 1.0 and self._seen:
            if self._seen_ids is None:
                self._seen_ids = torch.tensor(sorted(self._seen), dtype=torch.long)
            idx = self._seen_ids
            v = x[idx]
            x[idx] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and self._counts:
            idx = torch.tensor(list(self._counts), dtype=torch.long)
            cnt = torch.tensor(list(self._counts.values()), dtype=torch.float32)
            x[idx] -= p.frequency_penalty * cnt + p.presence_penalty
        if self.generated < p.min_tokens and self._stops:
            x[torch.tensor([t for t in self._stops if t < n], dtype=torch.long)] = float("-inf")
        if self.constraint is not None:
            allowed = self.constraint.allowed()
            if allowed.any():
                x = torch.where(allowed[:n], x, torch.full_like(x, float("-inf")))
        return x

    @property
    def finished(self) -> bool:
        """Structured output: the grammar is complete and admits no more tokens."""
        return self.constraint is not None and self.constraint.finished

    def pick(self, logits: torch.Tensor) -> int:
        x = self.process(logits)
        tok = self._choose(x)
        if self.p.logprobs is not None:
            lp = torch.log_softmax(x, -1)
            k = min(self.p.logprobs, lp.numel())
            top = torch.topk(lp, k) if k else None
            self.last = TokenLogprobs(tok, float(lp[tok]), tuple(zip(top.indices.tolist(), top.values.tolist()))
                                      if top is not None else ())
        self._counts[tok] = self._counts.get(tok, 0) + 1
        if self.p.repetition_penalty != 1.0 and tok not in self._seen:
            self._seen.add(tok)
            self._seen_ids = None
        self.generated += 1
        if self.constraint is not None:
            self.constraint.advance(tok)
        return tok

    def _choose(self, x: torch.Tensor) -> int:
        p = self.p
        if p.temperature <= 0:
            return int(torch.argmax(x))
        x = x / p.temperature
        if 0 < p.top_k < x.numel():
            kth = torch.topk(x, p.top_k).values[-1]
            x = torch.where(x < kth, torch.full_like(x, float("-inf")), x)
        probs = torch.softmax(x, -1)
        if p.min_p > 0:
            probs = torch.where(probs < p.min_p * probs.max(), torch.zeros_like(probs), probs)
        if p.top_p < 1.0:
            # of what min_p left: its mass is below 1 then
            probs = nucleus(probs, p.top_p, float(probs.sum(dtype=torch.float64)) if p.min_p > 0 else 1.0)
        return draw(probs, self.gen)


def draw(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """One token from ``probs`` (≥ 0, any positive total) by the inverse of its cumulative sum:
    one uniform from the request's own generator, then the first token whose running total
    exceeds it — so never a token of probability 0, and the same token for the same generator
    state, alone or beside other requests.

    NOTE: ``torch.multinomial`` took 1.17 ms per draw over SmolLM2's 49,152 tokens on this CPU
    (a c = 32 profile had sampling at 5 % of the worker); this takes ~0.06 ms."""
    cdf = torch.cumsum(probs.reshape(-1), 0, dtype=torch.float64)
    total = float(cdf[-1])
    if not (0.0 < total < float("inf")) or bool(torch.isnan(cdf[-1])):
        raise ValueError(f"cannot sample: the probabilities sum to {total} (inf, nan or nothing left)")
    u = float(torch.rand((), dtype=torch.float64, generator=gen)) * total     # < total: u < 1
    i = int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True))
    return min(i, cdf.numel() - 1)


def nucleus(probs: torch.Tensor, top_p: float, mass: float) -> torch.Tensor:
    """``probs`` with only the smallest head kept — in descending order, ties by token id (a
    stable sort's order) — whose exclusive running mass stays under ``top_p × mass`` (the first
    token always stays); every other token 0.

    Exactly the tokens and values a stable sort of the whole vocabulary keeps, from top-k of a
    growing head: the values come out in the same order (tied values are equal, so their order
    cannot change a running sum), and among tokens tied with the last kept value the lowest ids
    are the ones a stable sort puts first. NOTE: the whole sort took 4.4 ms per token for 49,152
    tokens here; the head is usually a few hundred tokens."""
    n = probs.numel()
    k = min(n, 256)
    while True:
        # past an eighth of the vocabulary a top-k costs more than the sort (a flat distribution)
        vals = torch.topk(probs, k, sorted=True).values if 8 * k <= n else torch.sort(probs, descending=True).values
        kept = int(((torch.cumsum(vals, 0) - vals) < top_p * mass).sum())   # a prefix: sums only grow
        if kept < vals.numel() or vals.numel() == n:
            break
        k = 4 * k
    last = vals[kept - 1]
    above = probs > last
    ties = torch.nonzero(probs == last).reshape(-1)[:kept - int(above.sum())]
    out = torch.where(above, probs, torch.zeros_like(probs))
    out[ties] = last
    return out


@dataclass(slots=True)
class Generated:
    tokens: list[int]
    #: ``length`` (max_tokens reached) or ``stop`` (a stop token, or the caller stopped it).
    finish_reason: str
    #: ``[len(tokens), vocab]``, the logits each token was sampled from (when kept).
    logits: torch.Tensor | None
    #: ``time.perf_counter()`` when the first token was sampled.
    first_token_at: float


class DecodeRun(Run):
    """One request's decode loop as data, for the stepper (:meth:`worker.stepper.Stepper.start`).

    The model thread calls :meth:`after` with each forward's logits: the token the forward fed
    joins the session's reply (``fed``: what the state holds), the sampler picks the next one,
    and the run ends at a stop token, a complete grammar or ``max_tokens`` — or continues,
    feeding that token to the next forward. The event loop calls :meth:`flush` after every
    forward: the tokens sampled since go to ``on_token``; one that returns True stops the run
    (``stopped``, read by the model thread before it forms the next batch, so at most the tokens
    of the forward in flight are computed past it, and never delivered). :attr:`done` resolves
    once the stepper has let go of the state (after that nothing touches it)."""

    decode = True

    def __init__(self, s: Session, sampler: Sampler, first: int, *, max_tokens: int,
                 stop_token_ids: Collection[int], keep_logits: bool,
                 on_token: Callable[[int, TokenLogprobs | None], bool] | None) -> None:
        super().__init__(s.state, s.order)
        self.fed = s.fed
        self.sampler = sampler
        #: The token the next forward feeds (sampled, delivered, not yet in the state).
        self.token = first
        self.max_tokens = max_tokens
        self.stop_token_ids = stop_token_ids
        self.on_token = on_token
        #: Tokens sampled (the first on the event loop, before the run).
        self.sampled = 1
        #: The logits each token after the first was sampled from (``keep_logits``).
        self.kept: list[torch.Tensor] | None = [] if keep_logits else None
        #: Tokens delivered to ``on_token`` (the reply after the first token).
        self.tokens: list[int] = []
        self.finish = "length"
        self._heard_stop = False

    # on the model thread
    def after(self, r) -> bool:
        self.fed.append(self.token)             # the forward just run holds it now
        if self.stopped:
            return False
        logits = r.logits
        if self.kept is not None:
            self.kept.append(logits.detach().cpu().clone())
        tok = self.sampler.pick(logits)
        self.sampled += 1
        self._out.append((tok, self.sampler.last))
        if tok in self.stop_token_ids or self.sampler.finished:
            self.finish = "stop"
            return False
        if self.sampled >= self.max_tokens:
            return False
        self.token = tok
        return True

    # on the event loop
    def _hand(self, item: tuple[int, TokenLogprobs | None]) -> None:
        if self.stopped:
            return                          # computed past the caller's stop: never delivered
        tok, lp = item
        self.tokens.append(tok)
        if self.on_token is not None and self.on_token(tok, lp):
            self.stopped = self._heard_stop = True

    def _finish(self) -> None:
        if self._heard_stop or self.stopped:
            self.finish = "stop"
        self.done.set_result(None)


def runs_on_model_thread(s: Session, sampling: SamplingParams) -> bool:
    """Whether a request's decode loop is a :class:`DecodeRun`: where the stepper takes runs
    (``service.request_runs``), and not with a grammar (its masks come from the grammar workers,
    through the event loop)."""
    return s.ports.runner.stepper.runs and sampling.grammar is None


async def generate(s: Session, sampling: SamplingParams, *, max_tokens: int,
                   stop_token_ids: Collection[int] = (), keep_logits: bool = False,
                   on_token: Callable[[int, TokenLogprobs | None], bool] | None = None,
                   on_prefilled: Callable[[], Awaitable[None]] | None = None) -> Generated:
    """Prefill the session's prompt, then sample and decode until ``max_tokens``, a stop token,
    or ``on_token(token, logprobs)`` (called once per token, as it is sampled; logprobs when the
    sampling asks for them) returning True. ``on_prefilled()`` runs once the prompt is in the
    state, before anything is decoded (where ``n`` > 1 samples fork it)."""
    sampler = Sampler(sampling, s.tokens, stop_token_ids)
    logits = await s.prefill_rest()
    if on_prefilled is not None:
        await on_prefilled()
    out: list[int] = []
    kept: list[torch.Tensor] = []
    first_at = 0.0
    with tracing.span("worker.decode") as sp:     # sampling and decode steps, first token to last
        while True:
            if keep_logits:
                kept.append(logits.detach().cpu().clone())
            tok = sampler.pick(logits)
            out.append(tok)
            first_at = first_at or time.perf_counter()
            stopped = on_token(tok, sampler.last) if on_token is not None else False
            if tok in stop_token_ids or stopped or sampler.finished:
                finish = "stop"
                break
            if len(out) >= max_tokens:
                finish = "length"
                break
            if runs_on_model_thread(s, sampling):
                run = DecodeRun(s, sampler, tok, max_tokens=max_tokens, stop_token_ids=stop_token_ids,
                                keep_logits=keep_logits, on_token=on_token)
                await s.decode_run(run)
                out += run.tokens
                kept += run.kept or []
                finish = run.finish
                break
            logits = await s.decode(tok)
        sp.set_attributes({"kvl.completion_tokens": len(out), "kvl.finish_reason": finish})
    return Generated(out, finish, torch.stack(kept) if kept else None, first_at)


__all__ = ["DecodeRun", "Generated", "Sampler", "SamplingParams", "TokenLogprobs", "draw", "generate", "nucleus"]
