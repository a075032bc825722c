"""The worker cache engine end to end: real coordinator, PostgreSQL, NATS and worker processes.

Requests go through each worker's NATS debug subject; every result is compared, with
``torch.equal``, against a cold run of a cache-disabled engine in this test process (the
same seeded model, one intra-op thread on both sides).
"""

from __future__ import annotations

import asyncio
import signal

import pytest
import torch

from shared.config import parse_config
from shared.hashing import chain_hashes
from shared.tenants import DEFAULT_TENANT_SECRET, tenant_salt
from tests.worker.processes import Cluster
from tests.segment_files import flip_header, flip_payload, records
from worker.engine import Engine
from worker.model import build_model

torch.set_num_threads(1)
BS = 16


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model():
    return build_model(seed=0)


@pytest.fixture
async def reference(model):
    engine = Engine(model, parse_config({"cache": {"chunk_blocks": 1}}), None)
    cache: dict[tuple, object] = {}

    async def run(tokens: list[int], max_tokens: int = 2):
        key = (tuple(tokens), max_tokens)
        if key not in cache:
            cache[key] = await engine.generate(tokens, max_tokens=max_tokens)
        return cache[key]

    yield run
    await engine.stop()


async def check(cluster: Cluster, reference, wid: str, tokens: list[int], max_tokens: int = 2) -> dict:
    got = await cluster.generate(wid, tokens, max_tokens)
    cold = await reference(tokens, max_tokens)
    assert got["tokens"] == cold.tokens and torch.equal(got["logits"], cold.logits), (wid, got["cached_tokens"])
    return got


async def test_reuse_in_a_worker_process_is_bit_identical(cluster, reference) -> None:
    cluster.start_coordinator()
    # small window/tail pools, no host tier: later prompts recycle every window slot
    cluster.start_worker("wa", cache={"host_tier_bytes": 0, "offload_dir": "", "compressed_pool_limit": 0.6,
                                      "swa_pool_limit": 0.2}, worker={"pool_bytes": 2 * 2**20})
    await cluster.wait_coordinator()
    await cluster.wait_worker("wa")
    p = prompt(100, seed=1)
    assert (await check(cluster, reference, "wa", p))["cached_tokens"] == 0
    warm = await check(cluster, reference, "wa", p)
    assert warm["cached_tokens"] == 96 and warm["invalid"] == [] and not warm["degraded"]
    # shared prefix, another suffix
    assert (await check(cluster, reference, "wa", p[:64] + prompt(30, seed=2)))["cached_tokens"] == 64
    # a shared prefix ending mid-block: the largest whole-block boundary
    assert (await check(cluster, reference, "wa", p[:70] + prompt(20, seed=3)))["cached_tokens"] == 64
    # one block is the unit, whatever the compression ratios
    assert (await check(cluster, reference, "wa", p[:16] + prompt(3, seed=4)))["cached_tokens"] == 16
    # a prefix 4x the sliding window, after other long prompts recycled every window slot
    long = prompt(136, seed=5)
    await check(cluster, reference, "wa", long, 1)
    for seed in (6, 7, 8):
        await cluster.generate("wa", prompt(136, seed=seed), 1)
    again = await check(cluster, reference, "wa", long, 3)
    assert again["invalid"] == []
    metrics = await cluster.debug("wa", "metrics")
    assert "kvl_worker_prefix_cache_validated_hits_total" in metrics
    assert await cluster.flush("wa")
    ready = await cluster.replicas(location="gpu:wa", state="READY")
    assert ready and all(r["generation"] >= 1 for r in ready)


async def test_a_burst_sharing_a_new_prefix_computes_it_once(cluster, reference) -> None:
    """Four requests at once, sharing 6 blocks nobody has cached: one computes them, the other
    three wait for its commit to be durable and read them (worker.inflight)."""
    cluster.start_coordinator()
    cluster.start_worker("wa")
    await cluster.wait_coordinator()
    await cluster.wait_worker("wa")
    base = prompt(96, seed=80)
    prompts = [base + prompt(20, seed=81 + i) for i in range(4)]
    got = await asyncio.gather(*(cluster.generate("wa", p) for p in prompts))
    assert sorted(g["cached_tokens"] for g in got) == [0, 96, 96, 96]
    for g, p in zip(got, prompts):
        cold = await reference(p)
        assert g["tokens"] == cold.tokens and torch.equal(g["logits"], cold.logits)
    metrics = await cluster.debug("wa", "metrics")
    assert 'kvl_worker_prefix_waits_total{outcome="committed"} 3.0' in metrics


