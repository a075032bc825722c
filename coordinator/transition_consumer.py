"""The JetStream half of the coordinator's NATS service: the transitions consumer, its ingest, the watermarks."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from coordinator.core import TransitionRejected, ingest_transition
from coordinator.unavailable import Unavailable
from coordinator.stream import CONSUMER_NAME, StartupError
from shared.messages import CommitWatermark, MessageError, TransitionBatch, TransitionEvent, decode, encode, now_ms

#: Redelivery of a message not acked in time (a commit takes milliseconds; statements time out in seconds).
ACK_WAIT_S = 10.0
#: Refused host-tier copies and GPU commits one watermark names at most (the newest; see
#: CommitWatermark.refused).
MAX_REFUSED = 4096


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

def _stored_behind(msg: Msg) -> int:
    """How many messages the broker held for the consumer after ``msg`` when it delivered it."""
    try:
        return max(0, int(msg.metadata.num_pending))
    except (nats.errors.NotJSMessageError, ValueError):   # not a JetStream delivery: nothing known behind it
        return 0

class TransitionConsumer:
    """The JetStream methods of :class:`~coordinator.nats_service.NatsService`, a base class of it:
    the durable pull consumer that feeds workers' transitions to the ledger, and the commit
    watermarks sent back.

    NOTE: its state (``_psub``, ``_consumer``, ``_pull``, ``_ingesting``, ``_marks``, …) is set by
    ``NatsService.__init__`` with the rest of the service's: one object, its two halves read apart.
    """

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
