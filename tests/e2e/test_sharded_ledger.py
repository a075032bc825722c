"""A ledger of two shards end to end: two coordinator processes (shards 0 and 1, a database each),
one NATS, a worker process with the tiny model, a member of both (docs/architecture.md, "The
ledger sharded"; worker.shard_links).

Prompts are chosen so that each shard owns some of their chains. Each chain is leased, committed
and reused on its own shard only, the repeat is served from the cache with the same output, and
each shard's audit (the worker's inventory of that shard's chains included) and the fleet audit
are clean.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from shared.embedded import free_port
from shared.hashing import chain_hashes
from shared.shards import ShardMap, map_bucket, shard_of, shard_subjects
from shared.subjects import Subjects
from shared.tenants import DEFAULT_TENANT_SECRET, tenant_salt
from tests.worker.processes import REPO, Cluster, Proc

PARTITIONS = 16
BS = 16


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class ShardedCluster(Cluster):
    """:class:`Cluster` with two coordinator shards: every process is told ``coordinator.shards: 2``;
    shard k's coordinator gets its database and admin port."""

    def __init__(self, tmp: Path, urls: list[str], nats_url: str, subjects: Subjects) -> None:
        super().__init__(tmp, urls[0], nats_url, subjects)
        self.urls = urls
        self.ports = [self.admin_port, free_port()]
        self.shard_procs: list[Proc] = []

    def base(self) -> dict[str, Any]:
        doc = super().base()
        doc["coordinator"].update(shards=2, shard_partitions=PARTITIONS)
        return doc

    def start_shards(self) -> None:
        for k in (0, 1):
            self.shard_procs.append(self.start_shard(k))
        self.coordinator = self.shard_procs[0]

    def start_shard(self, k: int) -> Proc:
        """Shard ``k``'s coordinator (again, after it died: same config, port and log)."""
        doc = self.base()
        doc["database"]["url"] = self.urls[k]
        doc["coordinator"].update(shard=k, port=self.ports[k])
        doc["state_dir"] = str(self.tmp / f"shard{k}-state")
        cfg = self._write(f"shard{k}", doc)
        p = Proc(f"shard{k}", [sys.executable, "-m", "coordinator", "--config", str(cfg)],
                 self.tmp / f"shard{k}.log", self._env())
        self.procs.append(p)
        return p

    async def wait_shards(self, timeout: float = 60) -> None:
        for k, port in enumerate(self.ports):
            self.admin_port = port
            self.coordinator = self.shard_procs[k]
            await self.wait_coordinator(timeout)
        self.admin_port, self.coordinator = self.ports[0], self.shard_procs[0]

    async def on(self, k: int, method: str, path: str, body: Any = None) -> Any:
        async with aiohttp.ClientSession() as http:
            async with http.request(method, f"http://127.0.0.1:{self.ports[k]}{path}", json=body) as r:
                assert r.status == 200, await r.text()
                return await r.json()


@pytest.fixture
async def sharded(tmp_path, database_url, other_database_url, nats_url, subjects):
    c = ShardedCluster(tmp_path, [database_url, other_database_url], nats_url, subjects)
    await c.connect()
    try:
        yield c
    finally:
        c.stop_all()
        js = c.nc.jetstream()       # shard 1's stream and the map's bucket (the fixture drops shard 0's stream)
        with contextlib.suppress(Exception):
            await js.delete_stream(shard_subjects(subjects.prefix, 1).stream_name)
        with contextlib.suppress(Exception):
            await js.delete_key_value(map_bucket(subjects.prefix))
        await c.close()


def prompts_by_shard(namespace: str, per_shard: int) -> dict[int, list[list[int]]]:
    """``per_shard`` prompts of three whole blocks whose chains each shard owns (by the static map)."""
    salt = tenant_salt(DEFAULT_TENANT_SECRET, "default")
    shard_map = ShardMap.uniform(2, PARTITIONS)
    by_shard: dict[int, list[list[int]]] = {0: [], 1: []}
    seed = 500
    while min(len(v) for v in by_shard.values()) < per_shard:
        p = prompt(3 * BS + 7, seed)
        seed += 1
        k = shard_of(shard_map, namespace, chain_hashes(p, BS, namespace, salt))
        if len(by_shard[k]) < per_shard:
            by_shard[k].append(p)
    return by_shard


