"""Two coordinator shards side by side on one NATS (real coordinators, real PostgreSQL, one database
each): each answers on its own subjects and stream, leases only the chains its shard map gives it,
refuses the others' with ``wrong_shard``, and keeps its own log, clean by its own audit — and the two
logs together hold every chain once (docs/architecture.md, "The ledger sharded")."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys

from typing import Any

import aiohttp
import asyncpg
import nats
import pytest

from coordinator.core import CoreParams, decode_event, replay
from shared.messages import ErrorCode, ErrorReply, LeaseGrant, ReplicaState
from shared.shards import ShardMap, map_bucket, shard_subjects
from shared.subjects import Subjects
from tests.integration.coordinator_kit import NS, Worker, fast_config, running_coordinator

PARTITIONS = 16
#: The protocol-level workers here send no heartbeats: a worker is suspended only after 200 ms × 600
#: (fast_config's 200 ms interval), far past a test's CLI calls on a loaded machine.
QUIET = {"missed_heartbeats": 600}


async def _drop_shards(nc: Any, subjects: Subjects) -> None:
    """What a two-shard test leaves on the NATS beyond shard 0's stream (the fixture drops that one):
    shard 1's stream and the shard map's bucket; then the connection is drained."""
    js = nc.jetstream()
    with contextlib.suppress(Exception):
        await js.delete_stream(shard_subjects(subjects.prefix, 1).stream_name)
    with contextlib.suppress(Exception):
        await js.delete_key_value(map_bucket(subjects.prefix))
    await nc.drain()


async def _audit(base: str) -> dict:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{base}/v1/audit", json={"check_workers": False}) as r:
            assert r.status == 200, await r.text()
            return await r.json()


async def _fleet_audit(bases: list[str]) -> tuple[int, str]:
    """``kvledger audit --shard-url … --json`` (the CLI, a process of its own)."""
    args = [sys.executable, "-m", "kvledger", "audit", "--no-workers", "--json"]
    for b in bases:
        args += ["--shard-url", b]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVL_")}
    proc = await asyncio.to_thread(subprocess.run, args, capture_output=True, text=True, env=env, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


def _chains(shard_map: ShardMap, per_shard: int) -> dict[int, list[list[str]]]:
    """``per_shard`` three-block chains for each shard, by the root the map gives it."""
    out: dict[int, list[list[str]]] = {0: [], 1: []}
    i = 0
    while min(len(c) for c in out.values()) < per_shard:
        chain = [f"{i:08x}{k:024x}" for k in range(3)]
        i += 1
        owned = out[shard_map.owner(NS, chain[0])]
        if len(owned) < per_shard:
            owned.append(chain)
    return out


async def test_two_shards_lease_only_their_own_chains_each_in_its_own_log_and_stream(
        database_url: str, other_database_url: str, nats_url: str, subjects: Subjects) -> None:
    urls = [database_url, other_database_url]
    shard_map = ShardMap.uniform(2, PARTITIONS)
    chains = _chains(shard_map, 3)
    configs = [fast_config(urls[k], nats_url, subjects, shards=2, shard=k, shard_partitions=PARTITIONS, **QUIET)
               for k in (0, 1)]
    per_shard = [shard_subjects(subjects.prefix, k) for k in (0, 1)]
    assert per_shard[0] == subjects and per_shard[1].prefix == f"{subjects.prefix}.s1"
    nc = await nats.connect(nats_url)
    try:
        async with contextlib.AsyncExitStack() as stack:
            bases = [(await stack.enter_async_context(running_coordinator(c)))[1] for c in configs]
            # one worker, a member of both shards: registered with each, one epoch and seq space per shard
            workers = [Worker(nc, per_shard[k], "w1", slots=64) for k in (0, 1)]
            for w in workers:
                assert (await w.register()).epoch == 1
                await w.watch_watermarks()
            for k in (0, 1):
                for chain in chains[k]:
                    grant = await workers[k].fill(chain)
                    assert isinstance(grant, LeaseGrant) and sorted(grant.write["compressed"]) == [0, 1, 2]
                    # the other shard does not decide this chain, and writes nothing for asking
                    refused = await workers[1 - k].acquire(chain)
                    assert isinstance(refused, ErrorReply) and refused.code is ErrorCode.WRONG_SHARD, refused
                    assert f"belongs to shard {k}, not {1 - k}" in refused.message
                    # the owner's next lease on the chain reads it
                    again = await workers[k].acquire(chain)
                    assert isinstance(again, LeaseGrant) and again.usable_blocks == 3, again
                    await workers[k].release(again.lease_id)
                    await workers[k].release(grant.lease_id)

            # each shard's stream: its own, holding only its own transitions
            js = nc.jetstream()
            for k in (0, 1):
                info = await js.stream_info(per_shard[k].stream_name)
                assert info.config.subjects == [per_shard[k].events_wildcard]
                assert info.state.last_seq == 9      # 3 chains × 3 commits (purged or not once acknowledged)

            # per shard: today's audit, clean, and every live block of a chain the shard owns
            for k, base in enumerate(bases):
                report = await _audit(base)
                assert report["ok"], report
                s = report["shard"]
                assert (s["shard"], s["shards"], s["map_version"], s["owned_partitions"]) == (k, 2, 1, PARTITIONS // 2)
                assert (s["live_blocks"], s["attributed"], s["foreign"]["count"]) == (9, 9, 0), s
            # fleet-wide, as an operator runs it: each shard once, one map, no block on two shards
            code, out = await _fleet_audit(bases)
            assert code == 0, out
            fleet = json.loads(out)
            assert fleet["ok"] and fleet["fleet"]["shards"] == {"0": bases[0], "1": bases[1]}, fleet["fleet"]
            assert fleet["fleet"]["live_blocks"] == 18 and "keys" not in fleet["shards"][bases[0]]["shard"]
    finally:
        await _drop_shards(nc, subjects)

    # fleet-wide: the two logs hold disjoint keys, each only chains its shard owns
    roots = {b: chain[0] for k in (0, 1) for chain in chains[k] for b in chain}
    ready: list[set[str]] = []
    for k in (0, 1):
        db = await asyncpg.connect(urls[k])
        try:
            rows = await db.fetch("SELECT payload FROM events ORDER BY position")
        finally:
            await db.close()
        state = replay((decode_event(r["payload"]) for r in rows), CoreParams(shard=k, shard_map=shard_map))
        keys = {key[0] for key, r in state.replicas.items() if r.state is ReplicaState.READY}
        assert keys == {b for chain in chains[k] for b in chain}, k
        assert {shard_map.owner(NS, roots[b]) for b in keys} == {k}
        ready.append(keys)
    assert not ready[0] & ready[1]


async def test_a_ledger_resharded_without_moving_its_chains_fails_its_shard_audit(
        database_url: str, other_database_url: str, nats_url: str, subjects: Subjects) -> None:
    """One shard's log, then run as shard 0 of 2 with nothing moved: the chains the map now gives
    shard 1 are still live on shard 0 — the shard audit names them, and the fleet audit fails."""
    shard_map = ShardMap.uniform(2, PARTITIONS)
    chains = _chains(shard_map, 2)
    nc = await nats.connect(nats_url)
    try:
        async with running_coordinator(fast_config(database_url, nats_url, subjects, **QUIET)):
            w = Worker(nc, subjects, "w1", slots=64)
            await w.register()
            await w.watch_watermarks()
            for chain in chains[0] + chains[1]:
                await w.release((await w.fill(chain)).lease_id)
        sharded = [fast_config(u, nats_url, subjects, shards=2, shard=k, shard_partitions=PARTITIONS, **QUIET)
                   for k, u in enumerate((database_url, other_database_url))]
        async with contextlib.AsyncExitStack() as stack:
            bases = [(await stack.enter_async_context(running_coordinator(c)))[1] for c in sharded]
            report = await _audit(bases[0])
            assert not report["ok"] and report["hash_match"] and not report["log_errors"], report
            foreign = {b for chain in chains[1] for b in chain}
            s = report["shard"]
            assert (s["live_blocks"], s["attributed"], s["foreign"]["count"]) == (12, 12, 6), s
            assert set(s["foreign"]["listed"]) == foreign
            assert (await _audit(bases[1]))["ok"]
            code, out = await _fleet_audit(bases)
            assert code == 3, out
            assert json.loads(out)["fleet"]["problems"] == [f"{bases[0]}: its own audit found problems"]
    finally:
        await _drop_shards(nc, subjects)


async def test_the_gateway_asks_the_shard_that_owns_a_prompts_chain(
        tmp_path: Any, database_url: str, other_database_url: str, nats_url: str, subjects: Subjects) -> None:
    """A gateway of a two-shard deployment: its fleet view from shard 0, and each prompt's route
    query sent to the shard its chain belongs to by the stored map — so a prefix cached on either
    shard is found, and after a move where it moved."""
    import yaml

    from coordinator.app import COORDINATOR
    from gateway.app import Gateway
    from shared.config import parse_config
    from shared.hashing import chain_hashes
    from shared.messages import RegisterReply, WorkerRegister
    from tests.integration.coordinator_kit import CATALOGUE

    shard_map = ShardMap.uniform(2, PARTITIONS)
    configs = [fast_config(u, nats_url, subjects, shards=2, shard=k, shard_partitions=PARTITIONS, **QUIET)
               for k, u in enumerate((database_url, other_database_url))]
    per_shard = [shard_subjects(subjects.prefix, k) for k in (0, 1)]
    # NOTE: a route hint that misses gateway.route_timeout_ms (100 ms) routes by affinity alone; on
    # a loaded CI machine one did (route_query_failed TimeoutError), and this test is about maps
    gw = Gateway(parse_config({"nats": {"url": nats_url, "subject_prefix": subjects.prefix},
                               "coordinator": {"shards": 2, "shard_partitions": PARTITIONS},
                               "gateway": {"route_timeout_ms": 5000}}), None, None)  # type: ignore[arg-type]
    nc = await nats.connect(nats_url)
    try:
        async with contextlib.AsyncExitStack() as stack:
            apps = [await stack.enter_async_context(running_coordinator(c)) for c in configs]
            bases = [base for _, base in apps]
            workers = [Worker(nc, per_shard[k], "w1", slots=64) for k in (0, 1)]
            for w in workers:       # registered with both shards, serving at one endpoint
                reply = await w.request(w.subjects.request("register", "w1"), WorkerRegister(
                    worker_id="w1", namespace=NS, catalogue=CATALOGUE, pool_slots={"compressed": 64},
                    endpoint="http://127.0.0.1:9"))
                assert isinstance(reply, RegisterReply), reply
                w.epoch = reply.epoch
                await w.watch_watermarks()
            await gw.start()
            assert [x.worker_id for x in gw.fleet] == ["w1"]
            prompts: dict[int, list[int]] = {}
            for first in range(1000):
                tokens = [first] * 16 + list(range(32))
                hashes = chain_hashes(tokens, CATALOGUE.block_size, NS, gw.salt("default"))
                prompts.setdefault(shard_map.owner(NS, hashes[0]), tokens)
                if len(prompts) == 2:
                    break
            for k, tokens in prompts.items():
                hashes = chain_hashes(tokens, CATALOGUE.block_size, NS, gw.salt("default"))
                await workers[k].release((await workers[k].fill(hashes)).lease_id)
            for k, tokens in prompts.items():
                choices, _ = await gw.route(tokens, "default")
                assert (choices[0].worker.worker_id, choices[0].reason, choices[0].cached_tokens) == ("w1", "cache", 48), k

            # shard 1's prompt's partition moves to shard 0 (cold) and is cached there: the gateway
            # finds it once it has read the new map, at its next fleet refresh
            hashes = chain_hashes(prompts[1], CATALOGUE.block_size, NS, gw.salt("default"))
            part = shard_map.partition(NS, hashes[0])
            cli_config = tmp_path / "kvledger.yaml"
            cli_config.write_text(yaml.safe_dump({"nats": {"url": nats_url, "subject_prefix": subjects.prefix},
                                                  "coordinator": {"shards": 2, "shard_partitions": PARTITIONS}}))
            await _shard_cli(cli_config, "freeze", str(part), "--to", "0")
            async with aiohttp.ClientSession() as http:
                for b in hashes:
                    async with http.post(f"{bases[1]}/v1/invalidate", json={"scope": "block", "value": b}) as r:
                        assert r.status == 200, await r.text()
            assert (await _shard_cli(cli_config, "open", str(part)))["map"]["version"] == 3
            await _until(lambda: all(a[COORDINATOR].ledger.params.shard_map.version == 3 for a, _ in apps))
            await workers[0].release((await workers[0].fill(hashes)).lease_id)
            # (by the map of the config, version 1, it would ask shard 1, which holds nothing of it now)
            assert await gw.refresh_fleet() and gw.shard_map.version == 3
            choices, _ = await gw.route(prompts[1], "default")
            assert (choices[0].reason, choices[0].cached_tokens) == ("cache", 48)
    finally:
        await gw.stop()
        await _drop_shards(nc, subjects)


async def _shard_cli(config: Any, *args: str) -> dict:
    """``kvledger shard … --json`` with this deployment's config (the CLI, a process of its own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVL_")}
    proc = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "kvledger", "shard", *args, "--json",
                                                    "--config", str(config)],
                                   capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


