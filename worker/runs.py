"""What the stepper keeps for a request from forward to forward, and the thread it runs on.

A *run* (:class:`Run`) is a request's work handed to the stepper (``worker.stepper``) as data:
the model thread advances it after every forward and queues what it produced, the event loop
hands that on in order. :class:`PrefillRun` is a whole prompt, planned piece after piece;
``worker.generation.DecodeRun`` a whole decode loop. :class:`ModelExecutor` is the model
thread itself, counting the jobs queued on it so that the stepper's driver can hand it back to
them after the forward it is in.

The stepper needs none of these names: it calls a run's ``after``, ``fail``, ``retire`` and
``flush`` and takes whatever executor it is given, so its module holds the step loop alone.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.stepper import StepResult


class ModelExecutor(ThreadPoolExecutor):
    """The model thread (one worker), counting the jobs queued on it: the stepper's driver runs
    forward after forward on this thread and hands it back to a queued job (a state to build or
    restore, a fork, an export) after the forward it is in, so such a job waits one forward, as before."""

    def __init__(self, thread_name_prefix: str = "kvl-model") -> None:
        super().__init__(1, thread_name_prefix=thread_name_prefix)
        self._queued = 0
        self._count = threading.Lock()

    def submit(self, fn, /, *args, **kwargs):
        with self._count:
            self._queued += 1

        def job():
            with self._count:
                self._queued -= 1
            return fn(*args, **kwargs)
        return super().submit(job)

    def queued(self) -> int:
        """Jobs submitted and not yet started."""
        return self._queued


class Run:
    """What the stepper keeps from forward to forward for one request (see the module docstring):
    the model thread queues what each forward gave it (:meth:`after` in the subclass, then
    :meth:`fail`, :meth:`retire` when it lets go), the event loop hands that on in order
    (:meth:`flush`) and resolves :attr:`done` once the stepper has let go of the state."""

    decode = False

    def __init__(self, state, order: tuple) -> None:
        self.state, self.order = state, order
        #: Set on the event loop: no more (the caller stopped or was cancelled).
        self.stopped = False
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()
        self._out: deque = deque()
        self._error: BaseException | None = None
        self._ended = False

    # on the model thread
    def fail(self, err: BaseException) -> None:
        self._error = err

    def retire(self) -> None:
        self._ended = True

    # on the event loop
    def flush(self) -> None:
        ended = self._ended                # NOTE: read first: outputs are queued before the end is set
        while self._out:
            self._hand(self._out.popleft())
        if not ended or self.done.done():
            return
        self.state = None                  # the stepper let go of it: so does the run (worker.model.recycle)
        if self._error is not None:
            self.done.set_exception(self._error)
        else:
            self._finish()

    def _hand(self, item) -> None:
        """One queued output, on the event loop."""

    def _finish(self) -> None:
        self.done.set_result(None)


class PrefillRun(Run):
    """A prompt run as data: the stepper plans its next piece at every forward (``plan``, as for a
    prefill step) until ``finished()``, on the model thread, without the request's coroutine
    between pieces. Each piece's result reaches ``on_piece`` on the event loop (its exports are
    committed there while the next forward runs); :attr:`done` resolves with the last piece's."""

    def __init__(self, state, plan, finished: Callable[[], bool], order: tuple, embeds=None,
                 on_piece: Callable[[StepResult], None] | None = None, left: Callable[[], int] | None = None) -> None:
        super().__init__(state, order)
        self.plan, self.finished, self.embeds, self.on_piece = plan, finished, embeds, on_piece
        #: () → the prompt tokens still to run (the stepper's prompt cap follows their sum).
        self.left = left
        self.pieces = 0
        self._last: StepResult | None = None

    def after(self, r: StepResult) -> bool:
        self._out.append(r)
        if not self.finished():
            return True
        self._last = r
        return False

    def _hand(self, r: StepResult) -> None:
        self.pieces += 1
        if self.on_piece is not None:
            self.on_piece(r)

    def _finish(self) -> None:
        if self._last is not None:
            self.done.set_result(self._last)
        else:
            self.done.cancel()              # stopped before its last piece


__all__ = ["ModelExecutor", "PrefillRun", "Run"]
