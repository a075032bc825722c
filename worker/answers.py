"""What the worker answers the coordinator's requests: its inventory, and the decisions it applies.

* :meth:`Answers.on_inventory` — what this worker holds (items, or every replica digest grouped by
  location), or, for an audit's disk check, the verdicts on the records it names;
* :meth:`Answers.on_control` — a decision the ledger already records, applied locally: drain,
  evict, invalidate (a block, blocks, a namespace).

With a sharded ledger each shard asks about, and decides, its own chains only. Nothing here emits
a transition; it never touches a request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from shared.messages import Control, ControlAck, InventoryItem, InventoryReply, InventoryRequest, ReplicaState
from worker.cache import offload_key as of
from worker.cache.planner import BlockMeta
from worker.cache.replicas import ReplicaWriter
from worker.cache.store import CacheStore
from worker.cache.tiers import Tiers
from worker.contact import Contact
from worker.publisher import TransitionPublisher
from worker.shard_links import ShardLinks

R = ReplicaState


class Answers:
    """The coordinator's inventory and control requests, answered (see the module's docstring)."""

    def __init__(self, *, contact: Contact, publisher: TransitionPublisher | None, links: ShardLinks | None,
                 replicas: ReplicaWriter, store: CacheStore | None, tiers: Tiers, log: Any, worker_id: str,
                 namespace: str, spec_digests: dict[str, str], io: Callable[[Callable[[], Any]], Any],
                 active_sessions: Callable[[], int]) -> None:
        self.contact = contact
        self.publisher = publisher
        self.links = links
        self.replicas = replicas
        self.store = store
        self.tiers = tiers
        self.log = log
        self.worker_id = worker_id
        self.gpu = f"gpu:{worker_id}"
        self.host_location = f"host:{worker_id}"
        self.namespace = namespace
        self.spec_digests = spec_digests
        self.io = io
        self._active_sessions = active_sessions

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


__all__ = ["Answers"]
