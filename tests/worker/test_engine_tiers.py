"""Eviction to host memory and to the shared offload directory, and reloads from both — on the
coordinator twin, two engines sharing one ledger and one directory."""

from __future__ import annotations

from pathlib import Path

import torch

from shared.hashing import chain_hashes
from shared.messages import ReplicaState
from tests.worker.conftest import core_accepts_lru_offload, prompt
from tests.twin import InProcessCoordinator


def same(a, b) -> bool:
    return a.tokens == b.tokens and torch.equal(a.logits, b.logits)


#: Pools of ~7 blocks per form, so a few 6-block prompts push each other out.
SMALL = {"worker.pool_bytes": 400_000, "cache.compressed_pool_limit": 0.1, "cache.swa_pool_limit": 0.7,
         "cache.tail_pool_limit": 0.18, "cache.offload_pool_limit": 0.02}
ONE_PROMPT = 6 * (2560 + 1024 + 6144 + 24576)


async def test_evicted_to_host_then_reloaded_bit_identical(make_engine, reference) -> None:
    p = prompt(100, seed=50)
    twin = InProcessCoordinator()
    async with make_engine(twin, **SMALL, **{"cache.host_tier_bytes": 4 * ONE_PROMPT,
                                              "cache.offload_dir": ""}) as e:
        await e.generate(p, max_tokens=1)
        await e.generate(prompt(100, seed=51), max_tokens=1)     # pushes p's blocks to the host tier
        await e.flush()
        assert e.metrics.value("kvl_worker_offload_bytes_total", {"tier": "host"}) > 0
        r = await e.generate(p, max_tokens=2)
        assert r.reloaded.get("host", 0) > 0 and r.cached_tokens == 96 and r.invalid == []
        assert same(r, await reference().generate(p, max_tokens=2))
    assert not [x for x in twin.rejected if x[0].location.startswith("host:")], twin.rejected[:3]


async def _fill_disk(make_engine, twin, prompts) -> None:
    """Worker ``wa`` caches ``prompts``, then pushes them out: GPU → host tier → offload files."""
    async with make_engine(twin, worker_id="wa", **SMALL, **{"cache.host_tier_bytes": ONE_PROMPT}) as a:
        for p in prompts:
            await a.generate(p, max_tokens=1)
        for seed in (52, 53, 54):
            await a.generate(prompt(100, seed=seed), max_tokens=1)
        assert await a.flush(timeout=10)
        assert a.metrics.value("kvl_worker_offload_bytes_total", {"tier": "host"}) > 0
        assert a.metrics.value("kvl_worker_offload_bytes_total", {"tier": "disk"}) > 0


def _files(root: Path, hashes: list[str]) -> list[Path]:
    return sorted(f for h in hashes for f in root.rglob(f"{h}.*.kvl"))


async def test_host_then_disk_then_reload_in_another_worker(make_engine, reference, tmp_path) -> None:
    """Clean files reload bit-identically in another worker; a truncated and a corrupted file
    are detected (integrity), marked INVALID, recomputed — same output, counted."""
    p1, p2, p3 = prompt(100, seed=50), prompt(100, seed=58), prompt(100, seed=59)
    twin = InProcessCoordinator()
    await _fill_disk(make_engine, twin, [p1, p2, p3])
    async with make_engine(twin, worker_id="wb", **SMALL) as b:
        salt_ns = (b.namespace, b.salt("default"))
        damaged = {}
        for p, how in ((p2, "truncate"), (p3, "corrupt")):
            files = _files(tmp_path / "offload", chain_hashes(p, 16, *salt_ns))
            assert files
            for f in files:
                raw = bytearray(f.read_bytes())
                raw = raw[:-100] if how == "truncate" else raw[:-7] + bytes([raw[-7] ^ 0x10]) + raw[-6:]
                f.write_bytes(bytes(raw))
            damaged[how] = p
        r = await b.generate(p1, max_tokens=2)
        assert r.reloaded.get("disk", 0) > 0 and r.cached_tokens > 0 and r.invalid == []
        assert same(r, await reference().generate(p1, max_tokens=2))
        for how, p in damaged.items():
            r = await b.generate(p, max_tokens=2)
            assert same(r, await reference().generate(p, max_tokens=2)), how
            assert r.invalid and all(x.startswith("integrity:") for x in r.invalid), (how, r.invalid)
        v = b.metrics.value
        assert v("kvl_worker_reload_failures_total", {"tier": "disk", "reason": "integrity"}) >= 2
        assert v("kvl_worker_hit_invalid_total", {"layer": "integrity", "form": "compressed"}) >= 1
        await b.flush()
        states = twin.state.replicas
        # reloaded replicas became wb's GPU replicas; the damaged files' replicas are INVALID
        assert any(k[2] == "gpu:wb" and rep.state is ReplicaState.READY for k, rep in states.items())
        assert any(k[2] == "disk" and rep.state is ReplicaState.INVALID for k, rep in states.items())


def test_core_accepts_offload_of_lru_victims() -> None:
    """The worker copies an LRU victim down a tier *after* the grant that evicted it; the
    coordinator must accept that offload (its source is EVICTED by then)."""
    assert core_accepts_lru_offload()


async def test_unwritable_offload_directory_keeps_serving(make_engine, reference, tmp_path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the directory should be")
    p = prompt(100, seed=55)
    async with make_engine(InProcessCoordinator(), **SMALL, **{"cache.host_tier_bytes": 0,
                                                                "cache.offload_dir": str(blocker / "x")}) as e:
        for seed in (55, 56, 57):
            r = await e.generate(prompt(100, seed=seed), max_tokens=1)
        await e.flush()
        assert e.metrics.value("kvl_worker_offload_failures_total", {"tier": "disk", "reason": "unavailable"}) >= 1
        assert e.metrics.value("kvl_worker_tier_unavailable_total", {"tier": "disk"}) >= 1
        assert e.health().disk_tier == "down"
        r = await e.generate(p, max_tokens=2)
        assert same(r, await reference().generate(p, max_tokens=2))
