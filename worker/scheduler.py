"""The serving scheduler: admission, the order of model calls, and one request's generation loop.

The request it serves, its job, its errors and the serving metrics are :mod:`worker.request`'s
(re-exported here).

Theory of operation
-------------------
*Batching.* Requests do not take turns at the model: each hands its next step (a decode
token, or more of its prompt) to the engine's :class:`worker.stepper.Stepper`, which runs the
steps of every ready request as ONE forward — continuous batching with chunked prefill, under
``service.max_batch_tokens``, decodes first, then prompts in (priority, arrival) order. The
model's ops are batch-invariant (``kernels.invariant``), so no request's output depends on
what else runs: the tests compare every output of concurrent requests with the same requests
run alone on a cache-disabled engine, bit for bit. Lease round trips, hit validation and
restores happen outside forwards (they are not model steps).

*Admission.* A request is checked (prompt length + ``max_tokens`` within the context
limit) and queued; the queue holds at most ``service.queue_size`` requests beyond the free
running slots (more → :class:`QueueFull`, with a Retry-After estimate). Queued requests are
admitted by ``priority`` (lower first, vLLM's convention), then arrival, while fewer than
``service.max_concurrency`` run and the tenant is below its own ``max_concurrency``. A new
arrival at a busy worker waits for the batch window (``service.batch_window_ms``) to close, so a
burst is admitted in priority order rather than arrival order and its prompts share forwards; at
an idle worker (nothing running, more slots free than requests waiting) a request is admitted
at once.

*Goodput under overload.* Admission also bounds the prefill backlog: the prompt tokens of
admitted requests not yet prefilled. The stepper prefills prompts in (priority, arrival) order
with the whole budget, but every admitted request's decode tokens ride in every forward — so
once more prompts are admitted than the worker can prefill before their deadline, the early
ones stream one token per (large) prompt forward and every request misses the deadline
together (eight ~970-token prompts on SmolLM2: all 504). So a queued request is admitted only
while the backlog plus its own prompt can be prefilled, at the stepper's measured prefill rate
(``Stepper.prefill_tok_s``, a moving average), within ``service.admission_prefill_share`` of the
time left to its deadline (the rest is for decoding); the first in line is admitted when
nothing is left to prefill, so a prompt always runs. Before any rate is measured, one prompt is
prefilled at a time. A queued request whose prompt could not be prefilled before its deadline
even with the whole time left is refused at once (:class:`Overloaded`, a 429 whose Retry-After
is the backlog's time) — at submission or while it waits — instead of running to a 504 and
taking the machine from those that can finish. 0 turns this off (admission by slots alone).
Waiting longer than ``service.queue_timeout_ms``
→ :class:`QueueTimeout`; the whole request longer than ``service.request_timeout_ms`` →
:class:`RequestTimeout`.

*Cancellation.* Each request runs in a task of its own. A client that goes away cancels
it (:meth:`Job.aclose`); wherever it was — queued, waiting for its step, in a model call —
the session is closed (shielded from a second cancellation), which settles its commits and
releases its leases, and its running slot is freed for the next queued request.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import Counter as _Counter
from typing import TYPE_CHECKING

from shared import tracing
from shared.config import ServiceConfig
from shared.logging import get_logger
from worker.backlog import PromptWork
from worker.generation import Sampler, SamplingParams, TokenLogprobs, generate
from worker.request import (
    _END, ContextTooLong, GenRequest, InternalError, InvalidRequest, Job, Outcome, Overloaded, QueueFull,
    QueueTimeout, RequestTimeout, SchedulerError, ServingMetrics, ShuttingDown,
)
from worker.stepper import FusedMismatch
from shared.tenants import Tenant

if TYPE_CHECKING:
    from worker.engine import Engine
    from worker.cache.manager import Session

log = get_logger("kvl.worker.scheduler")


# --- the scheduler -------------------------------------------------------------------------------

#: The range of a 429's ``Retry-After`` (seconds): see :meth:`Scheduler._retry_after`.
RETRY_AFTER_MIN_S = 1
RETRY_AFTER_MAX_S = 300

class Scheduler:
    def __init__(self, engine: Engine, service: ServiceConfig) -> None:
        self.engine = engine
        engine.load_probe = lambda: (len(self._running), len(self._waiting))
        self.cfg = service
        self.metrics = ServingMetrics.of(engine.metrics.registry)
        self._seq = itertools.count(1)
        self._waiting: list[Job] = []
        self._running: set[Job] = set()
        self._tenant_running: _Counter[str] = _Counter()
        self._jobs: set[Job] = set()
        #: Prompt tokens queued requests will compute, for the prefill backlog (``worker.backlog``).
        self._work = PromptWork(engine, engine.inflight.claimed)
        self._window: asyncio.TimerHandle | None = None
        self._closed = False
        #: Moving average of admitted requests' running time (for Retry-After); None until one ended.
        self._avg_run_s: float | None = None
        #: Re-check admission after every forward (prompts advanced; the prefill rate moved).
        engine.stepper.on_step = self._admit

    # --- state -------------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    def _gauges(self) -> None:
        self.metrics.queue_depth.set(len(self._waiting))
        self.metrics.running.set(len(self._running))

    # --- submission ----------------------------------------------------------------------------

    def check(self, req: GenRequest) -> None:
        """Validate a request against the model and limits; raises :class:`InvalidRequest`."""
        n = len(req.tokens)
        if n == 0:
            raise InvalidRequest("the prompt is empty; send at least one token", "prompt")
        if req.max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1", "max_tokens")
        vocab = self.engine.model.cfg.vocab_size
        if any(t < 0 or t >= vocab for t in req.tokens):
            raise InvalidRequest(f"prompt token ids must lie in [0, {vocab})", "prompt")
        if n + req.max_tokens > self.max_context:
            raise ContextTooLong(n, req.max_tokens, self.max_context)

    def submit(self, req: GenRequest, fork_of: Job | None = None) -> Job:
        """Queue a request and start its task; raises at once if it cannot be accepted.

        ``fork_of`` (another sample of the same prompt, ``n`` > 1): this job decodes a copy of
        that job's state once its prompt is done, instead of leasing, restoring and prefilling
        the prompt again; if that job is already past its prompt, or ends before, this one
        opens its own session (resuming from the cache as any request)."""
        if fork_of is not None and fork_of.req.tokens != req.tokens:
            raise ValueError("a fork must share its source's prompt")
        if self._closed:
            raise ShuttingDown()
        self.check(req)
        free = max(0, self.cfg.max_concurrency - len(self._running))
        if len(self._waiting) >= self.cfg.queue_size + free:
            retry = self._retry_after()
            self.metrics.rejected.labels(reason="queue_full").inc()
            raise QueueFull(len(self._waiting), retry)
        job = Job(req, next(self._seq), time.perf_counter())
        ahead = self._ahead_of_queue()
        queued = self._queued_prompt_tokens(req.priority, ahead)
        own = self._estimate(job, ahead) if fork_of is None else 0
        refusal = self._unreachable(own, queued, self.cfg.request_timeout_ms / 1000)
        if refusal is not None:
            self._work.forget(job.seq)
            self.metrics.rejected.labels(reason="overloaded").inc()
            raise refusal
        job.deadline = job.arrival + self.cfg.request_timeout_ms / 1000
        if fork_of is not None and fork_of._forks is not None:
            job.fork_from = asyncio.get_running_loop().create_future()
            fork_of._forks.append(job.fork_from)
        self._jobs.add(job)
        self._waiting.append(job)
        self._gauges()
        job.task = asyncio.get_running_loop().create_task(self._run(job), name=f"kvl-request-{job.id}")
        # NOTE: an idle worker starts a request at once: waiting out the window there cost every
        # request 20-30 ms of time to first token (bench.serving, c = 1). Under load the window
        # stays: it lets the highest priority among near-simultaneous arrivals take a contended
        # slot, and it gathers arrivals into fewer, larger forwards (admitting every arrival at
        # once cost c = 8 a fifth of its tokens/s in three alternated runs of bench.serving).
        if self.cfg.batch_window_ms <= 0 or free == 0 or (not self._running and len(self._waiting) < free):
            self._admit()
        elif self._window is None:
            self._window = asyncio.get_running_loop().call_later(self.cfg.batch_window_ms / 1000, self._close_window)
        return job

    def _retry_after(self, now: float | None = None) -> int:
        """Seconds a request refused now should wait: its estimated queue wait, clamped to
        [:data:`RETRY_AFTER_MIN_S`, :data:`RETRY_AFTER_MAX_S`].

        ``wait = S × (queued + 1) / max_concurrency``: slots free at ``max_concurrency / S``
        per second on average, and the refused request would be ``queued + 1`` in line. The
        service time ``S`` is the moving average of finished requests' running time, but never
        less than the mean age of the requests running now: those have run that long already
        and are not done — and before any request has finished (a burst of long requests
        filling every slot) they are all there is to go on. So a worker whose requests take
        30–60 s no longer says "retry in 1 s". Nothing running and nothing finished: 1 s.
        """
        now = time.perf_counter() if now is None else now
        ages = [max(0.0, now - j.admitted_at) for j in self._running]
        mean_age = sum(ages) / len(ages) if ages else 0.0
        service_s = max(self._avg_run_s or 0.0, mean_age) or 1.0
        wait_s = service_s * (len(self._waiting) + 1) / self.cfg.max_concurrency
        return max(RETRY_AFTER_MIN_S, min(RETRY_AFTER_MAX_S, math.ceil(wait_s)))

    # --- the prefill backlog (see "Goodput under overload" in the module docstring) ---------------

    def _prefill_backlog(self) -> int:
        """Prompt tokens running requests have still to compute: what is left of an open session's
        prompt; before it opened, its estimate at admission (:mod:`worker.backlog`)."""
        n = 0
        for j in self._running:
            s = j.session
            if s is not None:
                n += max(0, len(s.tokens) - s.prefill_pos)
            elif j.fork_from is None:
                n += len(j.req.tokens) if j.work is None else j.work
        return n

    def _estimate(self, job: Job, ahead: set[str] | None) -> int:
        """Prompt tokens ``job`` will compute, were it admitted behind ``ahead`` (:mod:`worker.backlog`)."""
        req = job.req
        # NOTE: without prefix waits, requests sharing a new prefix each compute it
        shared = ahead if self.engine.prefix_wait_s > 0 else None
        return self._work.estimate(job.seq, req.tokens, req.tenant.id, reuse=req.reuse,
                                   has_images=bool(req.images), ahead=shared, claims=shared is not None)

    def _ahead_of_queue(self) -> set[str]:
        """The block hashes of running requests whose sessions have not opened yet (they will
        compute or claim them before any queued request runs)."""
        ahead: set[str] = set()
        for j in self._running:
            if j.session is None and j.fork_from is None:
                self._estimate(j, ahead)
        return ahead

    def _queued_prompt_tokens(self, priority: int, ahead: set[str]) -> int:
        """Prompt tokens queued requests a new request of ``priority`` would wait behind will compute."""
        return sum(self._estimate(j, ahead) for j in sorted(self._waiting, key=lambda j: (j.req.priority, j.seq))
                   if j.req.priority <= priority and j.fork_from is None)

    def _unreachable(self, own: int, ahead: int, time_left_s: float) -> Overloaded | None:
        """An :class:`Overloaded` when ``own`` prompt tokens behind the running backlog and ``ahead``
        queued ones could not be prefilled within ``time_left_s`` at the measured rate; else None."""
        rate = self.engine.stepper.prefill_tok_s
        if not self.cfg.admission_prefill_share or not rate:
            return None
        before = self._prefill_backlog() + ahead
        if not before or (before + own) / rate <= time_left_s:
            return None
        return self._overloaded(before + own, rate)

    def _overloaded(self, tokens: int, rate: float) -> Overloaded:
        """The refusal of a request that would finish prefilling ``tokens`` (its own last): Retry-After
        is the time until a fresh request could be admitted: the backlog ahead of it within
        ``admission_prefill_share`` of the request timeout."""
        wait_s = tokens / rate - self.cfg.admission_prefill_share * self.cfg.request_timeout_ms / 1000
        retry = max(RETRY_AFTER_MIN_S, min(RETRY_AFTER_MAX_S, math.ceil(max(wait_s, 0.0))))
        return Overloaded(tokens, rate, retry)

    def _fits(self, now: float, prefill_s: float, job: Job) -> bool:
        """Whether ``prefill_s`` of prompts (the backlog with ``job``'s) may run before the remaining
        tokens of every running request and of ``job``: within ``admission_prefill_share`` of the
        time each has left after its own decoding (the rest is the margin for a machine slower than
        measured, and for decode tokens that ride in the prompt forwards, counted at no speed)."""
        share = self.cfg.admission_prefill_share
        return all(prefill_s <= share * (j.deadline - now - self._decode_s(j)) for j in (*self._running, job))

    def _decode_s(self, job: Job) -> float:
        """The time ``job``'s remaining tokens take at the measured decode step with every running
        request decoding (the larger of the step and the per-row time × requests; before one was
        measured: two blocks of prompt at the prefill rate per row), at most
        ``1 - admission_prefill_share`` of the request timeout."""
        st = self.engine.stepper
        rows = len(self._running) + (job not in self._running)
        row_s = st.decode_row_s or (2 * self.engine.block_size / st.prefill_tok_s)
        step_s = max(st.decode_step_s or 0.0, row_s * rows)
        most = (1 - self.cfg.admission_prefill_share) * self.cfg.request_timeout_ms / 1000
        return min(most, (job.req.max_tokens - job.generated) * step_s)

    def _close_window(self) -> None:
        self._window = None
        self._admit()

    def _admit(self) -> None:
        """Admit queued requests in (priority, arrival) order while there is room."""
        if not self._waiting or len(self._running) >= self.cfg.max_concurrency:
            return
        now = time.perf_counter()
        share = self.cfg.admission_prefill_share
        rate = self.engine.stepper.prefill_tok_s
        backlog = self._prefill_backlog() if share else 0
        ahead = self._ahead_of_queue() if share else None
        blocked = False                       # a request ahead waits: the rest only hear if they cannot make it
        for job in sorted(self._waiting, key=lambda j: (j.req.priority, j.seq)):
            if not blocked and len(self._running) >= self.cfg.max_concurrency:
                break
            t = job.req.tenant
            if t.max_concurrency and self._tenant_running[t.id] >= t.max_concurrency:
                continue                      # this tenant waits; others may go ahead
            if job.admitted.done():
                continue                      # cancelled while queued (its task removes it)
            own = 0 if job.fork_from is not None else (self._estimate(job, ahead) if share else len(job.req.tokens))
            if share and rate and backlog:
                left = job.deadline - now
                need = (backlog + own) / rate         # its prompt done after all ahead of it
                if need + self._decode_s(job) > left:
                    # NOTE: both sides shrink alike while the worker prefills: it would never fit
                    self._waiting.remove(job)
                    job.admitted.set_exception(self._overloaded(backlog + own, rate))
                    continue
                if not blocked and not self._fits(now, need, job):
                    blocked = True            # waits (in order) until the backlog drains
            elif share and backlog and not rate:
                blocked = True                # nothing measured yet: one prompt at a time
            backlog += own
            if blocked:
                continue
            self._waiting.remove(job)
            self._running.add(job)
            self._tenant_running[t.id] += 1
            job.admitted_at = now
            job.work = own
            job.admitted.set_result(None)
        self._gauges()

    def _leave(self, job: Job) -> None:
        if job in self._waiting:
            self._waiting.remove(job)
        if job in self._running:
            self._running.discard(job)
            self._tenant_running[job.req.tenant.id] -= 1
            if self._tenant_running[job.req.tenant.id] <= 0:
                del self._tenant_running[job.req.tenant.id]
            run_s = time.perf_counter() - job.admitted_at
            self._avg_run_s = run_s if self._avg_run_s is None else 0.8 * self._avg_run_s + 0.2 * run_s
        self._jobs.discard(job)
        self._work.forget(job.seq)
        self._gauges()
        self._admit()

    # --- one request -----------------------------------------------------------------------------

    async def _run(self, job: Job) -> None:
        deadline = asyncio.get_running_loop().time() + self.cfg.request_timeout_ms / 1000
        reason = "error"
        timeout = asyncio.timeout_at(deadline)
        try:
            try:
                async with timeout:
                    with tracing.span("worker.admission", {"kvl.priority": job.req.priority,
                                                           "kvl.queue_depth": len(self._waiting)}):
                        await self._wait_admitted(job)
                    job.outcome = await self._generate(job)
                reason = job.outcome.finish_reason
                job._events.put_nowait(_END)
            except TimeoutError as e:
                if not timeout.expired():
                    raise SchedulerError(f"internal timeout: {e!r}") from e
                reason = "timeout"
                self.metrics.rejected.labels(reason="request_timeout").inc()
                job._events.put_nowait(RequestTimeout(self.cfg.request_timeout_ms))
            except Overloaded as e:
                reason = "overloaded"
                job._events.put_nowait(e)
            except QueueTimeout as e:
                reason = "timeout"
                self.metrics.rejected.labels(reason="queue_timeout").inc()
                job._events.put_nowait(e)
        except asyncio.CancelledError:
            reason = "stop" if job.stopped else "cancelled"
            job._events.put_nowait(ShuttingDown() if self._closed else SchedulerError("the request was cancelled"))
            raise
        except FusedMismatch as e:
            # not this request's fault nor a bug here: the worker stopped fusing; a retry is exact
            job._events.put_nowait(SchedulerError(str(e)))
        except Exception as e:  # noqa: BLE001 - reported to the caller, logged with its traceback
            log.error("request_failed", job=job.id, error=type(e).__name__, exc_info=True)
            job._events.put_nowait(InternalError(f"the worker failed to serve this request ({type(e).__name__}; "
                                                 f"logged as job {job.id})"))
        finally:
            self._end_forks(job)
            self.metrics.finished.labels(reason=reason).inc()
            self.engine.metrics.requests.labels(outcome="ok" if reason in ("stop", "length") else reason).inc()
            self._leave(job)

    async def _wait_admitted(self, job: Job) -> None:
        try:
            async with asyncio.timeout(self.cfg.queue_timeout_ms / 1000):
                await asyncio.shield(job.admitted)
        except Overloaded:
            self.metrics.rejected.labels(reason="overloaded").inc()
            raise
        except TimeoutError:
            if job.admitted.done():
                return                        # admitted at the last moment: run it
            job.admitted.cancel()
            raise QueueTimeout(self.cfg.queue_timeout_ms) from None
        except BaseException:
            if not job.admitted.done():
                job.admitted.cancel()
            raise
        self.metrics.queue_time.observe(job.admitted_at - job.arrival)

    async def _open(self, job: Job) -> Session:
        """The job's session: a fork of another job's (``submit(fork_of=)``) or its own."""
        e, req, fut = self.engine, job.req, job.fork_from
        if fut is not None:
            try:
                s = await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled() and fut.result() is not None:
                    await e.close(fut.result())     # handed over just as this job was cancelled
                raise
            if s is not None:
                self.metrics.forked.inc()
                job.forked = True
                return s
        return await e.open(req.tokens, tenant=req.tenant.id, reuse=req.reuse, max_new_tokens=req.max_tokens,
                            images=req.images)

    async def _fork(self, job: Job, s: Session) -> None:
        """Hand a copy of ``s``'s state to every job waiting for one (at the end of the prompt)."""
        waiting = [f for f in job._forks or () if not f.done()]
        job._forks = None
        if not waiting:
            return
        states = await self.engine.compute(lambda: [s.state.fork() for _ in waiting])
        for fut, state in zip(waiting, states, strict=True):
            if not fut.done():                          # its job may have gone meanwhile
                child = s.fork(state)
                self.engine.sessions.add(child)
                fut.set_result(child)

    @staticmethod
    def _end_forks(job: Job) -> None:
        """Jobs still waiting to fork ``job`` (it ended before its prompt was done) open their own."""
        for fut in job._forks or ():
            if not fut.done():
                fut.set_result(None)
        job._forks = None

    async def _generate(self, job: Job) -> Outcome:
        e = self.engine
        req = job.req
        s = await self._open(job)
        job.session = s
        try:
            job.cached_tokens = s.cached_tokens
            job.fallbacks = list(s.fallbacks)
            job.degraded = s.degraded
            if (span := tracing.current()).is_recording():     # the request's span (worker.request)
                span.set_attributes({"kvl.prompt_tokens": len(req.tokens), "kvl.cached_tokens": s.cached_tokens,
                                     "kvl.hit_tokens": s.hit_blocks * s.bs, "kvl.epoch": s.epoch,
                                     "kvl.fallbacks": s.fallbacks, "kvl.degraded": s.degraded,
                                     "kvl.forked": job.forked})
            self._apply_quota(s, req.tenant)
            s.order = (req.priority, job.seq)
            ttft = 0.0
            last = 0.0

            def on_token(tok: int, lp: TokenLogprobs | None) -> bool:
                nonlocal ttft, last
                now = time.perf_counter()
                if not last:                    # the first token: the prompt is done
                    self.metrics.prompt_tokens.inc(len(req.tokens))
                    ttft = now - job.arrival
                    e.metrics.ttft.observe(ttft)
                else:
                    self.metrics.itl.observe(now - last)
                last = now
                self.metrics.generation_tokens.inc()
                job.generated += 1
                if lp is not None:
                    job.logprobs.append(lp)     # before the token: a reader of token i finds its logprobs
                job._events.put_nowait(tok)
                return job.stopped

            g = await generate(s, req.sampling, max_tokens=req.max_tokens, stop_token_ids=req.stop_token_ids,
                               keep_logits=req.keep_logits, on_token=on_token,
                               on_prefilled=lambda: self._fork(job, s))
        finally:
            # NOTE: shielded: a second cancellation must not stop the settling of the commits. The
            # leases are released after the response ends (release_later: one round trip and a
            # log append fewer before its last chunk; the next turn needs the blocks READY, which
            # the settling waits for, not the lease gone).
            await asyncio.shield(e.close(s, release_later=True))
        self.metrics.e2e.observe(time.perf_counter() - job.arrival)
        r = s.result(g.tokens, None, ttft)
        return Outcome(tokens=g.tokens, finish_reason=g.finish_reason, prompt_tokens=r.prompt_tokens,
                       cached_tokens=r.cached_tokens, fallbacks=r.fallbacks, degraded=r.degraded,
                       queued_s=job.admitted_at - job.arrival, ttft_s=ttft, logits=g.logits)

    def _apply_quota(self, s: Session, tenant: Tenant) -> None:
        """Cache no more of ``tenant``'s blocks than its quota: drop the excess from the writes.

        The blocks are still computed; their write grants are released unfilled with the
        lease. Counted per worker (this worker's GPU pools), and soft: two requests of a
        tenant opened at once may both see the last free room.
        """
        q = tenant.cache_quota_blocks
        store = self.engine.store
        if not q or store is None or not s.writes:
            return
        used = len({m.block_hash for _, _, m in store.items() if m.tenant == tenant.id})
        skipped = s.limit_writes(max(0, q - used))
        if skipped:
            self.metrics.quota_skipped.inc(skipped)

    # --- life cycle ------------------------------------------------------------------------------

    async def stop(self, grace_s: float = 5.0) -> None:
        """Refuse new requests; let running ones finish for ``grace_s``, then cancel the rest."""
        self._closed = True
        if self._window is not None:
            self._window.cancel()
            self._window = None
        for job in list(self._waiting):
            if job.task is not None:
                job.task.cancel()
        tasks = [j.task for j in self._jobs if j.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=grace_s)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending, timeout=grace_s)


__all__ = ["ContextTooLong", "GenRequest", "InternalError", "InvalidRequest", "Job", "Outcome", "QueueFull",
           "Overloaded", "QueueTimeout", "RequestTimeout", "Sampler", "SamplingParams", "Scheduler", "SchedulerError",
           "ServingMetrics", "ShuttingDown"]
