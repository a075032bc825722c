"""Outbox: kept until the watermark covers it, resent when due, never dropped.
Pools: fixed storage, generations bumped per allocation."""

import pytest
import torch

from shared.forms import FormCatalogue, FormScope, FormSpec
from shared.messages import TransitionEvent
from worker.cache.outbox import Outbox, OutboxFull
from worker.cache.pools import PoolExhausted, PoolSet, slots_per_form

H = "ab" * 16


def _ev(seq: int, epoch: int = 3) -> TransitionEvent:
    return TransitionEvent(worker_id="w1", epoch=epoch, seq=seq, namespace=H, block_hash=H, parent_hash=H)


def test_outbox_keeps_until_watermark_and_resends() -> None:
    ob = Outbox("w1", 3, capacity=10, resend_ms=100)
    for _ in range(4):
        ob.add(_ev)
    assert [e.seq for e in ob.due(0)] == [1, 2, 3, 4]
    for s in (1, 2, 3, 4):
        ob.mark_sent(s, 0)
    assert ob.due(50) == []
    assert ob.ack(3, 2) == 2 and ob.pending_seqs() == [3, 4]
    assert [e.seq for e in ob.due(100)] == [3, 4]  # publish acked by the broker is not enough
    assert ob.ack(2, 4) == 0  # another epoch's watermark is ignored
    assert ob.ack(3, 1) == 0  # a stale watermark changes nothing
    assert ob.ack(3, 4) == 2 and len(ob) == 0


def test_outbox_full_refuses_instead_of_dropping() -> None:
    ob = Outbox("w1", 3, capacity=2, resend_ms=100)
    ob.add(_ev)
    ob.add(_ev)
    with pytest.raises(OutboxFull):
        ob.add(_ev)
    assert ob.pending_seqs() == [1, 2] and ob.next_seq == 3


def test_outbox_rejects_foreign_event() -> None:
    ob = Outbox("w1", 3, capacity=2, resend_ms=100)
    with pytest.raises(ValueError):
        ob.add(lambda s: _ev(s, epoch=9))


CAT = FormCatalogue(model_id="m", block_size=16, forms=(
    FormSpec(name="compressed", scope=FormScope.FULL_HISTORY, bytes_per_block=64, dtype="float32"),
    FormSpec(name="indexer", scope=FormScope.FULL_HISTORY, bytes_per_block=32, dtype="float32"),
    FormSpec(name="swa", scope=FormScope.WINDOW, bytes_per_block=128, dtype="float32", window_tokens=31),
))


def test_slots_from_budget() -> None:
    slots = slots_per_form(CAT, pool_bytes=10_000, reserve_ratio=0.5, limits={"compressed": 0.7, "swa": 0.1})
    assert slots == {"compressed": int(5000 * 0.7 // 64), "indexer": int(5000 * 0.7 // 32),
                     "swa": int(5000 * 0.1 // 128)}


def test_pool_storage_is_static_and_generations_fence() -> None:
    ps = PoolSet.allocate(CAT, {"compressed": 2, "indexer": 2, "swa": 1}, torch.device("cpu"))
    addrs = ps.addresses()
    p = ps["compressed"]
    s1, g1 = p.allocate("a" * 32)
    p.write(s1, torch.arange(16, dtype=torch.float32))
    assert torch.equal(p.view(s1).view(torch.float32), torch.arange(16, dtype=torch.float32))
    s2, _ = p.allocate("b" * 32)
    with pytest.raises(PoolExhausted):
        p.allocate("c" * 32)
    p.free(s1)
    s3, g3 = p.allocate("c" * 32)
    assert s3 == s1 and g3 == g1 + 1  # recycled slot, new generation
    assert p.lookup("a" * 32) is None and p.lookup("c" * 32)[0] == s3
    with pytest.raises(ValueError, match="bytes"):
        p.write(s3, torch.zeros(3))
    flat = torch.arange(64, dtype=torch.uint8)                  # a tier's copy: written as it is
    p.write(s3, flat)
    assert torch.equal(p.view(s3), flat)
    with pytest.raises(ValueError, match="bytes"):
        p.write(s3, torch.zeros(63, dtype=torch.uint8))
    entry = torch.arange(64, 128, dtype=torch.uint8)            # a host-tier entry, as its memoryview
    p.write(s3, memoryview(entry.numpy()))
    assert torch.equal(p.view(s3), entry) and p.view(s3).data_ptr() != entry.data_ptr()
    with pytest.raises(ValueError, match="bytes"):
        p.write(s3, memoryview(bytes(63)))
    with pytest.raises((ValueError, TypeError)):               # 64 bytes, but not a flat run of bytes
        p.write(s3, memoryview(torch.zeros(16, dtype=torch.float32).numpy()))
    assert torch.equal(p.view(s3), entry)
    assert ps.addresses() == addrs


def test_host_tier_lru_and_integrity() -> None:
    from shared.hashing import checksum
    from worker.cache.host_tier import HostTier, HostTierCorrupt

    tier = HostTier(capacity_bytes=100)
    x = torch.arange(10, dtype=torch.float32)  # 40 bytes
    d = checksum(x.numpy().tobytes())
    assert tier.put("a", "f", x, d) == [] and tier.put("b", "f", x, d) == []
    assert tier.get("a", "f") is not None  # touch a: b is now the oldest
    assert tier.put("c", "f", x, d) == [("b", "f")] and tier.used_bytes == 80
    assert torch.equal(tier.get("c", "f").view(torch.float32), x)
    tier.get("c", "f")[0] ^= 1  # corrupt host memory in place
    with pytest.raises(HostTierCorrupt):
        tier.get("c", "f")
    assert tier.get("c", "f") is None and tier.put("big", "f", torch.zeros(100), d) is None


def test_host_tier_never_evicts_what_a_lease_pins() -> None:
    """The oldest unpinned entry makes room; when only pinned ones could, the put is refused."""
    from shared.hashing import checksum
    from worker.cache.host_tier import HostTier

    pins: set[tuple[str, str]] = set()
    tier = HostTier(capacity_bytes=100, pinned=lambda: pins)
    x = torch.arange(10, dtype=torch.float32)  # 40 bytes
    d = checksum(x.numpy().tobytes())
    assert tier.put("a", "f", x, d) == [] and tier.put("b", "f", x, d) == []
    pins.add(("a", "f"))                                    # a is the oldest, and pinned
    assert tier.put("c", "f", x, d) == [("b", "f")]
    pins.add(("c", "f"))
    assert tier.put("e", "f", x, d) is None and tier.keys() == [("a", "f"), ("c", "f")]
    assert tier.put("c", "f", x, d) == []                   # replacing an entry needs no victim
    pins.clear()
    assert tier.put("e", "f", x, d) == [("a", "f")] and tier.used_bytes == 80
