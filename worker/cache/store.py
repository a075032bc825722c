"""The GPU tier: per-form pools plus what the worker knows about each slot's bytes.

:class:`CacheStore` wraps :class:`worker.cache.pools.PoolSet` (static storage, generation
per slot) with the record written beside every slot at commit (:class:`BlockMeta`:
namespace, tenant, chain, token span, spec digest, checksum) and a local LRU order, and
answers the questions hit validation asks (:meth:`observe`). Every method runs on the
engine's event-loop thread. A request validates and restores either from a private copy
(:meth:`observe_many`: taken in the same tick as the presence check) or from the slot itself
(:meth:`observe_in_place`, :meth:`reserve`), and then checks that the slot was not recycled
while it read (:meth:`unchanged`: the generation of a slot changes with every allocation, and a
slot is only written right after one) — either way a slot recycled later cannot change what a
request already validated.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import msgspec
import torch

from shared.forms import FormCatalogue
from shared.hashing import checksum
from worker.cache.planner import BlockMeta, Observed
from worker.cache.pools import PoolExhausted, PoolSet, SlotHold
from worker.cache.segments import ALIGN


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor (a view when contiguous)."""
    return t.detach().contiguous().view(torch.uint8).reshape(-1)


def bytes_checksum(t: torch.Tensor) -> str:
    """xxh3 of a tensor's bytes (copied to host first if it lives on a device)."""
    b = as_bytes(t)
    if b.device.type != "cpu":
        b = b.cpu()
    return checksum(memoryview(b.numpy()))


class Reservation(msgspec.Struct, frozen=True):
    """A slot taken for one block before its bytes are known good (a disk reload reads straight
    into it): not READY, so no lookup finds it, and no meta, so nothing offloads it. ``view`` is
    the slot's memory, ``raw`` the same as a memoryview when the slot is ALIGN-aligned (a
    :class:`worker.cache.segments.Destination`). Whoever holds one either installs it
    (:meth:`CacheStore.install_reserved`) or releases it; either way the generation says whether
    the slot is still this one. (A frozen msgspec struct: one per block reloaded, see
    :class:`BlockMeta`.)"""

    form: str
    block_hash: str
    slot: int
    generation: int
    view: torch.Tensor
    raw: memoryview | None = None

    def filled_by(self, data: torch.Tensor | None) -> bool:
        """Whether ``data`` (what a disk read returned) is this slot's memory: the read landed in
        place (the reader hands back the destination's own ``view``). A read that could not use
        the slot returns a buffer of its own (or nothing)."""
        return data is self.view


@dataclass(frozen=True, slots=True)
class SlotRead:
    """Which slot, at which generation, a caller read in place (:meth:`CacheStore.observe_in_place`).
    A READY slot's bytes never change while its generation stands (a slot is written only right
    after an allocation, which bumps it), so :meth:`CacheStore.unchanged` after the read says
    whether what was read is what was validated."""

    form: str
    slot: int
    generation: int