async def test_killed_worker_is_fenced_and_nothing_stale_is_reused(cluster, reference) -> None:
    cluster.start_coordinator()
    cluster.start_worker("wa", cache={"offload_dir": ""})
    await cluster.wait_coordinator()
    h = await cluster.wait_worker("wa")
    assert h["epoch"] == 1 and h["pools_allocated"]
    p = prompt(80, seed=10)
    await check(cluster, reference, "wa", p)
    assert (await check(cluster, reference, "wa", p))["cached_tokens"] == 64
    assert await cluster.flush("wa")
    before = await cluster.replicas(location="gpu:wa", state="READY")
    assert len(before) == 5 * 4
    cluster.workers["wa"].kill(signal.SIGKILL)
    cluster.start_worker("wa", cache={"offload_dir": ""})
    h = await cluster.wait_worker("wa", epoch_above=1)
    assert h["epoch"] == 2
    lost = await cluster.replicas(location="gpu:wa", state="LOST")
    assert {(r["block_hash"], r["form"]) for r in lost} >= {(r["block_hash"], r["form"]) for r in before}
    r = await check(cluster, reference, "wa", p)
    assert r["cached_tokens"] == 0 and r["hit_tokens"] == 0 and r["invalid"] == [] and r["epoch"] == 2
    assert (await check(cluster, reference, "wa", p))["cached_tokens"] == 64


async def test_coordinator_killed_recomputes_then_resumes_with_its_cache(cluster, reference) -> None:
    cluster.start_coordinator()
    cluster.start_worker("wa", cache={"offload_dir": ""})
    await cluster.wait_coordinator()
    await cluster.wait_worker("wa")
    p = prompt(64, seed=20)
    await check(cluster, reference, "wa", p)
    assert (await check(cluster, reference, "wa", p))["cached_tokens"] == 48
    cluster.stop_coordinator(signal.SIGKILL)
    r = await check(cluster, reference, "wa", p)
    assert r["degraded"] and r["cached_tokens"] == 0 and "degraded" in r["fallbacks"]
    h = await cluster.health("wa")
    assert h is not None and h["degraded"] and h["reason"]
    assert "kvl_worker_degraded 1.0" in await cluster.debug("wa", "metrics")
    r = await check(cluster, reference, "wa", p)         # still degraded: no coordinator round trip
    assert r["degraded"]
    h = await cluster.wait_worker("wa", contact="unreachable")
    assert h["epoch"] == 1 and h["pool_used"]["compressed"] > 0    # epoch and cache kept
    cluster.start_coordinator()
    await cluster.wait_coordinator()
    h = await cluster.wait_worker("wa", contact="reachable")
    assert not h["degraded"] and h["epoch"] == 1                  # resumed (the restart suspended it)
    assert "kvl_worker_resumes_total 1.0" in await cluster.debug("wa", "metrics")
    r = await check(cluster, reference, "wa", p)                   # the first request after: reuse
    assert r["cached_tokens"] == 48 and not r["degraded"] and r["epoch"] == 1


SMALL = {"compressed_pool_limit": 0.1, "swa_pool_limit": 0.7, "tail_pool_limit": 0.18}
ONE_PROMPT = 6 * (2560 + 1024 + 6144 + 24576)


async def test_offload_to_host_and_disk_then_reload_in_another_worker(cluster, reference, model) -> None:
    cluster.start_coordinator()
    cluster.start_worker("wa", cache={**SMALL, "host_tier_bytes": ONE_PROMPT}, worker={"pool_bytes": 400_000})
    cluster.start_worker("wb", cache={**SMALL, "host_tier_bytes": 0}, worker={"pool_bytes": 400_000})
    await cluster.wait_coordinator()
    await cluster.wait_worker("wa")
    await cluster.wait_worker("wb")
    p1, p2, p3 = prompt(100, seed=30), prompt(100, seed=31), prompt(100, seed=32)
    for p in (p1, p2, p3):
        await check(cluster, reference, "wa", p, 1)
    for seed in (33, 34, 35):                  # push p1..p3 to the host tier, then to disk
        await cluster.generate("wa", prompt(100, seed=seed), 1)
    assert await cluster.flush("wa")
    wa_metrics = await cluster.debug("wa", "metrics")
    assert 'kvl_worker_offload_bytes_total{tier="host"}' in wa_metrics
    assert 'kvl_worker_offload_bytes_total{tier="disk"}' in wa_metrics
    assert await cluster.replicas(location="disk", state="READY")
    # damage p2's records (a header byte: wb's scan skips them) and p3's (a payload byte)
    ns = Engine(model, parse_config({}), None).namespace
    salt = tenant_salt(DEFAULT_TENANT_SECRET, "default")
    for p, damage in ((p2, flip_header), (p3, flip_payload)):
        recs = records(cluster.offload_dir, chain_hashes(p, BS, ns, salt))
        assert recs
        for r in recs:
            damage(r)
    r1 = await check(cluster, reference, "wb", p1)
    assert r1["reloaded"].get("disk", 0) > 0 and r1["cached_tokens"] > 0 and r1["invalid"] == []
    r2 = await check(cluster, reference, "wb", p2)
    r3 = await check(cluster, reference, "wb", p3)
    assert any(x.startswith("presence:") for x in r2["invalid"]), r2["invalid"]     # no such record, for wb
    assert any(x.startswith("integrity:") for x in r3["invalid"]), r3["invalid"]
    wb_metrics = await cluster.debug("wb", "metrics")
    line = next(x for x in wb_metrics.splitlines()
                if x.startswith('kvl_worker_reload_failures_total{reason="integrity",tier="disk"}'))
    assert float(line.split()[-1]) >= 1
    assert float(next(x for x in wb_metrics.splitlines() if x.startswith("kvl_worker_disk_records_skipped")).split()[-1]) >= 1
    assert await cluster.flush("wb")
    assert await cluster.replicas(location="disk", state="INVALID")


