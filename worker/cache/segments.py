"""Append-only segment files: the shared disk tier's storage.

Each worker appends the replicas it offloads to its own segment files,
``<root>/segments/<writer>/<NNNNNNNN>.kvs``, one batch at a time (sequential writes, one fsync
per batch). A process never appends to a segment an earlier process left (its tail may be
torn): it starts the next number. Any worker reads any writer's segments (the shared
directory), through an index of the records it has scanned.

One record, starting at a multiple of :data:`ALIGN` bytes::

    magic "KVLR" | header length (u32 LE) | CRC-32 of the header (u32 LE) | header (JSON, padded
    with spaces so the payload starts ALIGN-aligned) | payload | zero padding to ALIGN

The header carries the format version, namespace, tenant, block hash, form, the form's spec
digest, the payload length and its xxh3-128 checksum (``shared.hashing.checksum``): a reader
checks them against what it expects, and the checksum against the bytes, before anything
reaches a pool (``worker.cache.planner.validate``).

What damage costs: a record whose header fails its CRC (a torn write, a flipped bit) is
skipped, and the scan resynchronises at the next aligned offset holding a record whose
header passes its CRC; a record whose payload fails its checksum is rejected when read. Either
way that record alone is lost. A segment's tail that ends inside a record is a torn write (or,
for another writer's live segment, a batch still being written): the scan stops before it
and looks again on the next refresh.

Reads: :meth:`SegmentIndex.read_many` groups the records a resume wants by segment and reads
each contiguous run with one ``pread`` into an aligned buffer (blocks offloaded together lie
together); payloads are views of that buffer. A caller that already holds the memory a payload
is going to (a pool slot the write grant reserved) passes it as ``into``: the run is then one
scatter ``preadv`` — headers into a scratch buffer, each payload straight into its destination —
so the bytes cross memory once and land in memory that is already faulted in.

Writing is :class:`worker.cache.segment_writer.SegmentWriter`'s. Segments are deleted whole (:meth:`SegmentWriter.delete`), by their writer, once the ledger has
evicted every replica they hold (the engine's garbage collector).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import mmap
import operator
import os
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

import msgspec
import torch

from shared.hashing import checksum
from worker.cache.offload_key import OffloadUnavailable

MAGIC = b"KVLR"
_PREFIX = struct.Struct("<4sII")          # magic, header length, header CRC-32
#: Alignment of records (and so of payloads): enough for any dtype a form stores.
ALIGN = 64
SUFFIX = ".kvs"
_MAX_HEADER = 16 * 1024
#: How far past a damaged header the scan looks for the next record at most, per step.
_RESYNC_CHUNK = 1 << 20

Key = tuple[str, str, str, str]           # (namespace, tenant, block_hash, form)


class RecordHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    version: int
    namespace: str
    tenant: str
    block_hash: str
    form: str
    spec_digest: str
    length: int
    checksum: str


class Record(NamedTuple):
    """Where one record lies: its segment, its start, where its payload starts, its end.

    NOTE: a NamedTuple, not a frozen dataclass: one is made per record written or scanned, and
    the dataclass's ``__init__`` (one ``object.__setattr__`` per field) was a sixth of the
    per-record cost of an offload write."""

    path: Path
    start: int
    payload: int
    end: int
    header: RecordHeader
    #: CRC-32 of the record's bytes before its payload (prefix, header, padding) as indexed: a
    #: read compares it with what it read (one CRC and a compare, against re-parsing the prefix
    #: and re-checking the header's own CRC: 0.4 against 1.25 us), which also catches a header
    #: replaced by another whole one since the scan.
    head_crc: int

    @property
    def key(self) -> Key:
        h = self.header
        return (h.namespace, h.tenant, h.block_hash, h.form)


class RecordKey(Protocol):
    """What names a record: an ``offload_key.BlockKey``, or the ``BlockMeta`` of a block."""

    namespace: str
    tenant: str
    block_hash: str
    form: str
    spec_digest: str


_path_of = operator.attrgetter("path")


def key_of(k: RecordKey) -> Key:
    return (k.namespace, k.tenant, k.block_hash, k.form)


def _pad(n: int) -> int:
    return (-n) % ALIGN


_ZEROS = bytes(ALIGN)


def encode_header(h: RecordHeader) -> bytes:
    """The prefix and header of a record, padded so the payload that follows is aligned."""
    body = msgspec.json.encode(h)
    body += b" " * _pad(_PREFIX.size + len(body))
    return _PREFIX.pack(MAGIC, len(body), zlib.crc32(body)) + body


def _errno_name(e: OSError) -> str:
    return errno.errorcode.get(e.errno or 0, str(e.errno))


# --- reading ------------------------------------------------------------------------------------

class Found(msgspec.Struct, frozen=True):
    """One wanted record as read: the record and its payload bytes (an aligned uint8 view), or
    what went wrong (``missing``: no record; ``damage``: a record whose bytes are not whole).

    NOTE: a frozen msgspec struct, one per record read: a frozen dataclass's ``__init__`` cost
    ~1.5 us (a NamedTuple with keywords 0.6, this 0.15) of a tiny block's ~12 us reload."""

    record: Record | None
    data: torch.Tensor | None = None
    damage: str = ""
    unavailable: str = ""
    #: The payload's xxh3 checksum, computed right after the read while the bytes were still in
    #: the CPU's caches (set whenever ``data`` is).
    digest: str = ""


