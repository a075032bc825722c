"""Segment files: batches appended and read back whole; a torn tail, a damaged header or a
damaged payload costs that record alone; a restarted writer never appends to an old segment;
another writer's segment is read as it grows; contiguous records are read with one call."""

from __future__ import annotations

import errno
import os
from typing import NamedTuple

import pytest
import torch

from shared.hashing import checksum
from tests.segment_files import cut_inside, flip_header, flip_payload, records, segment_files
from worker.cache import segments as sg
from worker.cache.offload_key import BlockKey, OffloadUnavailable
from worker.cache.segment_writer import SegmentWriter
from worker.cache.segments import ALIGN, SegmentIndex

NS = "ab" * 16


def key(i: int, form: str = "swa", tenant: str = "t1") -> BlockKey:
    return BlockKey(namespace=NS, tenant=tenant, block_hash=f"{i + 1:032x}", form=form, spec_digest="0123abcd")


def payload(i: int, n: int = 1000) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(n))


def write(w: SegmentWriter, ids: range, n: int = 1000) -> list[sg.Record]:
    return w.append([(key(i), memoryview(payload(i, n))) for i in ids])


def read(root, ids) -> list[sg.Found]:
    return SegmentIndex(root).read_many([key(i) for i in ids])


def test_a_batch_round_trips_aligned_and_contiguous_records_are_one_read(tmp_path, monkeypatch) -> None:
    w = SegmentWriter(tmp_path, "w1", segment_bytes=1 << 20)
    recs = write(w, range(5))
    assert all(r.start % ALIGN == 0 and r.payload % ALIGN == 0 for r in recs)
    assert [r.header.checksum for r in recs] == [checksum(payload(i)) for i in range(5)]
    calls = []
    real = os.preadv
    monkeypatch.setattr(sg.os, "preadv", lambda fd, bufs, at: calls.append(at) or real(fd, bufs, at))
    found = read(tmp_path, [3, 0, 1, 2, 4])
    assert [bytes(f.data.numpy()) for f in found] == [payload(i) for i in (3, 0, 1, 2, 4)]
    assert all(f.data.data_ptr() % ALIGN == 0 for f in found)
    assert calls == [0]                                         # five records, one read
    assert read(tmp_path, [9]) == [sg.Found(None)]              # never written: missing


def test_a_torn_tail_loses_only_the_last_record_and_a_restart_starts_a_new_segment(tmp_path) -> None:
    w = SegmentWriter(tmp_path, "w1", segment_bytes=1 << 20)
    recs = write(w, range(4))
    w.close()
    cut_inside(recs[-1])                                        # a crash in the middle of the last write
    assert [f.data is not None for f in read(tmp_path, range(4))] == [True, True, True, False]
    w2 = SegmentWriter(tmp_path, "w1", segment_bytes=1 << 20)  # the same worker, restarted
    write(w2, range(10, 12))
    assert [p.name for p in segment_files(tmp_path)] == ["00000001.kvs", "00000002.kvs"]
    assert all(f.data is not None for f in read(tmp_path, [0, 1, 2, 10, 11]))


def test_a_damaged_header_loses_that_record_alone(tmp_path) -> None:
    w = SegmentWriter(tmp_path, "w1", segment_bytes=1 << 20)
    recs = write(w, range(6))
    flip_header(recs[2])
    idx = SegmentIndex(tmp_path)
    found = idx.read_many([key(i) for i in range(6)])
    assert [f.record is not None for f in found] == [True, True, False, True, True, True]
    assert idx.skipped == 1                                     # the scan resynchronised after it


def test_a_damaged_payload_is_read_and_fails_its_checksum(tmp_path) -> None:
    w = SegmentWriter(tmp_path, "w1", segment_bytes=1 << 20)
    recs = write(w, range(3))
    flip_payload(recs[1])
    f = read(tmp_path, [1])[0]
    assert not f.damage and checksum(memoryview(f.data.numpy())) != f.record.header.checksum


