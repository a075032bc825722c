"""A request's prompt and decode tokens through the model's stepper: one step at a time, or as runs.

Mixed into :class:`worker.cache.manager.Session`: it reads the session's prompt, state, order
and writes, advances its prompt position, logits and reply, and commits through its
``_commit_pending``. :meth:`ModelSteps._plan` cuts the prompt into the pieces the stepper
runs; :meth:`ModelSteps.prefill_step` and :meth:`ModelSteps.decode` hand the stepper one step
each, :meth:`ModelSteps.prefill_rest` and :meth:`ModelSteps.decode_run` the whole prompt or
decode loop as one run (``worker.runs``, ``service.request_runs``), which
:meth:`ModelSteps._ride` waits for until the stepper lets go of the state. Blocks a piece
completes are exported with it and committed while the next forward runs.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import torch

from shared import tracing
from worker.cache.store import as_bytes
from worker.runs import PrefillRun

if TYPE_CHECKING:
    from worker.stepper import StepResult


class ModelSteps:
    """Prefill and decode, for :class:`worker.cache.manager.Session` (see the module's docstring)."""

    def _plan(self, max_tokens: int | None) -> tuple[list[int], list[int]]:
        """The prompt tokens the next forward runs for this request, and the blocks to export.

        ``max_tokens`` None: the next unit of the ``cache.chunk_blocks`` grid (per-request
        schedule). Otherwise whole blocks up to ``max_tokens`` (at least one), and the trailing
        partial block once nothing else is left, or in the same piece when it fits: with
        batch-invariant ops every cut gives the same bits, so the budget may decide it.
        """
        bs, n, start = self.bs, len(self.tokens), self.prefill_pos
        if max_tokens is None:
            end = _next_unit_end(start, n, bs, self.ports.ctx.chunk_blocks)
        else:
            full_end = n - n % bs
            end = n if start >= full_end else min(full_end, start + max(bs, max_tokens // bs * bs))
            if end == full_end and n - full_end <= max_tokens - (end - start):
                end = n
        self.prefill_pos = end
        return self.tokens[start:end], [i for i in range(start // bs, end // bs) if i in self.writes]

    def _left(self) -> int:
        """Prompt tokens not yet run (the stepper's backlog)."""
        return len(self.tokens) - self.prefill_pos

    async def prefill_step(self) -> bool:
        """Run the next piece of the prompt; True once the prompt is done (``self.logits`` is set).

        The model's stepper decides how much runs, fused with other requests' steps
        (:mod:`worker.stepper`). Blocks a piece completes are exported with it and committed
        while the *next* model call runs (or at :meth:`decode` / :meth:`close`), so commits
        stay off the TTFT path.
        """
        if self.done_prefill:
            return True
        ports = self.ports
        t0 = time.perf_counter()
        fut = ports.runner.stepper.prefill(self.state, self._plan, self.order, self.embeds, left=self._left)
        self._commit_pending()          # NOTE: overlaps the model call just queued
        res = await fut
        self._spent("forward", t0)
        for i, payload in res.payloads:
            for form in self.writes.get(i, ()):
                self._pending.append((self._block_meta(i, form), as_bytes(payload[form])))
        if self.done_prefill:
            self.logits = res.logits
        return self.done_prefill

    async def prefill_rest(self) -> torch.Tensor:
        """Run every remaining piece of the prompt; returns the last prompt token's logits.

        Where the stepper takes runs (``service.request_runs``) the prompt goes to it as one
        (``worker.runs.PrefillRun``): it plans piece after piece on the model thread, and each
        piece's exports are committed here, on the event loop, while the next forward runs;
        otherwise one :meth:`prefill_step` per piece."""
        if not self.done_prefill and not self.ports.runner.stepper.runs:
            with tracing.span("worker.prefill", {"kvl.prompt_tokens": len(self.tokens),
                                                 "kvl.cached_tokens": self.prefill_pos}) as sp:
                pieces = 1
                while not await self.prefill_step():
                    pieces += 1
                sp.set_attribute("kvl.pieces", pieces)
        if not self.done_prefill:
            with tracing.span("worker.prefill", {"kvl.prompt_tokens": len(self.tokens),
                                                 "kvl.cached_tokens": self.prefill_pos}) as sp:
                t0 = time.perf_counter()
                run = PrefillRun(self.state, self._plan, lambda: self.done_prefill, self.order, self.embeds,
                                 on_piece=self._piece_done, left=self._left)
                res = await self._ride(run)
                self._spent("forward", t0)
                self.logits = res.logits
                sp.set_attribute("kvl.pieces", run.pieces)
        assert self.logits is not None
        return self.logits

    def _piece_done(self, res: StepResult) -> None:
        """A prompt piece ran: its exports join the pending commits, made now (the next piece is in
        the model already)."""
        for i, payload in res.payloads:
            for form in self.writes.get(i, ()):
                self._pending.append((self._block_meta(i, form), as_bytes(payload[form])))
        self._commit_pending()

    async def decode_run(self, run) -> None:
        """Hand the decode loop to the stepper (``worker.generation.DecodeRun``) until it ends."""
        if not self.done_prefill:
            raise RuntimeError("decode before the prompt is prefilled")
        await self._ride(run)

    async def _ride(self, run):
        """Start ``run`` on the stepper and wait for it. Cancelled, it stops the run and still waits
        until the stepper lets go of the state (one forward at most), so nothing reads or writes
        the state once this returns or raises; :meth:`close` waits the same way."""
        self._run = run
        self.ports.runner.stepper.start(run)
        self._commit_pending()              # NOTE: overlaps the run's first forward
        try:
            return await asyncio.shield(run.done)
        except asyncio.CancelledError:
            run.stopped = True
            await self._quiesce()
            raise

    async def _quiesce(self) -> None:
        """Wait until no stepper run holds this session's state."""
        run = self._run
        if run is not None and not run.done.done():
            run.stopped = True
            await asyncio.wait([run.done])

    async def decode(self, token: int) -> torch.Tensor:
        """Feed one token; returns the logits for the next position."""
        if not self.done_prefill:
            raise RuntimeError("decode before the prompt is prefilled")
        fut = self.ports.runner.stepper.decode(self.state, int(token), self.order)
        self._commit_pending()
        self.logits = (await fut).logits
        self.fed.append(int(token))
        return self.logits


def _next_unit_end(start: int, end: int, bs: int, chunk_blocks: int) -> int:
    """Where the prefill unit starting at ``start`` (a block boundary) ends, on the model's grid:
    the next grid point or the last whole block, then the trailing partial block."""
    unit = chunk_blocks * bs
    full_end = end - end % bs
    return min((start // unit + 1) * unit, full_end) if start < full_end else end


__all__ = ["ModelSteps"]
