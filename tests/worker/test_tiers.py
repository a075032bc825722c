"""The host and disk tiers as storage: LRU spill from host to the disk queue, verified reads,
damaged records reported as damage, an unusable directory reported as unavailable."""

from __future__ import annotations

import os
import stat

import msgspec
import pytest
import torch

from shared.forms import FormScope, FormSpec
from shared.hashing import checksum
from shared.ids import ROOT_HASH
from tests.segment_files import cut_inside, flip_header, flip_payload, records, segment_files
from worker.cache import offload_key as of
from worker.cache.planner import BlockMeta
from worker.cache.pools import PoolSet
from worker.cache.store import CacheStore, bytes_checksum
from worker.cache.tiers import Tiers

NS = "ab" * 16


def _meta(i: int, data: torch.Tensor, form: str = "compressed", tenant: str = "t1") -> BlockMeta:
    return BlockMeta(namespace=NS, tenant=tenant, block_hash=f"{i + 1:032x}", parent_hash=ROOT_HASH,
                     token_start=0, token_end=16, form=form, spec_digest="0123456789abcdef",
                     checksum=bytes_checksum(data))


def _data(i: int, n: int = 256) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int32).add(i).to(torch.uint8)


def test_host_lru_spills_and_stays_readable_until_written(tmp_path) -> None:
    t = Tiers(host_bytes=512, disk_root=tmp_path)
    metas = [_meta(i, _data(i)) for i in range(3)]
    for i, m in enumerate(metas):
        assert t.put_host(m, _data(i))
    spills = t.take_spills()
    assert [(m.block_hash, from_host) for m, _, from_host in spills] == [(metas[0].block_hash, True)]
    obs, data, raw = t.host_read(metas[0].block_hash, "compressed")   # served from the spill queue
    assert obs.meta == metas[0] and torch.equal(data, _data(0)) and obs.checksum() == metas[0].checksum
    assert bytes(raw) == bytes(data.numpy())
    t.spilled(metas[0])
    assert t.host_read(metas[0].block_hash, "compressed")[0].meta is None
    assert {m.block_hash for m in t.host_items()} == {metas[1].block_hash, metas[2].block_hash}


def test_a_victim_pinned_while_it_waits_for_the_disk_stays_a_host_replica(tmp_path) -> None:
    """The finding of a drill run: a host LRU victim was being written to disk when a lease
    pinned it; dropping it then left the ledger (which refuses a pinned eviction) with a READY
    host replica nobody held. Pinned at that moment, it goes back into the host tier."""
    pins: set[tuple[str, str]] = set()
    t = Tiers(host_bytes=512, disk_root=tmp_path, host_pins=lambda: pins)
    metas = [_meta(i, _data(i)) for i in range(3)]
    for i, m in enumerate(metas):
        assert t.put_host(m, _data(i))
    [(victim, _, from_host)] = t.take_spills()
    assert victim == metas[0] and from_host
    # while queued it is still held (the inventory says so, reads are served)
    assert {m.block_hash for m in t.host_items()} == {m.block_hash for m in metas}
    assert not t.keep_pinned(victim)             # not pinned: dropped as usual by the caller
    pins.add((victim.block_hash, victim.form))   # a lease granted during the disk write
    assert t.keep_pinned(victim)
    assert not t.is_spilling(victim) and torch.equal(t.host_read(victim.block_hash, "compressed")[1], _data(0))
    # it took an unpinned entry's room: that one is the victim now
    assert [m for m, _, _ in t.take_spills()] == [metas[1]]
    assert {m.block_hash for m in t.host_items()} == {m.block_hash for m in metas}
    # all pinned and no room: it stays readable in the queue, still a host replica
    pins.update((m.block_hash, m.form) for m in metas)
    t2 = Tiers(host_bytes=256, disk_root=tmp_path / "b", host_pins=lambda: pins)
    assert t2.put_host(metas[0], _data(0))
    pins.discard((metas[0].block_hash, metas[0].form))
    assert t2.put_host(metas[1], _data(1))       # metas[0] is the victim
    pins.add((metas[0].block_hash, metas[0].form))
    assert t2.keep_pinned(metas[0]) and t2.is_spilling(metas[0])
    assert {m.block_hash for m in t2.host_items()} == {metas[0].block_hash, metas[1].block_hash}


def test_host_copy_failing_its_checksum_is_damage(tmp_path) -> None:
    t = Tiers(host_bytes=4096, disk_root=None)
    m = _meta(0, _data(0))
    t.put_host(m, _data(0))
    t.host._entries[(m.block_hash, "compressed")][0][3] ^= 1
    obs, data, raw = t.host_read(m.block_hash, "compressed")
    assert data is None and raw is None and "checksum" in obs.damage