def test_segments_roll_and_another_writer_is_read_as_it_grows(tmp_path) -> None:
    a = SegmentWriter(tmp_path, "wa", segment_bytes=2048)
    b = SegmentWriter(tmp_path, "wb", segment_bytes=4096)
    reader = SegmentIndex(tmp_path)
    write(a, range(3))
    write(a, range(3, 6))                                       # past 2048 bytes: a second segment
    assert len(a.segments()) == 2
    assert all(f.data is not None for f in reader.read_many([key(i) for i in range(6)]))
    recs = write(b, range(20, 23))
    # a batch of b's still being written: the reader stops before it and sees it once whole
    path = recs[0].path
    whole = path.read_bytes()
    write(b, range(23, 25))
    grown = path.read_bytes()
    path.write_bytes(grown[:len(whole) + 100])
    assert reader.read_many([key(23)])[0].record is None
    path.write_bytes(grown)
    assert reader.read_many([key(23)])[0].data is not None
    assert {r.header.block_hash for r in records(tmp_path)} == {key(i).block_hash for i in [*range(6), *range(20, 25)]}


def test_a_failed_write_leaves_nothing_half_written_and_the_next_batch_goes_on(tmp_path, monkeypatch) -> None:
    w = SegmentWriter(tmp_path, "w1", segment_bytes=1 << 20)
    write(w, range(2))
    size = segment_files(tmp_path)[0].stat().st_size
    real = os.writev

    def full(fd, bufs):
        if len(bufs) > 1:
            return real(fd, bufs[:1])                           # a short write: part of the batch lands
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(sg.os, "writev", full)
    with pytest.raises(OffloadUnavailable, match="ENOSPC"):
        write(w, range(2, 4))
    monkeypatch.setattr(sg.os, "writev", real)
    assert segment_files(tmp_path)[0].stat().st_size == size   # cut back to where the batch began
    write(w, range(4, 6))                                       # a new segment
    found = read(tmp_path, range(6))
    assert [f.data is not None for f in found] == [True, True, False, False, True, True]
    assert len(segment_files(tmp_path)) == 2


def test_short_writes_that_make_progress_land_every_byte_in_order(tmp_path, monkeypatch) -> None:
    """``writev`` may write less than asked without failing (a signal, a pipe-like file system):
    the rest follows, from the middle of a buffer when the cut falls inside one."""
    real = os.writev
    calls = []

    def trickle(fd, bufs):
        calls.append(len(bufs))
        return real(fd, [memoryview(b"".join(bytes(b) for b in bufs))[:777]])   # 777 bytes at a time
    w = SegmentWriter(tmp_path, "w1", segment_bytes=1 << 20)
    monkeypatch.setattr(sg.os, "writev", trickle)
    write(w, range(5), n=1500)
    monkeypatch.setattr(sg.os, "writev", real)
    assert len(calls) > 10
    found = read(tmp_path, range(5))
    assert [bytes(f.data.numpy()) for f in found] == [payload(i, 1500) for i in range(5)]
    assert segment_files(tmp_path)[0].stat().st_size % ALIGN == 0


def test_a_deleted_segment_is_forgotten(tmp_path) -> None:
    w = SegmentWriter(tmp_path, "w1", segment_bytes=2048)
    write(w, range(2))
    write(w, range(2, 4))
    idx = SegmentIndex(tmp_path)
    assert all(f.data is not None for f in idx.read_many([key(i) for i in range(4)]))
    first = w.segments()[0][0]
    w.delete(first)
    found = idx.read_many([key(i) for i in range(4)])
    assert [f.data is not None for f in found] == [False, False, True, True]
    assert idx.records(first) == []


def test_unsafe_names_are_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="tenant"):
        BlockKey(namespace=NS, tenant="../etc", block_hash="cd" * 16, form="f", spec_digest="x")
    with pytest.raises(ValueError, match="writer"):
        SegmentWriter(tmp_path, "../w", segment_bytes=4096)


def test_a_writer_whose_segment_was_deleted_starts_a_new_one(tmp_path) -> None:
    """Someone emptied the directory under a live writer: its next batch must land in a file
    readers can find, not in the unlinked one it still has open."""
    import shutil

    w = SegmentWriter(tmp_path, "w1", segment_bytes=1 << 20)
    write(w, range(2))
    shutil.rmtree(tmp_path / "segments")
    write(w, range(2, 4))
    assert [f.data is not None for f in read(tmp_path, range(4))] == [False, False, True, True]


