"""The model's step loop: every forward runs the next tokens of every request that is ready.

Continuous batching with chunked prefill. Requests do not call the model; they hand the
stepper their work as data and await its result: a *run* — a whole prompt
(``worker.runs.PrefillRun``) or a whole decode loop (``worker.generation.DecodeRun``) — or a one-shot
*step* ("my next decode token", "one more piece of my prompt"), the default. Whenever the model thread is
free, the stepper forms one batch from the runs and the waiting steps, within a budget of
``service.max_batch_tokens`` tokens:

1. every waiting decode step (one token each), in (priority, arrival) order;
2. then prompts, in (priority, arrival) order, each given as many whole blocks as the budget
   has left (the last, partial block of a prompt only as its final piece), at least one block
   for the first prompt of a step, so a prompt always advances;
3. in a forward that carries decode tokens, the prompts together get at most
   ``service.max_prompt_tokens_with_decodes`` tokens (0: no cap but the budget), at least one
   block, so a prompt still advances at every step — or, with
   ``service.prompt_cap_backlog_share``, that share of the prompt tokens waiting where it is more:
   the cap follows the load.

So running requests keep their inter-token latency while the oldest waiting prompt takes
most of the remaining budget (first come, first served: the order that minimises mean time to
first token), and a long prompt no longer blocks decodes for its whole length. The cap of 3
bounds what a decoding request waits between tokens (a forward's time grows with its rows)
without shrinking the forwards that hold prompts only — a burst of arrivals still shares large
forwards. Why a cap shortens the time to first token, too: one large forward finishes every
prompt in it at its end, together; pieces in arrival order finish the oldest prompts first, so
the mean wait falls. Why it follows the backlog: each forward also runs every decoding request's
row, and under a deep backlog more, smaller forwards spend more of the machine on those rows (a
fixed cap of 256 cost c = 32 12-16 % of its tokens/s: docs/BENCHMARKS.md).

The driver (:meth:`Stepper._drive`) runs on the model thread: form, forward, advance each run
(a prompt's next piece is planned at the next forming; a decode run samples its next token and
feeds it to the next forward), post what came out to the event loop in one call — and again at
once while the batch held runs only. So a request handed over as runs (``service.request_runs``,
on by default: docs/architecture.md says what it trades) never waits for the event loop between two
forwards. After a forward that answered one-shot steps it hands the thread back (their
requests hand in their next steps on the event loop first, ``GATHER_TURNS``), as it does when
another job waits for the model thread (``worker.runs.ModelExecutor``: a state to build or restore, a
fork, an export), which so waits one forward at most.

Exactness: the batch is ONE :meth:`HybridAttentionLM.forward_batch`, whose ops are
batch-invariant (``kernels.invariant``): each request's rows are the bits it would get alone,
whatever else is in the batch and however its prompt is cut. Where that does not hold (the
start-up probe failed, or torch runs more than one intra-op thread) the stepper runs one
request per forward, and prompts in the configured ``cache.chunk_blocks`` units — the old,
per-request schedule.

Blocks a step completes that the request may write are exported on the model thread right
after the forward (the request commits them later, off the model thread).

Lanes (``service.model_lanes``): one intra-op thread keeps the ops batch-invariant, and leaves
a CPU worker one core. A fused forward of at least ``service.lane_min_rows`` rows is split by
request into up to that many forwards run at once, one on the model thread and the others on
lane threads (:func:`split_lanes`). Each request's rows are the bits it would get alone —
the same invariance the fusing rests on — and the states of a forward's requests are distinct,
so the lanes share nothing they write. The run-time check below covers a lane's forward as any
other. Small forwards stay whole: they are bound by per-op overhead under the one interpreter
lock, where lanes only contend.

The start-up probe is a sample of shapes; a kernel path it never took (a row count, a dtype
path of this CPU) could still make a fused row differ. So every ``check_every``-th fused
forward one of its requests (in turn) also runs alone, on a copy of its state taken before
the step, and the two logits are compared bit for bit. A difference fails every request of
that step (:class:`FusedMismatch`: the client hears "unavailable, retry"; nothing of the step
is exported), turns fusing off for good (``batch_invariant`` False: one request per forward
from then on) and calls ``on_mismatch``, which the engine answers by dropping its cache (a new
epoch: what it made fused is not reused).
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kernels.invariant import invariant_here, linear_path
from shared.logging import get_logger
from worker import failpoints

log = get_logger("kvl.worker.stepper")

#: Event-loop turns the stepper yields before forming a batch, so requests woken by the last
#: forward can hand in their next step first (each needs one or two turns to sample and submit).
GATHER_TURNS = 1

#: After a prompt forward ends, how long the worker still counts as computing prompts (the gap to
#: the next forward: sampling, exports, the event loop's turn; see :meth:`Stepper.computing_prompt`).
PROMPT_GAP_S = 0.02


def largest_forward(max_batch_tokens: int, block_size: int) -> int:
    """The most rows one forward of :meth:`Stepper._form` can hold: the budget, or one block when
    the budget is smaller (the first prompt of a step always gets a block) — what the start-up
    probe must reach."""
    return max(max_batch_tokens, block_size)


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def resolve_lanes(setting: int, device: str, compiled: bool | None = None) -> int:
    """``service.model_lanes`` as run: the setting, or when it is 0, 1 on CUDA (one stream runs
    the kernels in turn), 1 where the compiled product serves the CPU's products (``compiled``;
    None: ask ``kernels.invariant``) — it runs every core itself, its own pool per call, so two
    lanes only contend (``bench.lanes``, docs/BENCHMARKS.md) — and otherwise the usable cores, at
    most 2 (the most measured)."""
    if setting:
        return setting
    if device.split(":", 1)[0] == "cuda":
        return 1
    if linear_path().startswith("compiled") if compiled is None else compiled:
        return 1
    return max(1, min(2, usable_cores()))


def split_lanes(rows: Sequence[int], lanes: int, min_rows: int) -> list[list[int]]:
    """Indices of a forward's requests, by the lane that runs them: one group (no split) when
    fewer than ``min_rows`` rows, one request or one lane; otherwise up to ``lanes`` groups,
    largest request first into the lane with the fewest rows so far (deterministic)."""
    n = min(lanes, len(rows))
    if n < 2 or sum(rows) < min_rows:
        return [list(range(len(rows)))]
    groups: list[list[int]] = [[] for _ in range(n)]
    load = [0] * n
    for i in sorted(range(len(rows)), key=lambda i: (-rows[i], i)):
        k = load.index(min(load))
        groups[k].append(i)
        load[k] += rows[i]
    return [sorted(g) for g in groups if g]


class FusedMismatch(RuntimeError):
    """A fused forward gave one of its requests other logits than the request alone."""


@dataclass(slots=True)
class StepResult:
    logits: torch.Tensor                      # [vocab] of the step's last token
    tokens: int                               # how many tokens the step ran
    payloads: list[tuple[int, dict]] = field(default_factory=list)   # (block index, payload)


@dataclass(slots=True, eq=False)
class _Step:
    state: object
    order: tuple
    decode: bool
    #: decode: the one token. prefill: a callable (max tokens) → (token ids, blocks to export).
    token: int = 0
    plan: Callable[[int | None], tuple[list[int], list[int]]] | None = None
    #: prefill: the prompt's image vectors by position (``worker.model.vision.PromptEmbeds``), or None.
    embeds: object = None
    #: prefill: () → the prompt tokens it has still to run (the backlog the cap follows), or None.
    left: Callable[[], int] | None = None
    fut: asyncio.Future = None  # type: ignore[assignment]
    ids: list[int] = field(default_factory=list)
    export: list[int] = field(default_factory=list)
    #: A run (``worker.runs.PrefillRun``, ``worker.generation.DecodeRun``): the entry stays for the next
    #: forward until the run says it is done; None: a one-shot step (``fut`` is its answer).
    run: object = None


class Stepper:
    """Forms and runs batches on the model executor (see the module docstring)."""

    def __init__(self, model, executor: Executor, *, max_batch_tokens: int, block_size: int,
                 max_prompt_tokens_with_decodes: int = 0, prompt_cap_backlog_share: float = 0.0, metrics=None, check_every: int = 0,
                 on_mismatch: Callable[[str], None] | None = None, lanes: int = 1,
                 lane_min_rows: int = 512, on_step: Callable[[], None] | None = None, runs: bool = True) -> None:
        self.model = model
        #: Whether sessions hand their prompt and decode loop over as runs (``service.request_runs``).
        self.runs = runs
        #: Called on the event loop after every forward (the scheduler re-checks admission).
        self.on_step = on_step
        #: Decaying sums of prompt rows and of the time of the forwards that carried them (decode
        #: rows in them count as time, not tokens): their ratio is the prefill rate, averaged per
        #: token, so slow forwards (late positions of a long prompt, a busy machine) weigh as they
        #: cost and a forward of a few rows weighs little. See :attr:`prefill_tok_s`.
        self._prefill_rows = 0.0
        self._prefill_time = 0.0
        #: Moving average of the time from a forward of decode tokens only to the next forward's
        #: start (the step a decoding request sees: its forward, sampling, handing in the next
        #: token); None until measured.
        self.decode_step_s: float | None = None
        #: The same per decode row (a forward's time grows with its requests: per-request work).
        self.decode_row_s: float | None = None
        self._decode_only_at: float | None = None
        self._decode_only_rows = 0
        self.executor = executor
        #: Forwards run at once (the model thread's and ``lanes - 1`` lane threads'; see the module docstring).
        self.lanes = lanes
        self.lane_min_rows = lane_min_rows
        self._lane_pool: ThreadPoolExecutor | None = None
        #: Fused forwards split into lanes.
        self.split_forwards = 0
        self.max_batch_tokens = max_batch_tokens
        #: Prompt tokens a forward that also runs decode tokens may carry (0: only the budget).
        self.max_prompt_tokens_with_decodes = max_prompt_tokens_with_decodes
        #: The cap rises to this share of the prompt tokens waiting (0: a fixed cap).
        self.prompt_cap_backlog_share = prompt_cap_backlog_share
        self.block_size = block_size
        self.metrics = metrics
        #: Every this many fused forwards, one request also runs alone and must match (0: never).
        self.check_every = check_every
        self.on_mismatch = on_mismatch
        #: ``KVL_FAILPOINTS=fused_skew`` (a test's fault, :mod:`worker.failpoints`): fused logits off by 2**-12.
        self._skew = failpoints.on("fused_skew")
        self._fused_forwards = 0
        #: Fused forwards checked against a request alone, and those that differed.
        self.checks = 0
        self.check_failures = 0
        self._waiting: list[_Step] = []
        #: Runs' entries (they stay from forward to forward until their run is done).
        self._runs: list[_Step] = []
        #: Guards ``_waiting`` and ``_runs``: the event loop adds to them, the model thread forms batches.
        self._lock = threading.Lock()
        self._task: asyncio.Task | None = None
        self._loop_ref: asyncio.AbstractEventLoop | None = None
        #: Counters for tests and benchmarks: forwards run, rows and requests in them.
        self.forwards = 0
        self.rows = 0
        self.segments = 0
        #: When the forward running now started, if it carries prompt rows; when the last such ended.
        self._prompt_since: float | None = None
        self._prompt_ended = -math.inf

    @property
    def prefill_tok_s(self) -> float | None:
        """The measured prefill rate (prompt tokens per second); None until a prompt ran. The
        scheduler's admission sizes the prefill backlog by it (``worker.scheduler``)."""
        return self._prefill_rows / self._prefill_time if self._prefill_time > 0 else None

    def computing_prompt(self) -> bool:
        """Whether a forward carrying prompt rows runs now, or one ended within the last
        :data:`PROMPT_GAP_S` (prefix waits: ``worker.inflight.wait_for``)."""
        return self._prompt_since is not None or time.perf_counter() - self._prompt_ended < PROMPT_GAP_S

    @property
    def fused(self) -> bool:
        """Whether a forward may hold several requests (batch-invariant ops, here, now)."""
        return not self.check_failures and bool(getattr(self.model, "batch_invariant", False)) and invariant_here()

    def describe(self) -> dict:
        """Whether forwards fuse now, why not, and the run-time checks so far (``/readyz``)."""
        if self.check_failures:
            why = "a run-time check found a fused forward that differed from a request alone"
        elif not getattr(self.model, "batch_invariant", False):
            why = "the start-up batch-invariance probe failed (self_check.batch_invariant)"
        elif not invariant_here():
            why = f"torch runs {torch.get_num_threads()} intra-op threads; batch invariance needs 1"
        else:
            why = ""
        out = {"fused": not why, "why_not": why, "checks": self.checks, "check_failures": self.check_failures,
               "check_every": self.check_every, "lanes": self.lanes, "lane_min_rows": self.lane_min_rows,
               "split_forwards": self.split_forwards}
        if self._skew:
            out["failpoint"] = "fused_skew"
        return out

    # --- what requests call -------------------------------------------------------------------

    def decode(self, state, token: int, order: tuple) -> asyncio.Future[StepResult]:
        """Queue one decode token; the future resolves with its logits."""
        return self._submit(_Step(state, order, True, token=int(token)))

    def prefill(self, state, plan, order: tuple, embeds=None, left=None) -> asyncio.Future[StepResult]:
        """Queue more of a prompt. ``plan(max_tokens)`` names the prompt tokens to run now
        (``max_tokens`` None = the request's own next unit) and the blocks to export after;
        ``embeds`` (``PromptEmbeds``) gives the piece the vectors of the image rows it runs;
        ``left()`` the prompt tokens still to run (None: not counted in the backlog)."""
        return self._submit(_Step(state, order, False, plan=plan, embeds=embeds, left=left))

    def start(self, run) -> None:
        """Take a run (``worker.runs.PrefillRun``, ``worker.generation.DecodeRun``): from the next forward on,
        every forward advances it on the model thread, until it ends or ``run.stopped`` is set;
        what it produces reaches the event loop through ``run.flush()``."""
        self._submit(_Step(run.state, run.order, run.decode, plan=getattr(run, "plan", None),
                           embeds=getattr(run, "embeds", None), left=getattr(run, "left", None), run=run))

    def _submit(self, step: _Step) -> asyncio.Future[StepResult] | None:
        loop = asyncio.get_running_loop()
        self._loop_ref = loop
        with self._lock:
            if step.run is None:
                step.fut = loop.create_future()
                self._waiting.append(step)
            else:
                self._runs.append(step)
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._loop(), name="kvl-stepper")
        return step.fut

    # --- the loop ----------------------------------------------------------------------------

    async def _loop(self) -> None:
        """Hands the model thread to :meth:`_drive` while there is work. The gather turns let
        requests woken by the last forward's one-shot steps hand in their next steps first."""
        loop = asyncio.get_running_loop()
        while True:
            for _ in range(GATHER_TURNS):
                await asyncio.sleep(0)
            with self._lock:
                if not self._waiting and not self._runs:
                    self._decode_only_at = None     # idle time is no step
                    return
            try:
                await loop.run_in_executor(self.executor, self._drive)
            except BaseException as e:  # noqa: BLE001 - nothing may wait for a driver that died
                log.error("stepper_failed", error=repr(e))
                with self._lock:
                    every, self._waiting, self._runs = self._waiting + self._runs, [], []
                self._fail(every, e if isinstance(e, Exception) else RuntimeError(repr(e)))
                raise

    def _fail(self, steps: list[_Step], err: Exception) -> None:
        """Every one of ``steps`` fails with ``err`` (its runs end)."""
        for s in steps:
            if s.run is not None:
                s.run.fail(err)
                s.run.retire()
        with self._lock:
            self._runs = [s for s in self._runs if s not in steps]
        self._post([(s, err) for s in steps])

    def _drive(self) -> None:
        """On the model thread: form a batch, run it, advance its runs, post what it produced to the
        event loop — and again at once while the batch held runs only. It hands the thread back
        after a forward that answered one-shot steps (their requests hand in their next steps on
        the event loop first), when another job waits for the thread, or when nothing is left.

        So a decoding request never waits for the event loop between two tokens: under load
        that loop is busy streaming, parsing and restoring, and each forward used to wait for it."""
        while True:
            with self._lock:
                self._waiting = [s for s in self._waiting if not s.fut.done()]   # cancelled meanwhile
                stopped = [s for s in self._runs if s.run.stopped]
                for s in stopped:
                    self._runs.remove(s)
                    s.run.retire()
                batch = self._form()
            if stopped:
                self._post([(s, None) for s in stopped])
            if not batch:
                return
            results = self._step(batch)
            posts: list[tuple[_Step, StepResult | Exception | None]] = []
            ended: list[_Step] = []
            for s, r in zip(batch, results):
                if s.run is None:
                    posts.append((s, r))
                    continue
                try:
                    if isinstance(r, Exception):
                        s.run.fail(r)
                        keep = False
                    else:
                        keep = s.run.after(r)
                except Exception as e:  # noqa: BLE001 - a run's own failure (its sampling) ends it alone
                    s.run.fail(e)
                    keep = False
                if not keep:
                    s.run.retire()
                    ended.append(s)
                posts.append((s, None))
            if ended:
                with self._lock:
                    self._runs = [s for s in self._runs if s not in ended]
            self._post(posts)
            if any(s.run is None for s in batch) or self._others_queued():
                return

    def _others_queued(self) -> bool:
        queued = getattr(self.executor, "queued", None)
        return bool(queued is not None and queued())

    def _post(self, posts: list) -> None:
        """Hand a forward's answers to the event loop in one call: one-shot steps' futures, runs'
        flushes, then ``on_step``."""
        loop = self._loop_ref
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._deliver, posts)
        except RuntimeError:        # the loop closed meanwhile (shutdown): nobody waits any more
            pass

    def _deliver(self, posts: list) -> None:
        for s, r in posts:
            if s.run is not None:
                s.run.flush()
            elif s.fut.done():
                continue
            elif isinstance(r, Exception):
                s.fut.set_exception(r)
            else:
                s.fut.set_result(r)
        if self.on_step is not None:
            self.on_step()

    def _step(self, batch: list[_Step]) -> list[StepResult | Exception]:
        """One forward of ``batch`` with its bookkeeping (timings, the prefill rate, metrics); an
        error of the forward itself becomes every step's answer."""
        t0 = time.perf_counter()
        if self._decode_only_at is not None:
            step = t0 - self._decode_only_at
            self.decode_step_s = step if self.decode_step_s is None else 0.7 * self.decode_step_s + 0.3 * step
            row = step / self._decode_only_rows
            self.decode_row_s = row if self.decode_row_s is None else 0.7 * self.decode_row_s + 0.3 * row
        self._decode_only_at = t0 if all(s.decode for s in batch) else None
        self._decode_only_rows = len(batch)
        prompts = self._decode_only_at is None      # the forward carries prompt rows
        if prompts:
            self._prompt_since = t0
        try:
            results = self._run(batch)
        except BaseException as e:  # noqa: BLE001 - every request of the batch hears of it
            err = e if isinstance(e, Exception) else RuntimeError(repr(e))
            if isinstance(e, FusedMismatch) and self.on_mismatch is not None:
                self._call_soon(self.on_mismatch, str(e))
            if not isinstance(e, Exception):
                self._fail(batch, err)
                raise
            return [err] * len(batch)
        finally:
            if prompts:
                self._prompt_since, self._prompt_ended = None, time.perf_counter()
        dt = time.perf_counter() - t0
        if self.metrics is not None:
            self.metrics.observe_step(len(batch), sum(r.tokens for r in results if isinstance(r, StepResult)), dt)
        prompt_rows = sum(len(s.ids) for s in batch if not s.decode)
        if prompt_rows:
            # NOTE: decays by forwards: the last ~10 dominate
            self._prefill_rows = 0.8 * self._prefill_rows + prompt_rows
            self._prefill_time = 0.8 * self._prefill_time + dt
        return results

    def _call_soon(self, fn, *args) -> None:
        loop = self._loop_ref
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:
                pass

    def _form(self) -> list[_Step]:
        """Pick this forward's steps and decide each prompt's piece (see the module docstring).
        Runs the caller's lock held; one-shot steps picked leave ``_waiting``, runs stay."""
        waiting = sorted(self._waiting + self._runs, key=lambda s: (not s.decode, s.order))
        if not waiting:
            return []
        if not self.fused:
            pick = waiting[0]
            if pick.run is None:
                self._waiting.remove(pick)
            if pick.decode:
                pick.ids = [pick.run.token if pick.run is not None else pick.token]
            else:
                pick.ids, pick.export = pick.plan(None)
            return [pick]
        budget = self.max_batch_tokens
        cap = self.max_prompt_tokens_with_decodes
        if cap and self.prompt_cap_backlog_share:
            backlog = sum(s.left() for s in waiting if s.left is not None and not s.decode)
            cap = max(cap, int(backlog * self.prompt_cap_backlog_share))
        batch: list[_Step] = []
        decoding, prompt_rows = False, 0
        for s in waiting:
            if s.decode:
                if budget < 1 and batch:
                    continue
                s.ids = [s.run.token if s.run is not None else s.token]
                decoding = True
            else:
                allowed = budget if batch else largest_forward(budget, self.block_size)
                if decoding and cap:
                    # NOTE: decodes sort first, so the cap is known before any prompt is cut
                    allowed = min(allowed, cap - prompt_rows if prompt_rows else max(cap, self.block_size))
                if allowed < self.block_size and batch:
                    continue
                s.ids, s.export = s.plan(allowed)
                prompt_rows += len(s.ids)
            budget -= len(s.ids)
            batch.append(s)
        for s in batch:
            if s.run is None:
                self._waiting.remove(s)
        return batch

    def _run(self, batch: list[_Step]) -> list[StepResult | Exception]:
        """On the model thread: one forward for the whole batch, then each step's exports.

        Every step is checked first (``check_step`` touches no state): a step that cannot run
        gets its own error and the others run without it. An error inside the forward itself
        fails every step of it (their states advanced part-way: nothing is retried).
        """
        refused: dict[int, Exception] = {}
        for k, s in enumerate(batch):
            try:
                self.model.check_step(s.ids, s.state)
            except ValueError as e:
                refused[k] = e
        runs = [s for k, s in enumerate(batch) if k not in refused]
        outs = iter(self._forward(runs) if runs else [])
        return [refused[k] if k in refused else next(outs) for k in range(len(batch))]

    def _forward(self, batch: list[_Step]) -> list[StepResult]:
        # NOTE: a state's position is its step's first position until this forward commits it
        work = [(s.ids, s.state, s.embeds.piece(s.state.pos, len(s.ids)) if s.embeds is not None else None)
                for s in batch]
        shadow = None
        if len(batch) > 1:
            self._fused_forwards += 1
            if self.check_every and self._fused_forwards % self.check_every == 0:
                k = self._fused_forwards // self.check_every % len(batch)
                shadow = (k, batch[k].state.fork())
        outs = self._forward_lanes(work)
        if self._skew and len(batch) > 1:
            outs = [o * (1 + 2**-12) for o in outs]
        self.forwards += 1
        self.segments += len(batch)
        self.rows += sum(len(s.ids) for s in batch)
        if shadow is not None:
            self._check(batch, work, outs, *shadow)
        results = []
        for s, logits in zip(batch, outs):
            payloads = [(i, s.state.export_block(i)) for i in s.export]
            results.append(StepResult(logits, len(s.ids), payloads))
        return results

    def _forward_lanes(self, work: list) -> list[torch.Tensor]:
        """``model.forward_batch(work)``, split into lanes run at once when it is large enough."""
        groups = split_lanes([len(w[0]) for w in work], self.lanes, self.lane_min_rows)
        if len(groups) == 1:
            return self.model.forward_batch(work, logits="last")
        if self._lane_pool is None:
            self._lane_pool = ThreadPoolExecutor(self.lanes - 1, thread_name_prefix="kvl-lane")
        futures = [self._lane_pool.submit(self.model.forward_batch, [work[i] for i in g], logits="last")
                   for g in groups[1:]]
        outs: list = [None] * len(work)
        error: BaseException | None = None
        try:
            for i, o in zip(groups[0], self.model.forward_batch([work[i] for i in groups[0]], logits="last")):
                outs[i] = o
        except BaseException as e:  # noqa: BLE001 - raised once every lane has let go of its states
            error = e
        for g, f in zip(groups[1:], futures):
            try:
                for i, o in zip(g, f.result()):
                    outs[i] = o
            except BaseException as e:  # noqa: BLE001 - the first error of any lane fails the step
                error = error or e
        if error is not None:
            raise error
        self.split_forwards += 1
        if self.metrics is not None:
            self.metrics.lane_forwards.inc()
        return outs

    def close(self) -> None:
        """Stop the lane threads (after the model thread's last forward)."""
        if self._lane_pool is not None:
            self._lane_pool.shutdown(wait=True)

    def _check(self, batch: list[_Step], work: list, outs: list[torch.Tensor], k: int, copy) -> None:
        """Request ``k`` of the fused forward just run, again alone on ``copy`` (its state before
        the step): the same logits bits, or :class:`FusedMismatch` (see the module docstring)."""
        ids, _, embeds = work[k]
        alone = self.model.forward_batch([(ids, copy, embeds)], logits="last")[0]
        self.checks += 1
        same = torch.equal(alone.contiguous().view(torch.uint8), outs[k].contiguous().view(torch.uint8))
        if self.metrics is not None:
            self.metrics.fused_checks.labels(outcome="same" if same else "differs").inc()
        if same:
            return
        self.check_failures += 1
        self.model.distrust_invariance()
        rows = [len(s.ids) for s in batch]
        log.error("fused_forward_differs", request=k, rows=rows, dtype=str(getattr(self.model, "dtype", "")))
        raise FusedMismatch(f"a fused forward ({len(batch)} requests, rows {rows}) gave request {k} other logits "
                            "than the same request alone; fusing is off on this worker from now on, retry")


__all__ = ["FusedMismatch", "StepResult", "Stepper", "largest_forward", "resolve_lanes", "split_lanes"]
