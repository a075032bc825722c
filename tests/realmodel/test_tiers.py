"""SmolLM2's blocks (0.7 MiB each in float32: 30 layers × K and V × 3 heads × 64 × 16 tokens)
evicted to the host tier and to the shared offload directory, and reloaded from each
bit-identically — in the worker that wrote them and in another one."""

from __future__ import annotations

from tests.realmodel.conftest import BS, chat_ids, loaded, real_config
from tests.twin import InProcessCoordinator
from worker.engine import Engine

BLOCK = 30 * 2 * 3 * 64 * BS * 4
#: Four slots of the one K/V form (the dense model's form takes the whole reserve of 0.7 × 0.9).
POOL = int(4.5 * BLOCK / (0.7 * 0.9))


def prompts() -> list[list[int]]:
    cities = ("Paris", "Lisbon", "Oslo", "Rome")
    # no whole block in common (a system message of their own: not the template's default one)
    return [chat_ids([{"role": "system", "content": f"{c} is the city to talk about. Keep it simple and friendly."},
                      {"role": "user", "content": "Tell me one fact about it, in a short sentence, and then one more about its people."}])
            for c in cities]


def engine(tmp_path, twin, worker_id: str, **over) -> Engine:
    return Engine(loaded(), real_config(tmp_path, **{"worker.worker_id": worker_id, "worker.pool_bytes": POOL,
                                                     "cache.offload_dir": str(tmp_path / "offload"), **over}), twin)


async def cold(tmp_path, tokens: list[int]):
    ref = Engine(loaded(), real_config(tmp_path), None)
    try:
        return await ref.generate(tokens, max_tokens=2)
    finally:
        await ref.stop()


async def test_host_tier_then_disk_reload_bit_identical(tmp_path) -> None:
    p, *others = prompts()
    assert len(p) >= 3 * BS and all(len(o) >= 3 * BS for o in others)
    whole = (len(p) - 1) // BS * BS
    want = await cold(tmp_path, p)
    twin = InProcessCoordinator()
    a = engine(tmp_path, twin, "wa", **{"cache.host_tier_bytes": 4 * BLOCK})
    await a.start()
    try:
        assert a.slots == {"kv": 4}
        await a.generate(p, max_tokens=1)
        # one more prompt pushes p's blocks out of the 4 slots, to the host tier (which holds 4: a
        # second one could push them on to the disk, depending on when the spill loop ran)
        await a.generate(others[0], max_tokens=1)
        assert await a.flush(timeout=10)
        assert a.metrics.value("kvl_worker_offload_bytes_total", {"tier": "host"}) >= 3 * BLOCK
        r = await a.generate(p, max_tokens=2)
        assert r.reloaded.get("host", 0) > 0 and r.cached_tokens == whole and r.invalid == []
        assert r.tokens == want.tokens and (r.logits == want.logits).all()
    finally:
        await a.stop()
    # a worker with a host tier of one block: its evictions go on to the offload files, and another
    # worker reads them back
    b = engine(tmp_path, twin, "wb", **{"cache.host_tier_bytes": BLOCK})
    await b.start()
    try:
        for o in others:
            await b.generate(o, max_tokens=1)
        assert await b.flush(timeout=10)
        assert b.metrics.value("kvl_worker_offload_bytes_total", {"tier": "disk"}) > 0
    finally:
        await b.stop()
    c = engine(tmp_path, twin, "wc", **{"cache.host_tier_bytes": 0})
    await c.start()
    try:
        o = others[0]
        r = await c.generate(o, max_tokens=2)
        assert r.reloaded.get("disk", 0) > 0 and r.cached_tokens == (len(o) - 1) // BS * BS and r.invalid == []
        ref = await cold(tmp_path, o)
        assert r.tokens == ref.tokens and (r.logits == ref.logits).all()
    finally:
        await c.stop()
