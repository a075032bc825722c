"""The worker's background duties towards the coordinator and its lower tiers.

:class:`Supervisor` runs two tasks the engine starts and stops:

* **contact** — register (an epoch), heartbeat, and whenever the coordinator or NATS is
  unreachable, the epoch is suspended or the outbox is full, keep the worker *degraded*
  (``worker.contact``): every request is served by full recomputation while the cache is
  *kept*. When the coordinator answers again the worker carries on with the same epoch: at
  once if the ledger never suspended it, after a *resume* (its inventory, reconciled against
  the log) if it did. Only a fenced epoch, or an outage longer than the coordinator's resume
  grace period, makes it register a new epoch and drop its GPU and host copies (the
  coordinator has fenced them, or is about to).
* **spill** — write the blocks queued for the disk tier in batches (one fsync each), ask the
  coordinator to evict host-tier victims once their disk copies are in the ledger, and keep
  this worker's offload segments within ``cache.offload_dir_bytes`` (``DiskGc``).

It also answers what the coordinator asks of the worker (:meth:`on_inventory`,
:meth:`on_control`). Transitions it causes go through the replica writer
(``worker.cache.replicas``); it never touches a request.

With a sharded ledger (``worker.shard_links``) the contact task runs once per shard, each with
its own epoch, outbox and standing: a takeover on one shard suspends and resumes that shard's
epoch only, a fence there drops only that shard's blocks, and what the worker tells or asks a
shard (its inventory, an eviction, a disk GC) is of that shard's chains.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import torch

from shared.config import Config
from shared.forms import FormCatalogue
from shared.hashing import split_digests
from shared.messages import (
    MAX_HOST_EVICT_BLOCKS,
    Control,
    ControlAck,
    DiskBlock,
    Heartbeat,
    InventoryItem,
    InventoryReply,
    InventoryRequest,
    ReplicaState,
    WorkerRegister,
    WorkerResume,
)
from worker.cache import offload_key as of
from worker.cache.planner import BlockMeta
from worker.cache.replicas import ReplicaWriter
from worker.cache.store import CacheStore
from worker.cache.tiers import Tiers
from worker.client import CoordinatorClient, CoordinatorRefused, CoordinatorUnavailable
from worker.contact import Contact
from worker.metrics import WorkerMetrics
from worker.publisher import TransitionPublisher
from worker.shard_links import ShardLink, ShardLinks

R = ReplicaState
#: Blocks written to the disk tier per batch (one fsync each).
SPILL_BATCH = 256


class Supervisor:
    """Registration, heartbeats, resume, spill and disk GC (see the module's docstring)."""

    def __init__(self, *, cfg: Config, contact: Contact, replicas: ReplicaWriter,
                 client: CoordinatorClient | None, publisher: TransitionPublisher | None,
                 store: CacheStore | None, tiers: Tiers, metrics: WorkerMetrics, log, worker_id: str,
                 namespace: str, catalogue: FormCatalogue, slots: dict[str, int], spec_digests: dict[str, str],
                 device: str, dtype: str, cache_dtype: str, io: Callable[[Callable[[], Any]], Any],
                 active_sessions: Callable[[], int], links: ShardLinks | None = None) -> None:
        self.cfg = cfg
        self.contact = contact
        self.replicas = replicas
        self.client = client
        self.publisher = publisher
        #: Every shard's link (one: this coordinator's client, outbox and contact).
        self.links = links if links is not None else (
            ShardLinks([ShardLink(0, client, publisher, contact)], namespace) if client is not None
            and publisher is not None else None)
        self.store = store
        self.tiers = tiers
        self.metrics = metrics
        self.log = log
        self.worker_id = worker_id
        self.gpu = f"gpu:{worker_id}"
        self.host_location = f"host:{worker_id}"
        self.namespace = namespace
        self.catalogue = catalogue
        self.slots = slots
        self.spec_digests = spec_digests
        self.device = device
        self.dtype = dtype
        self.cache_dtype = cache_dtype
        self.io = io
        self._active_sessions = active_sessions
        #: The address gateways reach this worker at (set once the HTTP server is bound).
        self.endpoint = ""
        #: (running, queued) requests of the scheduler serving this engine, sent with each
        #: heartbeat (gateways weigh load with it); the scheduler installs its own.
        self.load_probe: Callable[[], tuple[int, int]] = lambda: (0, 0)
        #: A fused forward differed at run time: the next registration disowns what we computed.
        #: Kept on disk until then (``<state_dir>/disown-<worker id>``), so that a process that
        #: stops first (a crash, an operator's restart while the coordinator was away) still does.
        self.disown_marker = Path(cfg.state_dir) / f"disown-{worker_id}"
        self.disown = self.disown_marker.exists()
        #: Shards still to be told to disown (every shard's registration carries it once).
        self._disown_pending: set[int] = set(range(len(self.links))) if self.disown and self.links else set()
        self.registered_once = asyncio.Event()
        self.tasks: list[asyncio.Task] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        assert self.links is not None
        self.tasks = [loop.create_task(self._supervise(link), name=f"kvl-supervisor-s{link.shard}" if link.shard
                                       else "kvl-supervisor") for link in self.links]
        self.tasks.append(loop.create_task(self._spill_loop(), name="kvl-spill"))
        if self.links.sharded:
            self.tasks.append(loop.create_task(self.links.follow(self.client, self.cfg, self.log), name="kvl-shard-map"))

    def take_tasks(self) -> list[asyncio.Task]:
        """The running tasks, for the engine to cancel at stop (the supervisor no longer runs)."""
        tasks, self.tasks = self.tasks, []
        return tasks

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

    # --- contact --------------------------------------------------------------------------

    async def _supervise(self, link: ShardLink) -> None:
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
            await link.client.listen(self.worker_id, self.replicas.on_watermark, self.on_inventory, self.on_control)
            return
        k = link.shard
        await link.client.listen(self.worker_id, functools.partial(self.replicas.on_watermark, shard=k),
                                 functools.partial(self.on_inventory, shard=k),
                                 functools.partial(self.on_control, shard=k))

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

    # --- coordinator → worker -------------------------------------------------------------

    def _link(self, shard: int) -> tuple[Contact, TransitionPublisher | None, int | None]:
        """Shard ``shard``'s contact and outbox, and the shard whose blocks it hears of (None: all)."""
        if self.links is None or not self.links.sharded:
            return self.contact, self.publisher, None
        link = self.links.links[shard]
        return link.contact, link.publisher, shard

    async def on_inventory(self, req: InventoryRequest, shard: int = 0) -> InventoryReply:
        """What we hold (items, or with ``req.digests`` every replica digest grouped by location,
        whole: the transport pages it), or, for a disk check, the verdicts on ``req.disk``; of the
        asking shard's chains where the ledger is sharded."""
        contact, publisher, of_shard = self._link(shard)
        mine = self.replicas.mine(of_shard)
        epoch = max(1, contact.epoch)
        if req.disk:
            root = self.tiers.disk_root
            if root is None or not self.tiers.disk_available():
                return InventoryReply(worker_id=self.worker_id, epoch=epoch, disk_tier=False)

            def check() -> tuple[int, list, list]:
                mine = []
                for ref in req.disk[:1024]:   # bounded whatever the request says
                    spec = self.spec_digests.get(ref.form)
                    if spec is None or ref.namespace != self.namespace:
                        continue   # another model's record: this worker cannot name it
                    try:
                        of.check_token("tenant", ref.tenant)
                    except ValueError:
                        continue
                    mine.append((ref, BlockMeta(namespace=ref.namespace, tenant=ref.tenant, block_hash=ref.block_hash,
                                                parent_hash="", token_start=0, token_end=0, form=ref.form,
                                                spec_digest=spec, checksum=ref.checksum)))
                verdicts = self.tiers.disk_check([(meta, ref.checksum) for ref, meta in mine])
                missing = [ref for (ref, _), v in zip(mine, verdicts) if v == "missing"]
                damaged = [msgspec.structs.replace(ref, reason=v[:200]) for (ref, _), v in zip(mine, verdicts)
                           if v and v != "missing"]
                return len(mine), missing, damaged
            try:
                checked, missing, damaged = await self.io(check)
            except of.OffloadUnavailable as e:
                self.log.warning("audit disk check: offload directory unavailable", error=str(e))
                return InventoryReply(worker_id=self.worker_id, epoch=epoch, disk_tier=False)
            return InventoryReply(worker_id=self.worker_id, epoch=epoch, disk_tier=True, disk_checked=checked,
                                  disk_missing=missing, disk_damaged=damaged)
        emitted = publisher.outbox.next_seq - 1 if publisher is not None and publisher.outbox is not None else 0
        if req.digests:
            held = sorted((loc, d) for d, (loc, *_) in self.replicas.inventory_digests(of_shard).items())
            counts: dict[str, int] = {}
            for loc, _ in held:
                counts[loc] = counts.get(loc, 0) + 1
            return InventoryReply(worker_id=self.worker_id, epoch=epoch, digests=b"".join(d for _, d in held),
                                  locations=list(counts.items()), emitted_seq=emitted)
        items: list[InventoryItem] = []
        if self.store is not None:
            items += [InventoryItem(block_hash=m.block_hash, form=f, location=self.gpu, generation=m.generation,
                                    state=R.READY, checksum=m.checksum) for f, _, m in self.store.items()
                      if mine(m.block_hash)]
        items += [InventoryItem(block_hash=m.block_hash, form=m.form, location=self.host_location, generation=0,
                                state=R.READY, checksum=m.checksum) for m in self.tiers.host_items()
                  if mine(m.block_hash)]
        return InventoryReply(worker_id=self.worker_id, epoch=epoch, items=items, emitted_seq=emitted)

    async def on_control(self, msg: Control, shard: int = 0) -> ControlAck:
        """Apply a coordinator decision locally (the ledger already records it: no transitions).

        An invalidation drops the block's bytes wherever this worker holds them, blocks queued for
        the disk writer included; a copy of them whose transition is already on its way is refused
        by the ledger (the invalidation retired its EVICTED source), so neither side keeps it."""
        affected = 0
        mine = self.replicas.mine(self._link(shard)[2])
        if msg.action == "drain":
            for link in self.links or ():
                link.contact.draining = True
            self.contact.draining = True
            affected = self._active_sessions()
        elif msg.action == "invalidate_blocks":
            # by key, not by a scan: an invalidated worker is named every block it held
            for b in msg.blocks:
                affected += self.replicas.drop_block(b.block_hash, b.generations)
            self.replicas.update_pool_metrics()
        elif msg.action == "invalidate_block" and msg.block_hash:
            affected += self.replicas.drop_block(msg.block_hash, msg.generations)
            self.replicas.update_pool_metrics()
        elif msg.action in ("evict", "invalidate_block", "invalidate_namespace"):
            def hit(m: BlockMeta) -> bool:
                if not mine(m.block_hash):
                    return False        # another shard's: it decides its own blocks
                if msg.action == "invalidate_namespace":
                    return m.namespace == msg.namespace
                return not msg.block_hash or m.block_hash == msg.block_hash
            if self.store is not None:
                for form, _, m in list(self.store.items()):
                    if hit(m):
                        affected += self.store.drop(form, m.block_hash, m.generation) is not None
                self.replicas.update_pool_metrics()
            queued = [m for m, _, from_host in self.tiers.take_spills()
                      if not from_host and msg.action != "evict"]
            for m in (*self.tiers.host_items(), *queued):
                if hit(m):
                    affected += self.tiers.host_drop(m.block_hash, m.form)
        self.log.info("control", action=msg.action, blocks=len(msg.blocks), affected=affected, reason=msg.reason)
        return ControlAck(worker_id=self.worker_id, affected=affected)

    # --- spill ----------------------------------------------------------------------------

    async def _spill_loop(self) -> None:
        due = self.replicas.spill_due
        while True:
            await due.wait()
            due.clear()
            try:
                await self.spill_once()
            except Exception as e:  # noqa: BLE001 - the task must survive a bad block
                self.log.error("spill failed", error=repr(e))

    async def spill_once(self) -> None:
        """Write the spill queue to the disk tier in batches (one fsync each), then keep this
        worker's segments within ``cache.offload_dir_bytes``. A block that fails on its own (an
        unsafe key: anything but the tier being unavailable) is logged without content, counted
        in ``offload_failures{reason="error"}`` and dropped from the queue; the others go on."""
        queue = self.tiers.take_spills()
        for i in range(0, len(queue), SPILL_BATCH):
            await self._spill_batch(queue[i:i + SPILL_BATCH])
        if queue:
            await self._collect_disk()

    async def _spill_batch(self, batch: list[tuple[BlockMeta, torch.Tensor, bool]]) -> None:
        good: list[tuple[BlockMeta, torch.Tensor, bool]] = []
        victims: list[BlockMeta] = []   # host-tier victims: their eviction is the coordinator's to decide
        for meta, data, from_host in batch:
            if not self.tiers.needs_disk(meta):
                victims.append(meta)   # written by an earlier pass; still waiting for its eviction
                continue
            try:
                of.BlockKey(meta.namespace, meta.tenant, meta.block_hash, meta.form, meta.spec_digest)
                good.append((meta, data, from_host))
            except ValueError as e:
                self.metrics.offload_failures.labels(tier="disk", reason="error").inc()
                self.log.error("spill_item_failed", block=meta.block_hash[:12], form=meta.form, error=type(e).__name__)
                self._spill_done(meta, from_host, written=False)
                if from_host:
                    victims.append(meta)
        digests: list[str] = []
        if good and self.tiers.disk_available():
            t0 = time.perf_counter()
            try:
                digests = await self.io(lambda: self.tiers.disk_write_many([(m, d) for m, d, _ in good]))
            except of.OffloadUnavailable as e:
                self.tiers.mark_disk_down(str(e))
                self.metrics.offload_failures.labels(tier="disk", reason="unavailable").inc()
                self.metrics.tier_unavailable.labels(tier="disk").inc()
                self.log.warning("disk tier unavailable; serving without it", error=str(e),
                                 retry_s=self.tiers.retry_s)
            else:
                self.metrics.offload_seconds.labels(tier="disk").observe(time.perf_counter() - t0)
                self.metrics.offloaded_bytes.labels(tier="disk").inc(sum(d.numel() for _, d, _ in good))
        elif good and self.tiers.disk_root is not None:
            self.metrics.tier_unavailable.labels(tier="disk").inc()
        for j, (meta, _, from_host) in enumerate(good):
            written = j < len(digests) and digests[j] == meta.checksum
            if j < len(digests) and not written:
                self.metrics.offload_failures.labels(tier="disk", reason="checksum").inc()
            try:
                self._spill_done(meta, from_host, written=written)
            except Exception as e:  # noqa: BLE001 - one bad block must not stop the writer for good
                self.metrics.offload_failures.labels(tier="disk", reason="error").inc()
                self.log.error("spill_item_failed", block=meta.block_hash[:12], form=meta.form,
                               error=type(e).__name__)
            if from_host:
                victims.append(meta)
        if victims:
            await self._evict_host(victims)

    def _spill_done(self, meta: BlockMeta, from_host: bool, *, written: bool) -> None:
        """One queued block's disk copy handled: its disk replica is READY if written. A
        host-tier victim stays queued (and readable) until :meth:`_evict_host` settles it."""
        if not self.tiers.is_spilling(meta):
            return  # put back into the host tier meanwhile: it stays there
        if written:
            self.replicas.emit(meta, "disk", None, R.READY, 0, kind="offload")
        if from_host:
            self.tiers.disk_done(meta)
        else:
            self.tiers.spilled(meta)

    async def _evict_host(self, victims: list[BlockMeta]) -> None:
        """Drop host-tier LRU victims' bytes once the coordinator has evicted their replicas
        (``HostEvict``); a victim a live lease pins stays a host replica.

        NOTE: the coordinator decides, in the ledger's order, as it does a grant's GPU victims.
        Dropping first and reporting the eviction after the fact left a window (the transition's
        way to the ledger) in which a grant could pin bytes that were already gone; the ledger
        then refused the eviction and listed a READY replica that existed nowhere. Without an
        answer (coordinator unreachable, epoch suspended) the victims stay queued and readable,
        and are asked about again after ``retry_s``."""
        todo = [m for m in victims if self.tiers.is_spilling(m) and not self.tiers.keep_pinned(m)]
        if todo and self.client is None:
            # no ledger to ask (an engine without a coordinator): report after the fact
            for meta in todo:
                self.tiers.spilled(meta)
                self.replicas.emit(meta, self.host_location, R.READY, R.EVICTED, 0, kind="evict", reason="host lru")
            todo = []
        by_key = {(m.block_hash, m.form): m for m in todo}
        blocks = [DiskBlock(block_hash=h, form=f) for h, f in by_key]
        # NOTE: the victims' disk copies must be in the ledger first: an offload is accepted only
        # while a copy it can come from is known (here, the host replica), and until the disk
        # replica is READY the host one is what a reader has.
        timeout_s = self.cfg.nats.request_timeout_ms / 1000
        if blocks and not await self.links.outboxes_empty(timeout_s):
            self._defer_host_evictions(len(blocks), "the victims' offloads are not committed yet")
            blocks = []
        for i in range(0, len(blocks), MAX_HOST_EVICT_BLOCKS):
            chunk = blocks[i:i + MAX_HOST_EVICT_BLOCKS]
            try:
                pinned = await self.replicas.ask_evict(chunk)
            except (CoordinatorRefused, CoordinatorUnavailable) as e:
                self._defer_host_evictions(len(blocks) - i, type(e).__name__)
                break
            for b in chunk:
                meta = by_key[(b.block_hash, b.form)]
                if (b.block_hash, b.form) in pinned:
                    # still queued and readable, asked about again once the lease may have ended
                    # (not put back into the host tier: that would push out another entry)
                    self.metrics.host_evictions.labels(outcome="pinned").inc()
                elif self.tiers.is_spilling(meta):   # (else: dropped meanwhile, an invalidation)
                    self.tiers.spilled(meta)   # evicted in the log (or not a live replica): the bytes go
                    self.metrics.host_evictions.labels(outcome="evicted").inc()
            if pinned:
                self._spill_again_later()

    def _defer_host_evictions(self, n: int, why: str) -> None:
        """Host-tier victims stay (queued, readable) without a decision; ask again after ``retry_s``."""
        self.metrics.host_evictions.labels(outcome="deferred").inc(n)
        self.log.warning("host-tier evictions deferred: the coordinator did not decide", victims=n, error=why,
                         retry_s=self.tiers.retry_s)
        self._spill_again_later()

    def _spill_again_later(self) -> None:
        asyncio.get_running_loop().call_later(self.tiers.retry_s, self.replicas.spill_due.set)

    async def _collect_disk(self) -> None:
        """Delete this worker's oldest segments while they exceed ``cache.offload_dir_bytes``,
        each only once the ledger has evicted every replica it holds (``DiskGc``): a segment
        holding a replica a live lease pins is kept for now, and without the coordinator
        nothing is deleted (the bound waits; no READY replica loses its bytes)."""
        bound = self.cfg.cache.offload_dir_bytes
        if not bound or self.client is None or not self.tiers.disk_available():
            return
        try:
            usage = await self.io(self.tiers.disk_usage)
            if usage <= bound:
                return
            candidates = await self.io(self.tiers.disk_collectable)
        except of.OffloadUnavailable as e:
            self.tiers.mark_disk_down(str(e))
            return
        for path, size, metas in candidates:
            if usage <= bound:
                break
            blocks = list(dict.fromkeys(DiskBlock(block_hash=m.block_hash, form=m.form) for m in metas))
            try:
                assert self.links is not None
                pinned = await self.links.disk_pinned(self.worker_id, blocks)
            except (CoordinatorRefused, CoordinatorUnavailable) as e:
                self.metrics.disk_gc.labels(outcome="no_coordinator").inc()
                self.log.warning("disk gc deferred: the coordinator did not decide", error=type(e).__name__)
                return
            if pinned:
                self.metrics.disk_gc.labels(outcome="pinned").inc()
                continue
            try:
                await self.io(lambda p=path: self.tiers.disk_delete(p))
            except of.OffloadUnavailable as e:
                self.tiers.mark_disk_down(str(e))
                return
            usage -= size
            self.metrics.disk_gc.labels(outcome="deleted").inc()
            self.metrics.disk_gc_bytes.inc(size)
        self.metrics.disk_bytes.set(usage)


__all__ = ["SPILL_BATCH", "Supervisor"]