def test_host_entries_are_private_and_replaced_never_rewritten(tmp_path) -> None:
    """``host_read`` hands out the stored bytes themselves (verified, no copy), which is exact
    only because an entry is a copy of its own, never written after ``put``: a caller's tensor
    changed after the put, and a later put of the same key, leave bytes already read as they were."""
    t = Tiers(host_bytes=4096, disk_root=None)
    src = _data(0)
    m = _meta(0, src)
    assert t.put_host(m, src)
    src.add_(1)                                           # the caller's tensor is not the entry
    obs, first, raw = t.host_read(m.block_hash, "compressed")
    assert obs.damage == "" and torch.equal(first, _data(0)) and obs.checksum() == m.checksum
    assert bytes(raw) == bytes(first.numpy())            # the same bytes, as a memoryview
    assert t.host_read(m.block_hash, "compressed")[1] is first           # the entry itself: no copy
    other = _data(7)
    m2 = msgspec.structs.replace(m, checksum=bytes_checksum(other))
    assert t.put_host(m2, other)                          # the same key again: a new entry replaces it
    assert torch.equal(first, _data(0))                   # what was read is untouched
    obs, second, _ = t.host_read(m.block_hash, "compressed")
    assert second is not first and torch.equal(second, other) and obs.checksum() == m2.checksum


def test_disk_round_trip_layout_and_modes(tmp_path) -> None:
    t = Tiers(host_bytes=0, disk_root=tmp_path / "off", writer="w1")
    metas = [_meta(i, _data(i)) for i in range(3)]
    assert t.disk_write_many([(m, _data(i)) for i, m in enumerate(metas)]) == [m.checksum for m in metas]
    [seg] = segment_files(tmp_path / "off")
    assert seg.parent.name == "w1" and seg.name == "00000001.kvs"            # the writer's own directory
    assert stat.S_IMODE(os.stat(seg).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(seg.parent).st_mode) == 0o700
    reads = t.disk_read_many(metas)
    for i, (m, r) in enumerate(zip(metas, reads)):
        assert r.observed.meta.block_hash == m.block_hash and r.observed.checksum() == m.checksum
        assert torch.equal(r.data, _data(i)) and not r.observed.damage
        # the payload follows a variable-length header, yet lands aligned: the model views it as float32
        assert r.observed.aligned and r.data.data_ptr() % 64 == 0 and r.data.view(torch.float32).numel() == 64
    # another worker (no writer of its own here) reads the same records from the shared directory
    other = Tiers(host_bytes=0, disk_root=tmp_path / "off")
    assert [r.observed.checksum() for r in other.disk_read_many(metas)] == [m.checksum for m in metas]


@pytest.mark.parametrize("how", ["flip", "truncate", "header"])
def test_damaged_records_are_reported(tmp_path, how) -> None:
    t = Tiers(host_bytes=0, disk_root=tmp_path, writer="w1")
    m = _meta(0, _data(0))
    t.disk_write_many([(m, _data(0))])
    [rec] = records(tmp_path)
    if how == "flip":
        flip_payload(rec)
        r = t.disk_read_many([m])[0]
        assert not r.observed.damage and r.observed.checksum() != m.checksum   # integrity layer's job
    elif how == "truncate":
        cut_inside(rec)
        assert "ends inside the record" in t.disk_read_many([m])[0].observed.damage
        assert Tiers(host_bytes=0, disk_root=tmp_path).disk_read_many([m])[0].observed.meta is None  # a new reader
    else:
        flip_header(rec)
        assert "CRC" in t.disk_read_many([m])[0].observed.damage
        assert Tiers(host_bytes=0, disk_root=tmp_path).disk_read_many([m])[0].observed.meta is None


def test_missing_and_unusable_directory(tmp_path) -> None:
    t = Tiers(host_bytes=0, disk_root=tmp_path / "nope", retry_s=60)
    m = _meta(0, _data(0))
    assert t.disk_read_many([m])[0].unavailable
    # A root under a regular file cannot be created by anyone (root included, unlike a 0500
    # directory), which is what an unusable offload directory looks like to the writer.
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("x")
    t = Tiers(host_bytes=0, disk_root=blocker / "sub", retry_s=60, writer="w1")
    with pytest.raises(of.OffloadUnavailable):
        t.disk_write_many([(m, _data(0))])


def test_store_keeps_storage_and_bumps_generations() -> None:
    from shared.forms import FormCatalogue
    cat = FormCatalogue(model_id="m", block_size=16, forms=(
        FormSpec(name="compressed", scope=FormScope.FULL_HISTORY, bytes_per_block=256, dtype="uint8"),))
    store = CacheStore(cat, {"compressed": 2}, torch.device("cpu"))
    addr = store.addresses()
    a = store.install(_meta(0, _data(0)), _data(0))
    b = store.install(_meta(1, _data(1)), _data(1))
    assert (a.generation, b.generation) == (1, 1)
    assert store.lru_victim("compressed", keep=set()) == a
    assert store.lru_victim("compressed", keep={a.block_hash}) == b
    assert store.drop("compressed", a.block_hash, generation=99) is None      # another generation: kept
    meta, data = store.drop("compressed", a.block_hash, generation=1)
    assert torch.equal(data, _data(0))
    c = store.install(_meta(2, _data(2)), _data(2))
    assert c.generation == 2 and store.addresses() == addr
    obs, copy = store.observe("compressed", c.block_hash)
    assert obs.checksum() == checksum(memoryview(_data(2).numpy()))
    store.pools["compressed"].storage[0].zero_()
    assert torch.equal(copy, _data(2))                                        # a private copy
    assert store.clear() == 2 and store.addresses() == addr
    assert isinstance(store.pools, PoolSet)


