"""Where a sharded deployment keeps its shard map: one key of a NATS KV bucket (JetStream), written
by compare-and-set on its revision and read again every few moments by every coordinator and
gateway (docs/architecture.md, "The ledger sharded").

The first reader of an empty bucket stores the static map of the config (version 1); from then on
only a move changes it (``kvledger shard freeze`` / ``open``), each change a new version. A
follower takes a map only if it is the deployment's shape (shards and partitions as configured)
and newer than the one it holds, so a map never goes back.
"""

from __future__ import annotations

import contextlib
from typing import Any

import msgspec
import nats.js.errors

from shared.shards import ShardMap, map_bucket

#: The map's key in the bucket.
KEY = "map"


class ShardMapConflict(Exception):
    """The map changed since it was read (another writer): read it again and decide again."""


class ShardMapStore:
    def __init__(self, js: Any, prefix: str, *, replicas: int = 1) -> None:
        self.js = js
        self.bucket = map_bucket(prefix)
        self.replicas = replicas
        self._kv: Any = None

    async def _bucket(self, create: bool = True) -> Any:
        if self._kv is None:
            try:
                self._kv = await self.js.key_value(self.bucket)
            except nats.js.errors.BucketNotFoundError:
                if not create:
                    raise
                self._kv = await self.js.create_key_value(bucket=self.bucket, history=16, replicas=self.replicas)
        return self._kv

    async def get(self) -> ShardMap | None:
        """The stored map (None when none is stored yet), for a reader that may not write (a gateway)."""
        try:
            entry = await (await self._bucket(create=False)).get(KEY)
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.KeyNotFoundError):
            return None
        return msgspec.json.decode(entry.value, type=ShardMap)

    async def load(self, initial: ShardMap) -> tuple[ShardMap, int]:
        """The stored map and its revision; ``initial`` is stored first when there is none."""
        kv = await self._bucket()
        try:
            entry = await kv.get(KEY)
        except nats.js.errors.KeyNotFoundError:
            with contextlib.suppress(nats.js.errors.KeyWrongLastSequenceError):   # another reader stored it first
                return initial, await kv.create(KEY, msgspec.json.encode(initial))
            entry = await kv.get(KEY)
        return msgspec.json.decode(entry.value, type=ShardMap), entry.revision

    async def replace(self, new: ShardMap, revision: int) -> int:
        """Store ``new`` if the map is still at ``revision``; its new revision, else :class:`ShardMapConflict`."""
        kv = await self._bucket()
        try:
            return await kv.update(KEY, msgspec.json.encode(new), last=revision)
        except nats.js.errors.KeyWrongLastSequenceError as e:
            raise ShardMapConflict(f"the shard map changed since revision {revision}") from e


class ShardMapReader:
    """A reader's view of the stored map (a gateway's, at each fleet refresh): the stored one when
    it is of this deployment's shape and newer than the one held, else the one held."""

    def __init__(self, js: Any, config: Any, logger: Any) -> None:
        self.store = ShardMapStore(js, config.nats.subject_prefix)
        self.shards, self.partitions = config.coordinator.shards, config.coordinator.shard_partitions
        self.log = logger

    async def newer(self, held: ShardMap) -> ShardMap:
        try:
            stored = await self.store.get()
        except Exception as e:  # noqa: BLE001 - NATS away, or no grant to read it: keep the map held
            self.log.debug("shard_map_unreadable", error=type(e).__name__)
            return held
        if stored is None or stored.version <= held.version:
            return held
        if (why := accepts(held, stored, self.shards, self.partitions)):
            self.log.warning("shard_map_refused", version=stored.version, why=why)
            return held
        self.log.info("shard_map", version=stored.version)
        return stored


def accepts(held: ShardMap | None, new: ShardMap, shards: int, partitions: int) -> str:
    """Why a follower holding ``held`` must not take ``new`` ("" when it may)."""
    if (new.shards, new.partitions) != (shards, partitions):
        return (f"the map has {new.shards} shards and {new.partitions} partitions, the config "
                f"{shards} and {partitions} (coordinator.shards, coordinator.shard_partitions)")
    if held is not None and new.version <= held.version:
        return f"version {new.version} is not newer than the one held ({held.version})"
    return ""


__all__ = ["KEY", "ShardMapConflict", "ShardMapReader", "ShardMapStore", "accepts"]
