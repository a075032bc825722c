"""The host-memory tier: evicted GPU blocks kept in (pinned, on CUDA) host memory.

An LRU of fixed byte capacity keyed by (block hash, form). Every entry keeps the checksum
recorded at commit, and a reload always re-verifies it: host memory is outside the pools'
generation fencing, so integrity is the only proof left.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shared.hashing import checksum


class HostTierCorrupt(Exception):
    """A host-tier entry whose bytes no longer match their checksum."""


@dataclass
class HostTier:
    capacity_bytes: int
    #: Called with ``((block_hash, form), bytes, checksum)`` for each LRU victim of ``put``
    #: (e.g. to spill it to the disk tier) before the bytes are dropped.
    on_evict: Callable[[tuple[str, str], torch.Tensor, str], None] | None = None
    _entries: OrderedDict[tuple[str, str], tuple[torch.Tensor, str]] = field(default_factory=OrderedDict)
    used_bytes: int = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, block_hash: str, form: str, payload: torch.Tensor, digest: str) -> list[tuple[str, str]]:
        """Store a copy; returns the keys evicted to make room (oldest first)."""
        data = payload.detach().contiguous().view(torch.uint8).reshape(-1)
        n = data.numel()
        if n > self.capacity_bytes:
            return []
        key = (block_hash, form)
        self.drop(block_hash, form)
        evicted = []
        while self.used_bytes + n > self.capacity_bytes and self._entries:
            old, (t, d) = self._entries.popitem(last=False)
            self.used_bytes -= t.numel()
            evicted.append(old)
            if self.on_evict is not None:
                self.on_evict(old, t, d)
        copy = torch.empty(n, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        copy.copy_(data.cpu())
        self._entries[key] = (copy, digest)
        self.used_bytes += n
        return evicted

    def get(self, block_hash: str, form: str) -> torch.Tensor | None:
        """The verified bytes, or None if absent. Raises HostTierCorrupt on a bad checksum."""
        key = (block_hash, form)
        item = self._entries.get(key)
        if item is None:
            return None
        data, digest = item
        if checksum(data.numpy().tobytes()) != digest:
            self.drop(block_hash, form)
            raise HostTierCorrupt(f"host-tier copy of block {block_hash[:12]}… form {form} fails its checksum")
        self._entries.move_to_end(key)
        return data

    def peek(self, block_hash: str, form: str) -> tuple[torch.Tensor, str] | None:
        """The stored bytes and their recorded checksum, *unverified* (touches the LRU order).

        For a caller that copies the bytes and checksums its copy: one pass over the bytes
        instead of two, and the check covers exactly what it will use.
        """
        key = (block_hash, form)
        item = self._entries.get(key)
        if item is not None:
            self._entries.move_to_end(key)
        return item

    def drop(self, block_hash: str, form: str) -> bool:
        item = self._entries.pop((block_hash, form), None)
        if item is None:
            return False
        self.used_bytes -= item[0].numel()
        return True

    def keys(self) -> list[tuple[str, str]]:
        return list(self._entries)
