"""``python -m bench.fleet --quick`` for one and two shards on real PostgreSQL and NATS (the
coordinators and the drivers its own processes): every key printed, leases on every shard, no lease
routed to a shard that does not own it, no error — and nothing left behind."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import asyncpg
import nats
import nats.js.errors

from shared.embedded import Services
from shared.shards import map_bucket, shard_subjects

REPO = Path(__file__).resolve().parents[2]


def test_bench_fleet_quick_drives_one_and_two_shards_routing_every_lease_to_its_owner(services: Services) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVL_")}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.fleet", "--quick", "--shards", "1,2", "--database-url", services.database_url,
         "--nats-url", services.nats_url], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for n in (1, 2):
        for key in ("leases_per_s", "cpu_us_per_lease", "scaling_efficiency", "leases_per_cpu_s",
                    "cpu_us_per_lease_beyond_idle", "idle_cpu_ms_per_s", "append_txs_per_lease",
                    "cpu_us_per_lease_ledger", "scaling_efficiency_ledger"):
            assert isinstance(result[f"{key}_shards{n}"], (int, float)) and result[f"{key}_shards{n}"] > 0, key
        for role in ("coordinators", "drivers", "postgres", "nats"):
            assert result[f"cpu_us_per_lease_shards{n}_{role}"] > 0, role
        by_shard = result[f"leases_by_shard_shards{n}"]
        assert len(by_shard) == n and min(by_shard) > 0, by_shard
        assert result[f"wrong_shard_shards{n}"] == 0 and result[f"errors_shards{n}"] == 0
        assert len(result["run_leases_by_shard"][f"shards{n}"]) == n
        assert result["run_errors"][f"shards{n}"] == {}
        assert 0 < result[f"reuse_share_shards{n}"] < 1          # turns read cached prefixes and write new blocks
    assert result["scaling_efficiency_shards1"] == 1.0 and result["run_wrong_shard"] == 0
    assert result["goals"]["wrong_shard == 0"] and result["goals"]["errors == 0"]
    assert "scaling_efficiency_shards2 >= 0.9" in result["goals"]
    table = proc.stderr[proc.stderr.index("shards  leases/s"):].splitlines()
    assert [row.split()[0] for row in table[1:3]] == ["1", "2"]     # the readable table, a row per shard count

    made = result["made_and_removed"]
    assert len(made["prefixes"]) == 2 and len(made["databases"]) == 3

    async def leftovers() -> list[str]:
        left = []
        conn = await asyncpg.connect(services.database_url.replace("postgresql+asyncpg://", "postgresql://"))
        try:
            names = {r["datname"] for r in await conn.fetch("SELECT datname FROM pg_database")}
        finally:
            await conn.close()
        left += sorted(set(made["databases"]) & names)
        nc = await nats.connect(services.nats_url)
        try:
            js = nc.jetstream()
            for prefix, n in zip(made["prefixes"], (1, 2)):
                for k in range(n):
                    try:
                        await js.stream_info(shard_subjects(prefix, k).stream_name)
                        left.append(shard_subjects(prefix, k).stream_name)
                    except nats.js.errors.NotFoundError:
                        pass
                try:
                    await js.key_value(map_bucket(prefix))
                    left.append(map_bucket(prefix))
                except nats.js.errors.BucketNotFoundError:
                    pass
        finally:
            await nc.drain()
        return left
    assert asyncio.run(leftovers()) == []