class Destination(Protocol):
    """Where one payload may land (a reserved pool slot): ``view``, its memory as a flat uint8
    tensor, and ``raw``, the same memory as a flat writable byte memoryview, ALIGN-aligned (None
    when it is not: the read then uses a buffer of its own). Both are made once per slot and
    kept by the pool: ``Tensor.numpy()`` costs ~2.5 us, more than reading a small block."""

    @property
    def view(self) -> torch.Tensor: ...

    @property
    def raw(self) -> memoryview | None: ...


class SegmentIndex:
    """Every record this process has scanned in every writer's segments, by key.

    :meth:`refresh` scans what is new (grown or new segments; vanished ones are forgotten).
    Blocking (the engine's I/O thread).
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._by_key: dict[Key, Record] = {}
        self._by_path: dict[Path, list[Record]] = {}
        self._scanned: dict[Path, int] = {}
        #: Records skipped by the scan (a damaged header), counted for a metric.
        self.skipped = 0

    def __len__(self) -> int:
        return len(self._by_key)

    def lookup(self, key: Key) -> Record | None:
        return self._by_key.get(key)

    def records(self, path: Path) -> list[Record]:
        return list(self._by_path.get(path, ()))

    def add(self, records: Sequence[Record]) -> None:
        """Records this process just wrote (known without a scan)."""
        by_key, by_path, scanned = self._by_key, self._by_path, self._scanned
        # NOTE: a batch's records share one segment: its list and end are looked up once per run of
        # records of one path (hashing a Path per record was a tenth of a tiny block's write)
        for path, group in itertools.groupby(records, key=_path_of):
            run = list(group)
            for r in run:
                h = r.header
                by_key[(h.namespace, h.tenant, h.block_hash, h.form)] = r
            by_path.setdefault(path, []).extend(run)
            end = max(r.end for r in run)
            scanned[path] = max(scanned.get(path, 0), end + _pad(end))

    def drop(self, key: Key) -> None:
        """Stop offering one record (its bytes failed validation; the segment stays)."""
        r = self._by_key.pop(key, None)
        if r is not None:
            self._by_path[r.path] = [x for x in self._by_path.get(r.path, ()) if x is not r]

    def forget(self, path: Path) -> None:
        for r in self._by_path.pop(path, ()):
            if self._by_key.get(r.key) is r:
                del self._by_key[r.key]
        self._scanned.pop(path, None)

    def refresh(self) -> None:
        """Scan what is new in every writer's segments. Raises :class:`OffloadUnavailable` when
        the directory itself cannot be listed."""
        top = self.root / "segments"
        try:
            if not self.root.exists():
                raise OffloadUnavailable(f"offload directory {self.root} is missing")
            writers = [d for d in top.iterdir() if d.is_dir()] if top.exists() else []
            seen: set[Path] = set()
            for d in writers:
                # oldest first: a reader takes the newest record of a block a writer wrote again
                for p in sorted(d.glob(f"*{SUFFIX}")):
                    seen.add(p)
                    try:
                        size = p.stat().st_size
                    except FileNotFoundError:
                        continue
                    if size > self._scanned.get(p, 0):
                        self._scan(p, self._scanned.get(p, 0), size)
        except OSError as e:
            raise OffloadUnavailable(f"offload directory {self.root} cannot be read ({_errno_name(e)}): "
                                     f"{e.strerror}") from e
        for p in [p for p in self._by_path if p not in seen]:
            self.forget(p)

    def _scan(self, path: Path, at: int, size: int) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            new: list[Record] = []
            while at + _PREFIX.size <= size:
                rec, nxt = _read_record(fd, path, at, size)
                if rec is None and nxt is None:
                    break                                   # a tail inside a record: torn, or being written
                if rec is None:
                    self.skipped += 1
                    at = _resync(fd, nxt, size)             # type: ignore[arg-type]
                    continue
                new.append(rec)
                at = nxt                                    # type: ignore[assignment]
            self.add(new)
            self._scanned[path] = at
        finally:
            os.close(fd)

    def read_many(self, keys: Sequence[RecordKey],
                  into: Sequence[Destination | None] | None = None) -> list[Found]:
        """Each key's record and payload, reading every contiguous run of records once.

        ``into[i]`` (optional) is where key ``i``'s payload should land. It is used when its
        ``raw`` is set and as long as the record, and every record of its run has such a
        destination; the caller sees which by ``Found.data`` being that destination's ``view``
        (the same object) or a view of a buffer of the read's own."""
        wanted = [key_of(k) for k in keys]
        if any(k not in self._by_key for k in wanted):
            self.refresh()
        recs = [self._by_key.get(k) for k in wanted]
        out: list[Found | None] = [None] * len(keys)
        by_path: dict[Path, list[int]] = {}
        for i, r in enumerate(recs):
            if r is None:
                out[i] = Found(None)
            else:
                by_path.setdefault(r.path, []).append(i)
        for path, idx in by_path.items():
            idx.sort(key=lambda i: recs[i].start)           # type: ignore[union-attr]
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                for i in idx:
                    out[i] = Found(None)                    # deleted since the scan
                self.forget(path)
                continue
            except OSError as e:
                for i in idx:
                    out[i] = Found(recs[i], unavailable=f"offload read failed ({_errno_name(e)}): {e.strerror}")
                continue
            try:
                run: list[int] = []
                for i in idx + [-1]:
                    r = recs[i] if i >= 0 else None
                    prev = recs[run[-1]] if run else None
                    if r is not None and prev is not None and r.start <= prev.end + _pad(prev.end):
                        run.append(i)
                        continue
                    if run:
                        dests = [into[j] for j in run] if into is not None else None
                        if dests is not None and _fits(dests, [recs[j] for j in run]):  # type: ignore[misc]
                            _scatter_run(fd, [recs[j] for j in run], run, out, dests)   # type: ignore[misc,arg-type]
                        else:
                            _read_run(fd, [recs[j] for j in run], run, out)  # type: ignore[misc]
                    run = [i] if r is not None else []
            finally:
                os.close(fd)
        return out  # type: ignore[return-value]


