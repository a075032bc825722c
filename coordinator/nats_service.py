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
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from coordinator.core import (
    CoreError, Invalidated, TransitionRejected, acquire_lease, collect_disk, drop_controls, evict_host,
    ingest_transition, register_worker, release_lease, renew_lease, resume_worker,
)
from coordinator.controls import outcome as control_outcome, send_controls
from coordinator.ledger import Ledger, Unavailable
from coordinator.metrics import CoordinatorMetrics
from coordinator.request_trace import BatchSpans
from coordinator.stream import CONSUMER_NAME, StartupError, TransitionStream
from shared.messages import (
    CommitWatermark, Control, DiskGc, ErrorCode, ErrorReply, Heartbeat, HostEvict, InventoryReply, InventoryRequest, LeaseAcquire, LeaseRelease,
    LeaseRenew, MessageError, ResumeReply, RouteQuery, RouteReply, TransitionBatch, TransitionEvent, WorkerRegister, WorkerResume, decode,
    RegisterReply, encode, now_ms,
)
from shared import tracing
from shared.hashing import REPLICA_DIGEST_BYTES
from shared.subjects import COORDINATOR_QUEUE, Subjects

#: Redelivery of a message not acked in time (a commit takes milliseconds; statements time out in seconds).
ACK_WAIT_S = 10.0


def new_lease_id() -> str:
    return "l" + secrets.token_hex(8)


def error_kind(e: MessageError) -> str:
    """What was wrong with a message's shape, without repeating any of its content."""
    text = str(e)
    for prefix, kind in (("not a kvledger message", "not_json_object"), ("unknown message type", "unknown_type"),
                         ("expected a message of type", "wrong_type"),
                         ("transition of worker", "identity_mismatch")):
        if text.startswith(prefix):
            return kind
    return "bad_version" if "schema version" in text else "invalid_fields"


async def _or_unavailable(decided: Any) -> Any:
    """The results of ``ledger.execute_all``, or None when the ledger cannot commit (nak, redeliver)."""
    try:
        return await decided
    except Unavailable:
        return None


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
#: Refused host-tier copies and GPU commits one watermark names at most (the newest; see
#: CommitWatermark.refused).
MAX_REFUSED = 4096
MAX_PENDING_RESUMES = 1024
#: Answered inline by :meth:`Ledger.heartbeat` (nothing to decide or commit).
_HEARTBEAT = _Op("heartbeat", Heartbeat, lambda req: lambda s: (None, []))
#: Answered inline by :meth:`Ledger.route` (read-only).
_ROUTE = _Op("route", RouteQuery, lambda req: lambda s: (None, []))


def _stored_behind(msg: Msg) -> int:
    """How many messages the broker held for the consumer after ``msg`` when it delivered it."""
    try:
        return max(0, int(msg.metadata.num_pending))
    except (nats.errors.NotJSMessageError, ValueError):   # not a JetStream delivery: nothing known behind it
        return 0


