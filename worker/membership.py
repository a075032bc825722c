"""The worker's membership of the ledger: registration, heartbeats and resume, per shard.

:meth:`Membership.run` is one shard's contact task (the :class:`worker.supervisor.Supervisor`
runs one per :class:`worker.shard_links.ShardLink`): register (an epoch), heartbeat, and whenever
the coordinator or NATS is unreachable, the epoch is suspended or the outbox is full, keep the
worker *degraded* (``worker.contact``): every request is served by full recomputation while the
cache is *kept*. When the coordinator answers again the worker carries on with the same epoch: at
once if the ledger never suspended it, after a *resume* (its inventory, reconciled against the
log) if it did. Only a fenced epoch, or an outage longer than the coordinator's resume grace
period, makes it register a new epoch and drop that shard's GPU and host copies (the coordinator
has fenced them, or is about to).

A fused forward that differed at run time (:meth:`Membership.fused_mismatch`) makes every shard's
next registration disown what this worker computed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shared.forms import FormCatalogue
from shared.hashing import split_digests
from shared.messages import Heartbeat, WorkerRegister, WorkerResume
from worker.answers import Answers
from worker.cache.replicas import ReplicaWriter
from worker.cache.store import CacheStore
from worker.cache.tiers import Tiers
from worker.client import CoordinatorRefused, CoordinatorUnavailable
from worker.contact import Contact
from worker.metrics import WorkerMetrics
from worker.publisher import TransitionPublisher
from worker.shard_links import ShardLink, ShardLinks


class Membership:
    """Registration, heartbeats and resume with every shard (see the module's docstring)."""

    def __init__(self, *, links: ShardLinks | None, replicas: ReplicaWriter, store: CacheStore | None, tiers: Tiers,
                 answers: Answers, metrics: WorkerMetrics, log: Any, worker_id: str, namespace: str,
                 catalogue: FormCatalogue, slots: dict[str, int], device: str, dtype: str, cache_dtype: str,
                 state_dir: str) -> None:
        self.links = links
        self.replicas = replicas
        self.store = store
        self.tiers = tiers
        self.answers = answers
        self.metrics = metrics
        self.log = log
        self.worker_id = worker_id
        self.gpu = f"gpu:{worker_id}"
        self.namespace = namespace
        self.catalogue = catalogue
        self.slots = slots
        self.device = device
        self.dtype = dtype
        self.cache_dtype = cache_dtype
        #: The address gateways reach this worker at (set once the HTTP server is bound).
        self.endpoint = ""
        #: (running, queued) requests of the scheduler serving this engine, sent with each
        #: heartbeat (gateways weigh load with it); the scheduler installs its own.
        self.load_probe: Callable[[], tuple[int, int]] = lambda: (0, 0)
        #: A fused forward differed at run time: the next registration disowns what we computed.
        #: Kept on disk until then (``<state_dir>/disown-<worker id>``), so that a process that
        #: stops first (a crash, an operator's restart while the coordinator was away) still does.
        self.disown_marker = Path(state_dir) / f"disown-{worker_id}"
        self.disown = self.disown_marker.exists()
        #: Shards still to be told to disown (every shard's registration carries it once).
        self._disown_pending: set[int] = set(range(len(self.links))) if self.disown and self.links else set()
        #: Set once every shard has registered.
        self.registered_once = asyncio.Event()

    def fused_mismatch(self, reason: str) -> None:
        """A fused forward differed from a request alone (``worker.stepper``): the ops are not
        batch-invariant here after all. Fusing is already off; what this worker cached may hold
        fused bits, so the cache goes with the epoch (a new one is registered, its GPU and host
        copies dropped, the ledger ends the old epoch's replicas). Its offload copies on the shared
        disk outlive the epoch and other workers may reload them, so the registration also
        disowns every replica this worker created (``WorkerRegister.disown_replicas``)."""
        self.log.error("batch invariance failed at run time: one request per forward, cache dropped",
                       reason=reason[:300])
        self.metrics.batch_invariant.set(0)
        self.disown = True
        self._disown_pending = set(range(len(self.links))) if self.links else set()
        try:
            self.disown_marker.parent.mkdir(parents=True, exist_ok=True)
            self.disown_marker.write_text(f"{reason[:300]}\n")
        except OSError as e:
            self.log.warning("cannot keep the disown marker: a restart before registering would not disown",
                             path=str(self.disown_marker), error=str(e))
        for link in self.links or ():
            if link.contact.registered:
                link.contact.registration_lost(f"batch invariance failed at run time: {reason}"[:300])

    async def run(self, link: ShardLink) -> None:
        """Shard ``link.shard``'s contact task: register, resume or heartbeat, for as long as it runs."""
        c = link.contact
        backoff = 0.1
        while True:
            if c.registered and c.away_since and c.away_too_long():
                c.registration_lost(f"out of contact for more than the resume grace period "
                                    f"({c.resume_grace_ms} ms): the epoch is fenced by now")
            if not c.registered:
                ok = await self._register(link)
            elif c.suspended:
                ok = await self._resume(link)
            else:
                ok = True
            if not ok:
                await self._sleep(c, backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            if c.registered and not c.suspended:
                if c.away_since:
                    await self._sleep(c, backoff)
                    backoff = min(backoff * 2, 2.0)
                    if c.away_too_long():
                        # NOTE: the grace may have passed while we slept: re-register (the loop's
                        # top) rather than race the coordinator's fence with a heartbeat.
                        continue
                elif not c.suspect:
                    backoff = 0.1
                    await self._sleep(c, c.heartbeat_interval_ms / 1000)
                await self._heartbeat(link)

    async def _sleep(self, contact: Contact, seconds: float) -> None:
        try:
            await asyncio.wait_for(contact.wake.wait(), seconds)
        except asyncio.TimeoutError:
            pass
        contact.wake.clear()

    @staticmethod
    async def _settle_outbox(publisher: TransitionPublisher, timeout_s: float = 1.0) -> None:
        if publisher.depth:
            await publisher.publish_due()
            await publisher.wait_empty(timeout=timeout_s)

    async def _listen(self, link: ShardLink) -> None:
        if link.shard == 0 and self.links is not None and not self.links.sharded:
            await link.client.listen(self.worker_id, self.replicas.on_watermark, self.answers.on_inventory,
                                     self.answers.on_control)
            return
        k = link.shard
        await link.client.listen(self.worker_id, functools.partial(self.replicas.on_watermark, shard=k),
                                 functools.partial(self.answers.on_inventory, shard=k),
                                 functools.partial(self.answers.on_control, shard=k))

    def _pool_slots(self, link: ShardLink) -> dict[str, int]:
        assert self.links is not None
        return self.links.share(self.slots, link.shard)

    async def _register(self, link: ShardLink) -> bool:
        assert self.store is not None
        c, client, publisher = link.contact, link.client, link.publisher
        disown = link.shard in self._disown_pending
        try:
            await client.connect()
            await self._settle_outbox(publisher)   # what the old epoch still owes the ledger, before fencing it
            reply = await c.call("register", client.register(WorkerRegister(
                worker_id=self.worker_id, namespace=self.namespace, catalogue=self.catalogue,
                pool_slots=self._pool_slots(link), endpoint=self.endpoint, disown_replicas=disown)))
            await self._listen(link)
        except CoordinatorUnavailable as e:
            c.reason = c.reason or f"coordinator unreachable: {e}"
            self.metrics.degraded.set(1)
            return False
        except CoordinatorRefused as e:
            c.reason = f"registration refused: {e}"
            self.metrics.degraded.set(1)
            return False
        dropped_gpu, dropped_host = self.replicas.drop_shard(link.shard)
        dropped_events = publisher.new_epoch(self.worker_id, reply.epoch)
        c.epoch = reply.epoch
        c.timing(reply)
        c.registered = True
        c.outbox_full = False
        c.in_contact()
        if link.shard == 0:
            self.metrics.epoch.set(c.epoch)
        self.replicas.update_pool_metrics()
        self.log.info("registered", worker_id=self.worker_id, epoch=c.epoch, dropped_gpu=dropped_gpu,
                      dropped_host=dropped_host, dropped_events=dropped_events, disowned=reply.disowned,
                      **({"shard": link.shard} if self.links is not None and self.links.sharded else {}))
        if disown:
            self._disown_pending.discard(link.shard)
            self.metrics.disowned_replicas.inc(reply.disowned)
        if self.disown and not self._disown_pending:
            self.disown = False
            with contextlib.suppress(FileNotFoundError):
                self.disown_marker.unlink()
        assert self.links is not None
        if all(other.contact.registered for other in self.links):
            self.registered_once.set()
        return True

    async def _resume(self, link: ShardLink) -> bool:
        """Keep our epoch and cache: settle the outbox, send our inventory (of this shard's
        chains), drop what the ledger disowns."""
        assert self.store is not None
        c, client, publisher = link.contact, link.client, link.publisher
        sharded = self.links is not None and self.links.sharded
        try:
            await client.connect()
            await self._settle_outbox(publisher)   # the coordinator reconciles once the log holds all we emitted
            held = self.replicas.inventory_digests(link.shard if sharded else None)
            emitted = publisher.outbox.next_seq - 1 if publisher.outbox is not None else 0
            t0 = time.perf_counter()
            reply = await c.call("resume", client.resume(WorkerResume(
                worker_id=self.worker_id, epoch=c.epoch, namespace=self.namespace, catalogue=self.catalogue,
                pool_slots=self._pool_slots(link), endpoint=self.endpoint, emitted_seq=emitted,
                held=b"".join(held))))
            await self._listen(link)
        except (CoordinatorUnavailable, CoordinatorRefused) as e:
            self.log.info("resume not accepted yet", epoch=c.epoch, reason=str(e)[:200])
            return False
        dropped = 0
        for d in split_digests(reply.drop):
            where = held.get(d)
            if where is None:
                continue
            loc, form, block_hash, generation = where
            if loc == self.gpu:
                dropped += self.store.drop(form, block_hash, generation) is not None
            else:
                dropped += self.tiers.host_drop(block_hash, form)
        self.replicas.update_pool_metrics()
        c.timing(reply)
        publisher.ack(c.epoch, reply.committed_seq)
        c.in_contact()
        self.metrics.resumes.inc()
        self.log.info("resumed", worker_id=self.worker_id, epoch=c.epoch, kept=reply.kept, dropped=dropped,
                      held=len(held), seconds=round(time.perf_counter() - t0, 3),
                      **({"shard": link.shard} if sharded else {}))
        return True

    async def _heartbeat(self, link: ShardLink) -> None:
        assert self.store is not None
        c, client, publisher = link.contact, link.client, link.publisher
        try:
            running, queued = self.load_probe()
            reply = await c.call("heartbeat", client.heartbeat(Heartbeat(
                worker_id=self.worker_id, epoch=c.epoch, ready=self.store.ready_counts(),
                running=running, queued=queued, cache=self.metrics.cache_counters(),
                device=self.device, dtype=self.dtype, cache_dtype=self.cache_dtype)))
        except (CoordinatorUnavailable, CoordinatorRefused):
            return
        publisher.ack(c.epoch, reply.committed_seq)
        if c.suspect or c.away_since:
            # NOTE: the coordinator answers for this epoch and never suspended it: it was slow or
            # briefly unreachable, not gone; our replicas are still its replicas.
            self.log.info("coordinator answers again; same epoch", epoch=c.epoch, after=c.suspect or c.reason)
            c.in_contact()
        if c.outbox_full and publisher.depth <= publisher.capacity // 2:
            c.outbox_drained()
            self.log.info("outbox drained; reuse resumes", epoch=c.epoch)


__all__ = ["Membership"]