def _read_record(fd: int, path: Path, at: int, size: int) -> tuple[Record | None, int | None]:
    """The record at ``at`` and where the next one starts; ``(None, at + ALIGN)`` for a damaged
    header; ``(None, None)`` when the file ends inside the record."""
    head = os.pread(fd, _PREFIX.size, at)
    if len(head) < _PREFIX.size:
        return None, None
    magic, hlen, crc = _PREFIX.unpack(head)
    if magic != MAGIC or hlen > _MAX_HEADER:
        return None, at + ALIGN
    if at + _PREFIX.size + hlen > size:
        return None, None
    body = os.pread(fd, hlen, at + _PREFIX.size)
    if len(body) < hlen:
        return None, None
    if zlib.crc32(body) != crc:
        return None, at + ALIGN
    try:
        h = msgspec.json.decode(body, type=RecordHeader)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None, at + ALIGN
    payload = at + _PREFIX.size + hlen
    end = payload + h.length
    if end > size:
        return None, None
    return Record(path, at, payload, end, h, zlib.crc32(body, zlib.crc32(head))), end + _pad(end)


def _resync(fd: int, at: int, size: int) -> int:
    """The next aligned offset from ``at`` that starts with the record magic (or ``size``)."""
    while at < size:
        chunk = os.pread(fd, min(_RESYNC_CHUNK, size - at), at)
        if not chunk:
            return size
        i = 0
        while True:
            i = chunk.find(MAGIC, i)
            if i < 0:
                break
            if (at + i) % ALIGN == 0:
                return at + i
            i += 1
        at += len(chunk) - len(chunk) % ALIGN or len(chunk)
    return size


