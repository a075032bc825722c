"""One sample's generated tokens → what every endpoint sends: text, tool calls, finish reason.

The completions and chat endpoints, streaming or not, one sample or ``n`` (:mod:`worker.api.handlers`),
read a job's tokens through :class:`Output` alone; the handlers keep only the HTTP shape (chunks,
choices, usage). An :class:`Output` holds:

* the text (:class:`worker.api.text.TextStream`: incremental detokenization, ``stop`` strings cut
  with their tail held back), so a stream's chunks, concatenated, are the non-streaming text;
* tool calls: streamed, text that may begin a call is held and the whole calls come at the end
  (:class:`worker.api.tools.ToolStream`); not streamed, the whole text is read once
  (:meth:`worker.api.tools.ToolPlan.message`). A reply with calls finishes ``tool_calls``;
* the finish reason: ``stop`` when a stop string ended the text, else the job's (``stop`` for a
  stop token or a grammar's end, ``length``);
* the tokens' log probabilities, each sent once, never past the text's last token.

Where a request's output is stopped (issue 53 item 5 asked for one place; written down, not merged):

* stop token ids — :func:`worker.generation.generate` ends its loop on one; the set is built once,
  in :func:`worker.api.handlers.gen_request` (the tokenizer's EOS unless ``ignore_eos``, plus
  ``stop_token_ids``), and :class:`worker.generation.Sampler` masks it below ``min_tokens``;
* a grammar's end — ``Sampler.finished`` (``generate``: finish ``stop``);
* stop strings — here, on the detokenized text, which then sets the job's stop flag
  (:meth:`worker.request.Job.stop`) once the piece ending the text has been sent; the generation
  loop reads the flag at the next token it samples.

Stop strings stay here rather than in the generation loop: deciding them there would need the
detokenizer in the loop and would stop it up to a token sooner than now (the loop runs ahead of the
handler by the tokens queued between them), which changes ``kvl_worker_generation_tokens`` and the
decode work of a stopped request; ``usage.completion_tokens`` counts to the stop string's token
either way.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from shared.text.tokenizer import Detokenizer
from worker.api.logprobs import LogprobsShape
from worker.api.text import TextStream
from worker.api.tools import ToolPlan
from worker.request import Job


@dataclass(slots=True)
class Ending:
    """How an output ended: its last text, the calls read from it, its finish reason."""

    #: Streamed: the text not sent yet. Whole (:meth:`Output.whole`): the whole text.
    text: str
    finish: str
    #: Streamed: the calls' ``delta.tool_calls`` entries, each with its ``index`` (``[]``: none).
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    #: Whole, with tools: the chat ``message`` (``content`` and any ``tool_calls``); else None.
    message: dict[str, Any] | None = None


class Output:
    """One sample's output as it comes (see the module's docstring)."""

    def __init__(self, job: Job, detok: Detokenizer, stops: Sequence[str], *, lps: LogprobsShape | None = None,
                 tools: ToolPlan | None = None, stream: bool = False, prefetched: Sequence[int] = ()) -> None:
        self.job = job
        self.text = TextStream(detok, stops)
        self.lps = lps
        self._tools = tools
        self._calls = tools.stream() if tools is not None and stream else None
        #: Tokens read from the job before (``n`` > 1: the first sample's first token, its prefill done).
        self._prefetched = tuple(prefetched)
        self._sent_lp = 0              # tokens whose logprobs went out

    @property
    def tokens(self) -> int:
        """Completion tokens: those pushed until the output ended (a stop string's last one included)."""
        return self.text.tokens

    async def pieces(self) -> AsyncIterator[str]:
        """Each token's text that is final now (may be empty; streamed with tools, text that may
        begin a call is held). After the piece that ends with a stop string is used, the job is
        stopped and the iteration ends."""
        for tok in self._prefetched:
            yield self._push(tok)
            if self.text.stopped:
                self.job.stop()
                return
        async for tok in self.job:
            yield self._push(tok)
            if self.text.stopped:
                self.job.stop()
                return

    def _push(self, tok: int) -> str:
        piece = self.text.push(tok)
        return self._calls.push(piece) if self._calls is not None else piece

    async def end(self) -> Ending:
        """The output is over (or abandoned): the held text, the job closed, the finish reason and calls."""
        tail = self.text.finish()
        await self.job.aclose()
        finish = "stop" if self.text.stopped else self.job.finish_reason
        if self._calls is None:
            return Ending(tail, finish)
        tail, calls, finish = self._calls.end(tail, finish)
        return Ending(tail, finish, calls)

    async def whole(self, before: str = "") -> Ending:
        """Read the output to its end, not streamed: the whole text after ``before`` (an echoed prompt)."""
        parts = [before]
        async for piece in self.pieces():
            parts.append(piece)
        end = await self.end()
        text = "".join(parts) + end.text
        if self._tools is None:
            return Ending(text, end.finish)
        message, finish = self._tools.message(text, end.finish)
        return Ending(text, finish, message=message)

    def new_logprobs(self) -> dict[str, Any] | None:
        """The logprobs of the tokens not sent yet, up to the text's last (None without logprobs)."""
        if self.lps is None:
            return None
        out = self.lps.entries(self.job.logprobs[self._sent_lp:self.text.tokens])
        self._sent_lp = max(self._sent_lp, self.text.tokens)
        return out

    @property
    def logprobs_pending(self) -> bool:
        """Whether some tokens' logprobs were not sent yet."""
        return self._sent_lp < self.text.tokens

    def all_logprobs(self) -> dict[str, Any] | None:
        """Every completion token's logprobs (None without logprobs)."""
        return self.lps.entries(self.job.logprobs[:self.text.tokens]) if self.lps is not None else None

    @property
    def total_logprob(self) -> float:
        """The completion's log probability (``best_of`` ranks samples by it)."""
        return sum(lp.logprob for lp in self.job.logprobs[:self.text.tokens])


__all__ = ["Ending", "Output"]
