"""The worker's membership of every coordinator shard (docs/architecture.md, "The ledger sharded").

A sharded ledger (``coordinator.shards`` > 1) splits the key space by chain: a chain's blocks are
decided by the shard that owns its partition (``shared.shards.shard_of``). A worker is a member of
every shard, each one a coordinator of today's kind, so it keeps with each what it keeps with the
one today: a :class:`ShardLink` holds shard k's client (its subjects), outbox (its epoch and seq
space, its watermarks) and contact (its epoch's standing: registered, suspended, degraded). Each
link is fenced, suspended and resumed on its own.

:class:`ShardLinks` routes:

* a lease to the shard owning its chain (:meth:`ShardLinks.for_chain`), by the map the worker
  holds (read from the stored map at start and every heartbeat interval; :meth:`refresh` after a
  ``wrong_shard`` refusal);
* a transition, an eviction question or an inventory to the shard of its *block*. A replica does
  not carry its chain's root, but every block this worker holds entered through a lease on its
  chain, so the worker remembers ``block → root`` as it leases (:meth:`note`): a chained hash has
  one root, hence one shard, whatever lease names it.

The pool is shared by a fixed share, never double-booked: shard k is told it may use
``slots × (partitions k owns) / partitions`` of each form (:meth:`share`), so the shards' counts
together never exceed the physical pool; each shard decides LRU victims within its share.

One shard (the default) is one link — the engine's own client, outbox and contact — and nothing
here changes what the worker does: no map, no roots, today's subjects.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from shared.messages import MAX_DISK_GC_BLOCKS, DiskBlock, DiskGc, HostEvict
from shared.shards import ShardMap, shard_of
from worker.client import CoordinatorClient
from worker.contact import Contact
from worker.publisher import TransitionPublisher

#: Remembered roots before those of blocks no longer held are forgotten (at least this many).
ROOTS_FLOOR = 65_536


@dataclass(slots=True)
class ShardLink:
    """Shard ``shard``'s client, outbox and the worker's standing with it."""

    shard: int
    client: CoordinatorClient
    publisher: TransitionPublisher
    contact: Contact


class ShardLinks:
    """Every shard's link, the map the worker routes by and the roots of the blocks it leased."""

    def __init__(self, links: list[ShardLink], namespace: str, shard_map: ShardMap | None = None,
                 *, held: Callable[[], Iterable[str]] = tuple, roots_limit: int = ROOTS_FLOOR) -> None:
        assert links and [link.shard for link in links] == list(range(len(links)))
        self.links = links
        self.namespace = namespace
        #: The map routed by (None: one shard).
        self.map = shard_map if len(links) > 1 else None
        #: block → its chain's root, for every block leased here (sharded only).
        self.roots: dict[str, str] = {}
        #: The blocks whose roots must be kept (held in a tier, or by a live session).
        self._held = held
        self._roots_limit = max(ROOTS_FLOOR, roots_limit)
        #: Reads the stored map (set by the engine where one is stored: ``shared.shard_store``).
        self.reader: Any = None

    @property
    def sharded(self) -> bool:
        return self.map is not None

    def __iter__(self):
        return iter(self.links)

    def __len__(self) -> int:
        return len(self.links)

    # --- routing ----------------------------------------------------------------------------

    def for_chain(self, hashes: list[str]) -> ShardLink:
        """The link of the shard owning this chain (shard 0 for no whole block, or one shard)."""
        if self.map is None:
            return self.links[0]
        return self.links[shard_of(self.map, self.namespace, hashes) or 0]

    def note(self, hashes: list[str]) -> None:
        """Remember the root of every block of a chain about to be leased."""
        if self.map is None or not hashes:
            return
        root = hashes[0]
        roots = self.roots
        for h in hashes:
            roots[h] = root
        if len(roots) > self._roots_limit:
            keep = set(self._held()) | set(hashes)
            self.roots = {h: r for h, r in roots.items() if h in keep}

    def shard_of_block(self, block_hash: str) -> int | None:
        """The shard deciding ``block_hash`` (None: sharded, and its root is not known here)."""
        if self.map is None:
            return 0
        root = self.roots.get(block_hash)
        return None if root is None else shard_of(self.map, self.namespace, [root])

    def for_block(self, block_hash: str) -> ShardLink | None:
        k = self.shard_of_block(block_hash)
        return None if k is None else self.links[k]

    def group(self, blocks: Iterable[Any], key: Callable[[Any], str]) -> dict[int, list[Any]]:
        """``blocks`` by the shard deciding each; one whose root is not known is asked of every
        shard (a question about a replica a shard does not hold is answered "not pinned" there)."""
        if self.map is None:
            return {0: list(blocks)}
        out: dict[int, list[Any]] = {}
        for b in blocks:
            k = self.shard_of_block(key(b))
            for shard in (range(len(self.links)) if k is None else (k,)):
                out.setdefault(shard, []).append(b)
        return out

    def share(self, slots: dict[str, int], shard: int) -> dict[str, int]:
        """The slots of each form shard ``shard`` may count: all with one shard, else its partitions' share."""
        if self.map is None:
            return dict(slots)
        owned = len(self.map.owned_by(shard))
        return {form: n * owned // self.map.partitions for form, n in slots.items()}

    # --- questions to the shards -------------------------------------------------------------

    async def outboxes_empty(self, timeout_s: float) -> bool:
        """Whether every shard's outbox empties within ``timeout_s`` (all it holds is committed)."""
        return all(await asyncio.gather(*(link.publisher.wait_empty(timeout_s) for link in self.links)))

    async def ask_evict(self, worker_id: str, blocks: list[DiskBlock], **how: Any) -> set[tuple[str, str]]:
        """``HostEvict`` (``how``: its tier) of each block to the shard deciding it; the (block,
        form) of those a live lease pins. Raises as :meth:`Contact.call` does."""
        pinned: set[tuple[str, str]] = set()
        for k, part in self.group(blocks, lambda b: b.block_hash).items():
            link = self.links[k]
            reply = await link.contact.call("host_evict", link.client.host_evict(HostEvict(
                worker_id=worker_id, epoch=max(1, link.contact.epoch), blocks=part, **how)))
            pinned.update((b.block_hash, b.form) for b in reply.pinned)
        return pinned

    async def disk_pinned(self, worker_id: str, blocks: list[DiskBlock]) -> bool:
        """``DiskGc`` of a segment's disk replicas, each to the shard deciding its block: True if
        a live lease pins one (the segment stays). Raises as :meth:`Contact.call` does."""
        for k, part in self.group(blocks, lambda b: b.block_hash).items():
            link = self.links[k]
            for i in range(0, len(part), MAX_DISK_GC_BLOCKS):
                reply = await link.contact.call("disk_gc", link.client.disk_gc(DiskGc(
                    worker_id=worker_id, epoch=max(1, link.contact.epoch), blocks=part[i:i + MAX_DISK_GC_BLOCKS])))
                if reply.pinned:
                    return True
        return False

    # --- the map ----------------------------------------------------------------------------

    async def follow(self, client: Any, cfg: Any, log: Any) -> None:
        """Take each newer stored map, every heartbeat interval (as the coordinators do: a read,
        not a KV watch, which goes silent with a lost consumer). ``client``: shard 0's, whose
        connection reads the map once it is connected."""
        from shared.shard_store import ShardMapReader   # NATS KV: only a sharded worker reads it

        while True:
            nc = getattr(client, "nc", None)
            if self.reader is None and nc is not None:
                self.reader = ShardMapReader(nc.jetstream(), cfg, log)
            with contextlib.suppress(Exception):     # NATS away: the map held stands (each shard fences)
                if await self.refresh():
                    log.info("shard_map", version=self.map.version if self.map is not None else 0)
            await asyncio.sleep(cfg.coordinator.heartbeat_interval_ms / 1000)

    async def refresh(self) -> bool:
        """Take a newer stored map, if there is one; True if the map changed."""
        if self.map is None or self.reader is None:
            return False
        newer = await self.reader.newer(self.map)
        if newer is self.map:
            return False
        self.map = newer
        return True


__all__ = ["ROOTS_FLOOR", "ShardLink", "ShardLinks"]
