"""Every replica state change this worker decides, and the moves of bytes between its tiers.

:class:`ReplicaWriter` is the one place a worker tells the ledger about its replicas — commits
(ALLOCATED→READY), aborts, invalidations, offloads to the host and disk tiers, evictions — so
the list of what a worker may say is one screen long. Each transition goes to the outbox
(``worker.publisher``) under the current epoch (``worker.contact``); none is queued while the
worker is unregistered, and a full outbox degrades the worker instead of dropping anything.

It also moves the bytes those transitions describe: a committed block into its pool slot, a
block leaving the GPU down to the host tier (or the disk writer's queue), the coldest replicas
copied down ahead of time above ``cache.offload_threshold``, and room made in a pool whose view
diverged from the ledger's (the coordinator decides which replicas go). Live leases pin what
they read: a pinned replica is never the writer's to drop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

import torch

from shared.hashing import replica_digests
from shared.messages import (
    MAX_HOST_EVICT_BLOCKS,
    CommitWatermark,
    DiskBlock,
    HostEvict,
    LeaseGrant,
    ReplicaRef,
    ReplicaState,
    TransitionEvent,
    now_ms,
)
from worker.cache.planner import BlockMeta
from worker.cache.pools import PoolExhausted
from worker.cache.store import CacheStore, Reservation
from worker.cache.tiers import Tiers
from worker.client import CoordinatorClient, CoordinatorRefused, CoordinatorUnavailable
from worker.contact import Contact
from worker.metrics import WorkerMetrics
from worker.publisher import OutboxFull, TransitionPublisher
from worker.shard_links import ShardLinks

R = ReplicaState


class _Unsettled:
    """One shard's transitions kept until its watermark settles them (see on_watermark): copies to
    the host tier (seq → (block, form), and the newest seq of each) and GPU commits (seq → (form,
    block, generation)), all of one epoch."""

    __slots__ = ("commits", "epoch", "offer_of", "offers")

    def __init__(self) -> None:
        self.offers: dict[int, tuple[str, str]] = {}
        self.offer_of: dict[tuple[str, str], int] = {}
        self.commits: dict[int, tuple[str, str, int]] = {}
        self.epoch = 0


class ReplicaWriter:
    """Transitions and tier moves (see the module's docstring)."""

    def __init__(self, *, contact: Contact, client: CoordinatorClient | None, publisher: TransitionPublisher | None,
                 store: CacheStore | None, tiers: Tiers, metrics: WorkerMetrics, log, worker_id: str,
                 block_size: int, model_id: str, slots: dict[str, int], offload_threshold: float,
                 leases: Callable[[], Iterable[LeaseGrant]],
                 background: Callable[[Coroutine[Any, Any, None]], None],
                 running: Callable[[], bool], links: ShardLinks | None = None) -> None:
        self.contact = contact
        self.client = client
        self.publisher = publisher
        #: Every shard's link where the ledger is sharded (None or one link: this one coordinator).
        self.links = links if links is not None and links.sharded else None
        self.store = store
        self.tiers = tiers
        self.metrics = metrics
        self.log = log
        self.worker_id = worker_id
        self.gpu = f"gpu:{worker_id}"
        self.host_location = f"host:{worker_id}"
        self.block_size = block_size
        self.model_id = model_id
        self.slots = slots
        self.offload_threshold = offload_threshold
        #: The grants of this worker's live leases (sessions releasing in the background included).
        self._leases = leases
        self._background = background
        #: Whether the engine runs (a retry scheduled before stop() must not start work after it).
        self._running = running
        #: Set when the spill queue has blocks for the disk writer (``worker.spill``).
        self.spill_due = asyncio.Event()
        #: GPU replicas (block, form, generation) the threshold copied down a tier already.
        self.backed: dict[tuple[str, str, int], None] = {}
        #: Per shard: copies to the host tier and GPU commits not yet settled by a watermark.
        self.unsettled: dict[int, _Unsettled] = {}
        #: Forms whose full pool refused granted writes, and how many, while make_room runs.
        self.making_room: dict[str, int] = {}

    # --- transitions ----------------------------------------------------------------------

    @property
    def commits(self) -> list[tuple[str, str, int]]:
        """GPU commits not yet settled by a watermark, every shard's: (form, block, generation)."""
        return [c for u in self.unsettled.values() for c in u.commits.values()]

    @property
    def offers(self) -> list[tuple[str, str]]:
        """Copies to the host tier not yet settled by a watermark, every shard's: (block, form)."""
        return [key for u in self.unsettled.values() for key in u.offers.values()]

    def _route(self, block_hash: str) -> tuple[Contact, TransitionPublisher | None, int] | None:
        """The contact and outbox a transition on ``block_hash`` goes through, and their shard
        (None: sharded, and the block's chain is not known here: nothing can be said of it)."""
        if self.links is None:
            return self.contact, self.publisher, 0
        link = self.links.for_block(block_hash)
        return None if link is None else (link.contact, link.publisher, link.shard)

    def emit(self, meta: BlockMeta, location: str, frm: ReplicaState | None, to: ReplicaState, generation: int,
             *, kind: str, lease_id: str = "", reason: str = "", checksum: str | None = None) -> int:
        """Queue one transition for the ledger; returns its seq (0 if none could be queued)."""
        route = self._route(meta.block_hash)
        if route is None:
            return 0
        contact, publisher, _ = route
        if not contact.registered or publisher is None:
            return 0
        epoch, wid = contact.epoch, self.worker_id

        def make(seq: int) -> TransitionEvent:
            return TransitionEvent(
                worker_id=wid, epoch=epoch, seq=seq, namespace=meta.namespace, tenant=meta.tenant,
                block_hash=meta.block_hash, parent_hash=meta.parent_hash, token_start=meta.token_start,
                token_end=meta.token_end, form=meta.form, location=location, from_state=frm, to_state=to,
                generation=generation, checksum=meta.checksum if checksum is None else checksum,
                lease_id=lease_id, reason=reason, block_size=self.block_size, model_name=self.model_id,
                ts_ms=now_ms())

        try:
            ev = publisher.emit(make)
        except OutboxFull:
            contact.outbox_overflow()
            return 0
        self.metrics.count_transition(kind)
        return ev.seq

    def commit(self, meta: BlockMeta, data: torch.Tensor | memoryview | Reservation, *, lease_id: str) -> int:
        """Fill a granted GPU slot with ``data`` and commit it (ALLOCATED→READY); ``data`` may be
        a slot reserved earlier that already holds the bytes (a disk reload read into it), or a
        host-tier entry's memoryview."""
        assert self.store is not None
        route = self._route(meta.block_hash)
        if route is not None and route[1] is not None and route[1].full:
            # NOTE: no slot without its commit event: the ledger must hear of every READY slot.
            route[0].outbox_overflow()
            if isinstance(data, Reservation):
                self.store.release(data)
            return 0
        if isinstance(data, Reservation):
            full = self.store.install_reserved(meta, data)
            if full is None:
                # the slot was freed since (a new epoch, or the same block installed by another
                # request): what it holds now is not ours to commit
                return self.emit(meta, self.gpu, R.ALLOCATED, R.EVICTED, 0, kind="abort", lease_id=lease_id,
                                 reason="reserved slot lost")
            return self._commit_emit(full, lease_id)
        try:
            full = self._install(meta, data)
        except PoolExhausted as e:
            self.log.warning("no free slot for a granted write; aborting it", form=meta.form, error=str(e))
            return self.emit(meta, self.gpu, R.ALLOCATED, R.EVICTED, 0, kind="abort", lease_id=lease_id,
                             reason="pool exhausted")
        return self._commit_emit(full, lease_id)

    def _commit_emit(self, full: BlockMeta, lease_id: str) -> int:
        """The commit of a slot just filled, kept until a watermark settles it (see on_watermark)."""
        seq = self.emit(full, self.gpu, R.ALLOCATED, R.READY, full.generation, kind="commit", lease_id=lease_id)
        if seq:
            self._unsettled(full.block_hash).commits[seq] = (full.form, full.block_hash, full.generation)
        return seq

    def committed(self) -> None:
        """After a session's commits: pool gauges, and the threshold's copies down a tier."""
        self.update_pool_metrics()
        self.pre_offload()

    def invalidate(self, meta: BlockMeta, ref: ReplicaRef, *, damaged: bool, reason: str) -> int:
        """A replica failed validation: drop our copy, mark it INVALID in the ledger."""
        if ref.location == self.gpu and self.store is not None:
            self.store.drop(ref.form, ref.block_hash, ref.generation)
            self.update_pool_metrics()
        elif ref.location == self.host_location:
            self.tiers.host_drop(ref.block_hash, ref.form)
        elif ref.location == "disk" and damaged:
            self.tiers.disk_drop(meta)
        return self.emit(meta, ref.location, R.READY, R.INVALID, ref.generation, kind="invalidate",
                         reason=reason, checksum=ref.checksum)

    def apply_evictions(self, grant: LeaseGrant) -> None:
        """Drop the LRU victims a grant names (already EVICTED in the log), copying them down a tier first."""
        if self.store is None or not grant.evict:
            return
        for ref in grant.evict:
            if ref.location != self.gpu:
                continue
            dropped = self.store.drop(ref.form, ref.block_hash, ref.generation)
            if dropped is not None:
                self.offload(*dropped)
        self.update_pool_metrics()

    # --- what this worker holds -----------------------------------------------------------

    def update_pool_metrics(self) -> None:
        if self.store is None:
            return
        for form, (used, _) in self.store.usage().items():
            self.metrics.pool_used.labels(form=form).set(used)

    def holds_block(self, block_hash: str, forms: Iterable[str]) -> bool:
        """Whether this worker's pools hold a READY replica of ``block_hash`` in any of ``forms``."""
        store = self.store
        return store is not None and any(store.lookup(f, block_hash) is not None for f in forms)

    def mine(self, shard: int | None) -> Callable[[str], bool]:
        """Whether a block is shard ``shard``'s to hear of (every block: ``None``, or one shard).
        A block whose chain is not known here is every shard's: none may list it unseen."""
        if shard is None or self.links is None:
            return lambda _: True
        links = self.links
        return lambda block_hash: links.shard_of_block(block_hash) in (shard, None)

    def held_blocks(self) -> set[str]:
        """Every block this worker holds bytes of, on its GPU or host tier."""
        out = {m.block_hash for _, _, m in self.store.items()} if self.store is not None else set()
        out.update(m.block_hash for m in self.tiers.host_items())
        return out

    def drop_shard(self, shard: int) -> tuple[int, int]:
        """Drop the GPU and host copies of shard ``shard``'s blocks (its epoch was fenced): how
        many of each. Unsharded, every copy."""
        if self.links is None:
            return (self.store.clear() if self.store is not None else 0), self.tiers.host_clear()
        mine = self.mine(shard)
        gpu = 0
        if self.store is not None:
            for form, _, m in list(self.store.items()):
                if mine(m.block_hash):
                    gpu += self.store.drop(form, m.block_hash, m.generation) is not None
        host = sum(self.tiers.host_drop(m.block_hash, m.form) for m in list(self.tiers.host_items())
                   if mine(m.block_hash))
        return gpu, host

    def inventory_digests(self, shard: int | None = None) -> dict[bytes, tuple[str, str, str, int]]:
        """What this worker holds on its GPU and host tier (of shard ``shard``'s chains, if given),
        by :func:`replica_digest`: ``digest → (location, form, block_hash, generation)``."""
        mine = self.mine(shard)
        rows: list[tuple[str, str, str, int, str]] = []
        if self.store is not None:
            rows.extend((m.block_hash, f, self.gpu, m.generation, m.checksum) for f, _, m in self.store.items()
                        if mine(m.block_hash))
        # host copies are offloaded as generation 0 (see offload)
        rows.extend((m.block_hash, m.form, self.host_location, 0, m.checksum) for m in self.tiers.host_items()
                    if mine(m.block_hash))
        return {d: (loc, f, h, gen) for d, (h, f, loc, gen, _) in zip(replica_digests(rows), rows)}

    def drop_block(self, block_hash: str, gens: dict[str, int] | None) -> int:
        """Drop an invalidated block's bytes here: of its GPU replicas only the incarnations the
        decision named (``gens``: form → generation; None = every form's; one written since is
        listed READY), and its host-tier copies, queued for the disk writer too."""
        affected = 0
        for form in self.slots:
            if self.store is not None and (gens is None or form in gens):
                affected += self.store.drop(form, block_hash, None if gens is None else gens[form]) is not None
            affected += self.tiers.host_drop(block_hash, form)
        return affected

    def _pins_at(self, location: str) -> list[ReplicaRef]:
        """The replicas at ``location`` that this worker's live leases pin."""
        return [r for grant in self._leases() for r in grant.read if r.location == location]

    def local_gpu_pins(self) -> set[str]:
        """Blocks whose GPU replicas live leases pin."""
        return {r.block_hash for r in self._pins_at(self.gpu)}

    def host_pins(self) -> set[tuple[str, str]]:
        """(block, form) of this worker's host-tier replicas that live leases pin (sessions
        releasing in the background still hold theirs): the host tier's LRU never drops them."""
        return {(r.block_hash, r.form) for r in self._pins_at(self.host_location)}

    # --- a pool the ledger sees otherwise -------------------------------------------------

    def _install(self, meta: BlockMeta, data: torch.Tensor | memoryview) -> BlockMeta:
        assert self.store is not None
        try:
            return self.store.install(meta, data)
        except PoolExhausted:
            # The ledger thought a slot was free: our view diverged (e.g. a commit the ledger
            # rejected left a slot it does not count). The write is aborted (commit's caller) and
            # the coordinator decides which of our coldest replicas go (make_room): evicting one
            # here and reporting it after the fact could drop bytes a grant already in flight pins.
            self.metrics.pool_divergences.labels(form=meta.form).inc()
            if self.client is None:
                self._evict_local_lru(meta.form)      # no ledger to ask (an engine without a coordinator)
                return self.store.install(meta, data)
            self.want_room(meta.form, 1)
            raise

    def want_room(self, form: str, n: int) -> None:
        """``n`` more slots of ``form`` wanted: one request at a time per form asks for all of them."""
        if not self._running():                       # stopped (a retry scheduled before stop() fires after it)
            return
        need = self.making_room.get(form)
        self.making_room[form] = (need or 0) + n
        if need is None:
            self._background(self.make_room(form))

    def _evict_local_lru(self, form: str) -> None:
        assert self.store is not None
        victim = self.store.lru_victim(form, self.local_gpu_pins())
        if victim is None:
            return
        dropped = self.store.drop(victim.form, victim.block_hash, victim.generation)
        if dropped is not None:
            self.offload(*dropped)
            self.emit(victim, self.gpu, R.READY, R.EVICTED, victim.generation, kind="evict", reason="local lru")
        self.update_pool_metrics()

    async def make_room(self, form: str) -> None:
        """Ask the coordinator to evict this form's coldest GPU replicas, one per write the full
        pool refused (``HostEvict``, tier ``gpu``), and drop the bytes of those it evicted or does
        not list as READY — the latter is how a slot the ledger does not count is found and freed.
        Pinned ones stay, and the next coldest are asked about in their place (a slot the ledger
        does not count may sit behind them)."""
        try:
            assert self.store is not None and self.client is not None
            keep = self.local_gpu_pins()
            need = min(self.making_room.get(form, 1), MAX_HOST_EVICT_BLOCKS)
            while need > 0:
                victims = self.store.coldest_metas(form, need, lambda m: m.block_hash not in keep)
                if not victims:
                    break
                try:
                    pinned_keys = await self.ask_evict(
                        [DiskBlock(block_hash=v.block_hash, form=v.form) for v in victims], tier="gpu")
                except (CoordinatorRefused, CoordinatorUnavailable) as e:
                    # asked again later (or by the next refused write): a lost answer may have evicted
                    # them in the ledger, and until the worker asks again it holds what the ledger does not list
                    self.metrics.pool_room.labels(outcome="deferred").inc(len(victims))
                    self.log.warning("no room made in a diverged GPU pool: the coordinator did not decide",
                                     form=form, error=type(e).__name__, retry_s=self.tiers.retry_s)
                    asyncio.get_running_loop().call_later(self.tiers.retry_s, self.want_room, form, need)
                    return
                pinned = {h for h, _ in pinned_keys}
                for v in victims:
                    if v.block_hash in pinned:
                        self.metrics.pool_room.labels(outcome="pinned").inc()
                        keep.add(v.block_hash)
                        continue
                    need -= 1
                    # (the ledger's decision holds for the replica it knew; a slot recycled since then
                    # holds another generation, which drop() leaves alone)
                    dropped = self.store.drop(v.form, v.block_hash, v.generation)
                    if dropped is not None:
                        self.offload(*dropped)
                        self.metrics.pool_room.labels(outcome="evicted").inc()
            self.update_pool_metrics()
        finally:
            self.making_room.pop(form, None)

    async def ask_evict(self, blocks: list[DiskBlock], **how: Any) -> set[tuple[str, str]]:
        """Ask the ledger to evict these replicas of this worker (``HostEvict``; ``how``: its tier),
        each of the shard deciding its block; the (block, form) of those a live lease pins. Raises
        :class:`CoordinatorRefused` / :class:`CoordinatorUnavailable` (nothing decided is lost:
        a repeated question about an evicted replica is answered "not pinned")."""
        assert self.client is not None
        if self.links is None:
            reply = await self.contact.call("host_evict", self.client.host_evict(HostEvict(
                worker_id=self.worker_id, epoch=max(1, self.contact.epoch), blocks=blocks, **how)))
            return {(b.block_hash, b.form) for b in reply.pinned}
        return await self.links.ask_evict(self.worker_id, blocks, **how)

    # --- down a tier ----------------------------------------------------------------------

    def offload(self, meta: BlockMeta, data: torch.Tensor) -> None:
        """Copy a block leaving the GPU to the host tier, or queue it for disk (no host tier, or
        one that cannot take it: too large, or full of replicas live leases pin). A block a lower
        tier already holds (the threshold copied it down: :meth:`pre_offload`) is not copied again."""
        self.backed.pop((meta.block_hash, meta.form, meta.generation), None)
        if not self.tiers.holds(meta):
            self.offload_copy(meta, data)

    def offload_copy(self, meta: BlockMeta, data: torch.Tensor) -> None:
        to_disk = self.tiers.disk_root is not None
        if self.tiers.host is not None:
            t0 = time.perf_counter()
            if self.tiers.put_host(meta, data):
                self.metrics.offload_seconds.labels(tier="host").observe(time.perf_counter() - t0)
                self.metrics.offloaded_bytes.labels(tier="host").inc(data.numel())
                seq = self.emit(meta, self.host_location, None, R.READY, 0, kind="offload")
                if seq:
                    self._host_offer(seq, (meta.block_hash, meta.form))
                to_disk = False
            else:
                reason = "too_large" if data.numel() > self.tiers.host.capacity_bytes else "pinned"
                self.metrics.offload_failures.labels(tier="host", reason=reason).inc()
        if to_disk:
            self.tiers.spill_direct(meta, data)
        if self.tiers.spill_depth:
            self.spill_due.set()

    def pre_offload(self) -> None:
        """Above ``cache.offload_threshold`` of a form's slots, copy its coldest replicas down a
        tier now (the GPU copy stays READY), so the eviction that comes when the pool runs out
        loses nothing and copies nothing: the lower tier already holds them."""
        th = self.offload_threshold
        if self.store is None or th >= 1.0 or (self.tiers.host is None and self.tiers.disk_root is None):
            return
        for form, (used, slots) in self.store.usage().items():
            over = used - int(th * slots)
            if over <= 0:
                continue
            def unbacked(meta: BlockMeta) -> bool:
                key = (meta.block_hash, meta.form, meta.generation)
                if key in self.backed:
                    return False
                self.backed[key] = None
                return not self.tiers.holds(meta)
            # NOTE: only the ones not yet below are copied out of the pool (this runs after commits)
            for meta, data in self.store.coldest(form, over, unbacked):
                self.offload_copy(meta, data)
                self.metrics.pre_offloaded.labels(form=form).inc()
        if len(self.backed) > sum(self.slots.values()):
            # forget backings of slots that left the pool some other way (invalidated, fenced):
            # rarely, once there are more of them than slots
            live = {(m.block_hash, f, m.generation) for f, _, m in self.store.items()}
            for key in [k for k in self.backed if k not in live]:
                del self.backed[key]

    def _unsettled(self, block_hash: str) -> _Unsettled:
        """What the shard of ``block_hash`` keeps until a watermark settles it (a transition on it
        was just queued, so its route is known); what an older epoch kept is forgotten (its
        watermarks no longer come)."""
        route = self._route(block_hash)
        assert route is not None
        contact, _, shard = route
        u = self.unsettled.get(shard)
        if u is None:
            u = self.unsettled[shard] = _Unsettled()
        if u.epoch != contact.epoch:
            u.offers.clear()
            u.offer_of.clear()
            u.commits.clear()
            u.epoch = contact.epoch
        return u

    def _host_offer(self, seq: int, key: tuple[str, str]) -> None:
        """A copy to the host tier went out as transition ``seq``; kept until a watermark settles it."""
        u = self._unsettled(key[0])
        u.offers[seq] = key
        u.offer_of[key] = seq

    def on_watermark(self, wm: CommitWatermark, shard: int = 0) -> None:
        """The ledger's commit watermark: the outbox drops what it covers, and bytes whose
        transition the ledger refused go too, for the ledger does not list them:

        * a copy to the host tier (its source was no longer known, or invalidated), unless the
          tier holds a later copy by now;
        * a GPU commit (its lease had ended first: released after ``settle_timeout_s`` and the
          background wait while the log was out of reach, or expired, and the release aborted the
          write), unless the slot holds another generation by now.

        NOTE: a refused commit's slot is one the ledger counts free; kept, it was bytes no grant
        would ever pin (never read) but that the audit reports as ``unknown_to_ledger``, and a
        pool fuller than the ledger thinks (``make_room`` found it only once the pool ran out)."""
        publisher = self.publisher if self.links is None else self.links.links[shard].publisher
        assert publisher is not None
        publisher.on_watermark(wm)
        u = self.unsettled.get(shard)
        if u is None or wm.epoch != u.epoch:
            return
        offers, offer_of, commits = u.offers, u.offer_of, u.commits
        dropped = 0
        for seq in wm.refused:
            key = offers.pop(seq, None)
            if key is not None and offer_of.get(key) == seq:
                del offer_of[key]
                if self.tiers.host_drop(*key):
                    self.metrics.refused_copies.inc()
            slot = commits.pop(seq, None)
            if slot is not None and self.store is not None and self.store.drop(*slot) is not None:
                self.metrics.refused_commits.inc()
                dropped += 1
        if dropped:
            self.update_pool_metrics()
        while offers:                                  # settled (seqs increase): forget them
            seq = next(iter(offers))
            if seq > wm.seq:
                break
            key = offers.pop(seq)
            if offer_of.get(key) == seq:
                del offer_of[key]
        while commits:
            seq = next(iter(commits))
            if seq > wm.seq:
                break
            del commits[seq]


__all__ = ["ReplicaWriter"]
