"""Per-form paged pools: allocated once, never reallocated (static topology).

Each declared form gets one pool: a ``[slots, bytes_per_block]`` uint8 tensor on the
worker's device (host memory on CPU), a generation counter per slot and a slot table.
A block's payload for a form is stored as raw bytes in one slot; readers view it back with
the shape and dtype the model declares. Slots are recycled, storage never is: kernels and
CUDA graphs may hold the storage address for the worker's lifetime.

The generation of a slot is bumped on every (re)allocation. A read lease carries the
generation the coordinator recorded at commit; the worker checks it before a kernel reads
the slot, so a slot recycled in between can never be mistaken for the leased block.

A running request whose state reads cached blocks in place (``worker.model.dense.state``)
*pins* their slots (:meth:`FormPool.pin`, at the generation it validated). A pinned slot that
is freed — evicted, fenced, dropped with its epoch — leaves the slot table at once, so no
lookup finds it again, but its storage is not handed out until the last reader unpins it:
the bytes a request validated are the bytes it reads until it ends. Pins are taken and let go
on the model thread and on the event loop, so they, ``free`` and ``allocate`` hold one lock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from shared.forms import FormCatalogue, FormSpec


class PoolExhausted(Exception):
    """No free slot in a form's pool."""


@dataclass(slots=True)
class SlotInfo:
    block_hash: str
    generation: int
    ready: bool = False
    checksum: str = ""


@dataclass
class FormPool:
    spec: FormSpec
    slots: int
    device: torch.device
    storage: torch.Tensor = field(init=False, repr=False)
    generations: list[int] = field(init=False, repr=False)
    table: dict[int, SlotInfo] = field(init=False, repr=False)
    by_hash: dict[str, int] = field(init=False, repr=False)
    _free: list[int] = field(init=False, repr=False)
    #: Each slot's view of ``storage``, made on first use and kept (the storage never moves):
    #: indexing ``storage[slot]`` builds a tensor each time, ~1.3 us, as much as copying a small
    #: block. The price is host memory, ~600 bytes per slot ever used (60 MB per 100k slots).
    _views: list[torch.Tensor | None] = field(init=False, repr=False)
    #: Each slot's memoryview (host pools only), kept for the same reason: ``Tensor.numpy()``
    #: costs ~1.5 us, more than checksumming a small block in place.
    _raws: list[memoryview | None] = field(init=False, repr=False)
    #: The storage's address and whether it is host memory, read once (it never moves).
    base: int = field(init=False, repr=False)
    on_host: bool = field(init=False, repr=False)
    #: Readers per pinned slot; freed slots waiting for their last reader (see the module docstring).
    _pins: dict[int, int] = field(init=False, repr=False)
    _deferred: set[int] = field(init=False, repr=False)
    _lock: threading.Lock = field(init=False, repr=False)

    def __post_init__(self) -> None:
        pin = self.device.type == "cpu" and torch.cuda.is_available()
        self.storage = torch.zeros((self.slots, self.spec.bytes_per_block), dtype=torch.uint8,
                                   device=self.device, pin_memory=pin)
        self.generations = [0] * self.slots
        self.table = {}
        self.by_hash = {}
        self._free = list(range(self.slots - 1, -1, -1))
        self._views = [None] * self.slots
        self._raws = [None] * self.slots
        self.base = self.storage.data_ptr()
        self.on_host = self.storage.device.type == "cpu"
        self._pins = {}
        self._deferred = set()
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def used(self) -> int:
        return self.slots - len(self._free)

    def data_ptr(self) -> int:
        return self.base

    def allocate(self, block_hash: str) -> tuple[int, int]:
        """Take a free slot for ``block_hash``; returns (slot, new generation)."""
        if block_hash in self.by_hash:
            raise ValueError(f"block {block_hash[:12]}… already has a slot in pool {self.name}")
        with self._lock:
            if not self._free:
                waiting = f" ({len(self._deferred)} freed, still read by running requests)" if self._deferred else ""
                raise PoolExhausted(f"pool {self.name}: all {self.slots} slots in use{waiting}")
            slot = self._free.pop()
        self.generations[slot] += 1
        gen = self.generations[slot]
        self.table[slot] = SlotInfo(block_hash, gen)
        self.by_hash[block_hash] = slot
        return slot, gen

    def write(self, slot: int, payload: torch.Tensor | memoryview) -> None:
        """Copy one block's bytes into ``slot``: a tensor, or a flat byte memoryview (a host-tier
        entry's: on host pools a memoryview copy costs a third of ``Tensor.copy_`` at small blocks)."""
        if isinstance(payload, memoryview):
            if payload.nbytes != self.spec.bytes_per_block:
                raise ValueError(f"pool {self.name}: payload is {payload.nbytes} bytes, a slot holds "
                                 f"{self.spec.bytes_per_block}")
            if self.on_host:
                self.raw(slot)[:] = payload   # ValueError unless a flat run of bytes
            else:
                self.view(slot).copy_(torch.frombuffer(payload, dtype=torch.uint8))
            return
        # NOTE: tier copies and exported payloads are flat uint8 already; the conversions below
        # cost twice the copy of a tiny model's block, on every install (and copy_ records no
        # autograd history into a tensor that does not require grad: no detach needed)
        if payload.dtype is torch.uint8 and payload.dim() == 1 and not payload.requires_grad:
            flat = payload
        else:
            flat = payload.detach().contiguous().view(torch.uint8).reshape(-1)
        if flat.numel() != self.spec.bytes_per_block:
            raise ValueError(f"pool {self.name}: payload is {flat.numel()} bytes, a slot holds "
                             f"{self.spec.bytes_per_block}")
        self.view(slot).copy_(flat)  # in place: storage address unchanged

    def view(self, slot: int) -> torch.Tensor:
        v = self._views[slot]
        if v is None:
            v = self._views[slot] = self.storage[slot]
        return v

    def raw(self, slot: int) -> memoryview:
        """The slot's bytes as a memoryview (host memory only; for a checksum in place)."""
        m = self._raws[slot]
        if m is None:
            m = self._raws[slot] = memoryview(self.view(slot).numpy())
        return m

    def free(self, slot: int) -> None:
        with self._lock:
            info = self.table.pop(slot, None)
            if info is None:
                return
            self.by_hash.pop(info.block_hash, None)
            if slot in self._pins:
                self._deferred.add(slot)    # handed out when its last reader unpins it
            else:
                self._free.append(slot)

    def pin(self, slot: int, generation: int) -> bool:
        """Hold ``slot`` for a reader while it still holds ``generation`` (not freed or taken again
        since the reader validated it); False, and nothing held, if it does not."""
        with self._lock:
            info = self.table.get(slot)
            if info is None or info.generation != generation:
                return False
            self._pins[slot] = self._pins.get(slot, 0) + 1
            return True

    def hold(self, slot: int, generation: int) -> SlotHold | None:
        """:meth:`pin` as a :class:`SlotHold`; None when the slot no longer holds ``generation``."""
        return SlotHold(self, slot) if self.pin(slot, generation) else None

    def _add_reader(self, slot: int) -> None:
        with self._lock:
            assert slot in self._pins, "another reader of a slot nobody holds"
            self._pins[slot] += 1

    def unpin(self, slot: int) -> None:
        """One reader of ``slot`` is done; a freed slot goes back to the free list with its last."""
        with self._lock:
            n = self._pins.get(slot, 0) - 1
            if n > 0:
                self._pins[slot] = n
                return
            self._pins.pop(slot, None)
            if slot in self._deferred:
                self._deferred.discard(slot)
                self._free.append(slot)

    def pinned(self, slot: int) -> bool:
        return slot in self._pins

    @property
    def pinned_slots(self) -> int:
        """Slots running requests read in place now (freed ones waiting for them included)."""
        return len(self._pins)

    def lookup(self, block_hash: str) -> tuple[int, SlotInfo] | None:
        slot = self.by_hash.get(block_hash)
        return None if slot is None else (slot, self.table[slot])


