"""The shell around the pure core: live state, decide → apply → append → answer.

Theory of operation
-------------------

Every change goes through :meth:`Ledger.execute`: the core decides against the live state
(``reply, events = command(state, …)``), the events are applied to the live state at once
and queued for the log (group commit), and the caller is answered only after the batch
holding them has committed. Decide, apply and queue happen without an ``await`` in
between, so in this single-threaded event loop they are atomic, and the log order is the
order in which events were applied. Later decisions see earlier effects immediately,
which is what lets many requests share one transaction.

A call that produces no events still waits for the latest queued batch (:meth:`barrier`):
its answer was computed from a state that may include not-yet-durable events, so it must
not be sent before they are durable either.

If an append fails, the live state holds events the log does not: every waiting caller
is answered UNAVAILABLE, the state is rebuilt from the log (snapshot + replay), and only
then does the ledger serve again. ``NotLeader`` means another coordinator has taken over:
the ledger stops and tells its owner to step down.

Snapshots and audits *freeze* the ledger briefly (``coordinator.ledger_snapshots``): new
decisions wait, queued events are flushed, and then the live state equals the log up to
:attr:`position` exactly.

Heartbeats never wait: they change nothing durable (liveness is soft state, :attr:`seen`;
only the decisions taken from it — suspended, lost — are logged), so they are answered at
once from the live state with the *durable* commit watermark (:attr:`durable`: what the
worker may drop from its outbox must already be in the log, not merely applied).

A standby *follows* the log (:meth:`follow`): it folds the leader's events as they are
committed, so a takeover reads only the last few instead of replaying.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from coordinator.core import (
    EVENT_TYPES, CoreParams, LedgerState, TransitionApplied, TransitionRejected, apply, encode_event, heartbeat,
    resume, stream_of,
)
from coordinator.log.groupcommit import GroupCommitter, Submission
from coordinator.ledger_snapshots import LedgerSnapshots
from coordinator.log.port import EventLog, LogError, NewEvent, NotLeader
from coordinator.metrics import CoordinatorMetrics
from coordinator.replay import LogCorrupt, load_state
from coordinator.snapshot_child import can_fork
from coordinator.core.rejections import coalesce_rejections, strands_bytes
from coordinator.rejection_hold import RejectionHold
from coordinator.core.route import route
from coordinator.unavailable import Unavailable
from shared.messages import (
    CacheCounters, ErrorCode, ErrorReply, Heartbeat, HeartbeatReply, RouteQuery, RouteReply, now_ms,
)

R = TypeVar("R")
#: Most gateways the status page lists (route queries come only from authorised gateway identities).
MAX_GATEWAYS_SHOWN = 256
Decision = Callable[[LedgerState], tuple[R, list[Any]]]
#: After a commit: ``{(worker_id, epoch): committed contiguous seq}``, and
#: ``{(worker_id, epoch): [seq, …]}`` of the copies to a host tier and the GPU commits among them
#: that the ledger refused (the worker holds bytes the ledger does not list: it drops them;
#: ``core.rejections.strands_bytes``).
WatermarkHook = Callable[[dict[tuple[str, int], int], dict[tuple[str, int], list[int]]], None]

#: Ledger event type → its tag (``__struct_config__`` builds a new object on every access).
_TAGS: dict[type, str] = {t: tag for tag, t in EVENT_TYPES.items()}
_SOURCED = (TransitionApplied, TransitionRejected)


def to_new_event(e: Any) -> NewEvent:
    t = type(e)
    return NewEvent(stream_of(e), _TAGS[t], encode_event(e), e.source_id if t in _SOURCED else None)


class Ledger(LedgerSnapshots):
    #: standby (not leader) | recovering (replaying) | serving | degraded (rebuilding) | stopped
    status: str

    def __init__(self, log: EventLog, params: CoreParams, *, batch_ms: float, batch_max: int,
                 snapshot_every: int, metrics: CoordinatorMetrics, logger: Any,
                 on_watermarks: WatermarkHook | None = None,
                 on_not_leader: Callable[[str], None] | None = None, progress_every: int = 50_000,
                 snapshot_fork: bool = True, snapshot_timeout_s: float = 300.0,
                 rejection_interval_ms: int = 0) -> None:
        self.log = log
        self.params = params
        self.batch_ms = batch_ms
        self.batch_max = batch_max
        self.snapshot_every = snapshot_every
        #: Serialise snapshots in a forked child (``coordinator.snapshot_child``) where the OS can.
        self.snapshot_fork = snapshot_fork and can_fork()
        self.snapshot_timeout_s = snapshot_timeout_s
        self.metrics = metrics
        self.logger = logger
        self.on_watermarks = on_watermarks
        self.on_not_leader = on_not_leader
        self.progress_every = progress_every
        self.status = "standby"
        self.reason = "not started"
        self.state = LedgerState.empty(params)
        self.position = 0
        self.epoch = 0
        self.committer: GroupCommitter | None = None
        self._open = asyncio.Event()
        self._open.set()
        self._freeze_lock = asyncio.Lock()
        self._rebuild: asyncio.Task[None] | None = None
        self._snapshotting: asyncio.Task[Any] | None = None
        self._since_snapshot = 0
        self.last_replay: dict[str, Any] = {}
        #: The last archived log position, as last read (at a load, a snapshot, a summary); 0 = none.
        self.archived_upto = 0
        #: ``(worker, epoch)`` → highest contiguous transition seq known to be committed.
        self.durable: dict[tuple[str, int], int] = {}
        #: ``(worker, epoch)`` → when it last heartbeat (soft state: never logged, lost on restart).
        self.seen: dict[tuple[str, int], int] = {}
        #: worker → (running, queued) requests of its last heartbeat (soft state for route answers).
        self.load: dict[str, tuple[int, int]] = {}
        #: worker → (epoch, prefix-cache counters) of its last heartbeat that carried them (soft
        #: state for the status page; one entry per worker id, so it stays bounded).
        self.cache_counters: dict[str, tuple[int, CacheCounters]] = {}
        #: worker -> (epoch, device, dtype, cache dtype) from its heartbeats (the status page's).
        self.devices: dict[str, tuple[int, str, str, str]] = {}
        #: gateway -> when its latest route query arrived (ms): the gateways the status page lists.
        self.gateways: dict[str, int] = {}
        #: When this process took the lead (``seen`` starts empty then).
        self.took_over_ms = 0
        #: True while :attr:`state` is the log folded up to :attr:`position` (a standby following it).
        self._following = False
        #: Whether this process may still speak for the ledger without writing (see
        #: ``LeaderElection.confirmed``); appends are fenced by the epoch instead.
        self.leadership_confirmed: Callable[[], bool] = lambda: True
        #: Refusals held for the next row of their worker epoch and kind (``coordinator.rejection_hold``).
        self.rejections = RejectionHold(rejection_interval_ms, self._flush_rejections)

    @property
    def serving(self) -> bool:
        return self.status == "serving"

    # --- leadership -------------------------------------------------------------------------

    async def take_over(self, epoch: int) -> None:
        """Load the state (snapshot + tail), open the commit queue with ``epoch``, record the takeover."""
        self.epoch = epoch
        self.set_status("recovering", "replaying the log")
        # A standby that followed the log folds only the tail the old leader wrote last.
        incremental, self._following = self._following, False
        await self._load(incremental=incremental)
        self.seen.clear()
        self.load.clear()
        self.cache_counters.clear()
        self.devices.clear()
        self.gateways.clear()
        self.took_over_ms = now_ms()
        self.committer = GroupCommitter(self.log, batch_ms=self.batch_ms, batch_max=self.batch_max,
                                        leader_epoch=epoch, on_commit=self._on_commit,
                                        on_failure=self._on_failure, on_batch=self.metrics.on_batch)
        self.committer.start()
        self.set_status("serving", "")
        await self.execute(lambda s: (None, resume(s, now_ms())))

    async def stand_down(self, reason: str, *, flush: bool = True, status: str = "standby") -> None:
        """Stop deciding; commit what is queued (``flush``) or fail it; waiters get UNAVAILABLE.

        ``status``: ``standby`` (another coordinator leads: callers hear NOT_LEADER) or
        ``degraded`` (nobody can lead right now, e.g. PostgreSQL is gone: UNAVAILABLE).
        """
        if self.status != "stopped":
            self.set_status(status, reason)
        self.rejections.fail_all(Unavailable(f"coordinator is {self.status}: {reason}"))
        if self._rebuild is not None:
            self._rebuild.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._rebuild
            self._rebuild = None
        if self.committer is not None:
            await self.committer.close(flush=flush)
            self.committer = None
        self.epoch = 0
        self.metrics.leader_epoch.set(0)

    def set_status(self, status: str, reason: str) -> None:
        if status != self.status:
            self.logger.info("ledger_status", status=status, previous=self.status, reason=reason or None,
                             leader_epoch=self.epoch, position=self.position)
        self.status = status
        self.reason = reason
        self.metrics.leader.set(1 if status == "serving" else 0)
        self.metrics.leader_epoch.set(self.epoch)

    async def _load(self, incremental: bool = False) -> None:
        start = (self.state, self.position) if incremental else None
        if not incremental:
            self._following = False
        result = await load_state(self.log, self.params, logger=self.logger, progress_every=self.progress_every,
                                  start=start, what="catch_up" if incremental else "replay")
        self.state = result.state
        self.position = result.position
        self.durable = {k: wm.contiguous for k, wm in self.state.watermarks.items()}
        self._since_snapshot = result.events if start is None else self._since_snapshot + result.events
        self.metrics.replay_seconds.set(result.seconds)
        self.metrics.replay_events.set(result.events)
        self.metrics.log_position.set(self.position)
        self.last_replay = {"events": result.events, "seconds": round(result.seconds, 3),
                            "position": result.position, "snapshot_position": result.snapshot_position}
        await self.read_archived()

    async def read_archived(self) -> None:
        """How far an operator has archived the log (``kvledger log archive``): for the status and
        the metric only, so a failure to read it changes nothing."""
        try:
            self.archived_upto = await self.log.archived_upto()
        except LogError:
            return
        self.metrics.log_archived.set(self.archived_upto)

    async def follow(self, stop: asyncio.Event, interval_s: float = 0.2) -> None:
        """While standby: fold what the leader commits, every ``interval_s``, until ``stop`` is set
        (a catch-up under way is finished first, so a takeover continues from it).

        NOTE: positions are contiguous and appends are serialised by the leader row lock, so
        reading past :attr:`position` never skips an event that commits later.
        """
        last_error = ""
        while not stop.is_set():
            try:
                if self._following:
                    # NOTE: not "following" until the catch-up completes: one cancelled halfway (a
                    # takeover) leaves the state past :attr:`position`, and must not be continued.
                    self._following = False
                    result = await load_state(self.log, self.params, start=(self.state, self.position))
                    self.position = result.position
                    self._following = True
                    self.metrics.log_position.set(self.position)
                else:
                    await self._load()
                    self._following = True
                    self.logger.info("following_log", position=self.position)
                last_error = ""
            except (LogError, LogCorrupt, OSError) as e:
                self._following = False
                if str(e) != last_error:
                    self.logger.warning("follow_failed", error=str(e), action="retrying")
                last_error = str(e)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)

    # --- liveness: soft state, answered at once ----------------------------------------------

    def heartbeat(self, msg: Heartbeat) -> HeartbeatReply | ErrorReply:
        """A worker's heartbeat: no event, no wait (see the module docstring)."""
        self.check_serving()
        if not self.leadership_confirmed():
            # NOTE: nothing is appended, so no epoch check fences this answer: a leader that was
            # paused (or starved) past its renewal may already be replaced.
            raise Unavailable("leadership not confirmed recently (renewal pending); retry")
        now = now_ms()
        reply, _ = heartbeat(self.state, msg, now)
        if isinstance(reply, ErrorReply):
            return reply
        key = (msg.worker_id, msg.epoch)
        self.seen[key] = now
        self.load[msg.worker_id] = (msg.running, msg.queued)
        if msg.cache is not None:
            self.cache_counters[msg.worker_id] = (msg.epoch, msg.cache)
        if msg.device:
            self.devices[msg.worker_id] = (msg.epoch, msg.device, msg.dtype, msg.cache_dtype)
        return HeartbeatReply(committed_seq=self.durable.get(key, 0))

    def route(self, query: RouteQuery) -> RouteReply:
        """A gateway's route query, answered from the live state (``coordinator.core.route``):
        no event, no wait. Workers count only while their current epoch heartbeats."""
        self.check_serving()
        now = now_ms()
        # NOTE: bounded: only identities NATS lets ask on their own route subject get here
        if query.gateway_id in self.gateways or len(self.gateways) < MAX_GATEWAYS_SHOWN:
            self.gateways[query.gateway_id] = now
        horizon = self.state.params.heartbeat_timeout_ms
        fresh = {w for (w, epoch), t in self.seen.items()
                 if now - t <= horizon and (r := self.state.workers.get(w)) is not None and r.epoch == epoch}
        # a worker that registered a moment ago has not heartbeat yet; nor has any to a leader that
        # took over a moment ago (its log says they are alive: until they are overdue, they are)
        fresh |= {w.worker_id for w in self.state.workers.values()
                  if now - max(w.registered_at_ms, self.took_over_ms) <= horizon}
        return route(self.state, query, fresh, self.load)

    # --- the one way to change state -------------------------------------------------------

    def check_serving(self) -> None:
        if self.status != "serving":
            code = ErrorCode.NOT_LEADER if self.status in ("standby", "stopped") else ErrorCode.UNAVAILABLE
            raise Unavailable(f"coordinator is {self.status}" + (f": {self.reason}" if self.reason else ""), code)

    async def execute(self, decide: Decision[R]) -> R:
        """Decide with the core, apply at once, answer after the commit (see module docstring).

        Raises :class:`Unavailable` when the ledger is not serving or the commit failed, and
        lets the core's own errors (``CoreError``) through for the caller to report.
        """
        self.check_serving()
        if not self._open.is_set():
            await self._open.wait()
            self.check_serving()
        committer = self.committer
        assert committer is not None
        reply, events = decide(self.state)
        fut: asyncio.Future[Any] | None
        if events:
            try:
                for event in events:
                    apply(self.state, event)
            except Exception as e:  # noqa: BLE001 - a core bug: the live state may be half-applied
                self.logger.error("apply_failed", error=str(e), event_type=type(event).__name__)
                self._degrade(f"live state inconsistent after a failed apply: {e}")
                raise Unavailable("internal error while applying a decision; rebuilding from the log") from e
            fut = committer.submit([to_new_event(e) for e in events], context=self._watermarks_after(events))
        else:
            fut = committer.barrier()
        await self._durable(fut)
        return reply

    async def execute_all(self, decisions: Sequence[Decision[R]]) -> list[R | Exception]:
        """Several decisions, taken in order exactly as :meth:`execute` would take them one after
        another, made durable by one submission (one future, one wake-up for all of them).

        For the transition consumer: per message, a task and a commit future cost more than
        deciding the transition itself. A decision that raises changed nothing (commands are
        pure): its exception takes its place in the result and the others go on. Raises
        :class:`Unavailable` (for all of them) as :meth:`execute` does.
        """
        self.check_serving()
        if not self._open.is_set():
            await self._open.wait()
            self.check_serving()
        committer = self.committer
        assert committer is not None
        state = self.state
        out: list[R | Exception] = []
        decided: list[Any] = []
        held: list[asyncio.Future[None]] = []
        logging_now: set[tuple[str, int, str]] = set()   # keys whose row this pass writes
        for decide in decisions:
            try:
                reply, events = decide(state)
            except Exception as e:  # noqa: BLE001 - reported in its place
                out.append(e)
                continue
            if len(events) == 1 and type(events[0]) is TransitionRejected:
                # NOTE: not applied, not logged: held for its key's next row (rejection_hold),
                # unless this pass logs a row of its key anyway (coalesce_rejections joins them)
                key = self.rejections.key(events[0])
                if key not in logging_now:
                    wait = self.rejections.hold(events[0])
                    if wait is not None:
                        held.append(wait)
                        out.append(reply)
                        continue
                    logging_now.add(key)
            if events:
                try:
                    for event in events:
                        apply(state, event)
                except Exception as e:  # noqa: BLE001 - a core bug: the live state may be half-applied
                    self.logger.error("apply_failed", error=str(e), event_type=type(event).__name__)
                    self._degrade(f"live state inconsistent after a failed apply: {e}")
                    raise Unavailable("internal error while applying a decision; rebuilding from the log") from e
                decided.extend(events)
            out.append(reply)
        if decided:
            # NOTE: the rejections of one worker epoch and kind become one row (core.rejections);
            # the watermarks and refusals are the individual events' (they were applied one by one)
            fut = committer.submit([to_new_event(e) for e in coalesce_rejections(decided)],
                                   context=self._watermarks_after(decided))
        else:
            fut = committer.barrier()
        await self._durable(fut)
        for wait in held:
            await self._durable(wait)
        return out

    def _flush_rejections(self, key: tuple[str, int, str]) -> None:
        """The row of the refusals held for ``key`` (one worker epoch and kind): applied and
        queued like a decision (no await in between), its waiters answered once it is durable."""
        if self.serving and not self._open.is_set():
            # NOTE: frozen (a snapshot or an audit reads the state as the log has it): after it
            self.rejections.rearm(key, 0.05)
            return
        events, waiter = self.rejections.take(key)
        if waiter is None:
            return
        if not self.serving or self.committer is None:
            waiter.set_exception(Unavailable(f"coordinator is {self.status}; retry"))
            return
        wm = self.state.watermarks.get((key[0], key[1]))
        fresh: list[Any] = []
        seen: set[int] = set()
        for e in events:   # a redelivered refusal may be held twice; a seq may have been taken since
            if e.transition.seq not in seen and (wm is None or not wm.has(e.transition.seq)):
                seen.add(e.transition.seq)
                fresh.append(e)
        if not fresh:
            waiter.set_result(None)
            return
        row = coalesce_rejections(fresh)
        assert len(row) == 1, row
        try:
            apply(self.state, row[0])
        except Exception as e:  # noqa: BLE001 - a core bug: the live state may be half-applied
            self.logger.error("apply_failed", error=str(e), event_type="transition.rejected")
            waiter.set_exception(Unavailable("internal error while recording refusals"))
            self._degrade(f"live state inconsistent after a failed apply: {e}")
            return
        fut = self.committer.submit([to_new_event(row[0])], context=self._watermarks_after(fresh))

        def done(f: asyncio.Future[Any]) -> None:
            if waiter.done():
                return
            if f.cancelled() or f.exception() is not None:
                waiter.set_exception(Unavailable(f"refusals not logged: {f.exception() if not f.cancelled() else 'cancelled'}"))
            else:
                waiter.set_result(None)
        fut.add_done_callback(done)

    async def _durable(self, fut: asyncio.Future[Any] | None) -> None:
        """Wait for a submission (or barrier) to commit; log failures become :class:`Unavailable`."""
        if fut is not None:
            try:
                await asyncio.shield(fut)
            except NotLeader as e:
                raise Unavailable(f"not the leader any more: {e}", ErrorCode.NOT_LEADER) from e
            except LogError as e:
                raise Unavailable(f"event log unavailable: {e}") from e

    def barrier(self) -> asyncio.Future[Any] | None:
        return self.committer.barrier() if self.committer is not None else None

    def _watermarks_after(self, events: Sequence[Any]) -> tuple[dict[tuple[str, int], int],
                                                                 dict[tuple[str, int], list[int]]] | None:
        """The commit context: each worker epoch's watermark after ``events``, and its refused
        copies to a host tier and GPU commits (see :data:`WatermarkHook`)."""
        marks: dict[tuple[str, int], int] | None = None
        refused: dict[tuple[str, int], list[int]] = {}
        for e in events:
            if isinstance(e, (TransitionApplied, TransitionRejected)):
                t = e.transition
                k = (t.worker_id, t.epoch)
                marks = marks or {}
                marks[k] = self.state.committed_seq(t.worker_id, t.epoch)
                if isinstance(e, TransitionRejected) and strands_bytes(t):
                    refused.setdefault(k, []).append(t.seq)
        return None if marks is None else (marks, refused)

    # --- commit hooks (called by the group committer) --------------------------------------

    def _on_commit(self, batch: Sequence[Submission]) -> None:
        marks: dict[tuple[str, int], int] = {}
        refused: dict[tuple[str, int], list[int]] = {}
        stored = 0
        duplicate = False
        for sub in batch:
            for p in sub.positions:
                if p is None:
                    duplicate = True
                else:
                    stored += 1
                    self.position = max(self.position, p)
            if sub.context:
                for k, v in sub.context[0].items():
                    marks[k] = max(marks.get(k, 0), v)
                for k, seqs in sub.context[1].items():
                    refused.setdefault(k, []).extend(seqs)
        durable = self.durable
        for k, v in marks.items():
            if v > durable.get(k, 0):
                durable[k] = v
        self.metrics.log_position.set(self.position)
        if duplicate:
            # The core deduplicates by source id before the log does; if the log still found a
            # duplicate, the live state applied an event the log does not hold.
            self.logger.error("log_refused_duplicate_source", action="rebuilding live state from the log")
            self._degrade("the log held a source id the live state did not know")
        if marks and self.on_watermarks is not None:
            self.on_watermarks(marks, refused)
        self._since_snapshot += stored
        self._maybe_snapshot()

    def _on_failure(self, exc: BaseException) -> None:
        if isinstance(exc, NotLeader):
            self.set_status("standby", str(exc))
            if self.on_not_leader is not None:
                self.on_not_leader(str(exc))
            return
        self.logger.warning("append_failed", error=str(exc), action="answering UNAVAILABLE and rebuilding")
        self._degrade(f"append failed: {exc}")

    def _degrade(self, reason: str) -> None:
        if self.status not in ("serving", "degraded"):
            return
        self.set_status("degraded", reason)
        self.rejections.fail_all(Unavailable(reason))
        if self.committer is not None:
            self.committer.fail_pending(Unavailable(reason))
        if self._rebuild is None or self._rebuild.done():
            self._rebuild = asyncio.create_task(self._rebuild_loop(), name="ledger-rebuild")

    async def _rebuild_loop(self) -> None:
        delay = 0.05
        last = ""
        while self.status == "degraded":
            try:
                if self.committer is not None:
                    await self.committer.flush()
                await self._load()
            except (LogError, LogCorrupt, OSError) as e:
                if str(e) != last:
                    self.logger.warning("rebuild_waiting", error=str(e), retry_in_s=delay)
                last = str(e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            if self.status == "degraded":
                self.set_status("serving", "")
                self.logger.info("ledger_rebuilt", position=self.position)
            return
