"""``cache.dtype`` through the engine: pools, the host and disk tiers and hit validation hold
blocks in the storage precision, and reuse stays bit-identical to a cold (cache-disabled)
engine at the same precision — at every block boundary, and after a reload from each tier."""

from __future__ import annotations

import pytest
import torch

from tests.twin import InProcessCoordinator
from tests.worker.conftest import BS, config, prompt
from worker.engine import Engine
from worker.model.dense import DenseConfig, build_dense

#: Pools of ~7 blocks per form (as tests/worker/test_engine_tiers.py), so prompts push each other out.
SMALL = {"worker.pool_bytes": 400_000, "cache.compressed_pool_limit": 0.1, "cache.swa_pool_limit": 0.7,
         "cache.tail_pool_limit": 0.18}


def same(a, b) -> bool:
    return a.tokens == b.tokens and torch.equal(a.logits, b.logits)


@pytest.fixture(scope="module")
def dense():
    return build_dense(DenseConfig(max_position_embeddings=512), seed=2)


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("which", ["hybrid", "dense"])
async def test_resume_at_every_block_is_bit_identical(model, dense, tmp_path, which, cache_dtype) -> None:
    m = model if which == "hybrid" else dense
    toks = prompt(5 * BS + 3, seed=70)
    twin = InProcessCoordinator()
    engine = Engine(m, config(tmp_path, **{"cache.dtype": cache_dtype}), twin)
    cold = Engine(m, config(tmp_path / "cold", **{"cache.dtype": cache_dtype}), None)
    auto = Engine(m, config(tmp_path / "auto"), None)
    await engine.start()
    try:
        # the pools hold the storage precision's bytes; the spec says which
        for f, lay in engine.layouts.items():
            assert lay.spec.dtype == cache_dtype
            assert engine.store.pools[f].storage.shape[1] == lay.spec.bytes_per_block
        assert cold.namespace == engine.namespace != auto.namespace
        first = await engine.generate(toks, max_tokens=3)
        assert same(first, await cold.generate(toks, max_tokens=3))
        # the precision is real: the same request computes other logits at the family's own
        assert not torch.equal(first.logits, (await auto.generate(toks, max_tokens=3)).logits)
        for b in range(1, 6):
            probe = toks[:b * BS] + [(t + b) % 256 for t in toks[b * BS:b * BS + 5]]
            warm = await engine.generate(probe, max_tokens=3)
            assert warm.cached_tokens == b * BS and warm.invalid == [], (b, warm.fallbacks)
            assert same(warm, await cold.generate(probe, max_tokens=3)), b
    finally:
        for e in (engine, cold, auto):
            await e.stop()
    assert not twin.rejected


async def test_fp8_blocks_reload_from_host_and_disk_bit_identically(model, tmp_path) -> None:
    """Evicted to the host tier, then to the segment files; another worker reloads them."""
    fp8 = {"cache.dtype": "float8_e4m3fn"}
    small = {**SMALL, "worker.pool_bytes": 104_000}     # ~7 slots per form at fp8's 0.26 of the bytes
    p = prompt(100, seed=71)
    twin = InProcessCoordinator()
    cold = Engine(model, config(tmp_path / "cold", **fp8), None)
    wa = Engine(model, config(tmp_path, **{"worker.worker_id": "wa", **small, **fp8,
                                           "cache.host_tier_bytes": 60_000}), twin)
    await wa.start()
    try:
        await wa.generate(p, max_tokens=1)
        for seed in (72, 73, 74, 75):
            await wa.generate(prompt(100, seed=seed), max_tokens=1)   # push p's blocks down the tiers
        assert await wa.flush(timeout=10)
        assert wa.metrics.value("kvl_worker_offload_bytes_total", {"tier": "host"}) > 0
        assert wa.metrics.value("kvl_worker_offload_bytes_total", {"tier": "disk"}) > 0
        r = await wa.generate(p, max_tokens=2)
        assert r.cached_tokens > 0 and r.invalid == [] and sum(r.reloaded.values()) > 0, r.reloaded
        assert same(r, await cold.generate(p, max_tokens=2))
    finally:
        await wa.stop()
    wb = Engine(model, config(tmp_path, **{"worker.worker_id": "wb", **small, **fp8}), twin)
    await wb.start()
    try:
        r = await wb.generate(p, max_tokens=2)
        assert r.reloaded.get("disk", 0) > 0 and r.invalid == [], (r.reloaded, r.invalid)
        assert same(r, await cold.generate(p, max_tokens=2))
    finally:
        await wb.stop()
        await cold.stop()


async def test_a_replica_of_another_precision_fails_the_abi_layer(model, tmp_path) -> None:
    """A block written at bfloat16 offered to an fp8 reader (a shared disk tier, a mixed fleet):
    the namespace already keeps them apart; were it not to, validation's ABI layer would."""
    from shared.messages import ReplicaRef
    from worker.cache.planner import BlockMeta, Expect, Observed, Switches, validate

    bf = Engine(model, config(tmp_path / "bf", **{"cache.dtype": "bfloat16"}), None)
    f8 = Engine(model, config(tmp_path / "f8", **{"cache.dtype": "float8_e4m3fn"}), None)
    try:
        assert bf.namespace != f8.namespace
        st = model.new_state(BS, 2 * BS, cache_dtype="bfloat16")
        model.prefill(prompt(BS + 1, seed=76), st)
        payload = st.export_block(0)
        hashes = ["ab" * 16]
        for form, t in payload.items():
            meta = BlockMeta(namespace=f8.namespace, tenant="default", block_hash=hashes[0], parent_hash="0" * 32,
                             token_start=0, token_end=BS, form=form, spec_digest=bf.specs[form].spec_digest,
                             checksum="x")
            ref = ReplicaRef(block_hash=hashes[0], form=form, location="disk", generation=0, checksum="x")
            expect = Expect(namespace=f8.namespace, tenant="default", block_hashes=hashes, block_size=BS,
                            specs=f8.specs, stored_as=f8.stored_as)
            nbytes = t.numel() * t.element_size()
            v = validate(ref, 0, Observed(meta, nbytes=f8.specs[form].bytes_per_block), expect,
                         Switches(forms=frozenset(f8.catalogue.names)), reload=True)
            assert not v.ok and v.layer.value == "abi", v
            assert "float8_e4m3fn" in v.detail and "bfloat16" in v.detail, v.detail
            v = validate(ref, 0, Observed(meta, nbytes=nbytes), expect, Switches(forms=frozenset(f8.catalogue.names)),
                         reload=True)
            assert not v.ok and v.layer.value == "abi"
    finally:
        await bf.stop()
        await f8.stop()
