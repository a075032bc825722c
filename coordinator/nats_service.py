"""The coordinator on NATS: request/reply service, transition consumer, watermarks, worker calls.

* Request/reply (queue group ``COORDINATOR_QUEUE``): register, resume, heartbeat, lease
  acquire / renew / release. Every request is answered — with an ``ErrorReply`` when it cannot be
  served; a malformed one gets ``INVALID`` and a warning in the log that names the
  operation and what was wrong with the shape, never the content.
* JetStream: the stream is created or verified at start (limits retention, file storage,
  max age and duplicate window from config); a durable pull consumer feeds transitions to
  the ledger; a message is acked only after its event is committed (or found to be a
  redelivery of one that is), nak'ed for redelivery when the ledger cannot commit.
* After each commit, each affected worker epoch's :class:`CommitWatermark` is published on
  ``subjects.watermark(worker)``; the worker drops what it covers from its outbox.

The JetStream half (consumer, ingest, watermarks) is :class:`~coordinator.transition_consumer.TransitionConsumer`,
a base class of :class:`NatsService` in a module of its own.

Requests are decided in batches: every request taken while the previous batch was being
decided joins the next one, which is decided in arrival order, submitted to the group commit
as one, and answered once durable; the next batch's decisions need not wait for that commit
(that is what group commit batches). Heartbeats are the exception: they append nothing and
wait for nothing, so they are answered inline, never queued behind decisions or commits.

A request whose NATS headers carry a ``traceparent`` (tracing on, ``shared.tracing``) gets its
spans from :mod:`coordinator.request_trace`; an untraced one costs a header lookup at most.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import nats
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from coordinator.core import (
    CoreError, Invalidated, acquire_lease, collect_disk, drop_controls, evict_host,
    register_worker, release_lease, renew_lease, resume_worker,
)
from coordinator.controls import outcome as control_outcome, send_controls
from coordinator.ledger import Ledger
from coordinator.metrics import CoordinatorMetrics
from coordinator.request_trace import BatchSpans
# NOTE: CONSUMER_NAME and StartupError are imported from here by the runtime, the app and tests.
from coordinator.stream import CONSUMER_NAME, StartupError, TransitionStream
from coordinator.transition_consumer import TransitionConsumer, error_kind
from coordinator.unavailable import Unavailable
from shared.messages import (
    Control, DiskGc, ErrorCode, ErrorReply, Heartbeat, HostEvict, InventoryReply, InventoryRequest, LeaseAcquire, LeaseRelease,
    LeaseRenew, MessageError, ResumeReply, RouteQuery, RouteReply, WorkerRegister, WorkerResume, decode,
    RegisterReply, encode, now_ms,
)
from shared import tracing
from shared.hashing import REPLICA_DIGEST_BYTES
from shared.subjects import COORDINATOR_QUEUE, Subjects


def new_lease_id() -> str:
    return "l" + secrets.token_hex(8)


@dataclass(frozen=True, slots=True)
class _Op:
    name: str
    type: type
    #: ``decide(request)`` → the decision the ledger runs against its state.
    decide: Callable[[Any], Callable[[Any], tuple[Any, list[Any]]]]


_OPS = {
    "register": _Op("register", WorkerRegister, lambda req: lambda s: register_worker(s, req, now_ms())),
    "acquire": _Op("acquire", LeaseAcquire, lambda req: lambda s: acquire_lease(s, req, now_ms(), new_lease_id())),
    "renew": _Op("renew", LeaseRenew, lambda req: lambda s: renew_lease(s, req, now_ms())),
    "release": _Op("release", LeaseRelease, lambda req: lambda s: release_lease(s, req, now_ms())),
    "disk_gc": _Op("disk_gc", DiskGc, lambda req: lambda s: collect_disk(s, req, now_ms())),
    "host_evict": _Op("host_evict", HostEvict, lambda req: lambda s: evict_host(s, req, now_ms())),
}
#: Resumes are decided with the NATS max payload in hand (see ``NatsService._decision``).
_OPS["resume"] = _Op("resume", WorkerResume, lambda req: lambda s: resume_worker(s, req, now_ms()))
#: Parts of one resume, and resumes assembling at once, at most.
MAX_RESUME_PARTS = 1024
MAX_PENDING_RESUMES = 1024
#: Answered inline by :meth:`Ledger.heartbeat` (nothing to decide or commit).
_HEARTBEAT = _Op("heartbeat", Heartbeat, lambda req: lambda s: (None, []))
#: Answered inline by :meth:`Ledger.route` (read-only).
_ROUTE = _Op("route", RouteQuery, lambda req: lambda s: (None, []))


class NatsService(TransitionConsumer):
    def __init__(self, nc: NatsClient, subjects: Subjects, ledger: Ledger, *, config: Any,
                 metrics: CoordinatorMetrics, logger: Any, max_in_flight: int = 4096) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=config.nats.request_timeout_ms / 1000)
        self.subjects = subjects
        self.ledger = ledger
        self.config = config
        self.metrics = metrics
        self.log = logger
        self.request_timeout_s = config.nats.request_timeout_ms / 1000
        self._subs: list[Any] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        #: A disowning registration's decision → the other workers holding copies of what it
        #: disowned and the controls that make them drop those, sent once the decision is durable.
        self._disowned: dict[int, dict[str, list[Control]]] = {}
        #: Transitions fetched and not yet acked or nak'ed, and the event set while they are
        #: under the consumer's bound (see :meth:`_consume`).
        self._ingesting = 0
        self._ingest_room = asyncio.Event()
        self._slots = asyncio.Semaphore(max_in_flight)
        #: Requests taken, not yet decided: ``(op, msg, when taken)``; the task that will decide them.
        self._queued: list[tuple[_Op, Msg, float]] = []
        self._batch: asyncio.Task[None] | None = None
        self._request_series: dict[tuple[str, str], tuple[Any, Any]] = {}
        self._psub: Any = None
        #: Where a reclaim's new consumer starts once it has deleted the old one (None: no reclaim
        #: cut short between its delete and its add).
        self._reclaim_from: int | None = None
        self._consumer: asyncio.Task[None] | None = None
        self._pull = asyncio.Event()
        self._marks: dict[tuple[str, int], int] = {}
        self._refused: dict[tuple[str, int], list[int]] = {}
        self._marks_ready = asyncio.Event()
        self._publisher: asyncio.Task[None] | None = None
        #: The transitions stream (limits, purges) and the task purging what was acknowledged.
        self.stream = TransitionStream(self.js, nc, subjects, config=config, metrics=metrics, logger=logger)
        self._purger: asyncio.Task[None] | None = None
        #: ``(worker, epoch)`` → the parts of a multi-part resume received so far.
        self._resume_parts: dict[tuple[str, int], list[bytes]] = {}

    # --- request/reply --------------------------------------------------------------------

    @property
    def subscribed(self) -> bool:
        return bool(self._subs)

    async def start_requests(self) -> None:
        if self._subs:
            return
        s = self.subjects
        for op in ("register", "resume", "acquire", "renew", "release", "disk_gc", "host_evict"):
            self._subs.append(await self.nc.subscribe(s.requests_wildcard(op), queue=COORDINATOR_QUEUE,
                                                      cb=self._dispatcher(_OPS[op])))
        self._subs.append(await self.nc.subscribe(s.requests_wildcard("heartbeat"), queue=COORDINATOR_QUEUE,
                                                  cb=self._heartbeat))
        self._subs.append(await self.nc.subscribe(s.route_wildcard, queue=COORDINATOR_QUEUE, cb=self._route))
        self.log.info("requests_subscribed", queue=COORDINATOR_QUEUE, prefix=s.prefix)

    async def stop_requests(self) -> None:
        """Stop taking requests; those already taken are answered (their commits are awaited)."""
        subs, self._subs = self._subs, []
        for sub in subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if subs:
            self.log.info("requests_unsubscribed")

    async def wait_in_flight(self, timeout_s: float) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)

    def _dispatcher(self, op: _Op) -> Callable[[Msg], Any]:
        async def cb(msg: Msg) -> None:
            await self._slots.acquire()   # backpressure: at most max_in_flight requests taken
            self._queued.append((op, msg, time.perf_counter()))
            if self._batch is None:
                self._start_pass(behind=False)
        return cb

    def _start_pass(self, *, behind: bool) -> None:
        self._batch = task = asyncio.create_task(self._serve_queued(behind))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _heartbeat(self, msg: Msg) -> None:
        t0 = time.perf_counter()
        reply = self._request(_HEARTBEAT, msg)
        if not isinstance(reply, ErrorReply):
            try:
                reply = self.ledger.heartbeat(reply)
            except Unavailable as e:
                reply = ErrorReply(code=e.code, message=str(e)[:1000], retry_after_ms=e.retry_after_ms)
        await self._answer(_HEARTBEAT, msg, t0, reply)

    async def _route(self, msg: Msg) -> None:
        """A gateway's route query: decoded, checked against the subject's gateway id, answered
        from the live state (``Ledger.route``) — nothing decided, nothing appended."""
        t0 = time.perf_counter()
        with tracing.remote_span("coordinator.route", msg.headers) as span:   # a no-op unless the query is traced
            try:
                req = decode(msg.data, expect=RouteQuery)
            except Exception as e:  # noqa: BLE001 - whatever the bytes do to the decoder, INVALID
                kind = error_kind(e) if isinstance(e, MessageError) else "undecodable"
                self.metrics.malformed.labels(kind="route").inc()
                self.log.warning("malformed_request", op="route", size=len(msg.data), error_kind=kind)
                text = str(e) if isinstance(e, MessageError) else f"undecodable message ({type(e).__name__})"
                reply: Any = ErrorReply(code=ErrorCode.INVALID, message=text[:1000])
            else:
                sender = self.subjects.route_gateway(msg.subject)
                if sender != req.gateway_id:
                    self.metrics.forbidden.labels(op="route").inc()
                    reply = ErrorReply(code=ErrorCode.FORBIDDEN,
                                       message=f"a route query for gateway {req.gateway_id} must arrive on "
                                               f"{self.subjects.route(req.gateway_id)}, not on {msg.subject}")
                else:
                    try:
                        reply = self.ledger.route(req)
                    except Unavailable as e:
                        reply = ErrorReply(code=e.code, message=str(e)[:1000], retry_after_ms=e.retry_after_ms)
                span.set_attributes({"kvl.gateway_id": req.gateway_id, "kvl.blocks": len(req.block_hashes)})
            span.set_attributes({"kvl.outcome": reply.code.value if isinstance(reply, ErrorReply) else "ok",
                                 "kvl.candidates": len(reply.workers) if isinstance(reply, RouteReply) else 0})
            await self._answer(_ROUTE, msg, t0, reply)

    def _request(self, op: _Op, msg: Msg) -> Any:
        """The decoded request, or the ErrorReply for a malformed one or one that speaks for
        another worker than the subject it arrived on (the subject is what NATS permissions
        bind to the sender's identity)."""
        try:
            req = decode(msg.data, expect=op.type)
        except Exception as e:  # noqa: BLE001 - whatever the bytes do to the decoder (RecursionError...), INVALID
            kind = error_kind(e) if isinstance(e, MessageError) else "undecodable"
            self.metrics.malformed.labels(kind=op.name).inc()
            self.log.warning("malformed_request", op=op.name, size=len(msg.data), error_kind=kind)
            text = str(e) if isinstance(e, MessageError) else f"undecodable message ({type(e).__name__})"
            return ErrorReply(code=ErrorCode.INVALID, message=text[:1000])
        sender = self.subjects.request_worker(msg.subject)
        if sender != req.worker_id:
            self.metrics.forbidden.labels(op=op.name).inc()
            self.log.warning("request_identity_mismatch", op=op.name, subject_worker=sender,
                             message_worker=req.worker_id)
            return ErrorReply(code=ErrorCode.FORBIDDEN,
                              message=f"a request for worker {req.worker_id} must arrive on its own subject "
                                      f"({self.subjects.request(op.name, req.worker_id)}), not on {msg.subject}")
        return req

    def _assemble(self, req: WorkerResume) -> WorkerResume | ResumeReply | ErrorReply:
        """A multi-part resume: keep the parts until the last; then the whole inventory."""
        key = (req.worker_id, req.epoch)
        if req.part == 0:
            if len(self._resume_parts) >= MAX_PENDING_RESUMES and key not in self._resume_parts:
                return ErrorReply(code=ErrorCode.UNAVAILABLE, message="too many resumes in progress; retry",
                                  retry_after_ms=500)
            self._resume_parts[key] = []
        chunks = self._resume_parts.get(key)
        if chunks is None or req.part != len(chunks) or req.part >= req.parts or req.parts > MAX_RESUME_PARTS:
            self._resume_parts.pop(key, None)
            return ErrorReply(code=ErrorCode.INVALID, message=f"resume part {req.part} of {req.parts} out of order "
                              f"(expected part {len(chunks) if chunks is not None else 0}, at most "
                              f"{MAX_RESUME_PARTS} parts); start again from part 0")
        chunks.append(req.held)
        if req.part < req.parts - 1:
            return ResumeReply(worker_id=req.worker_id, epoch=req.epoch, complete=False)
        del self._resume_parts[key]
        return msgspec.structs.replace(req, held=b"".join(chunks), part=0, parts=1)

    def _decision(self, op: _Op, req: Any) -> Callable[[Any], tuple[Any, list[Any]]]:
        if isinstance(req, WorkerResume):
            # NOTE: the reply lists the digests to drop; it must fit one message too (base64 in JSON).
            max_drop = max(1, (self.nc.max_payload - 4096) * 3 // 4 // REPLICA_DIGEST_BYTES)
            return lambda s: resume_worker(s, req, now_ms(), max_drop)
        if isinstance(req, WorkerRegister) and req.disown_replicas:
            def disown(s: Any) -> tuple[Any, list[Any]]:
                reply, events = register_worker(s, req, now_ms())
                for e in events:
                    if isinstance(e, Invalidated):
                        self._disowned[id(req)] = drop_controls(s, e, but=req.worker_id)
                return reply, events
            return disown
        return op.decide(req)

    async def _serve_queued(self, behind: bool = False) -> None:
        """Decide the requests taken since the last pass started (at most
        ``coordinator.decide_pass_max``), in arrival order, as one submission to the ledger;
        answer each once the events of all are durable. What is left queued gets a pass of its
        own (``behind``), started now.

        NOTE: one task, one decision pass and one commit future per burst of requests instead
        of a task, a future and a shield per request (that bookkeeping cost more than many a
        decision). Passes start in the order they were created and decide before their
        first real wait, so decisions (and the log) follow the order requests arrived in.

        NOTE: a burst is decided in bounded passes so that its first part's append starts while
        the rest is decided, and its first answers go out while later parts wait for theirs. One
        pass for the whole burst ran it in lock step: 64 leases in flight, all decided (2.7 ms),
        then appended (2 ms), then answered, then the client's turn (2.8 ms), every stage idle
        while another ran. A pass started behind another yields once first, so the group
        committer (woken by the other's submission) takes that submission alone and starts its
        append before this pass decides.
        """
        if behind:
            await asyncio.sleep(0)
        self._batch = None
        cap = self.config.coordinator.decide_pass_max
        batch, self._queued = self._queued[:cap], self._queued[cap:]
        if self._queued:
            self._start_pass(behind=True)
        traced = BatchSpans.of(batch)    # None unless tracing is on and a request carries a traceparent
        try:
            replies: list[Any] = [None] * len(batch)
            reqs: list[Any] = [None] * len(batch)
            todo: list[int] = []
            decisions: list[Callable[[Any], tuple[Any, list[Any]]]] = []
            for i, (op, msg, _) in enumerate(batch):
                req = self._request(op, msg)
                if isinstance(req, WorkerResume) and req.parts > 1:
                    req = self._assemble(req)   # the whole inventory, or already the answer to one part
                reqs[i] = req
                if isinstance(req, (ErrorReply, ResumeReply)):
                    replies[i] = req
                else:
                    todo.append(i)
                    decisions.append(self._decision(op, req) if traced is None
                                     else traced.timed(i, self._decision(op, req)))
            if decisions:
                try:
                    results: list[Any] = await self.ledger.execute_all(decisions)
                except Unavailable as e:
                    results = [e] * len(decisions)
                except Exception as e:  # noqa: BLE001 - every request is answered, whatever went wrong
                    self.log.error("requests_failed", requests=len(decisions), error_type=type(e).__name__,
                                   exc_info=True)
                    results = [Unavailable("internal error; retry")] * len(decisions)
                if traced is not None:
                    traced.committed(todo)
                for i, r in zip(todo, results):
                    replies[i] = self._reply_of(batch[i][0], r)
            for i, ((op, msg, t0), req, reply) in enumerate(zip(batch, reqs, replies)):
                if isinstance(req, WorkerResume):
                    self._resume_answered(req, reply)
                await self._answer(op, msg, t0, reply)
                held = self._disowned.pop(id(req), None) if isinstance(req, WorkerRegister) else None
                # durable: tell the holders (also when the disown only retired EVICTED copies, which a
                # holder may still be copying down a tier: ``reply.disowned`` counts the live ones)
                if held and isinstance(reply, RegisterReply):
                    task = asyncio.create_task(self._notify_disowned(req.worker_id, held))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                if traced is not None:
                    traced.answered(i, req, reply)
        finally:
            if traced is not None:
                traced.close()
            for _ in batch:
                self._slots.release()

    def _reply_of(self, op: _Op, result: Any) -> Any:
        """A decision's reply, or the ErrorReply for what it raised."""
        if not isinstance(result, Exception):
            return result
        if isinstance(result, Unavailable):
            return ErrorReply(code=result.code, message=str(result)[:1000], retry_after_ms=result.retry_after_ms)
        if isinstance(result, CoreError):
            return ErrorReply(code=ErrorCode.INVALID, message=str(result)[:1000])
        # every request is answered, whatever went wrong
        self.log.error("request_failed", op=op.name, error_type=type(result).__name__,
                       exc_info=(type(result), result, result.__traceback__))
        return ErrorReply(code=ErrorCode.UNAVAILABLE, message="internal error; retry", retry_after_ms=500)

    def _resume_answered(self, req: WorkerResume, reply: Any) -> None:
        if isinstance(reply, ErrorReply) and reply.code is not ErrorCode.UNAVAILABLE:
            # a refused resume changes nothing in the log; an operator still wants to see it
            self.log.warning("resume_refused", worker_id=req.worker_id, epoch=req.epoch, code=reply.code.value,
                             reason=reply.message[:300])
        elif isinstance(reply, ResumeReply):
            self.log.info("worker_resumed", worker_id=req.worker_id, epoch=req.epoch, kept=reply.kept,
                          dropped=len(reply.drop) // REPLICA_DIGEST_BYTES)

    async def _answer(self, op: _Op, msg: Msg, t0: float, reply: Any) -> None:
        outcome = reply.code.value if isinstance(reply, ErrorReply) else "ok"
        count, latency = self._series(op.name, outcome)
        count.inc()
        latency.observe(time.perf_counter() - t0)
        if not msg.reply:
            self.log.warning("request_without_reply_subject", op=op.name)
            return
        try:
            await msg.respond(encode(reply))
        except Exception as e:  # noqa: BLE001 - the requester may be gone; nothing to do but say so
            self.log.warning("reply_failed", op=op.name, error=str(e))

    def _series(self, op: str, outcome: str) -> tuple[Any, Any]:
        """The request counter and latency histogram of ``(op, outcome)`` (labelled once: a
        ``labels()`` lookup takes a lock and builds a key on every call)."""
        key = (op, outcome)
        series = self._request_series.get(key)
        if series is None:
            series = self._request_series[key] = (self.metrics.requests.labels(op=op, outcome=outcome),
                                                  self.metrics.request_latency.labels(op=op, outcome=outcome))
        return series
    # --- inventory, control (the watermarks: transition_consumer) ------------------------
    async def inventory(self, worker_id: str, timeout_s: float | None = None, *, digests: bool = False,
                        disk: list[Any] | None = None, page_bytes: int = 0) -> InventoryReply | str:
        """Ask a worker what it holds; the reply, or why there is none. ``digests``: its replica
        digests, every page fetched (within ``timeout_s`` in all) and joined into one reply;
        ``disk``: a disk check of those replicas instead (see :class:`InventoryRequest`)."""
        deadline = time.monotonic() + (timeout_s or self.request_timeout_s)
        req = InventoryRequest(request_id=f"audit-{secrets.token_hex(6)}", digests=digests and not disk,
                               page_bytes=page_bytes, disk=list(disk or ()))
        pages: list[bytes] = []
        first: InventoryReply | None = None
        while True:
            try:
                msg = await self.nc.request(self.subjects.inventory(worker_id), encode(req),
                                            timeout=max(0.05, deadline - time.monotonic()))
            except nats.errors.NoRespondersError:
                return "no responders"
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                return "timed out" if not pages else f"timed out after page {len(pages)}"
            except ValueError:
                return "worker id is not a subject token"
            try:
                reply = decode(msg.data, expect=(InventoryReply, ErrorReply))
            except MessageError as e:
                return f"malformed inventory reply ({error_kind(e)})"
            if isinstance(reply, ErrorReply):
                return f"inventory refused ({reply.code.value}: {reply.message[:200]})"
            if not req.digests or reply.pages == 1 and reply.page == 0:
                return reply  # type: ignore[no-any-return]
            if reply.page != len(pages) or (first is not None and reply.pages != first.pages):
                return f"inventory page {reply.page} of {reply.pages} out of order"
            first = first or reply
            pages.append(reply.digests)
            if len(pages) == reply.pages:
                return msgspec.structs.replace(first, digests=b"".join(pages), page=0, pages=1)
            req = msgspec.structs.replace(req, page=len(pages))

    async def _notify_disowned(self, worker_id: str, held: dict[str, list[Control]]) -> None:
        """Other workers held copies of what ``worker_id`` disowned (reloads of its disk copies):
        the ledger has invalidated them; ``invalidate_blocks`` controls make each holder drop
        its copies (a holder that misses it finds the replica INVALID at its next
        lease, and the audit shows it). Sent together: the sooner a holder drops its copy,
        the less it serves from it (:func:`~coordinator.controls.send_controls` bounds how many)."""
        reason = f"copy of what worker {worker_id} disowned (its fused forwards differed)"
        held = {wid: [msgspec.structs.replace(c, reason=reason) for c in cs] for wid, cs in held.items()}
        results = await send_controls(self.control, held)
        self.log.info("disown_notified", worker_id=worker_id,
                      blocks=sum(len(c.blocks) for cs in held.values() for c in cs), results=results)

    async def control(self, worker_id: str, control: Control, timeout_s: float | None = None) -> str:
        """Send a control message; ``acked``, or why not (the ledger change stands either way)."""
        try:
            reply = await self.nc.request(self.subjects.control(worker_id), encode(control),
                                          timeout=timeout_s or self.request_timeout_s)
            return control_outcome(worker_id, reply.data)
        except nats.errors.NoRespondersError:
            return "no responders"
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            return "timed out"
        except ValueError:
            return "worker id is not a subject token"