class SlotHold:
    """One reader's pin on one slot (:meth:`FormPool.pin`): :meth:`release` lets go (once, from any
    thread); :meth:`share` is another reader of the same bytes (a forked request state), which
    needs no new check: the slot cannot have been taken again while this hold stands."""

    __slots__ = ("_pool", "slot", "_held")

    def __init__(self, pool: FormPool, slot: int) -> None:
        self._pool, self.slot, self._held = pool, slot, True

    def share(self) -> SlotHold:
        assert self._held, "a released hold cannot be shared"
        self._pool._add_reader(self.slot)
        return SlotHold(self._pool, self.slot)

    def release(self) -> None:
        if self._held:
            self._held = False
            self._pool.unpin(self.slot)

    def __del__(self) -> None:
        self.release()


def slots_per_form(catalogue: FormCatalogue, pool_bytes: int, reserve_ratio: float,
                   limits: dict[str, float]) -> dict[str, int]:
    """Slots each form gets from the budget: ``pool_bytes × reserve_ratio × limit(form)``.

    A form without its own ``<form>_pool_limit`` key (e.g. ``indexer``) shares the
    ``compressed`` limit: both are full-history forms and grow together.
    """
    budget = pool_bytes * reserve_ratio
    out = {}
    for f in catalogue.forms:
        frac = limits.get(f.name, limits.get("compressed", 0.0))
        out[f.name] = max(0, int(budget * frac // f.bytes_per_block))
    return out


@dataclass
class PoolSet:
    pools: dict[str, FormPool]

    @classmethod
    def allocate(cls, catalogue: FormCatalogue, slots: dict[str, int], device: torch.device) -> "PoolSet":
        return cls({f.name: FormPool(f, slots[f.name], device) for f in catalogue.forms})

    def __getitem__(self, form: str) -> FormPool:
        return self.pools[form]

    def addresses(self) -> dict[str, int]:
        return {n: p.data_ptr() for n, p in self.pools.items()}

    def usage(self) -> dict[str, tuple[int, int]]:
        return {n: (p.used, p.slots) for n, p in self.pools.items()}

    def nbytes(self) -> int:
        """Bytes of every pool's storage (fixed at allocation: slots are recycled, storage never is)."""
        return sum(p.storage.nbytes for p in self.pools.values())
