"""The ledger's key space split between coordinator shards: the partition key and the shard map.

Pure (no I/O). docs/architecture.md, "The ledger sharded", argues the choices:

* A key's *partition* is ``blake2b(namespace ‖ root)`` modulo the deployment's partition count,
  ``root`` being the chained hash of its chain's first whole block (``LeaseAcquire.block_hashes[0]``).
  Every hash of one chain shares its root, so a lease never spans shards, and a chained hash
  commits to its root, so each ``(namespace, block)`` key has exactly one partition.
* A :class:`ShardMap` gives each partition its shard, under a version; a move makes a new map
  with the version advanced (freeze, then open), never changes one in place.
* Shard 0 keeps the deployment's subject prefix; shard ``k ≥ 1`` lives under ``<prefix>.s<k>``
  (:func:`shard_subjects`), so one shard is exactly the unsharded deployment.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Annotated

import msgspec

from shared.subjects import Subjects

#: Partitions of a deployment unless ``coordinator.shard_partitions`` says otherwise: many more
#: than shards, so a move is a small share of the load.
DEFAULT_PARTITIONS = 256
#: Most partitions and shards a map may have (a map is a NATS KV value and every coordinator's).
MAX_PARTITIONS = 65_536
MAX_SHARDS = 1024

NonNeg = Annotated[int, msgspec.Meta(ge=0)]


class ShardMapError(ValueError):
    """A shard map that cannot be (a partition without an owner, a move to nowhere, …)."""


def partition_of(namespace: str, root: str, partitions: int) -> int:
    """The partition of a chain: of ``namespace`` and its first block's chained hash ``root``
    (``""`` for a request with no whole block, which pins and writes nothing)."""
    if partitions < 1:
        raise ShardMapError(f"partitions must be at least 1, not {partitions}")
    digest = hashlib.blake2b(f"{namespace}\0{root}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % partitions


class Move(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A partition on its way between shards (the map's version says which step)."""
    partition: NonNeg
    source: NonNeg
    target: NonNeg


class ShardMap(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Which shard owns each partition, at a version. ``owners[p]`` is partition ``p``'s shard;
    a partition in ``moving`` is frozen: no shard takes a lease on it until its move opens."""

    version: Annotated[int, msgspec.Meta(ge=1)] = 1
    shards: Annotated[int, msgspec.Meta(ge=1, le=MAX_SHARDS)] = 1
    owners: list[NonNeg] = msgspec.field(default_factory=lambda: [0])
    moving: list[Move] = []

    def __post_init__(self) -> None:
        if not 1 <= len(self.owners) <= MAX_PARTITIONS:
            raise ShardMapError(f"a shard map has 1 to {MAX_PARTITIONS} partitions, not {len(self.owners)}")
        if len(self.owners) < self.shards:
            raise ShardMapError(f"{self.shards} shards need at least as many partitions, not {len(self.owners)}")
        for p, owner in enumerate(self.owners):
            if owner >= self.shards:
                raise ShardMapError(f"partition {p} is owned by shard {owner}, but the map has {self.shards} shards")
        seen: set[int] = set()
        for mv in self.moving:
            if mv.partition >= len(self.owners) or mv.partition in seen:
                raise ShardMapError(f"move of partition {mv.partition}: no such partition, or listed twice")
            if mv.source != self.owners[mv.partition] or mv.target >= self.shards or mv.target == mv.source:
                raise ShardMapError(f"move of partition {mv.partition} from shard {mv.source} to {mv.target}: "
                                    f"its owner is shard {self.owners[mv.partition]} of {self.shards}")
            seen.add(mv.partition)

    @classmethod
    def uniform(cls, shards: int, partitions: int = DEFAULT_PARTITIONS) -> ShardMap:
        """The static map of ``shards`` shards: partition ``p`` to shard ``p mod shards``, version 1."""
        return cls(version=1, shards=shards, owners=[p % shards for p in range(partitions)])

    @property
    def partitions(self) -> int:
        return len(self.owners)

    def partition(self, namespace: str, root: str) -> int:
        return partition_of(namespace, root, len(self.owners))

    def owner(self, namespace: str, root: str) -> int:
        """The shard that owns this chain's keys (also while it is frozen: see :meth:`frozen`)."""
        return self.owners[self.partition(namespace, root)]

    def frozen(self, partition: int) -> bool:
        return any(mv.partition == partition for mv in self.moving)

    def owned_by(self, shard: int) -> list[int]:
        return [p for p, owner in enumerate(self.owners) if owner == shard]

    def freeze(self, partition: int, target: int) -> ShardMap:
        """Step 1 of a move: the next version, ``partition`` frozen on its way to ``target``."""
        if not 0 <= partition < len(self.owners):
            raise ShardMapError(f"no partition {partition} (the map has {len(self.owners)})")
        if self.frozen(partition):
            raise ShardMapError(f"partition {partition} is already moving")
        mv = Move(partition, self.owners[partition], target)
        return msgspec.structs.replace(self, version=self.version + 1, moving=[*self.moving, mv])

    def open(self, partition: int) -> ShardMap:
        """The last step of a move: the next version, ``partition`` owned by its target and thawed."""
        mv = next((mv for mv in self.moving if mv.partition == partition), None)
        if mv is None:
            raise ShardMapError(f"partition {partition} is not moving")
        owners = list(self.owners)
        owners[partition] = mv.target
        return msgspec.structs.replace(self, version=self.version + 1, owners=owners,
                                       moving=[m for m in self.moving if m.partition != partition])


def shard_of(shard_map: ShardMap | None, namespace: str, block_hashes: Sequence[str]) -> int | None:
    """The shard to ask for a lease on ``block_hashes`` (a worker's or a gateway's routing rule):
    the owner of its chain's partition by ``shard_map`` — the map the caller holds; a stale one is
    refused ``wrong_shard`` by the shard it names, never served by it. ``None`` for a request with no
    whole block, which pins and writes nothing: any shard may answer it. No map: one shard, 0."""
    if not block_hashes:
        return None
    if shard_map is None:
        return 0
    return shard_map.owner(namespace, block_hashes[0])


def map_bucket(prefix: str) -> str:
    """The NATS KV bucket of a deployment's shard map: ``KVL_SHARDS`` for the prefix ``kvl``
    (beside its stream ``KVL_EVENTS``; ``shared.shard_store``)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", prefix).upper() + "_SHARDS"


def shard_subjects(prefix: str, shard: int) -> Subjects:
    """Shard ``shard``'s subjects: shard 0 under ``prefix`` itself (today's), shard k under ``<prefix>.s<k>``."""
    if shard < 0:
        raise ShardMapError(f"shard {shard}: shards are numbered from 0")
    return Subjects(prefix if shard == 0 else f"{prefix}.s{shard}")


__all__ = ["DEFAULT_PARTITIONS", "MAX_PARTITIONS", "MAX_SHARDS", "Move", "ShardMap", "ShardMapError", "map_bucket",
           "partition_of", "shard_of", "shard_subjects"]
