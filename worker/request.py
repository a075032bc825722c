"""A request as the scheduler serves it: :class:`GenRequest` in, a :class:`Job` (an async iterator
of its token ids, then its :class:`Outcome`) out; the typed errors that refuse or end one; the
request-level serving metrics (:class:`ServingMetrics`).

The scheduler (:mod:`worker.scheduler`) admits jobs and runs their generation loop; the API
(:mod:`worker.api`) builds requests, reads jobs and chooses HTTP statuses for the errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shared.images import PromptImage
from shared.tenants import Tenant
from worker.generation import SamplingParams, TokenLogprobs

if TYPE_CHECKING:
    from worker.cache.manager import Session


# --- errors (typed here; HTTP statuses are chosen at the edge, in worker.api) ---------------------

class SchedulerError(Exception):
    """A request the scheduler will not (or can no longer) serve; the message says why."""


class InvalidRequest(SchedulerError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextTooLong(InvalidRequest):
    def __init__(self, prompt_tokens: int, max_tokens: int, limit: int) -> None:
        super().__init__(f"this request needs {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt + "
                         f"{max_tokens} max_tokens) but the maximum context length is {limit} tokens; shorten the "
                         f"prompt or lower max_tokens", "max_tokens")
        self.limit = limit


class QueueFull(SchedulerError):
    def __init__(self, queued: int, retry_after_s: int) -> None:
        super().__init__(f"the request queue is full ({queued} waiting); retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s


class Overloaded(QueueFull):
    """The prompt cannot be prefilled before the request's deadline at the measured rate."""

    def __init__(self, backlog_tokens: int, rate_tok_s: float, retry_after_s: int) -> None:
        SchedulerError.__init__(self, f"the worker is overloaded: {backlog_tokens} prompt tokens to prefill (this "
                                f"request's and those ahead of it) at ~{rate_tok_s:.0f} tokens/s would not finish "
                                f"within service.request_timeout_ms; retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s
        self.backlog_tokens = backlog_tokens


class QueueTimeout(SchedulerError):
    def __init__(self, timeout_ms: int) -> None:
        super().__init__(f"the request waited in the queue longer than service.queue_timeout_ms ({timeout_ms} ms) "
                         f"without being scheduled; the worker is overloaded, retry later")
        self.timeout_ms = timeout_ms


class RequestTimeout(SchedulerError):
    def __init__(self, timeout_ms: int) -> None:
        super().__init__(f"the request did not finish within service.request_timeout_ms ({timeout_ms} ms); "
                         f"lower max_tokens or retry later")
        self.timeout_ms = timeout_ms


class InternalError(SchedulerError):
    """The engine failed while serving the request (a bug or an impossible recomputation; logged)."""


class ShuttingDown(SchedulerError):
    def __init__(self) -> None:
        super().__init__("the worker is shutting down; send the request to another worker")


# --- metrics -------------------------------------------------------------------------------------

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


class ServingMetrics:
    """Request-level metrics, on the engine's registry (one ``/metrics`` for the worker).

    Time to first token is the engine's own histogram
    (``kvl_worker_time_to_first_token_seconds``), observed here from the request's arrival.
    """

    _by_registry: weakref.WeakKeyDictionary[CollectorRegistry, ServingMetrics] = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, registry: CollectorRegistry) -> ServingMetrics:
        m = cls._by_registry.get(registry)
        if m is None:
            m = cls._by_registry[registry] = cls(registry)
        return m

    def __init__(self, r: CollectorRegistry) -> None:
        p = "kvl_worker_"
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between consecutive output tokens",
                             buckets=_ITL, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival to last token of finished requests",
                             buckets=_LATENCY, registry=r)
        self.queue_time = Histogram(p + "request_queue_time_seconds", "Time admitted requests waited in the queue",
                                    buckets=_LATENCY, registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.queue_depth = Gauge(p + "queue_depth", "Requests waiting to be admitted", registry=r)
        self.running = Gauge(p + "requests_running", "Requests admitted and not yet finished", registry=r)
        self.finished = Counter(p + "requests_finished", "Requests that ended, by finish reason "
                                "(stop, length, cancelled, timeout, error)", ["reason"], registry=r)
        self.rejected = Counter(p + "requests_rejected", "Requests refused before running, by reason",
                                ["reason"], registry=r)
        self.quota_skipped = Counter(p + "tenant_quota_skipped_blocks", "Blocks computed but not cached because "
                                     "the tenant's cache quota was reached", registry=r)
        self.forked = Counter(p + "forked_samples", "Samples of an n > 1 request that decoded a copy of "
                              "another sample's prompt state instead of opening their own", registry=r)
        self.http = Counter(p + "http_requests", "HTTP requests by route and status", ["route", "status"],
                            registry=r)


# --- requests, jobs ------------------------------------------------------------------------------

@dataclass(slots=True)
class GenRequest:
    tokens: list[int]
    max_tokens: int
    tenant: Tenant
    sampling: SamplingParams = field(default_factory=SamplingParams)
    #: False = no cache reads for this request (a cold run, for differential checks).
    reuse: bool = True
    priority: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    #: Keep each step's logits in the outcome (tests; not exposed over HTTP).
    keep_logits: bool = False
    #: Images in the prompt: their token runs, content hashes and pixels (chat image parts).
    images: tuple[PromptImage, ...] = ()


@dataclass(slots=True)
class Outcome:
    tokens: list[int]
    #: ``length`` (max_tokens reached), ``stop`` (a stop token, or the caller stopped it).
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    fallbacks: list[str]
    degraded: bool
    queued_s: float
    ttft_s: float
    logits: torch.Tensor | None = None


class _End:
    pass


_END = _End()


class Job:
    """One submitted request: an async iterator of its generated token ids.

    After the iteration ends, :attr:`outcome` is set; an error ends the iteration by being
    raised. :meth:`aclose` cancels whatever is left (client gone) and waits until the
    engine has released the request's leases.
    """

    def __init__(self, req: GenRequest, seq: int, arrival: float) -> None:
        self.req = req
        self.seq = seq
        self.id = f"{seq:x}"
        self.arrival = arrival
        #: When ``service.request_timeout_ms`` ends for this request (``perf_counter`` time).
        self.deadline = math.inf
        #: The open session (its ``prefill_pos`` says how much of the prompt is left).
        self.session: Session | None = None
        #: Tokens generated so far.
        self.generated = 0
        self.admitted_at = 0.0
        #: Prompt tokens it was estimated to compute when admitted (:mod:`worker.backlog`).
        self.work: int | None = None
        self.admitted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.outcome: Outcome | None = None
        self.stopped = False
        self.task: asyncio.Task[None] | None = None
        # What the cache did for the prompt (known once the session is open; for ``usage``).
        self.prompt_tokens = len(req.tokens)
        self.cached_tokens = 0
        self.fallbacks: list[str] = []
        self.degraded = False
        #: The i-th generated token's log probabilities (when the sampling asks for them).
        self.logprobs: list[TokenLogprobs] = []
        self._events: asyncio.Queue[int | _End | BaseException] = asyncio.Queue()
        self._error: BaseException | None = None
        #: n > 1: where this job waits for a copy of another job's state after the prompt
        #: (None in the future = open a session of its own).
        self.fork_from: asyncio.Future[Session | None] | None = None
        #: The futures of jobs waiting to fork this one's state; None once it is past its prompt.
        self._forks: list[asyncio.Future[Session | None]] | None = []
        #: Whether this job decoded a fork of another job's state.
        self.forked = False

    def __aiter__(self) -> Job:
        return self

    async def __anext__(self) -> int:
        if self._error is not None:
            raise StopAsyncIteration
        item = await self._events.get()
        if isinstance(item, _End):
            self._error = StopIteration()   # sentinel: exhausted
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._error = item
            raise item
        return item

    @property
    def finish_reason(self) -> str:
        if self.outcome is not None:
            return self.outcome.finish_reason
        return "stop" if self.stopped else "cancelled"

    def stop(self) -> None:
        """End generation at the next step with finish reason ``stop`` (a stop string matched)."""
        self.stopped = True

    async def aclose(self) -> None:
        """Cancel the job if it is still running and wait for its cleanup (leases released)."""
        t = self.task
        if t is None or t.done():
            return
        if self.outcome is None:
            t.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.shield(t)

    async def wait(self) -> Outcome:
        """Consume the job to its end (non-streaming callers)."""
        async for _ in self:
            pass
        assert self.outcome is not None
        return self.outcome


__all__ = ["ContextTooLong", "GenRequest", "InternalError", "InvalidRequest", "Job", "Outcome", "Overloaded",
           "QueueFull", "QueueTimeout", "RequestTimeout", "SchedulerError", "ServingMetrics", "ShuttingDown"]