#: Runs at least this long are read into fresh huge-page-advised mappings (see :func:`_buffer`).
_HUGE = 2 << 20


def _buffer(n: int) -> torch.Tensor:
    """``n`` uninitialised bytes, ALIGN-aligned.

    NOTE: a large fresh buffer costs more in page faults than the read itself (measured here: a
    32 MiB read from the page cache at 2.1 GB/s into ``torch.empty``, 5.5 GB/s into an anonymous
    mapping advised MADV_HUGEPAGE, 12 GB/s into a reused one); the mapping lives as long as a
    view of it does. Small runs come from the allocator, which reuses its heap.
    """
    if n >= _HUGE:
        m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        with contextlib.suppress(AttributeError, OSError):      # no THP on this kernel: plain pages
            m.madvise(mmap.MADV_HUGEPAGE)
        return torch.frombuffer(m, dtype=torch.uint8)             # page-aligned
    whole = torch.empty(n + ALIGN, dtype=torch.uint8)
    skew = (-whole.data_ptr()) % ALIGN
    return whole[skew:skew + n]


def _read_run(fd: int, run: list[Record], idx: list[int], out: list[Found | None]) -> None:
    """One pread for records that lie back to back; payloads are aligned views of the buffer,
    each checksummed as read."""
    lo, hi = run[0].start, run[-1].end
    buf = _buffer(hi - lo)
    try:
        n = os.preadv(fd, [memoryview(buf.numpy())], lo)
    except OSError as e:
        for i, r in zip(idx, run):
            out[i] = Found(r, unavailable=f"offload read failed ({_errno_name(e)}): {e.strerror}")
        return
    raw = memoryview(buf.numpy())
    for i, r in zip(idx, run):
        if r.end - lo > n:
            out[i] = _truncated(r)
        elif (bad := _header_damage(raw[r.start - lo:r.payload - lo], r)) is not None:
            out[i] = bad
        else:
            # summed now, through the run's one memoryview: later, from the tensor view, it would
            # cost a Tensor.numpy() per record (~2.5 us, more than a small block's read)
            out[i] = Found(r, buf[r.payload - lo:r.end - lo], digest=checksum(raw[r.payload - lo:r.end - lo]))


def _truncated(r: Record) -> Found:
    return Found(r, damage=f"segment {r.path.name} ends inside the record at {r.start} "
                           f"(truncated after it was indexed)")