async def test_a_worker_whose_fused_forwards_differ_disowns_its_disk_copies(cluster, reference) -> None:
    """The run-time batch-invariance check in a worker process whose fused forwards depend on the
    batch (failpoint ``fused_skew``: the fault a kernel the start-up probe missed would cause).
    The checked step fails and its requests are retried exact; the worker stops fusing and
    registers a new epoch that disowns what it computed: its disk copies are INVALID in the
    ledger, and another worker recomputes that prompt instead of reloading them."""
    import asyncio

    cluster.start_coordinator()
    cluster.start_worker("wa", cache={**SMALL, "host_tier_bytes": 0}, worker={"pool_bytes": 400_000},
                         service={"fused_check_every": 1}, failpoints="fused_skew")
    cluster.start_worker("wb", cache={**SMALL, "host_tier_bytes": 0}, worker={"pool_bytes": 400_000})
    await cluster.wait_coordinator()
    await cluster.wait_worker("wa")
    await cluster.wait_worker("wb")
    p1 = prompt(100, seed=40)
    await check(cluster, reference, "wa", p1, 1)          # alone: one request per forward, exact
    for seed in (41, 42, 43):                           # pushes p1 out of wa's pools to the disk
        await cluster.generate("wa", prompt(100, seed=seed), 1)
    assert await cluster.flush("wa")
    on_disk = {(r["block_hash"], r["form"]) for r in await cluster.replicas(location="disk", state="READY")}
    assert on_disk
    caught = False
    for round_ in range(5):                              # until a fused forward was checked (the first, as a rule)
        tries = [prompt(20, seed=50 + 3 * round_ + k) for k in range(3)]
        got = await asyncio.gather(*(cluster.generate("wa", t, 4) for t in tries), return_exceptions=True)
        caught = any(isinstance(g, AssertionError) and "other logits" in str(g) for g in got)
        for t, g in zip(tries, got):                     # what was answered, and every retry, is exact
            cold = await reference(t, 4)
            if isinstance(g, AssertionError):
                g = await cluster.generate("wa", t, 4)
            assert g["tokens"] == cold.tokens and torch.equal(g["logits"], cold.logits)
        if caught:
            break
    assert caught, "no fused forward differed in five rounds of three concurrent requests"
    health = await cluster.wait_worker("wa", epoch_above=1)
    assert health["epoch"] == 2 and not health["degraded"], health
    left = {(r["block_hash"], r["form"]) for r in await cluster.replicas(location="disk", state="READY")}
    assert not on_disk & left, sorted(on_disk & left)[:3]
    metrics = await cluster.debug("wa", "metrics")
    assert float(next(x for x in metrics.splitlines()
                      if x.startswith("kvl_worker_disowned_replicas_total")).split()[-1]) >= len(on_disk)
    r1 = await check(cluster, reference, "wb", p1)
    assert not r1["reloaded"].get("disk") and r1["cached_tokens"] == 0, r1["cached_tokens"]


async def started(p, name: str) -> str:
    """Wait (up to 60 s) for worker process ``p`` to log ``worker_started``; returns that line."""
    for _ in range(600):
        line = next((x for x in p.tail(200).splitlines() if "worker_started" in x), None)
        if line is not None:
            return line
        assert p.alive, p.tail()
        await asyncio.sleep(0.1)
    raise AssertionError(f"{name} did not start\n{p.tail()}")


async def test_the_debug_subjects_are_off_unless_enabled(cluster) -> None:
    import nats.errors

    cluster.start_coordinator()
    p = cluster.start_worker("wd", worker={"debug_subjects": False})
    await cluster.wait_coordinator()
    await started(p, "wd")
    for what in ("generate", "health", "metrics", "flush"):
        with pytest.raises(nats.errors.NoRespondersError):
            await cluster.debug("wd", what, {"tokens": [1] * 20, "max_tokens": 1}, timeout=2)


async def test_the_worker_process_takes_its_switch_interval_from_the_config(cluster) -> None:
    import re

    cluster.start_coordinator()
    p = cluster.start_worker("ws", worker={"gil_switch_interval_ms": 0.25})
    await cluster.wait_coordinator()
    line = await started(p, "ws")
    assert re.search(r"gil_switch_interval_ms\W+0\.25\b", line), line