def test_a_disk_reload_lands_in_a_reserved_slot_that_is_invisible_until_installed(tmp_path) -> None:
    from shared.forms import FormCatalogue
    cat = FormCatalogue(model_id="m", block_size=16, forms=(
        FormSpec(name="compressed", scope=FormScope.FULL_HISTORY, bytes_per_block=256, dtype="uint8"),))
    store = CacheStore(cat, {"compressed": 3}, torch.device("cpu"))
    t = Tiers(0, tmp_path / "off", writer="w1")
    metas = [_meta(i, _data(i)) for i in range(2)]
    t.disk_write_many([(m, _data(i)) for i, m in enumerate(metas)])
    slots = [store.reserve("compressed", m.block_hash) for m in metas]
    assert all(r is not None for r in slots)
    assert store.reserve("compressed", metas[0].block_hash) is None     # the block has a slot already
    reads = t.disk_read_many(metas, slots)
    assert all(s.filled_by(r.data) and s.raw is not None for r, s in zip(reads, slots))
    assert [r.data.data_ptr() for r in reads] == [s.view.data_ptr() for s in slots]
    assert all(r.observed.checksum() == m.checksum for r, m in zip(reads, metas))
    # reserved: no hit, no meta, nothing to offload; the pool counts the slot as used
    assert store.lookup("compressed", metas[0].block_hash) is None
    assert store.observe("compressed", metas[0].block_hash)[0].meta is None
    assert list(store.items()) == [] and store.usage()["compressed"] == (2, 3)
    full = store.install_reserved(metas[0], slots[0])
    assert full is not None and full.generation == slots[0].generation
    assert store.observe("compressed", metas[0].block_hash)[0].checksum() == metas[0].checksum
    assert store.install_reserved(metas[0], slots[0]) is None           # once
    store.release(slots[1])
    assert store.usage()["compressed"] == (1, 3) and store.install_reserved(metas[1], slots[1]) is None
    # a new epoch frees every slot; a reservation taken before it is lost, even if the slot comes back
    again = store.reserve("compressed", metas[1].block_hash)
    store.clear()
    other = store.install(_meta(5, _data(5)), _data(5))
    assert not store.holds(again) and store.install_reserved(metas[1], again) is None
    store.release(again)                                                # a lost one is left alone
    assert store.lookup("compressed", other.block_hash) is not None


def test_a_slot_read_in_place_is_the_slot_and_its_generation_says_if_it_was_recycled() -> None:
    from shared.forms import FormCatalogue
    cat = FormCatalogue(model_id="m", block_size=16, forms=(
        FormSpec(name="compressed", scope=FormScope.FULL_HISTORY, bytes_per_block=256, dtype="uint8"),))
    store = CacheStore(cat, {"compressed": 2}, torch.device("cpu"))
    a = store.install(_meta(0, _data(0)), _data(0))
    (obs, data, read), (none, _, no_read) = store.observe_in_place("compressed", [a.block_hash, "f" * 32])
    assert none.meta is None and no_read is None
    assert obs.meta == a and obs.checksum() == a.checksum and torch.equal(data, _data(0))
    assert data.data_ptr() == store.pools["compressed"].view(read.slot).data_ptr()     # no copy
    assert store.unchanged(read)
    store.drop("compressed", a.block_hash)                      # freed: not the bytes validated any more
    assert not store.unchanged(read)
    b = store.install(_meta(0, _data(0)), _data(0))             # the same block again, a new generation
    assert b.generation != read.generation and not store.unchanged(read)


def test_a_block_queued_again_is_written_again(tmp_path) -> None:
    """A host victim waiting only for its eviction (its disk copy handled) that is queued anew —
    straight from the GPU, or as a new host-tier victim — needs its disk write again."""
    t = Tiers(host_bytes=512, disk_root=tmp_path)
    metas = [_meta(i, _data(i)) for i in range(3)]
    for i, m in enumerate(metas):
        assert t.put_host(m, _data(i))
    [(victim, _, _)] = t.take_spills()
    t.disk_done(victim)
    assert not t.needs_disk(victim) and t.evictions_waiting == 1
    t.spill_direct(victim, _data(0))
    assert t.needs_disk(victim) and t.evictions_waiting == 0
    t.disk_done(victim)
    assert t.put_host(victim, _data(0))             # back into the host tier: nothing waits
    assert t.evictions_waiting == 0 and t.needs_disk(victim)