class NatsService:
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

    # --- JetStream ------------------------------------------------------------------------

    async def ensure_stream(self) -> None:
        """Create the transitions stream, or verify (and bring up to date) an existing one."""
        await self.stream.ensure()

    async def purge_acknowledged(self) -> int:
        """Purge what the consumer has acknowledged (:meth:`TransitionStream.purge_acknowledged`)."""
        return await self.stream.purge_acknowledged()

    def _consumer_config(self, start_seq: int = 0) -> ConsumerConfig:
        batch_max = self.config.coordinator.commit_batch_max
        return ConsumerConfig(
            durable_name=CONSUMER_NAME, name=CONSUMER_NAME, ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE if start_seq else DeliverPolicy.ALL,
            opt_start_seq=start_seq or None, filter_subject=self.subjects.events_wildcard,
            # Longer than a commit takes (statement timeouts are seconds); redelivery is harmless.
            ack_wait=ACK_WAIT_S, max_deliver=-1, max_ack_pending=max(4 * batch_max, 1000))

    async def start_consumer(self) -> None:
        """Create (or bind to) the durable pull consumer and start the (paused) fetch loop."""
        stream = self.subjects.stream_name
        try:
            info = await self.js.consumer_info(stream, CONSUMER_NAME)
        except nats.js.errors.NotFoundError:
            await self.js.add_consumer(stream, self._consumer_config())
            self.log.info("consumer_created", consumer=CONSUMER_NAME, ack="explicit", ack_wait_s=ACK_WAIT_S,
                          max_deliver=-1)
        else:
            if info.config.ack_policy != AckPolicy.EXPLICIT:
                raise StartupError(f"JetStream consumer {CONSUMER_NAME} on {stream} does not use explicit acks; "
                                   "delete it and let the coordinator create it")
        self._psub = await self.js.pull_subscribe_bind(durable=CONSUMER_NAME, stream=stream)
        self._consumer = asyncio.create_task(self._consume(), name="transition-consumer")
        self._publisher = asyncio.create_task(self._publish_watermarks(), name="watermark-publisher")
        if self.config.nats.stream_purge_interval_s:
            self._purger = asyncio.create_task(self.stream.purge_loop(
                float(self.config.nats.stream_purge_interval_s), lambda: self._pull.is_set() and self.ledger.serving),
                name="stream-purger")

    async def reclaim_in_flight(self) -> int:
        """After a takeover: have deliveries the previous leader never acked redelivered now.

        A crashed coordinator's un-acked messages would otherwise wait out ``ack_wait``, and a
        worker's republish does not help (the broker drops it as a duplicate Nats-Msg-Id), so
        watermarks would stall. The consumer is recreated to start at its ack floor + 1;
        messages above the floor that were acked are delivered again and absorbed as duplicates.

        A reclaim cut short after its delete (a broker timeout right after a long stall: found by
        the stall-past-grace drill) left no consumer, and every later fetch and reclaim failed, so
        nothing was committed again. The next reclaim then finds none and creates it, from where
        the cut one meant to start (or the stream's start: what is delivered twice is absorbed).
        """
        stream = self.subjects.stream_name
        try:
            info = await self.js.consumer_info(stream, CONSUMER_NAME)
        except nats.js.errors.NotFoundError:
            start, unacked = self._reclaim_from or 0, 0
        else:
            if not info.num_ack_pending:
                return 0
            start = (info.ack_floor.stream_seq if info.ack_floor else 0) + 1
            unacked = int(info.num_ack_pending)
            self._reclaim_from = start
            await self.js.delete_consumer(stream, CONSUMER_NAME)
        await self.js.add_consumer(stream, self._consumer_config(start_seq=start))
        self._reclaim_from = None
        old, self._psub = self._psub, await self.js.pull_subscribe_bind(durable=CONSUMER_NAME, stream=stream)
        if old is not None:
            with contextlib.suppress(Exception):
                await old.unsubscribe()
        self.log.info("consumer_reclaimed", unacked=unacked, redeliver_from_stream_seq=start or 1)
        return unacked

    def resume_consumer(self) -> None:
        self._pull.set()

    def pause_consumer(self) -> None:
        self._pull.clear()

    async def stop_consumer(self) -> None:
        self._pull.clear()
        for task in (self._consumer, self._publisher, self._purger):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._consumer = self._publisher = self._purger = None
        if self._psub is not None:
            with contextlib.suppress(Exception):
                await self._psub.unsubscribe()
            self._psub = None

    async def _consume(self) -> None:
        most = self.config.coordinator.commit_batch_max
        # NOTE: at most as many transitions in flight (fetched, not yet acked) as the consumer's
        # max_ack_pending allows messages: a message may be a worker's batch of up to 1000
        # transitions, and a backlog was otherwise fetched as fast as the broker handed it over,
        # hundreds of thousands of transitions held at once.
        bound = max(4 * most, 1000)
        # transitions per message as last seen; at first, what a worker of this config sends
        per_message = float(self.config.worker.publish_batch)
        last_error = ""
        while True:
            await self._pull.wait()
            if not self.ledger.serving:
                await asyncio.sleep(0.05)
                continue
            while self._ingesting >= bound:
                self._ingest_room.clear()
                await self._ingest_room.wait()
            batch = max(1, min(1000, int((bound - self._ingesting) / per_message)))
            try:
                # NOTE: fetch(n) with n > 1 waits for n messages or its timeout once the first has
                # arrived: nats-py asks for what is stored, and when that is fewer than n it pulls
                # again and lingers until the timeout. So: wait for one, then ask only for as many
                # as the broker says are stored behind it (its num_pending), which it hands over at
                # once. Asking for batch - 1 with a 0.05 s timeout held a lone batch up to that long,
                # and with it a request's close (the commit watermark it waits for): 41 ms on average
                # at c = 1 of the quick serving bench, a third of each request (BENCHMARKS.md, stop 47).
                msgs = await self._psub.fetch(batch=1, timeout=1.0)
                more = min(batch - 1, _stored_behind(msgs[-1]))
                if more > 0:
                    with contextlib.suppress(nats.errors.TimeoutError, asyncio.TimeoutError):
                        msgs += await self._psub.fetch(batch=more, timeout=0.05)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                continue
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - broker trouble: wait and try again
                if str(e) != last_error:
                    self.log.warning("consumer_fetch_failed", error=f"{type(e).__name__}: {e}")
                last_error = str(e)
                await asyncio.sleep(0.5)
                continue
            last_error = ""
            if msgs:
                taken, malformed = self._decode_transitions(msgs)
                n = sum(len(ts) for _, ts in taken)
                per_message = max(n, 1) / len(msgs)
                self._ingesting += n
                # One task per fetched batch. Tasks start in creation order and decide before
                # their first real wait, so transitions are decided (and logged) in the order
                # they were fetched; a batch's decisions commit together (group commit still
                # joins batches while a commit is in flight).
                task = asyncio.create_task(self._ingest(taken, malformed))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                task.add_done_callback(lambda _, n=n, bound=bound: self._ingested(n, bound))
                with contextlib.suppress(Exception):
                    self.metrics.consumer_lag.set(msgs[-1].metadata.num_pending)

    def _ingested(self, n: int, bound: int) -> None:
        self._ingesting -= n
        if self._ingesting < bound:
            self._ingest_room.set()

    def _decode_transitions(self, msgs: list[Msg]) -> tuple[list[tuple[Msg, list[TransitionEvent]]], list[Msg]]:
        """Each message's transitions (one, or a worker's batch), and the messages that are not
        valid transitions from the worker whose subject they came on."""
        taken: list[tuple[Msg, list[TransitionEvent]]] = []
        malformed: list[Msg] = []
        for msg in msgs:
            try:
                t = decode(msg.data, expect=(TransitionEvent, TransitionBatch))
                if msg.subject != self.subjects.events(t.worker_id):
                    self.metrics.forbidden.labels(op="transition").inc()
                    raise MessageError(f"transition of worker {t.worker_id} arrived on another worker's subject")
            except Exception as e:  # noqa: BLE001 - a message that cannot be decoded is terminated, never redelivered
                kind = (error_kind(e) if isinstance(e, MessageError) else "bad_worker_id" if isinstance(e, ValueError)
                        else "undecodable")
                if kind != "identity_mismatch":   # that one is counted as forbidden
                    self.metrics.malformed.labels(kind="transition").inc()
                self.log.warning("malformed_transition", size=len(msg.data), error_kind=kind)
                malformed.append(msg)
                continue
            # a batch's transitions all speak for its worker and epoch (TransitionBatch checks it)
            ts = t.events if isinstance(t, TransitionBatch) else [t]
            self.metrics.transition_messages.observe(len(ts))
            taken.append((msg, ts))
        return taken, malformed

    async def _ingest(self, taken: list[tuple[Msg, list[TransitionEvent]]], malformed: list[Msg]) -> None:
        """Decide fetched transitions in order; ack each message once all its transitions are
        committed. A message whose transitions could not all be committed is nak'ed whole: those
        of them already in the ledger come back as duplicates, which the ledger drops."""
        items = [t for _, ts in taken for t in ts]
        results: list[Any] = []
        if items:
            now = now_ms()
            decisions = [lambda s, t=t: ((evs := ingest_transition(s, t, now)), evs) for t in items]
            most = self.config.coordinator.commit_batch_max
            # NOTE: more than commit_batch_max decisions (workers' batches) go in pieces, each its own
            # task: tasks start in creation order and decide before their first wait, so the order
            # holds, and requests are answered between pieces.
            pieces = [decisions[i:i + most] for i in range(0, len(decisions), most)]
            if len(pieces) == 1:
                outs: list[Any] = [await _or_unavailable(self.ledger.execute_all(decisions))]
            else:
                outs = await asyncio.gather(*(asyncio.ensure_future(_or_unavailable(self.ledger.execute_all(p)))
                                              for p in pieces))
            for piece, out in zip(pieces, outs):
                results.extend([None] * len(piece) if out is None else out)
        counts: dict[str, int] = {"malformed": len(malformed)} if malformed else {}
        for msg in malformed:
            with contextlib.suppress(Exception):
                await msg.term()  # can never be processed: do not redeliver
        at = 0
        for msg, ts in taken:
            outcome = results[at:at + len(ts)]
            at += len(ts)
            failed = [r for r in outcome if r is None or isinstance(r, Exception)]
            for r in failed:
                if r is not None:
                    self.log.error("transition_failed", error=f"{type(r).__name__}: {r}")
            for events in outcome:
                if events is None or isinstance(events, Exception):
                    continue
                result = ("duplicate" if not events else "rejected" if isinstance(events[0], TransitionRejected)
                          else "accepted")
                counts[result] = counts.get(result, 0) + 1
            if failed:
                with contextlib.suppress(Exception):
                    await msg.nak(delay=1.0)
                continue
            try:
                await msg.ack()
            except Exception as e:  # noqa: BLE001 - the ack is lost: JetStream redelivers, the log deduplicates
                self.log.warning("ack_failed", error=str(e))
        for result, n in counts.items():
            self.metrics.events_ingested.labels(result=result).inc(n)

    # --- watermarks, inventory, control ---------------------------------------------------

    def publish_watermarks(self, marks: dict[tuple[str, int], int],
                           refused: dict[tuple[str, int], list[int]] | None = None) -> None:
        """Called after each commit (synchronously); a task sends them."""
        for k, v in marks.items():
            if v > self._marks.get(k, -1):
                self._marks[k] = v
        for k, seqs in (refused or {}).items():
            self._refused.setdefault(k, []).extend(seqs)
        self._marks_ready.set()

    async def _publish_watermarks(self) -> None:
        while True:
            await self._marks_ready.wait()
            self._marks_ready.clear()
            marks, self._marks = self._marks, {}
            refused, self._refused = self._refused, {}
            for (worker, epoch), seq in marks.items():
                # NOTE: a watermark is not redelivered; a refusal it loses leaves the worker holding
                # a copy the ledger does not list, which the audit reports (bounded per message)
                gone = refused.get((worker, epoch), [])[-MAX_REFUSED:]
                try:
                    await self.nc.publish(self.subjects.watermark(worker), encode(
                        CommitWatermark(worker_id=worker, epoch=epoch, seq=seq, refused=gone)))
                except ValueError:
                    self.log.warning("watermark_not_published", reason="worker id is not a subject token")
                except Exception as e:  # noqa: BLE001 - the heartbeat reply carries it too
                    self.log.warning("watermark_publish_failed", error=str(e))

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
