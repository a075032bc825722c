"""Hit validation on the engine: each layer catches its kind of bad replica, the replica is
marked INVALID in the ledger, and the request recomputes from the first unusable block —
with output bit-identical to a cold run. ``on_invalid: error`` raises instead."""

from __future__ import annotations

import msgspec
import pytest
import torch

from shared.messages import ReplicaState
from tests.twin import InProcessCoordinator
from tests.worker.conftest import BS, prompt
from worker.cache.manager import CacheValidationError


def same(a, b) -> bool:
    return a.tokens == b.tokens and torch.equal(a.logits, b.logits)


def _slot(e, form: str, block_hash: str) -> int:
    hit = e.store.pools[form].lookup(block_hash)
    assert hit is not None
    return hit[0]


def _tamper_meta(e, form: str, block_hash: str, **changes) -> None:
    slot = _slot(e, form, block_hash)
    key = (form, slot)
    e.store._meta[key] = msgspec.structs.replace(e.store._meta[key], **changes)


@pytest.mark.parametrize("layer", ["presence", "abi", "intersection", "integrity"])
async def test_bad_replica_is_caught_invalidated_and_recomputed(make_engine, reference, layer) -> None:
    toks = prompt(100, seed=30)            # 6 whole blocks
    cold = await reference().generate(toks, max_tokens=2)
    twin = InProcessCoordinator()
    async with make_engine(twin) as e:
        await e.generate(toks, max_tokens=1)
        await e.flush()
        h3 = e.store.lookup("compressed", _hashes(e, toks)[3])[1].block_hash
        if layer == "presence":       # the slot was recycled for the same block: another generation
            meta, data = e.store.drop("compressed", h3)
            e.store.install(msgspec.structs.replace(meta, generation=0), data)
        elif layer == "abi":
            _tamper_meta(e, "compressed", h3, spec_digest="0" * 16)
        elif layer == "intersection":
            _tamper_meta(e, "compressed", h3, token_start=0, token_end=BS)
        else:
            e.store.pools["compressed"].storage[_slot(e, "compressed", h3)][5] ^= 0x40
        r = await e.generate(toks, max_tokens=2)
        assert same(cold, r)
        assert r.invalid == [f"{layer}:compressed:3"] and "validation" in r.fallbacks
        # recomputed from the first unusable block: blocks 0..2 still served
        assert r.cached_tokens == 3 * BS
        assert e.metrics.value("kvl_worker_hit_invalid_total", {"layer": layer, "form": "compressed"}) == 1
        assert e.metrics.value("kvl_worker_hit_validation_total", {"layer": layer, "outcome": "fail"}) == 1
        await e.flush()
        key = (h3, "compressed", "gpu:w1")
        assert twin.state.replicas[key].state is ReplicaState.INVALID
        # the next request resumes before the INVALID block and writes it again
        again = await e.generate(toks, max_tokens=2)
        assert same(cold, again) and again.invalid == [] and again.cached_tokens == 3 * BS
        await e.flush()
        assert twin.state.replicas[key].state is ReplicaState.READY
        assert (await e.generate(toks, max_tokens=2)).cached_tokens == 6 * BS


def _hashes(e, toks):
    from shared.hashing import chain_hashes
    return chain_hashes(toks, BS, e.namespace, e.salt("default"))


async def test_on_invalid_error_raises_and_releases(make_engine) -> None:
    toks = prompt(64, seed=31)
    twin = InProcessCoordinator()
    async with make_engine(twin, **{"cache.on_invalid": "error"}) as e:
        await e.generate(toks, max_tokens=1)
        h0 = _hashes(e, toks)[0]
        e.store.pools["indexer"].storage[_slot(e, "indexer", h0)][0] ^= 1
        with pytest.raises(CacheValidationError, match="integrity"):
            await e.generate(toks, max_tokens=1)
        await e.flush()
        assert not twin.state.leases and e.health().active_sessions == 0
        r = await e.generate(toks, max_tokens=1)       # the bad replica is INVALID now: a clean miss
        assert r.invalid == []


async def test_switched_off_layers_are_counted_as_skipped(make_engine) -> None:
    toks = prompt(48, seed=32)
    async with make_engine(InProcessCoordinator(), **{"cache.hit_validation.layers": ["presence"],
                                                      "cache.hit_validation.check_swa": False}) as e:
        await e.generate(toks, max_tokens=1)
        r = await e.generate(toks, max_tokens=1)
        assert r.cached_tokens == 32
        v = e.metrics.value
        assert v("kvl_worker_hit_validation_total", {"layer": "integrity", "outcome": "pass"}) == 0
        assert v("kvl_worker_hit_validation_total", {"layer": "integrity", "outcome": "skip"}) == r.validated
        # swa replicas skip every layer; the others pass presence
        swa = sum(1 for n in e.catalogue.names if n == "swa") * 2
        assert v("kvl_worker_hit_validation_total", {"layer": "presence", "outcome": "pass"}) == r.validated - swa