def test_the_gc_names_a_block_only_with_the_segment_of_its_current_record(tmp_path) -> None:
    """A block offloaded again lies in a newer segment; deleting the old one must not have the
    ledger evict it (its bytes live on)."""
    import torch

    from worker.cache.planner import BlockMeta
    from worker.cache.tiers import Tiers

    def meta(i: int) -> BlockMeta:
        k = key(i)
        return BlockMeta(namespace=k.namespace, tenant=k.tenant, block_hash=k.block_hash, parent_hash="",
                         token_start=0, token_end=0, form=k.form, spec_digest=k.spec_digest, checksum="")

    def block(i: int) -> tuple[BlockMeta, torch.Tensor]:
        return meta(i), torch.frombuffer(bytearray(payload(i)), dtype=torch.uint8)

    tiers = Tiers(host_bytes=0, disk_root=tmp_path, writer="w1", segment_bytes=2000)
    tiers.disk_write_many([block(0), block(1)])          # segment 1 (full: the next batch rolls)
    tiers.disk_write_many([block(2), block(0)])          # segment 2: block 0 again
    tiers.disk_write_many([block(3)])                    # segment 3, the one being appended to
    named = {path.name: sorted(m.block_hash for m in metas) for path, _, metas in tiers.disk_collectable()}
    assert named == {"00000001.kvs": [key(1).block_hash],
                     "00000002.kvs": sorted([key(0).block_hash, key(2).block_hash])}
    # another process (a restart) scans the same segments and knows the same
    again = Tiers(host_bytes=0, disk_root=tmp_path, writer="w1", segment_bytes=2000)
    again._writer.current = tiers._writer.current
    assert {p.name: sorted(m.block_hash for m in ms) for p, _, ms in again.disk_collectable()} == named
    # another worker's newer copy of block 1 does not count: the ledger replica may be w1's (the
    # first writer owns it), and w2's GC would leave it READY when deleting its own copy
    Tiers(host_bytes=0, disk_root=tmp_path, writer="w2", segment_bytes=2000).disk_write_many([block(1)])
    assert {p.name: sorted(m.block_hash for m in ms) for p, _, ms in tiers.disk_collectable()} == named


def _tensors(n: int, size: int = 1000) -> list:
    """``n`` ALIGN-aligned flat uint8 tensors (as pool slots are), filled with a marker."""
    whole = torch.full((n * 1024 + ALIGN,), 0xEE, dtype=torch.uint8)
    skew = (-whole.data_ptr()) % ALIGN
    return [whole[skew + k * 1024:skew + k * 1024 + size] for k in range(n)]


class _Slot(NamedTuple):
    """A :class:`worker.cache.segments.Destination` over any tensor (a pool's reservation is one)."""

    view: torch.Tensor
    raw: memoryview | None


def destination(t: torch.Tensor) -> _Slot:
    """``t`` as a destination: usable (``raw`` set) when it is a contiguous, ALIGN-aligned flat
    uint8 CPU tensor, as a pool slot is."""
    ok = (t.dtype is torch.uint8 and t.device.type == "cpu" and t.dim() == 1 and t.is_contiguous()
          and t.data_ptr() % ALIGN == 0)
    return _Slot(t, memoryview(t.numpy()) if ok else None)


def _slots(n: int, size: int = 1000) -> list:
    """``n`` destinations over :func:`_tensors`."""
    return [destination(t) for t in _tensors(n, size)]


def test_a_run_with_destinations_is_one_scatter_read_straight_into_them(tmp_path, monkeypatch) -> None:
    w = SegmentWriter(tmp_path, "w1", segment_bytes=1 << 20)
    write(w, range(5))
    calls = []
    real = os.preadv
    monkeypatch.setattr(sg.os, "preadv", lambda fd, bufs, at: calls.append(len(bufs)) or real(fd, bufs, at))
    dests = _slots(5)
    order = [3, 0, 1, 2, 4]
    found = SegmentIndex(tmp_path).read_many([key(i) for i in order], dests)
    assert [f.data for f in found] == [d.view for d in dests]      # landed in place
    assert [bytes(d.view.numpy()) for d in dests] == [payload(i) for i in order]
    assert len(calls) == 1 and calls[0] == 5 * 2 + 4       # header + payload each, padding between
    assert [f.digest for f in found] == [checksum(payload(i)) for i in order]   # summed as read


