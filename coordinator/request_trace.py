"""Spans of the coordinator's batched requests (``shared.tracing``), for requests that carry a trace.

A worker's lease, renew, release (and register, resume, disk GC) arrive with the ``traceparent``
of the span that sent them in their NATS headers; the coordinator continues that trace and never
starts one of its own (a request without one — heartbeats, a worker's supervisor — gets no span).

Requests are decided in batches (``NatsService._serve_queued``): everything taken while the
previous batch was being decided is decided together and made durable by one submission to the
group commit. So each traced request gets:

* ``coordinator.<op>`` (SERVER; ``coordinator.acquire``, ``.release``, ...): from when the request
  was taken to when its reply was sent — its wait for the batch, its decision, the commit;
* ``coordinator.decide``, its child: its own decision against the live state (the pure core);
* ``coordinator.commit``, its child: from the batch's last decision until its events are durable
  (or, for a reply decided on not-yet-durable state, until the barrier that covers it).

Child spans, not links to one batch span: an operator reading one request's trace sees where its
time went without opening another trace; ``kvl.batch_size`` says how many requests shared the
decision pass and the commit. The price is two short spans per traced request, only when traced.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from shared import tracing
from shared.messages import ErrorCode, ErrorReply, LeaseAcquire, LeaseGrant

#: Codes that mean the coordinator failed the request (the others are answers: refused, not found).
_FAILED = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.NOT_LEADER})


class BatchSpans:
    """The spans of one batch's traced requests, by position in the batch."""

    __slots__ = ("spans", "size", "decided_ns")

    def __init__(self, spans: list[Any], size: int) -> None:
        self.spans = spans
        self.size = size
        #: When the batch's last decision ended (wall clock, ns); 0 = nothing decided.
        self.decided_ns = 0

    @classmethod
    def of(cls, batch: Sequence[tuple[Any, Any, float]]) -> BatchSpans | None:
        """Spans for the ``(op, msg, taken at perf_counter)`` entries whose message names a trace;
        None when tracing is off or none does."""
        if not tracing.enabled():
            return None
        now_ns, now = time.time_ns(), time.perf_counter()
        spans: list[Any] = []
        for op, msg, taken in batch:
            parent = tracing.extract(msg.headers)
            spans.append(None if parent is None else tracing.start(
                f"coordinator.{op.name}", parent=parent, kind=tracing.SERVER,
                start_ns=now_ns - int((now - taken) * 1e9), attributes={"kvl.batch_size": len(batch)}))
        return cls(spans, len(batch)) if any(s is not None for s in spans) else None

    def timed(self, i: int, decide: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``decide`` recording a ``coordinator.decide`` span under request ``i``'s (as is if untraced)."""
        parent = self.spans[i]
        if parent is None:
            return decide

        def run(state: Any) -> Any:
            t0 = time.time_ns()
            try:
                return decide(state)
            finally:
                t1 = self.decided_ns = time.time_ns()
                span = tracing.start("coordinator.decide", parent=parent, start_ns=t0)
                if span is not None:
                    span.end(end_time=t1)
        return run

    def committed(self, decided: Sequence[int]) -> None:
        """The batch's events are durable (or failed): a ``coordinator.commit`` span under each
        traced request of ``decided`` (positions), from the last decision until now."""
        if not self.decided_ns:
            return
        now = time.time_ns()
        for i in decided:
            parent = self.spans[i]
            span = tracing.start("coordinator.commit", parent=parent, start_ns=self.decided_ns,
                                 attributes={"kvl.batch_size": self.size}) if parent is not None else None
            if span is not None:
                span.end(end_time=now)

    def answered(self, i: int, req: Any, reply: Any) -> None:
        """Request ``i`` was answered: its span gets what it asked and the outcome, and ends."""
        span, self.spans[i] = self.spans[i], None
        if span is None:
            return
        attrs: dict[str, Any] = {}
        for key in ("worker_id", "epoch", "tenant"):
            if (value := getattr(req, key, None)) is not None:
                attrs[f"kvl.{key}"] = value
        if isinstance(req, LeaseAcquire):
            attrs.update({"kvl.blocks": len(req.block_hashes), "kvl.write": bool(req.write_forms)})
        if isinstance(reply, LeaseGrant):
            attrs.update({"kvl.usable_blocks": reply.usable_blocks, "kvl.read_replicas": len(reply.read),
                          "kvl.write_replicas": sum(len(v) for v in reply.write.values()),
                          "kvl.evicted_replicas": len(reply.evict)})
        attrs["kvl.outcome"] = reply.code.value if isinstance(reply, ErrorReply) else "ok"
        span.set_attributes(attrs)
        if isinstance(reply, ErrorReply) and reply.code in _FAILED:
            span.set_status(tracing.Status(tracing.StatusCode.ERROR, reply.code.value))
        span.end()

    def close(self) -> None:
        """End what is still open (the batch failed before answering everyone)."""
        for i, span in enumerate(self.spans):
            if span is not None:
                self.spans[i] = None
                span.set_attribute("kvl.outcome", "unanswered")
                span.end()
