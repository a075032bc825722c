"""The host-memory tier: evicted GPU blocks kept in (pinned, on CUDA) host memory.

An LRU of fixed byte capacity keyed by (block hash, form). Every entry keeps the checksum
recorded at commit, and a reload always re-verifies it: host memory is outside the pools'
generation fencing, so integrity is the only proof left.

Pins: an entry a live lease pins is never an LRU victim (``pinned``, the keys this worker's
leases pin now). The ledger refuses the eviction of a pinned replica and keeps it READY, so
dropping its bytes anyway would leave a READY replica that exists nowhere (the finding of
``tests/faults/test_host_tier_pins.py``). When only pinned entries could make room, the new
entry is refused instead (the caller sends it on to the disk tier).
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
    #: The keys live leases pin now (never LRU victims); None: nothing is pinned.
    pinned: Callable[[], set[tuple[str, str]]] | None = None
    #: key → (bytes, checksum, a memoryview of the bytes: what the checksum is recomputed over on
    #: every read, made once — ``Tensor.numpy()`` costs 1.5 us, five times the xxh3 of a small block)
    _entries: OrderedDict[tuple[str, str], tuple[torch.Tensor, str, memoryview]] = field(default_factory=OrderedDict)
    used_bytes: int = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, block_hash: str, form: str, payload: torch.Tensor, digest: str) -> list[tuple[str, str]] | None:
        """Store a copy; returns the keys evicted to make room (oldest unpinned first), or None
        (nothing changed) when the entry does not fit even after every unpinned one left."""
        data = payload.detach().contiguous().view(torch.uint8).reshape(-1)
        n = data.numel()
        if n > self.capacity_bytes:
            return None
        key = (block_hash, form)
        need = self.used_bytes - self._size(key) + n - self.capacity_bytes
        victims: list[tuple[str, str]] = []
        if need > 0:
            pinned = self.pinned() if self.pinned is not None else set()
            for old, (t, _, _) in self._entries.items():
                if need <= 0:
                    break
                if old != key and old not in pinned:
                    victims.append(old)
                    need -= t.numel()
            if need > 0:
                return None
        self.drop(block_hash, form)
        evicted = []
        for old in victims:
            t, d, _ = self._entries.pop(old)
            self.used_bytes -= t.numel()
            evicted.append(old)
            if self.on_evict is not None:
                self.on_evict(old, t, d)
        copy = torch.empty(n, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        copy.copy_(data.cpu())
        self._entries[key] = (copy, digest, memoryview(copy.numpy()))
        self.used_bytes += n
        return evicted

    def get(self, block_hash: str, form: str) -> torch.Tensor | None:
        """The verified bytes, or None if absent. Raises HostTierCorrupt on a bad checksum."""
        key = (block_hash, form)
        item = self._entries.get(key)
        if item is None:
            return None
        data, digest, view = item
        if checksum(view) != digest:
            self.drop(block_hash, form)
            raise HostTierCorrupt(f"host-tier copy of block {block_hash[:12]}… form {form} fails its checksum")
        self._entries.move_to_end(key)
        return data

    def peek(self, block_hash: str, form: str) -> tuple[torch.Tensor, str, memoryview] | None:
        """The stored bytes, their recorded checksum and a memoryview of the bytes, *unverified*
        (touches the LRU order).

        For a caller that copies the bytes and checksums its copy: one pass over the bytes
        instead of two, and the check covers exactly what it will use.
        """
        key = (block_hash, form)
        item = self._entries.get(key)
        if item is not None:
            self._entries.move_to_end(key)
        return item

    def _size(self, key: tuple[str, str]) -> int:
        item = self._entries.get(key)
        return item[0].numel() if item is not None else 0

    def drop(self, block_hash: str, form: str) -> bool:
        item = self._entries.pop((block_hash, form), None)
        if item is None:
            return False
        self.used_bytes -= item[0].numel()
        return True

    def keys(self) -> list[tuple[str, str]]:
        return list(self._entries)
