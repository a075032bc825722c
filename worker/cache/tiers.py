"""The host and disk tiers as the engine sees them: storage plus the facts validation needs.

* **host** — :class:`worker.cache.host_tier.HostTier` (pinned memory on CUDA, byte-capped
  LRU, checksum re-verified on every read) plus the :class:`BlockMeta` of each entry. An
  entry the LRU pushes out is queued for the disk tier (:meth:`Tiers.take_spills`) and stays
  readable from that queue until the disk writer has handled it.
* **disk** — the shared offload directory: each worker appends to its own segment files
  (:mod:`worker.cache.segments`; one fsync per batch), and reads any worker's records, every
  header field and the checksum checked by :func:`worker.cache.planner.validate`. A write that
  fails for lack of space or permission marks the tier down for ``retry_s``; the worker keeps
  serving without it. This worker's segments are bounded in bytes (:meth:`disk_collectable`,
  :meth:`disk_delete`) and in age (:meth:`disk_expired`) by the supervisor's disk GC
  (:mod:`worker.disk_gc`), which deletes a segment
  only once the ledger has evicted every replica it holds.

Disk methods block (file I/O): the engine runs them in its I/O thread, one at a time, so
writes are sequential and a batch of reloads is one executor call.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
import torch

from shared.hashing import checksum
from shared.versions import SEGMENT_FORMAT_VERSION
from worker.cache import offload_key as of
from worker.cache.host_tier import HostTier
from worker.cache.planner import BlockMeta, Observed
from worker.cache.segment_writer import SegmentWriter
from worker.cache.segments import ALIGN, Destination, Found, Record, SegmentIndex, key_of

Key = tuple[str, str]  # (block_hash, form)


class DiskRead(msgspec.Struct, frozen=True):
    """One block read from the disk tier: what validation needs, and the bytes (a frozen msgspec
    struct: one per block reloaded, see :class:`worker.cache.segments.Found`)."""

    observed: Observed
    data: torch.Tensor | None
    #: The tier could not be read at all (directory missing, I/O error): not the file's fault.
    unavailable: str = ""


class Tiers:
    def __init__(self, host_bytes: int, disk_root: str | Path | None, *, retry_s: float = 5.0,
                 host_pins: Callable[[], set[Key]] | None = None, writer: str = "",
                 segment_bytes: int = 64 * 2**20) -> None:
        self.host = HostTier(host_bytes, on_evict=self._spill, pinned=host_pins) if host_bytes > 0 else None
        self._host_meta: dict[Key, BlockMeta] = {}
        self._spills: OrderedDict[Key, tuple[BlockMeta, torch.Tensor, bool]] = OrderedDict()
        #: Host-tier victims in the spill queue whose disk copy is handled, waiting only for the
        #: coordinator's eviction decision (the next pass asks again without writing them again).
        self._disk_done: set[Key] = set()
        self.disk_root = Path(disk_root) if disk_root else None
        #: This worker's segments (None without a disk tier or a writer id: read-only).
        self._writer = SegmentWriter(self.disk_root, writer, segment_bytes) if self.disk_root and writer else None
        self._disk_index = SegmentIndex(self.disk_root) if self.disk_root else None
        self.retry_s = retry_s
        self._disk_down_until = 0.0
        self.disk_down_reason = ""

    # --- host ------------------------------------------------------------------------------

    def put_host(self, meta: BlockMeta, data: torch.Tensor) -> bool:
        """Copy one block to host memory; False if there is no host tier or it cannot hold it
        (too large, or only entries live leases pin could make room).

        LRU victims go to the spill queue (see :meth:`take_spills`).
        """
        if self.host is None or data.numel() > self.host.capacity_bytes:
            return False
        if self.host.put(meta.block_hash, meta.form, data, meta.checksum) is None:
            return False
        key = (meta.block_hash, meta.form)
        self._spills.pop(key, None)
        self._disk_done.discard(key)
        self._host_meta[key] = meta
        return True

    def _spill(self, key: Key, data: torch.Tensor, digest: str) -> None:
        meta = self._host_meta.pop(key, None)
        if meta is not None:
            self._spills[key] = (meta, data, True)
            self._disk_done.discard(key)   # a new entry: its disk copy is still to be made

    def host_read(self, block_hash: str, form: str) -> tuple[Observed, torch.Tensor | None, memoryview | None]:
        """A host entry (or one waiting in the spill queue), verified: its bytes, read-only, as a
        tensor (what a restore reads) and as a memoryview (what an install copies fastest)."""
        key = (block_hash, form)
        meta = self._host_meta.get(key)
        data = view = None
        if self.host is not None and meta is not None:
            item = self.host.peek(block_hash, form)
            if item is not None:
                data, _, view = item
        if data is None and key in self._spills:
            meta, data, _ = self._spills[key]
        if meta is None or data is None:
            return Observed(None), None, None
        # NOTE: verify, once, always: host memory is outside the pools' generation fencing, so
        # the checksum is the only proof left. It covers exactly what the caller reads without a
        # private copy, because these tensors are immutable by construction: the host tier and
        # the spill queue hold copies made for them alone (``HostTier.put``, ``CacheStore.drop``,
        # ``coldest``), never write into them, and replace rather than rewrite an entry; callers
        # only read them (restore copies out, an install copies into a slot). A copy here cost
        # more than the check (fresh memory: page faults), and on CUDA it left pinned memory.
        if view is None:
            view = memoryview(data.numpy())
        digest = checksum(view)
        if digest != meta.checksum:
            self.host_drop(block_hash, form)
            return Observed(meta, damage=f"host-tier copy of block {block_hash[:12]}… form {form} fails its "
                                         f"checksum"), None, None
        return Observed(meta, nbytes=data.numel(), checksum=lambda: digest), data, view

    def host_drop(self, block_hash: str, form: str) -> bool:
        key = (block_hash, form)
        self._host_meta.pop(key, None)
        gone = self.host.drop(block_hash, form) if self.host is not None else False
        self._disk_done.discard(key)
        return gone or self._spills.pop(key, None) is not None

    def host_items(self) -> list[BlockMeta]:
        """The host replicas this worker holds: the host tier's entries and the LRU victims still
        waiting in the spill queue (:meth:`host_read` serves them until :meth:`spilled`)."""
        return list(self._host_meta.values()) + [m for m, _, from_host in self._spills.values() if from_host]

    def host_clear(self) -> int:
        n = 0
        for block_hash, form in list(self._host_meta):
            n += self.host_drop(block_hash, form)
        self._spills.clear()
        self._disk_done.clear()
        return n

    def take_spills(self) -> list[tuple[BlockMeta, torch.Tensor, bool]]:
        """``(meta, bytes, from_host)`` waiting for the disk writer, oldest first.

        ``from_host`` is True for host-tier victims (their host replica must be evicted once
        handled), False for blocks queued by :meth:`spill_direct`. Entries stay readable
        through :meth:`host_read` until :meth:`spilled` is called.
        """
        return list(self._spills.values())

    def spill_direct(self, meta: BlockMeta, data: torch.Tensor) -> None:
        """Queue a block for the disk tier without passing through host memory."""
        key = (meta.block_hash, meta.form)
        self._spills[key] = (meta, data.cpu(), False)
        self._disk_done.discard(key)

    def is_spilling(self, meta: BlockMeta) -> bool:
        return (meta.block_hash, meta.form) in self._spills

    def spilled(self, meta: BlockMeta) -> None:
        key = (meta.block_hash, meta.form)
        self._spills.pop(key, None)
        self._disk_done.discard(key)

    def disk_done(self, meta: BlockMeta) -> None:
        """A host-tier victim's disk copy is handled; it waits in the queue only for its eviction."""
        key = (meta.block_hash, meta.form)
        if key in self._spills:
            self._disk_done.add(key)

    def needs_disk(self, meta: BlockMeta) -> bool:
        """Whether a queued block still has to be written (False once :meth:`disk_done`)."""
        return (meta.block_hash, meta.form) not in self._disk_done

    @property
    def evictions_waiting(self) -> int:
        """Host-tier victims kept in the queue until the coordinator decides their eviction."""
        return len(self._disk_done)

    def keep_pinned(self, meta: BlockMeta) -> bool:
        """An LRU victim of the host tier that a live lease of this worker pinned while it waited
        to be spilled (the grant came during the disk write): it stays a host replica — back
        into the host tier, or, if only pinned entries could make room there, still readable in
        the spill queue for the next pass. False if it is not such a victim.

        NOTE: the host LRU skips pinned entries when it picks victims; this is the second place
        a host replica's bytes go, and a pinned replica stays READY in the ledger, so dropping
        it here would leave a READY host replica that exists nowhere. (Pins of grants this worker
        has not heard of yet are the coordinator's to see: ``SpillWriter._evict_host``.)"""
        key = (meta.block_hash, meta.form)
        item = self._spills.get(key)
        if item is None or not item[2] or self.host is None or self.host.pinned is None \
                or key not in self.host.pinned():
            return False
        self.put_host(item[0], item[1])
        return True

    def holds(self, meta: BlockMeta) -> bool:
        """Whether a lower tier already has these bytes (host entry, queued for disk, or a disk
        record this worker knows of, with the same checksum)."""
        key = (meta.block_hash, meta.form)
        have = self._host_meta.get(key)
        if have is not None and have.checksum == meta.checksum:
            return True
        if key in self._spills:
            return True
        if self.disk_root is not None:
            r = self._index.lookup(key_of(meta))
            return r is not None and r.header.checksum == meta.checksum
        return False

    @property
    def spill_depth(self) -> int:
        return len(self._spills)

    # --- disk ------------------------------------------------------------------------------

    def disk_available(self, now: float | None = None) -> bool:
        if self.disk_root is None:
            return False
        return (time.monotonic() if now is None else now) >= self._disk_down_until

    def mark_disk_down(self, reason: str, now: float | None = None) -> None:
        self._disk_down_until = (time.monotonic() if now is None else now) + self.retry_s
        self.disk_down_reason = reason

    def disk_write_many(self, items: Sequence[tuple[BlockMeta, torch.Tensor]]) -> list[str]:
        """Append blocks to this worker's current segment, one fsync for all (blocking); returns
        their checksums. Raises OffloadUnavailable (none of them is written then)."""
        assert self.disk_root is not None and self._writer is not None
        # NOTE: the metas name the records as they are (a BlockMeta has every key field): the
        # engine checked each key before queueing it (``SpillWriter._spill_batch``), and a BlockKey
        # per record here, each field re-checked by a regex, was 40 % of a batch's CPU time.
        # (``is_cpu``: ``device.type`` builds a device object, 0.28 against 0.06 us a record)
        batch = [(meta, memoryview((data if data.is_cpu else data.cpu()).contiguous().numpy()))
                 for meta, data in items]
        records = self._writer.append(batch)
        self._index.add(records)
        self.disk_down_reason = ""
        return [r.header.checksum for r in records]

    def disk_read_many(self, wants: Sequence[BlockMeta],
                       into: Sequence[Destination | None] | None = None) -> list[DiskRead]:
        """Read blocks (blocking), one read per contiguous run of records, and report what each
        record says about itself.

        ``into`` optionally names where each payload should land (a reserved pool slot, see
        :meth:`SegmentIndex.read_many`); ``DiskRead.data`` is its ``view`` when it did.

        ``want`` names the record (tenant, namespace, block, form; the spec digest the running
        model expects) and supplies the chain facts a record does not store (parent, span):
        the block hash binds them, and intersection checks the hash.
        """
        assert self.disk_root is not None
        try:
            # NOTE: a BlockMeta names its record as it is: the index is a dict by these fields (none
            # of them is a path any more), so a BlockKey per want, each field regex-checked, only
            # cost time (~5 us a record, a quarter of a tiny block's reload)
            found = self._index.read_many(wants, into)
        except of.OffloadUnavailable as e:
            return [DiskRead(Observed(None), None, unavailable=str(e)) for _ in wants]
        return [self._observe(w, f) for w, f in zip(wants, found)]

    @staticmethod
    def _observe(want: BlockMeta, f: Found) -> DiskRead:
        if f.unavailable:
            return DiskRead(Observed(None), None, unavailable=f.unavailable)
        if f.record is None:
            return DiskRead(Observed(None), None)
        h = f.record.header
        meta = BlockMeta(h.namespace, h.tenant, h.block_hash, want.parent_hash, want.token_start, want.token_end,
                         h.form, h.spec_digest, h.checksum)
        if h.version != SEGMENT_FORMAT_VERSION:
            return DiskRead(Observed(meta, damage=f"segment record format v{h.version}; this build reads "
                                                  f"v{SEGMENT_FORMAT_VERSION}"), None)
        if f.damage or f.data is None:
            return DiskRead(Observed(meta, damage=f.damage or "unreadable record"), None)
        data = f.data
        # NOTE: a digest the read computed covers the bytes as read into a reserved slot; were the
        # slot taken since, the session sees it by the reservation after its restore and recomputes
        digest = f.digest
        return DiskRead(Observed(meta, nbytes=data.numel(), checksum=lambda: digest,
                                 aligned=data.data_ptr() % ALIGN == 0), data)

    def disk_check(self, wants: Sequence[tuple[BlockMeta, str]]) -> list[str]:
        """For the audit: each ``(block, checksum recorded at commit)``'s record verified without
        keeping it: ``""`` (whole and as expected), ``"missing"``, or what is wrong. Raises
        OffloadUnavailable (the directory itself cannot be read)."""
        self._index.refresh()
        out = []
        for (want, expected), r in zip(wants, self.disk_read_many([w for w, _ in wants])):
            if r.unavailable:
                raise of.OffloadUnavailable(r.unavailable)
            obs = r.observed
            if obs.meta is None:
                out.append("missing")
            elif obs.damage:
                out.append(obs.damage)
            elif obs.meta.spec_digest != want.spec_digest:
                out.append(f"record is for spec_digest={obs.meta.spec_digest!r}, expected {want.spec_digest!r}")
            elif obs.checksum() != obs.meta.checksum:
                out.append("payload checksum does not match the record's header (corrupted bytes)")
            elif expected and obs.meta.checksum != expected:
                out.append("payload checksum differs from the one recorded at commit")
            else:
                out.append("")
        return out

    def disk_drop(self, meta: BlockMeta) -> None:
        """Stop reading one record (it failed validation); its segment goes with the GC."""
        if self.disk_root is not None:
            self._index.drop(key_of(meta))

    # --- the bound on this worker's segments ---------------------------------------------------

    def disk_usage(self) -> int:
        """Bytes of this worker's own segments."""
        return sum(size for _, size in self._writer.segments()) if self._writer is not None else 0

    def disk_collectable(self) -> list[tuple[Path, int, list[BlockMeta]]]:
        """This worker's segments the GC may delete, oldest first (not the one being appended
        to), each with its size and the blocks whose newest record *of this worker's* it holds.

        NOTE: a block this worker wrote again later lies in a newer segment of its own: the old
        record is dead bytes, and naming it would have the ledger evict a replica whose bytes live
        on. Another worker's newer record does not count: the ledger replica may be this
        worker's (the first writer owns it), and the other worker's GC will not evict what it
        does not own, so skipping it here would leave a READY replica whose owner's bytes are
        gone once the other deletes its copy."""
        if self._writer is None:
            return []
        self._index.refresh()
        segments = self._writer.segments()
        newest: dict[tuple[str, str, str, str], Record] = {}
        for path, _ in segments:                          # oldest first: later records win
            for r in self._index.records(path):
                newest[r.key] = r
        out = []
        for path, size in segments:
            if path == self._writer.current:
                continue
            metas = [BlockMeta(namespace=r.header.namespace, tenant=r.header.tenant, block_hash=r.header.block_hash,
                               parent_hash="", token_start=0, token_end=0, form=r.header.form,
                               spec_digest=r.header.spec_digest, checksum=r.header.checksum)
                     for r in self._index.records(path) if newest[r.key] is r]
            out.append((path, size, metas))
        return out

    def disk_expired(self, max_age_s: float, now: float | None = None) -> list[tuple[Path, int, list[BlockMeta]]]:
        """The :meth:`disk_collectable` segments last written more than ``max_age_s`` ago (by
        their modification time, so a segment still appended to is never one), oldest first."""
        cutoff = (time.time() if now is None else now) - max_age_s
        out = []
        for path, size, metas in self.disk_collectable():
            try:
                if path.stat().st_mtime < cutoff:
                    out.append((path, size, metas))
            except FileNotFoundError:
                continue            # deleted meanwhile (the bound's GC)
        return out

    def disk_delete(self, path: Path) -> None:
        """Delete one of this worker's segments (its replicas evicted in the ledger first)."""
        assert self._writer is not None
        self._writer.delete(path)
        self._index.forget(path)

    @property
    def disk_index_skipped(self) -> int:
        """Records the index skipped for a damaged header (each lost alone)."""
        return self._disk_index.skipped if self._disk_index is not None else 0

    @property
    def _index(self) -> SegmentIndex:
        """The disk tier's index (only with an offload directory)."""
        assert self._disk_index is not None, "no disk tier"
        return self._disk_index