class CacheStore:
    def __init__(self, catalogue: FormCatalogue, slots: dict[str, int], device: torch.device) -> None:
        self.catalogue = catalogue
        self.pools = PoolSet.allocate(catalogue, slots, device)
        self._meta: dict[tuple[str, int], BlockMeta] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {f: OrderedDict() for f in catalogue.names}

    # --- queries -------------------------------------------------------------------------

    def lookup(self, form: str, block_hash: str) -> tuple[int, BlockMeta] | None:
        hit = self.pools[form].lookup(block_hash)
        if hit is None:
            return None
        slot, info = hit
        meta = self._meta.get((form, slot))
        if meta is None or not info.ready:
            return None
        return slot, meta

    def observe(self, form: str, block_hash: str) -> tuple[Observed, torch.Tensor | None]:
        """The facts about ``form`` of ``block_hash`` here, and a private copy of its bytes."""
        hit = self.pools[form].lookup(block_hash)
        if hit is None:
            return Observed(None), None
        slot, info = hit
        meta = self._meta.get((form, slot))
        if meta is None:
            return Observed(None), None
        # NOTE: copy now, validate the copy, restore from the copy: what the checksum covers
        # is exactly what the model reads.
        data = self.pools[form].view(slot).clone()
        self._touch(form, slot)
        return Observed(meta, nbytes=data.numel(), ready=info.ready, checksum=lambda: bytes_checksum(data),
                        aligned=data.is_contiguous()), data

    def observe_many(self, form: str, block_hashes: list[str]) -> list[tuple[Observed, torch.Tensor | None]]:
        """:meth:`observe` for many blocks of one form, copying all their bytes in one gather."""
        pool = self.pools[form]
        found: list[tuple[int, int, BlockMeta, bool]] = []   # (position, slot, meta, ready)
        out: list[tuple[Observed, torch.Tensor | None]] = [(Observed(None), None)] * len(block_hashes)
        for k, h in enumerate(block_hashes):
            hit = pool.lookup(h)
            if hit is None:
                continue
            slot, info = hit
            meta = self._meta.get((form, slot))
            if meta is not None:
                found.append((k, slot, meta, info.ready))
                self._touch(form, slot)
        if not found:
            return out
        index = torch.tensor([slot for _, slot, _, _ in found], dtype=torch.long, device=pool.storage.device)
        # NOTE: one copy of every slot now; validation and restore both read this copy.
        batch = pool.storage.index_select(0, index)
        rows = (batch.cpu() if batch.device.type != "cpu" else batch).numpy()
        nbytes = batch.shape[1]
        # rows of a fresh contiguous gather: element-aligned and contiguous by construction
        for j, (k, _, meta, ready) in enumerate(found):
            out[k] = (Observed(meta, nbytes=nbytes, ready=ready, checksum=lambda v=rows[j]: checksum(v.data)),
                      batch[j])
        return out

    def observe_in_place(self, form: str, block_hashes: list[str]
                         ) -> list[tuple[Observed, torch.Tensor | None, SlotRead | None]]:
        """:meth:`observe_many` without the copy: each block's bytes are its slot's memory, and a
        :class:`SlotRead` names the slot. The caller validates and restores from the slot, then
        asks :meth:`unchanged` before it trusts the result (see the module docstring). Pools in
        device memory are copied as before (their checksum needs host bytes; ``SlotRead`` None)."""
        pool = self.pools[form]
        if pool.storage.device.type != "cpu":
            return [(obs, data, None) for obs, data in self.observe_many(form, block_hashes)]
        out: list[tuple[Observed, torch.Tensor | None, SlotRead | None]] = []
        for h in block_hashes:
            hit = pool.lookup(h)
            meta = self._meta.get((form, hit[0])) if hit is not None else None
            if hit is None or meta is None:
                out.append((Observed(None), None, None))
                continue
            slot, info = hit
            self._touch(form, slot)
            raw = pool.raw(slot)
            out.append((Observed(meta, nbytes=pool.spec.bytes_per_block, ready=info.ready,
                                 checksum=lambda v=raw: checksum(v)),          # a slot is contiguous, aligned
                        pool.view(slot), SlotRead(form, slot, info.generation)))
        return out

    def unchanged(self, read: SlotRead | Reservation) -> bool:
        """Whether a slot read in place (or reserved and read into) still holds what was read: not
        freed and taken again since."""
        if isinstance(read, Reservation):
            return self.holds(read)
        info = self.pools[read.form].table.get(read.slot)
        return info is not None and info.generation == read.generation

    def hold(self, read: SlotRead | Reservation) -> SlotHold | None:
        """Pin the slot a request state reads in place for as long as the state reads it
        (:class:`worker.cache.pools.SlotHold`), if it still holds what was read; else None."""
        return self.pools[read.form].hold(read.slot, read.generation)

    def pinned_slots(self) -> int:
        """Slots running requests read in place now, over every form."""
        return sum(p.pinned_slots for p in self.pools.pools.values())

    def ready_counts(self) -> dict[str, int]:
        return {f: sum(1 for i in p.table.values() if i.ready) for f, p in self.pools.pools.items()}

    def items(self) -> Iterator[tuple[str, int, BlockMeta]]:
        """``(form, slot, meta)`` of every READY slot."""
        for (form, slot), meta in list(self._meta.items()):
            info = self.pools[form].table.get(slot)
            if info is not None and info.ready:
                yield form, slot, meta

    def usage(self) -> dict[str, tuple[int, int]]:
        return self.pools.usage()

    def addresses(self) -> dict[str, int]:
        return self.pools.addresses()

    # --- changes -------------------------------------------------------------------------

    def install(self, meta: BlockMeta, payload: torch.Tensor | memoryview) -> BlockMeta:
        """Put ``payload`` (bytes of one block of ``meta.form``: a tensor, or a flat byte
        memoryview, ``FormPool.write``) in a fresh slot, READY.

        Returns the meta completed with the slot's new generation, and with the bytes' checksum
        when ``meta`` has none (a block just computed). A stale slot holding the same block is
        recycled first. Raises :class:`PoolExhausted` when no slot is free.
        """
        pool = self.pools[meta.form]
        old = pool.lookup(meta.block_hash)
        if old is not None:
            self._free(meta.form, old[0])
        slot, gen = pool.allocate(meta.block_hash)
        try:
            pool.write(slot, payload)
        except Exception:
            self._free(meta.form, slot)
            raise
        info = pool.table[slot]
        info.ready = True
        if meta.checksum:
            full = meta.at_generation(gen)
        else:
            # NOTE: a host pool's bytes are summed where they landed, through the slot's kept
            # memoryview: reaching a tensor's bytes (as_bytes, Tensor.numpy) cost ~5 us a block
            # more, on every block a prompt commits
            sums = (checksum(pool.raw(slot)) if pool.on_host else
                    checksum(payload) if isinstance(payload, memoryview) else bytes_checksum(payload))
            full = msgspec.structs.replace(meta, checksum=sums, generation=gen)
        info.checksum = full.checksum
        self._meta[(meta.form, slot)] = full
        self._touch(meta.form, slot)
        return full

    def reserve(self, form: str, block_hash: str) -> Reservation | None:
        """A free slot for ``block_hash`` of ``form`` to read its bytes into (see
        :class:`Reservation`); None when the block already has a slot here or none is free (the
        caller reads into memory of its own, as before)."""
        pool = self.pools.pools[form]
        if not pool.on_host or block_hash in pool.by_hash:
            return None
        try:
            slot, gen = pool.allocate(block_hash)
        except PoolExhausted:
            return None
        aligned = (pool.base + slot * pool.spec.bytes_per_block) % ALIGN == 0
        return Reservation(form, block_hash, slot, gen, pool.view(slot), pool.raw(slot) if aligned else None)

    def holds(self, r: Reservation) -> bool:
        """Whether ``r``'s slot is still the one reserved: not freed and taken again since (an
        epoch's :meth:`clear`, or another install of the same block, frees it). While this holds,
        nothing but the reservation's holder has written the slot."""
        info = self.pools[r.form].table.get(r.slot)
        return info is not None and info.generation == r.generation and not info.ready

    def install_reserved(self, meta: BlockMeta, r: Reservation) -> BlockMeta | None:
        """Make the reserved slot READY as ``meta``'s replica, its bytes already in place; None
        (nothing changed) when the reservation was lost."""
        if not self.holds(r) or meta.form != r.form or meta.block_hash != r.block_hash:
            return None
        info = self.pools[r.form].table[r.slot]
        info.ready = True
        info.checksum = meta.checksum
        full = meta.at_generation(r.generation)
        self._meta[(r.form, r.slot)] = full
        self._touch(r.form, r.slot)
        return full

    def release(self, r: Reservation) -> None:
        """Give a reserved slot back (idempotent; a lost reservation is left alone)."""
        if self.holds(r):
            self._free(r.form, r.slot)

    def drop(self, form: str, block_hash: str, generation: int | None = None) -> tuple[BlockMeta, torch.Tensor] | None:
        """Free the slot of ``form``/``block_hash`` (only at ``generation`` if given).

        Returns its meta and a copy of its bytes (for an offload), or None if it was not there.
        """
        hit = self.pools[form].lookup(block_hash)
        if hit is None:
            return None
        slot, info = hit
        meta = self._meta.get((form, slot))
        if generation is not None and info.generation != generation:
            return None
        data = self.pools[form].view(slot).clone()
        self._free(form, slot)
        return (meta, data) if meta is not None else None

    def coldest(self, form: str, n: int, want: Callable[[BlockMeta], bool]) -> list[tuple[BlockMeta, torch.Tensor]]:
        """Of the ``n`` least recently used READY blocks of ``form``, those ``want`` accepts, with
        a copy of their bytes (untouched: copying them down a tier does not make them recent)."""
        out = []
        seen = 0
        for slot in self._lru[form]:
            if seen >= n:
                break
            meta = self._meta.get((form, slot))
            info = self.pools[form].table.get(slot)
            if meta is not None and info is not None and info.ready:
                seen += 1
                if want(meta):
                    out.append((meta, self.pools[form].view(slot).clone()))
        return out

    def coldest_metas(self, form: str, n: int, want: Callable[[BlockMeta], bool]) -> list[BlockMeta]:
        """The ``n`` least recently used READY blocks of ``form`` that ``want`` accepts (untouched)."""
        out: list[BlockMeta] = []
        pool = self.pools[form]
        table = pool.table
        for slot in self._lru[form]:
            if len(out) >= n:
                break
            meta = self._meta.get((form, slot))
            info = table.get(slot)
            # NOTE: not a slot a running request reads in place: freeing it would free no memory
            if meta is not None and info is not None and info.ready and not pool.pinned(slot) and want(meta):
                out.append(meta)
        return out

    def lru_victim(self, form: str, keep: set[str]) -> BlockMeta | None:
        """The least recently used READY slot of ``form`` whose block is not in ``keep``."""
        found = self.coldest_metas(form, 1, lambda m: m.block_hash not in keep)
        return found[0] if found else None

    def clear(self) -> int:
        """Forget every slot (a new epoch fences them all); storage stays allocated."""
        n = 0
        for form, pool in self.pools.pools.items():
            for slot in list(pool.table):
                self._free(form, slot)
                n += 1
        return n

    def _touch(self, form: str, slot: int) -> None:
        lru = self._lru[form]
        lru.pop(slot, None)
        lru[slot] = None

    def _free(self, form: str, slot: int) -> None:
        self.pools[form].free(slot)
        self._meta.pop((form, slot), None)
        self._lru[form].pop(slot, None)


__all__ = ["CacheStore", "PoolExhausted", "Reservation", "SlotRead", "as_bytes", "bytes_checksum"]