def test_a_run_lacking_a_fitting_destination_reads_into_a_buffer_of_its_own(tmp_path) -> None:
    w = SegmentWriter(tmp_path, "w1", segment_bytes=1 << 20)
    write(w, range(3))
    for dests in (_slots(3)[:2] + [None], _slots(3, size=999) + [],
                  [destination(t[1:]) for t in _tensors(3, size=1001)]):   # one missing, wrong length, misaligned
        dests = (dests + [None] * 3)[:3]
        found = SegmentIndex(tmp_path).read_many([key(i) for i in range(3)], dests)
        assert [bytes(f.data.numpy()) for f in found] == [payload(i) for i in range(3)]
        assert all(d is None or f.data.data_ptr() != d.view.data_ptr() for f, d in zip(found, dests))
    assert destination(_tensors(1, size=1001)[0][1:]).raw is None     # misaligned: never a destination


def test_damage_after_the_scan_is_found_by_a_scatter_read_too(tmp_path) -> None:
    w = SegmentWriter(tmp_path, "w1", segment_bytes=1 << 20)
    recs = write(w, range(4))
    idx = SegmentIndex(tmp_path)
    idx.refresh()                                   # indexed whole, damaged afterwards
    flip_header(recs[1])
    flip_payload(recs[2])
    cut_inside(recs[3])
    found = idx.read_many([key(i) for i in range(4)], _slots(4))
    assert found[0].data is not None and bytes(found[0].data.numpy()) == payload(0)
    assert "fails its CRC" in found[1].damage
    assert not found[2].damage and checksum(memoryview(found[2].data.numpy())) != recs[2].header.checksum
    assert "ends inside the record" in found[3].damage


def test_a_header_swapped_for_another_whole_one_after_the_scan_is_damage(tmp_path) -> None:
    """Each header passes its own CRC, but record 0's bytes are no longer those indexed: a read
    says so rather than trust the index's memory of them."""
    w = SegmentWriter(tmp_path, "w1", segment_bytes=1 << 20)
    recs = write(w, range(2))
    idx = SegmentIndex(tmp_path)
    idx.refresh()
    with open(recs[0].path, "r+b") as f:
        f.seek(recs[1].start)
        other = f.read(recs[1].payload - recs[1].start)
        assert len(other) == recs[0].payload - recs[0].start
        f.seek(recs[0].start)
        f.write(other)
    for into in (None, _slots(2)):
        found = idx.read_many([key(0), key(1)], into)
        assert "fails its CRC" in found[0].damage and found[0].data is None
        assert bytes(found[1].data.numpy()) == payload(1)


@pytest.mark.parametrize("limit, value, reads", [("_IOV_RECORDS", 4, 3), ("_HOT_BYTES", 64 * 3, 4),
                                                  ("_HOT_BYTES", 10, 10)])
def test_a_long_run_is_split_under_the_iovec_limit_and_the_cache_budget(tmp_path, monkeypatch, limit, value,
                                                                        reads) -> None:
    monkeypatch.setattr(sg, limit, value)
    w = SegmentWriter(tmp_path, "w1", segment_bytes=1 << 20)
    write(w, range(10), n=64)
    calls = []
    real = os.preadv
    monkeypatch.setattr(sg.os, "preadv", lambda fd, bufs, at: calls.append(len(bufs)) or real(fd, bufs, at))
    dests = _slots(10, size=64)
    found = SegmentIndex(tmp_path).read_many([key(i) for i in range(10)], dests)
    assert [bytes(f.data.numpy()) for f in found] == [payload(i, 64) for i in range(10)]
    assert len(calls) == reads and all(f.data is d.view for f, d in zip(found, dests))
    assert [f.digest for f in found] == [checksum(payload(i, 64)) for i in range(10)]