async def _until(what: Any, timeout_s: float = 10) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not what():
        assert asyncio.get_running_loop().time() < deadline, "not within the time"
        await asyncio.sleep(0.05)


async def test_a_cold_move_of_a_partition_between_shards_by_the_versioned_map(
        tmp_path: Any, database_url: str, other_database_url: str, nats_url: str, subjects: Subjects) -> None:
    """The drill of a move that carries no replicas: freeze (no shard leases the partition), the old
    owner's leases on it ended and its replicas of it invalidated (the bytes dropped by the workers:
    the cache is recomputed, no event moves), open (the new owner leases it). Both shards follow each
    map version from NATS KV; each step reruns harmlessly; both audits and the fleet's stay clean."""
    import yaml

    from coordinator.app import COORDINATOR

    shard_map = ShardMap.uniform(2, PARTITIONS)
    chain = _chains(shard_map, 1)[0][0]
    part = shard_map.partition(NS, chain[0])
    # a chain of the same shard in another partition: not affected by the move
    same_shard = next(c for c in _chains(shard_map, 8)[0] if shard_map.partition(NS, c[0]) != part)
    configs = [fast_config(u, nats_url, subjects, shards=2, shard=k, shard_partitions=PARTITIONS, **QUIET)
               for k, u in enumerate((database_url, other_database_url))]
    cli_config = tmp_path / "kvledger.yaml"
    cli_config.write_text(yaml.safe_dump({"nats": {"url": nats_url, "subject_prefix": subjects.prefix},
                                          "coordinator": {"shards": 2, "shard_partitions": PARTITIONS}}))
    per_shard = [shard_subjects(subjects.prefix, k) for k in (0, 1)]
    nc = await nats.connect(nats_url)
    try:
        async with contextlib.AsyncExitStack() as stack:
            apps = [await stack.enter_async_context(running_coordinator(c)) for c in configs]
            bases = [base for _, base in apps]

            def version(k: int) -> int:
                return apps[k][0][COORDINATOR].ledger.params.shard_map.version

            workers = [Worker(nc, per_shard[k], "w1", slots=64) for k in (0, 1)]
            for w in workers:
                await w.register()
                await w.watch_watermarks()
            held = await workers[0].fill(chain)
            await workers[0].fill(same_shard)
            assert (await _shard_cli(cli_config, "show"))["map"]["version"] == 1

            # 1. freeze: no shard leases the partition (retry later); the shard's other partitions go on
            frozen = await _shard_cli(cli_config, "freeze", str(part), "--to", "1")
            assert frozen["changed"] and frozen["map"]["moving"] == [{"partition": part, "from": 0, "to": 1}]
            await _until(lambda: version(0) == version(1) == 2)
            for w in workers:
                r = await w.acquire(chain)
                assert isinstance(r, ErrorReply) and r.code is ErrorCode.WRONG_SHARD and r.retry_after_ms, r
            assert isinstance(await workers[0].acquire(same_shard), LeaseGrant)
            assert not (await _shard_cli(cli_config, "freeze", str(part), "--to", "1"))["changed"]   # a rerun

            # 2. drain: the old owner's leases on the partition end (here released; at worst they expire)
            out = (await _audit(bases[0]))["shard"]["moving_out"]
            assert out == {str(part): {"to": 1, "live_leases": 1, "live_blocks": sorted(chain), "live_block_count": 3}}
            await workers[0].release(held.lease_id)
            assert (await _audit(bases[0]))["shard"]["moving_out"][str(part)]["live_leases"] == 0
            # 3. release: the old owner invalidates its replicas of the partition (the workers drop them)
            async with aiohttp.ClientSession() as http:
                for b in chain:
                    async with http.post(f"{bases[0]}/v1/invalidate", json={
                            "scope": "block", "value": b, "reason": f"partition {part} moves to shard 1"}) as r:
                        assert r.status == 200 and (await r.json())["affected"] == 1, await r.text()

            assert (await _audit(bases[0]))["shard"]["moving_out"][str(part)]["live_block_count"] == 0
            # 4. open: the new owner leases the chain (cold: it computes and writes it), the old refuses
            opened = await _shard_cli(cli_config, "open", str(part))
            assert opened["changed"] and opened["map"]["version"] == 3 and opened["map"]["owned"] == {"0": 7, "1": 9}
            await _until(lambda: version(0) == version(1) == 3)
            grant = await workers[1].fill(chain)
            assert grant.usable_blocks == 0 and sorted(grant.write["compressed"]) == [0, 1, 2]
            r = await workers[0].acquire(chain)
            assert isinstance(r, ErrorReply) and r.code is ErrorCode.WRONG_SHARD and "belongs to shard 1" in r.message
            assert not (await _shard_cli(cli_config, "open", str(part)))["changed"]                  # a rerun

            for base in bases:
                report = await _audit(base)
                assert report["ok"] and report["shard"]["map_version"] == 3, report
            code, out = await _fleet_audit(bases)
            assert code == 0, out
    finally:
        await _drop_shards(nc, subjects)


async def test_a_coordinator_refuses_to_start_on_a_stored_map_of_another_shape(
        database_url: str, nats_url: str, subjects: Subjects) -> None:
    """The stored map says 3 shards, this coordinator's config 2: it does not decide by either."""
    import msgspec

    from coordinator.nats_service import StartupError
    from coordinator.runtime import Coordinator
    from shared.logging import get_logger

    nc = await nats.connect(nats_url)
    try:
        kv = await nc.jetstream().create_key_value(bucket=map_bucket(subjects.prefix), history=16)
        await kv.create("map", msgspec.json.encode(ShardMap.uniform(3, PARTITIONS)))
        cfg = fast_config(database_url, nats_url, subjects, shards=2, shard=1, shard_partitions=PARTITIONS, **QUIET)
        coord = Coordinator(cfg, database_url=database_url, nats_url=nats_url, logger=get_logger("test"))
        try:
            with pytest.raises(StartupError, match="does not fit this coordinator: the map has 3 shards"):
                await coord.start()
        finally:
            await coord.stop()
    finally:
        await _drop_shards(nc, subjects)