def _header_damage(head: memoryview, r: Record) -> Found | None:
    """``head`` (the record's bytes before its payload) re-checked: None when whole.

    NOTE: the header is re-checked on every read (it came with the run anyway): bytes that
    changed on disk since the scan are damage, not a record to trust from memory. A header is
    whole when its bytes are those the index holds (:attr:`Record.head_crc`), and those passed
    the header's own CRC when they were indexed."""
    if len(head) != r.payload - r.start or zlib.crc32(head) != r.head_crc:
        return Found(r, damage=f"the header of the record at {r.start} of segment {r.path.name} fails its "
                               f"CRC (its bytes changed since they were indexed)")
    return None


#: iovecs per ``preadv`` (Linux's IOV_MAX is 1024); a record takes up to three.
_IOV_RECORDS = 300
#: Payload bytes per scatter ``preadv``: few enough that they are still in the CPU's caches when
#: they are checksummed right after. Measured here (64 records of 1 MiB, page cache warm): read
#: and checksum 14.8 ms in 1 MiB steps, 18.7 ms as one read then the checksums (the raw read 11).
_HOT_BYTES = 1 << 20


def _fits(dests: Sequence[Destination | None], run: Sequence[Record]) -> bool:
    """Whether every record of ``run`` can be read straight into its destination."""
    prev_end = None
    for d, r in zip(dests, run):
        raw = d.raw if d is not None else None
        if raw is None or len(raw) != r.end - r.payload:
            return False
        if prev_end is not None and r.start < prev_end:
            return False                                    # overlapping records: not a plain run
        prev_end = r.end
    return True


def _scatter_run(fd: int, run: list[Record], idx: list[int], out: list[Found | None],
                 dests: list[Destination]) -> None:
    """Records that lie back to back, read with scatter ``preadv``s: each payload into its
    destination, headers and padding into one scratch buffer; then each header re-checked and
    each payload checksummed while it is still in the caches (``_HOT_BYTES`` per read)."""
    k = 0
    while k < len(run):
        end, payload = k + 1, run[k].end - run[k].payload
        while end < len(run) and end - k < _IOV_RECORDS and payload + run[end].end - run[end].payload <= _HOT_BYTES:
            payload += run[end].end - run[end].payload
            end += 1
        part, part_idx, part_dests = run[k:end], idx[k:end], dests[k:end]
        k = end
        lo = part[0].start
        scratch = bytearray(sum(r.payload - r.start for r in part)
                            + sum(b.start - a.end for a, b in zip(part, part[1:])))
        sv = memoryview(scratch)
        iov: list[memoryview] = []
        heads: list[memoryview] = []
        at, prev_end = 0, None
        for r, d in zip(part, part_dests):
            if prev_end is not None and r.start > prev_end:       # padding between records
                iov.append(sv[at:at + r.start - prev_end])
                at += r.start - prev_end
            head = sv[at:at + r.payload - r.start]
            at += r.payload - r.start
            heads.append(head)
            iov.append(head)
            iov.append(d.raw)                                   # type: ignore[arg-type]
            prev_end = r.end
        try:
            n = os.preadv(fd, iov, lo)
        except OSError as e:
            for i, r in zip(part_idx, part):
                out[i] = Found(r, unavailable=f"offload read failed ({_errno_name(e)}): {e.strerror}")
            continue
        for i, r, d, head in zip(part_idx, part, part_dests, heads):
            if r.end - lo > n:
                out[i] = _truncated(r)
            elif (bad := _header_damage(head, r)) is not None:
                out[i] = bad
            else:
                out[i] = Found(r, d.view, digest=checksum(d.raw))     # type: ignore[arg-type]


__all__ = ["ALIGN", "Destination", "Found", "Record", "RecordHeader", "SegmentIndex",
           "encode_header", "key_of"]