async def _fleet_audit(bases: list[str]) -> tuple[int, str]:
    """``kvledger audit --shard-url …`` (the CLI, a process of its own; the workers' inventories checked)."""
    args = [sys.executable, "-m", "kvledger", "audit", "--json"]
    for b in bases:
        args += ["--shard-url", b]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVL_")}
    env["PYTHONPATH"] = str(REPO)
    proc = await asyncio.to_thread(subprocess.run, args, capture_output=True, text=True, env=env, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


async def test_a_worker_serves_chains_of_both_shards_and_reuses_each_on_its_own(sharded: ShardedCluster) -> None:
    c = sharded
    c.start_shards()
    # pools of room for every prompt here in each shard's half (no host or disk tier: the GPU pool is the cache)
    c.start_worker("wa", cache={"host_tier_bytes": 0, "offload_dir": ""}, worker={"pool_bytes": 16 * 2**20})
    await c.wait_shards()
    health = await c.wait_worker("wa")
    workers = [await c.on(k, "GET", "/v1/workers") for k in (0, 1)]
    (w0,), (w1,) = (ws["workers"] if isinstance(ws, dict) else ws for ws in workers)
    assert (w0["worker_id"], w1["worker_id"]) == ("wa", "wa") and w0["namespace"] == w1["namespace"]
    # each shard counts half of the worker's pool (its 8 partitions of 16): a slot is never booked twice
    half = {f: n * 8 // PARTITIONS for f, n in health["pool_slots"].items()}
    assert w0["pool_slots"] == w1["pool_slots"] == half
    ns = w0["namespace"]
    salt = tenant_salt(DEFAULT_TENANT_SECRET, "default")
    by_shard = prompts_by_shard(ns, 2)

    first: dict[tuple[int, ...], dict[str, Any]] = {}
    for ps in by_shard.values():
        for p in ps:
            r = await c.generate("wa", p, max_tokens=2)
            assert r["cached_tokens"] == 0 and not r["degraded"], r["fallbacks"]
            first[tuple(p)] = r
    for ps in by_shard.values():
        for p in ps:
            again = await c.generate("wa", p, max_tokens=2)
            assert again["cached_tokens"] == 3 * BS, (health["pool_slots"], again["fallbacks"])
            assert again["tokens"] == first[tuple(p)]["tokens"]
            assert torch.equal(again["logits"], first[tuple(p)]["logits"])
    assert await c.flush("wa")

    for k in (0, 1):
        mine = {h for p in by_shard[k] for h in chain_hashes(p, BS, ns, salt)}
        page = await c.on(k, "GET", "/v1/blocks?limit=1000&state=READY&location=gpu:wa")
        ready = {r["block_hash"] for r in page["replicas"]}
        assert ready and ready <= mine, f"shard {k} holds only its own chains"
        report = await c.on(k, "POST", "/v1/audit", {"replay_from": "empty", "check_workers": True})
        assert report["ok"] and report["workers_checked"] == ["wa"] and not report["drift"], report
        assert report["shard"]["foreign"]["count"] == 0
    code, out = await _fleet_audit([f"http://127.0.0.1:{p}" for p in c.ports])
    assert code == 0, out


async def test_a_shard_coordinator_restarted_suspends_and_resumes_only_that_shards_epoch(
        sharded: ShardedCluster) -> None:
    c = sharded
    c.start_shards()
    c.start_worker("wa", cache={"host_tier_bytes": 0, "offload_dir": ""}, worker={"pool_bytes": 16 * 2**20})
    await c.wait_shards()
    await c.wait_worker("wa")
    (w0,) = (await c.on(0, "GET", "/v1/workers"))["workers"]
    by_shard = prompts_by_shard(w0["namespace"], 1)
    for k in (0, 1):
        assert (await c.generate("wa", by_shard[k][0], max_tokens=1))["cached_tokens"] == 0
    assert await c.flush("wa")
    # shard 1's only coordinator killed and started again: its new leader replays the log and
    # suspends every epoch it finds; shard 0 sees nothing of it
    c.shard_procs[1].kill()
    c.shard_procs[1] = c.start_shard(1)
    await c.wait_shards()
    for _ in range(100):    # the worker resumes shard 1's epoch (its inventory of shard 1's chains)
        (w1,) = (await c.on(1, "GET", "/v1/workers"))["workers"]
        if not w1["suspended"]:
            break
        await asyncio.sleep(0.1)
    assert (w1["epoch"], w1["suspended"]) == (1, False), w1
    (w0,) = (await c.on(0, "GET", "/v1/workers"))["workers"]
    assert (w0["epoch"], w0["suspended"]) == (1, False), w0
    for k in (0, 1):        # both shards' chains still served from the cache, on the same epochs
        r = await c.generate("wa", by_shard[k][0], max_tokens=1)
        assert r["cached_tokens"] == 3 * BS and r["epoch"] == 1, (k, r["fallbacks"])
    assert await c.flush("wa")
    metrics = await c.debug("wa", "metrics")
    assert next(x for x in metrics.splitlines() if x.startswith("kvl_worker_resumes_total")).split()[-1] == "1.0"
    for k in (0, 1):
        report = await c.on(k, "POST", "/v1/audit", {"replay_from": "empty", "check_workers": True})
        assert report["ok"] and not report["drift"], report
